"""Load a Hugging Face Llama-family checkpoint (safetensors) into llmu's :class:`LlamaModel`.

A checkpoint folder holds ``config.json`` and the weights, either in one ``model.safetensors`` or
split into shards listed by ``model.safetensors.index.json`` (``{"weight_map": {name: file}}``).
Parameter names are Hugging Face's with a ``model.`` prefix (``model.layers.0.self_attn.q_proj.weight``);
llmu uses the same names without it. Hugging Face checkpoints store Q/K rows in the order their
``"half"`` RoPE expects, so nothing is permuted.

Supported: ``model_type`` ``llama`` (SmolLM2, Llama 3.x with its ``llama3`` RoPE scaling) and
``qwen2`` (biases on q/k/v). Reading safetensors needs the ``safetensors`` package.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from llmu.models.config import LlamaConfig
from llmu.models.llama import LlamaModel

SUPPORTED = ("llama", "qwen2")


def config_from_hf(cfg: dict) -> LlamaConfig:
    """A :class:`LlamaConfig` from the dict of a ``config.json``."""
    kind = cfg.get("model_type", "llama")
    if kind not in SUPPORTED:
        raise ValueError(f"llmu loads {SUPPORTED} checkpoints; this one is model_type={kind!r}")
    rope = cfg.get("rope_parameters") or {}  # transformers 5 keeps theta and scaling here
    theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    heads = cfg["num_attention_heads"]
    return LlamaConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rope_theta=float(theta),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=cfg.get("eos_token_id"),
        pad_token_id=cfg.get("pad_token_id"),
        rope_scaling=dict(scaling) if scaling else None,
        attention_bias=bool(cfg.get("attention_bias", False)) or kind == "qwen2",
        attention_out_bias=bool(cfg.get("attention_bias", False)) and kind == "llama",
        name=cfg.get("_name_or_path") or kind,
    )


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"{folder} has neither model.safetensors nor model.safetensors.index.json")


def llmu_name(hf_key: str) -> str:
    """``model.layers.0.mlp.up_proj.weight`` -> ``layers.0.mlp.up_proj.weight``."""
    return hf_key[len("model."):] if hf_key.startswith("model.") else hf_key


def load_hf_checkpoint(folder: str | Path, *, dtype: torch.dtype = torch.float32, device=None,
                       attention: str = "sdpa") -> LlamaModel:
    """Build a :class:`LlamaModel` from a Hugging Face checkpoint folder (config.json + safetensors)."""
    try:
        from safetensors import safe_open
    except ImportError as exc:  # pragma: no cover - safetensors comes with transformers
        raise ImportError("reading Hugging Face checkpoints needs `pip install safetensors`") from exc
    folder = Path(folder)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{folder} has no config.json (is it a Hugging Face checkpoint folder?)")
    config = config_from_hf(json.loads(config_file.read_text()))
    files = _weight_files(folder)
    model = LlamaModel(config, attention=attention, dtype=dtype, device=device)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                name = llmu_name(key)
                if name.endswith("rotary_emb.inv_freq"):
                    continue  # a buffer some old checkpoints saved; llmu recomputes it
                if name not in params:
                    raise ValueError(f"{file.name}: unexpected weight {key!r} for a {config.name} model")
                if name == "lm_head.weight" and config.tie_word_embeddings:
                    continue  # tied: the LM head is the embedding matrix
                w = f.get_tensor(key)
                if tuple(w.shape) != tuple(params[name].shape):
                    raise ValueError(f"{key}: shape {tuple(w.shape)} does not fit {tuple(params[name].shape)}")
                params[name].data.copy_(w.to(dtype))
                loaded.add(name)
    if "lm_head.weight" not in loaded and not config.tie_word_embeddings:
        # a checkpoint without an LM head ties it to the embeddings whatever its config says
        config.tie_word_embeddings = True
        model.lm_head.weight = model.embed_tokens.weight
        loaded.add("lm_head.weight")
    missing = set(params) - loaded - ({"lm_head.weight"} if config.tie_word_embeddings else set())
    if missing:
        raise ValueError(f"the checkpoint has no weights for {sorted(missing)[:5]}")
    return model.eval()
