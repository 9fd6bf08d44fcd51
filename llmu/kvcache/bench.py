"""Benchmark entries of module 06: what the KV cache buys, and how fast attention reads it.

``kv_cache_decode`` (a whole-model ``run=`` entry): SmolLM2-135M, batch 1, the cost of producing
the next token when ``T`` tokens came before it, two ways.

- ``recompute``: no cache, the model runs over all ``T`` tokens again (one forward pass of ``T``
  tokens, timed as the prefill of a fresh cache, which costs the same);
- ``cached``: the ``T`` keys and values are in the cache, the model runs over ONE token.

FLOPs: about ``2 * parameters`` per token the model processes (a multiply and an add per weight),
so ``2 * P * T`` recomputing and ``2 * P`` cached, plus attention's ``4 * layers * H * D`` per
(query, key) pair: ``T (T + 1) / 2`` pairs recomputing, ``T`` cached. Bytes: every weight read
once either way (``P * elem``), plus the cache read when cached
(``kv_cache_bytes(layers, Hkv, D, T, 1, elem)``). The row's ``speedup`` is recompute / cached.

``decode_attention``: one new query per sequence and head against a cache of ``T`` positions,
``q (B, H, D)``, ``k``, ``v`` ``(B, Hkv, T, D)``. It is memory-bound: per key, ``4 * G * D``
FLOPs (``G = H / Hkv`` query heads share it) for ``2 * D * elem`` bytes of K and V.

    flops = 4 * B * H * T * D
    bytes = elem * (2 * B * Hkv * T * D + 2 * B * H * D)      (K, V read once; q read, out written)

Providers: the llmu Triton flash-decoding kernel (grouped: one program per KV head, so each key
and value is read once; module 07's ``gqa_decode`` entry also times its per-query-head mode), the
llmu torch reference ``attend_cached`` (it expands K/V to every query head and works in float32,
so it moves far more than these bytes),
and PyTorch's ``scaled_dot_product_attention`` with one query (``enable_gqa``). The GB/s of
every provider is counted against the same ideal bytes, so they compare like for like and the
Triton kernel's fraction of the HBM peak says how close decoding gets to the memory's speed.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from llmu import runtime
from llmu.bench.registry import Entry, Provider, register
from llmu.kvcache import kernels, reference

#: Cache lengths of the whole-model entry (the notebook's closing note quotes 512 and 2048).
DECODE_LENGTHS = (128, 512, 2048)


# ----------------------------------------------------------------------------------------------
# Whole model: recompute vs cached
# ----------------------------------------------------------------------------------------------


@torch.inference_mode()
def measure_decode(model, length: int, cached_steps: int = 5, recompute_repeats: int = 1, seed: int = 0) -> dict:
    """Milliseconds to produce one next token after ``length`` tokens, without and with a cache.

    The recompute time is a forward pass over ``length`` tokens (median of ``recompute_repeats``);
    the cached time the median of ``cached_steps`` one-token passes against a cache that holds
    ``length`` tokens (rewound after each step so every step sees the same length).
    """
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(100, model.config.vocab_size, (1, length + 1), generator=g, device="cpu").to(model.device)
    recompute = []
    cache = None
    for _ in range(max(1, recompute_repeats)):
        cache = model.new_cache(batch_size=1, max_len=length + 1)
        start = time.perf_counter()
        model(ids[:, :length], cache=cache, last_only=True)
        recompute.append(time.perf_counter() - start)
    model(ids[:, length:], cache=cache, last_only=True)  # warm up the one-token path
    cache.crop(length)
    cached = []
    for _ in range(max(1, cached_steps)):
        start = time.perf_counter()
        model(ids[:, length:], cache=cache, last_only=True)
        cached.append(time.perf_counter() - start)
        cache.crop(length)
    r, c = statistics.median(recompute), statistics.median(cached)
    return {"length": length, "recompute_ms": 1e3 * r, "cached_ms": 1e3 * c, "speedup": r / c}


def decode_costs(model, length: int, cached: bool, elem: int) -> tuple[float, float]:
    """(FLOPs, bytes) of producing one token after ``length`` tokens, with or without the cache."""
    c = model.config
    params = model.num_parameters()
    attn_per_pair = 4 * c.num_hidden_layers * c.num_attention_heads * c.head_dim
    if cached:
        flops = 2.0 * params + attn_per_pair * length
        nbytes = params * elem + reference.kv_cache_bytes(c.num_hidden_layers, c.num_key_value_heads, c.head_dim,
                                                          length, 1, elem)
    else:
        flops = 2.0 * params * length + attn_per_pair * length * (length + 1) / 2
        nbytes = params * elem
    return float(flops), float(nbytes)


def _run_decode(size: dict, device) -> list[dict]:
    from llmu.models.loading import load_model

    dtype = runtime.preferred_dtype(device)  # float32 on a CPU, bf16 on an A100/H100, fp16 on a T4
    model = load_model(dtype=dtype, device=device)
    t = size["T"]
    # Bounded on a CPU: a 2048-token forward pass takes seconds, so it runs once there.
    repeats = size.get("repeats", 1 if t >= 1024 else 3)
    m = measure_decode(model, t, cached_steps=size.get("steps", 5), recompute_repeats=repeats)
    elem = torch.empty((), dtype=dtype).element_size()
    rows = []
    for provider, ms in (("recompute", m["recompute_ms"]), ("cached", m["cached_ms"])):
        flops, nbytes = decode_costs(model, t, provider == "cached", elem)
        rows.append(dict(provider=provider, label=f"{provider} (ms per token)", kind="torch", ms=ms,
                         tokens_per_s=1e3 / ms, speedup=m["speedup"], flops=flops, bytes=nbytes, dtype=dtype))
    return rows


KV_CACHE_DECODE = register(
    Entry(
        name="kv_cache_decode",
        module="06_kv_cache",
        description="SmolLM2-135M, batch 1: ms for the next token after T tokens, recomputing them vs a KV cache",
        run=_run_decode,
        gpu_sizes=[{"T": t} for t in (128, 512, 2048, 4096)],
        cpu_sizes=[{"T": t} for t in DECODE_LENGTHS],
        x_axis="T",
    )
)


# ----------------------------------------------------------------------------------------------
# Decode attention: bandwidth
# ----------------------------------------------------------------------------------------------


def _attention_setup(size, device, dtype):
    g = torch.Generator(device="cpu").manual_seed(0)
    b, h, hkv, t, d = size["B"], size["H"], size["Hkv"], size["T"], size["D"]
    q = torch.randn(b, h, d, generator=g, device="cpu").to(device=device, dtype=dtype)
    # Filled on the device: a 30 GB cache would take long to make on the host and copy over.
    k = torch.randn(b, hkv, t, d, device=device, dtype=dtype)
    v = torch.randn(b, hkv, t, d, device=device, dtype=dtype)
    lengths = torch.full((b,), t, dtype=torch.int32, device=device)
    return q, k, v, lengths


def attention_flops(size) -> float:
    return 4.0 * size["B"] * size["H"] * size["T"] * size["D"]


def attention_bytes(size, elem: int) -> float:
    b, h, hkv, t, d = size["B"], size["H"], size["Hkv"], size["T"], size["D"]
    return float(elem * (2 * b * hkv * t * d + 2 * b * h * d))


def _sdpa(q, k, v, lengths):
    # Every sequence is full (lengths == T) in this benchmark, so no mask is needed.
    return F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)[:, :, 0]


DECODE_ATTENTION = register(
    Entry(
        name="decode_attention",
        module="06_kv_cache",
        description="one query token per sequence against a KV cache of T positions (GQA), K/V bandwidth",
        providers={
            "llmu triton": Provider(kernels.decode_attention, "triton", "llmu Triton flash-decoding"),
            "llmu torch": Provider(reference.attend_cached, "torch", "llmu reference.attend_cached"),
            "torch sdpa": Provider(_sdpa, "builtin", "F.scaled_dot_product_attention, one query"),
        },
        setup=_attention_setup,
        flops=attention_flops,
        bytes=attention_bytes,
        gpu_sizes=[{"B": b, "H": 32, "Hkv": 8, "T": t, "D": 128}
                   for b, t in ((8, 4096), (8, 16384), (8, 32768), (32, 4096), (32, 16384), (64, 4096), (64, 8192))],
        cpu_sizes=[{"B": 1, "H": 9, "Hkv": 3, "T": t, "D": 64} for t in (512, 2048, 8192)],
        x_axis="T",
    )
)
