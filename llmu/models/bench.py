"""Benchmarks of module 00: how fast the whole model loads and generates, llmu against transformers.

Loading (``model_load_s``, :func:`time_loads`): llmu's first load of a dtype dequantizes the GGUF
file and writes the weights to its cache on disk; later loads map that file
(:mod:`llmu.models.weight_cache`). transformers' ``from_pretrained`` of the same GGUF file beside them.

Generating (``decode_tokens_per_s``): one measurement = batch 1, a prompt of ``prompt_len`` tokens,
``new_tokens`` greedy tokens, the same fp32 weights and the same threads for both providers:

- prefill tokens/s = ``prompt_len / t(1 new token)``: the prompt in one forward pass;
- decode tokens/s = ``(new_tokens - 1) / (t(new_tokens) - t(1))``: one forward pass per token,
  each reading every weight once (memory-bound), so tokens/s is about bandwidth / model bytes.

FLOPs per decoded token are about ``2 * parameters`` (a multiply and an add per weight); bytes
per decoded token about ``parameters * bytes_per_weight`` plus the KV cache read.
transformers' model is built from llmu's weights (``to_transformers``), so both compute the same
function; it is an optional provider (skipped when transformers is not installed).
"""

from __future__ import annotations

import statistics
import time

import torch

from llmu import runtime
from llmu.bench.registry import Entry, register


def to_transformers(model):
    """A transformers ``LlamaForCausalLM`` holding (copies of) ``model``'s weights."""
    import transformers

    c = model.config
    hf_config = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=c.tie_word_embeddings,
        rope_theta=c.rope_theta, bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id,
        pad_token_id=c.pad_token_id,
    )
    if c.rope_layout != "half":
        raise ValueError("to_transformers needs a model with rope_layout='half' (Hugging Face's)")
    hf = transformers.LlamaForCausalLM(hf_config)  # randomly initialised, then overwritten
    state = {("lm_head.weight" if k == "lm_head.weight" else f"model.{k}"): v.detach().clone()
             for k, v in model.state_dict().items()}
    if c.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ValueError(f"weights do not fit transformers' Llama: missing {missing}, unexpected {unexpected}")
    if c.tie_word_embeddings:
        hf.tie_weights()
    return hf.to(model.dtype).eval()


def _prompt(vocab_size: int, length: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab_size, (1, length), generator=g)


def time_llmu(model, prompt: torch.Tensor, new_tokens: int) -> float:
    """Seconds for llmu to produce ``new_tokens`` greedy tokens after ``prompt`` (EOS ignored)."""
    from llmu.models.generate import generate_ids

    start = time.perf_counter()
    for _ in generate_ids(model, prompt[0].tolist(), new_tokens):
        pass
    return time.perf_counter() - start


def time_transformers(hf_model, prompt: torch.Tensor, new_tokens: int) -> float:
    """Seconds for transformers' ``generate`` to produce exactly ``new_tokens`` greedy tokens."""
    start = time.perf_counter()
    with torch.inference_mode():
        out = hf_model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    elapsed = time.perf_counter() - start
    assert out.shape[1] == prompt.shape[1] + new_tokens
    return elapsed


def measure(model, prompt_len: int = 128, new_tokens: int = 128, repeats: int = 3, hf_model=None,
            providers=("llmu", "transformers")) -> dict:
    """Prefill and decode tokens/s of each provider (median over ``repeats``, interleaved runs)."""
    if new_tokens < 2:
        raise ValueError(f"new_tokens must be >= 2 to time decoding, got {new_tokens}")
    prompt = _prompt(model.config.vocab_size, prompt_len).to(model.device)
    timers = {}
    if "llmu" in providers:
        timers["llmu"] = lambda n: time_llmu(model, prompt, n)
    if "transformers" in providers:
        if hf_model is None:
            hf_model = to_transformers(model)
        timers["transformers"] = lambda n: time_transformers(hf_model, prompt, n)
    for fn in timers.values():  # warm up (first calls allocate and pick kernels)
        fn(2)
    samples = {name: {"one": [], "all": []} for name in timers}
    for _ in range(repeats):
        for name, fn in timers.items():  # interleaved, so a busy moment hurts both alike
            samples[name]["one"].append(fn(1))
            samples[name]["all"].append(fn(new_tokens))
    out = {}
    for name, s in samples.items():
        one, full = statistics.median(s["one"]), statistics.median(s["all"])
        decode_s = max(full - one, 1e-9)
        out[name] = {
            "prefill_s": one,
            "decode_s": decode_s,
            "prefill_tokens_per_s": prompt_len / one,
            "decode_tokens_per_s": (new_tokens - 1) / decode_s,
        }
    return out


def _run(size: dict, device) -> list[dict]:
    from llmu.models.loading import load_model

    dtype = runtime.preferred_dtype(device)  # float32 on a CPU, bf16 on an A100/H100, fp16 on a T4
    model = load_model(dtype=dtype, device=device)
    providers = ["llmu"]
    try:
        import transformers  # noqa: F401

        providers.append("transformers")
    except ImportError:
        pass
    p, n = size.get("prompt", 128), size.get("new", 128)
    result = measure(model, p, n, repeats=size.get("repeats", 3), providers=tuple(providers))
    params = model.num_parameters()
    elem = torch.empty((), dtype=dtype).element_size()
    rows = []
    for provider, r in result.items():
        for phase, tokens in (("prefill", p), ("decode", n - 1)):
            seconds = r[f"{phase}_s"]
            rows.append(dict(
                provider=provider, label=f"{provider} {phase}", kind="torch" if provider == "llmu" else "external",
                phase=phase, tokens_per_s=r[f"{phase}_tokens_per_s"], ms=1e3 * seconds / tokens,
                flops=2.0 * params, bytes=float(params * elem), dtype=dtype,
            ))
    return rows


DECODE = register(
    Entry(
        name="decode_tokens_per_s",
        module="00_welcome",
        description="SmolLM2-135M generation, batch 1: prefill and decode tokens/s, llmu vs transformers "
                    "(ms, flops, bytes per token)",
        run=_run,
        gpu_sizes=[{"prompt": 128, "new": 128}, {"prompt": 1024, "new": 128}],
        cpu_sizes=[{"prompt": 128, "new": 128}],
        x_axis="prompt",
    )
)


# ---------------------------------------------------------------------------------------------
# Loading the model: the first time (dequantize the GGUF file) and after (map the weight cache)
# ---------------------------------------------------------------------------------------------

LOAD_PROVIDERS = ("llmu cold", "llmu warm", "transformers")


def time_loads(dtype=torch.float32, device="cpu", *, path=None, providers=LOAD_PROVIDERS) -> dict[str, float]:
    """Seconds to load the model from the GGUF file ``path`` (the course's by default): llmu's first
    load with an empty weight cache ("llmu cold": parse, dequantize, write the cache), its next one
    ("llmu warm": hash the file, map the cache), and transformers' ``from_pretrained`` of the same file.

    The cache lives in a temporary folder for the measurement (``LLMU_CACHE`` is set meanwhile),
    and what a new process would recompute (the parsed metadata, the file's hash) is forgotten
    first, so both llmu figures are what a fresh process waits for, imports aside.
    transformers raises ``ImportError`` when it (or ``accelerate``) is not installed.
    """
    import os
    import tempfile
    from pathlib import Path

    from llmu.cache import CACHE_ENV
    from llmu.models import gguf_file, weight_cache
    from llmu.models.loading import load_weights

    unknown = set(providers) - set(LOAD_PROVIDERS)
    if unknown:
        raise ValueError(f"providers must be among {LOAD_PROVIDERS}, got {sorted(unknown)}")
    path = Path(path) if path is not None else gguf_file.model_path()
    out = {}
    if "llmu cold" in providers or "llmu warm" in providers:
        previous = os.environ.get(CACHE_ENV)
        with tempfile.TemporaryDirectory(prefix="llmu-load-bench-") as folder:
            os.environ[CACHE_ENV] = folder
            try:
                for provider in ("llmu cold", "llmu warm"):
                    gguf_file._parse.cache_clear()
                    weight_cache._sha256.cache_clear()
                    start = time.perf_counter()
                    model, _ = load_weights(path, dtype=dtype, device=device)
                    seconds = time.perf_counter() - start
                    del model
                    if provider in providers:
                        out[provider] = seconds
            finally:
                if previous is None:
                    os.environ.pop(CACHE_ENV, None)
                else:
                    os.environ[CACHE_ENV] = previous
    if "transformers" in providers:
        import accelerate  # noqa: F401 - transformers needs it to load a GGUF file
        import transformers

        start = time.perf_counter()
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
        out["transformers"] = time.perf_counter() - start
        del hf
    return out


def _run_load(size: dict, device) -> list[dict]:
    dtype = runtime.preferred_dtype(device)
    seconds = time_loads(dtype, device, providers=("llmu cold", "llmu warm"))
    skipped = {}
    try:
        seconds.update(time_loads(dtype, device, providers=("transformers",)))
    except ImportError as exc:  # transformers or accelerate missing: skipped, as the runner does for providers
        skipped["transformers"] = f"not installed: {type(exc).__name__}: {exc}"
    rows = []
    for provider in LOAD_PROVIDERS:
        row = dict(provider=provider, label=provider, kind="external" if provider == "transformers" else "torch",
                   dtype=dtype)
        if provider in skipped:
            row.update(status="skipped", reason=skipped[provider])
        else:
            row.update(ms=1e3 * seconds[provider], seconds=seconds[provider])
        rows.append(row)
    return rows


LOAD = register(
    Entry(
        name="model_load_s",
        module="00_welcome",
        description="Loading SmolLM2-135M: llmu's first load (dequantize the GGUF file, write the weight "
                    "cache), its next ones (map the cache), and transformers' load of the same GGUF file",
        run=_run_load,
    )
)
