"""Hugging Face safetensors checkpoints load into llmu's LlamaModel and give transformers' logits."""

from __future__ import annotations

import json

import pytest
import torch

import llmu  # noqa: F401
from llmu.models import load_hf_checkpoint
from llmu.models.hf_loader import config_from_hf

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)


def write_checkpoint(folder, *, tied: bool, shard: str | None = None, seed: int = 0, kind: str = "llama", **extra):
    torch.manual_seed(seed)
    if kind == "qwen2":
        config = transformers.Qwen2Config(**TINY, tie_word_embeddings=tied, **extra)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        config = transformers.LlamaConfig(**TINY, tie_word_embeddings=tied, **extra)
        model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # larger-than-init weights, so that differences would show
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    return model.eval()


def compare(hf_model, folder):
    ours = load_hf_checkpoint(folder)
    ids = torch.randint(0, TINY["vocab_size"], (2, 17), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf_model(ids).logits
    got = ours(ids).logits
    # float32, same weights, same math in a different op order: rounding-level differences
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    return ours


@pytest.mark.parametrize("tied", [False, True])
def test_single_file(tmp_path, tied):
    hf = write_checkpoint(tmp_path, tied=tied)
    assert (tmp_path / "model.safetensors").is_file()
    ours = compare(hf, tmp_path)
    assert ours.config.tie_word_embeddings == tied
    assert (ours.lm_head.weight is ours.embed_tokens.weight) == tied


def test_sharded(tmp_path):
    hf = write_checkpoint(tmp_path, tied=False, shard="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    shards = set(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"].values())
    assert len(shards) > 1
    compare(hf, tmp_path)


def test_llama3_rope_scaling_and_bias(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    hf = write_checkpoint(tmp_path, tied=True, attention_bias=True, rope_scaling=scaling, rope_theta=500000.0)
    ours = compare(hf, tmp_path)
    assert ours.config.attention_bias and ours.config.rope_scaling["rope_type"] == "llama3"


def test_qwen2(tmp_path):
    hf = write_checkpoint(tmp_path, tied=True, kind="qwen2")
    ours = compare(hf, tmp_path)
    assert ours.layers[0].self_attn.q_proj.bias is not None


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_hf_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(dict(TINY, model_type="llama")))
    with pytest.raises(FileNotFoundError, match="neither model.safetensors"):
        load_hf_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="model_type='gpt2'"):
        config_from_hf(dict(TINY, model_type="gpt2"))
