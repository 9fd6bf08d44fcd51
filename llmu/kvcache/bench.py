"""Benchmark entries of module 06: what the KV cache buys, and how fast attention reads it.

``kv_cache_decode`` (a whole-model ``run=`` entry, :func:`compare_decode`): SmolLM2-135M, batch 1,
the cost of producing the next tokens after ``T`` tokens of prompt, two ways, greedy.

- ``recompute``: no cache: each next token is a forward pass over everything so far (``T``, then
  ``T + 1``, ... tokens), ``recompute`` of them per round;
- ``cached``: the ``T`` keys and values are in the cache (the prompt's prefill is done once, not
  timed, and the cache cropped back to ``T`` before each round), each next token is a pass over
  ONE token: ``new`` of them per round (after ``T`` to ``T + new - 1`` cached positions).

Each round times both, in turn (``recompute, cached, recompute, ...``, ``repeats`` rounds after a
warm-up of one recompute call and one cached step, :func:`llmu.bench.interleave`): tokens/s =
tokens / seconds of that call. The rows carry the median and spread, the paired ratio
``cached_r / recompute_r`` (the speedup; also ``speedup``, on both rows) with its min..max and
whether that includes 1, and the load average. Recomputing and caching compute the same function,
so their tokens must be the same: the cached run's first ``recompute`` tokens are compared with
the recomputed ones in every round, and a cache that gives other tokens makes the cached row an
error. Recomputing at ``T = 2048`` takes seconds a token on a CPU, so it makes fewer tokens there
than the cache does (``recompute`` in the sizes). The model runs in float32 on a GPU too: a pass
over ``T`` tokens and a pass over one round differently, and in bf16 that flips near-ties of the
argmax.

FLOPs: about ``2 * parameters`` per token the model processes (a multiply and an add per weight),
so ``2 * P * T`` recomputing and ``2 * P`` cached, plus attention's ``4 * layers * H * D`` per
(query, key) pair: ``T (T + 1) / 2`` pairs recomputing, ``T`` cached. Bytes: every weight read
once either way (``P * elem``), plus the cache read when cached
(``kv_cache_bytes(layers, Hkv, D, T, 1, elem)``).

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

import time

import torch
import torch.nn.functional as F

from llmu.bench.paired import Paired, first_difference, interleave
from llmu.bench.registry import Entry, Provider, register
from llmu.kvcache import kernels, reference

#: Cache lengths of the whole-model entry (the notebook's closing note quotes 512 and 2048).
DECODE_LENGTHS = (128, 512, 2048)


# ----------------------------------------------------------------------------------------------
# Whole model: recompute vs cached
# ----------------------------------------------------------------------------------------------


def _argmax(logits) -> int:
    return int(logits[0, -1].argmax())


@torch.inference_mode()
def compare_decode(model, length: int, new_tokens: int = 64, recompute_tokens: int = 4, repeats: int = 3,
                   seed: int = 0) -> Paired:
    """Tokens/s of the next tokens after ``length`` tokens, recomputing and cached, in turn (see
    the module's docstring). Figure ``tokens_per_s``; output: the greedy ids; ratio: cached over
    recompute; the cached ids are checked against the recomputed ones."""
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    if new_tokens < 1 or recompute_tokens < 1:
        raise ValueError(f"new_tokens and recompute_tokens must be >= 1, got {new_tokens}, {recompute_tokens}")
    g = torch.Generator(device="cpu").manual_seed(seed)
    prompt = torch.randint(100, model.config.vocab_size, (length,), generator=g, device="cpu").tolist()
    cache = model.new_cache(batch_size=1, max_len=length + new_tokens + 1)
    first = _argmax(model(torch.tensor([prompt], device=model.device), cache=cache, last_only=True).logits)

    def recompute() -> dict:
        ids = list(prompt)
        start = time.perf_counter()
        for _ in range(recompute_tokens):
            ids.append(_argmax(model(torch.tensor([ids], device=model.device), last_only=True).logits))
        seconds = time.perf_counter() - start
        return {"tokens_per_s": recompute_tokens / seconds, "seconds": seconds, "output": ids[length:]}

    def cached(steps: int = new_tokens) -> dict:
        cache.crop(length)
        ids = [first]
        start = time.perf_counter()
        for _ in range(steps):
            x = torch.tensor([[ids[-1]]], device=model.device)
            ids.append(_argmax(model(x, cache=cache, last_only=True).logits))
        seconds = time.perf_counter() - start
        return {"tokens_per_s": steps / seconds, "seconds": seconds, "output": ids}

    recompute()  # warm up: the passes over length, length + 1, ... tokens meet their shapes once
    cached(1)  # and the one-token path
    return interleave({"recompute": recompute, "cached": cached}, repeats, warmup=0, base="recompute",
                      figure="tokens_per_s", check=["cached"], reference="recompute",
                      compare=lambda want, got: first_difference(want, got[:len(want)], ("token",)))


def measure_decode(model, length: int, cached_steps: int = 5, recompute_repeats: int = 1, seed: int = 0, *,
                   repeats: int = 3) -> dict:
    """Milliseconds to produce a next token after ``length`` tokens, without and with a cache:
    :func:`compare_decode` with ``cached_steps`` cached tokens and ``recompute_repeats``
    recomputed ones a round, ``repeats`` rounds.

    Returns ``length``, ``recompute_ms`` and ``cached_ms`` (ms per token, medians over the rounds),
    ``speedup`` (the median of the per-round ratios, recompute time over cached time),
    ``speedup_min`` and ``speedup_max``, ``overlaps_1`` (the speedup's min..max includes 1),
    ``rounds``, and ``mismatch`` (why the cached tokens differ from the recomputed ones, or None).
    """
    paired = compare_decode(model, length, cached_steps, recompute_repeats, repeats, seed)
    r = paired.ratio("cached")
    return {"length": length, "recompute_ms": 1e3 / paired.stats("recompute")["median"],
            "cached_ms": 1e3 / paired.stats("cached")["median"], "speedup": r["median"],
            "speedup_min": r["min"], "speedup_max": r["max"], "overlaps_1": r["overlaps_1"],
            "rounds": paired.rounds, "mismatch": paired.mismatches.get("cached")}


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

    dtype = torch.float32  # on a GPU too: the tokens are compared (the module's docstring)
    model = load_model(dtype=dtype, device=device)
    t = size["T"]
    paired = compare_decode(model, t, new_tokens=size.get("new", 64), recompute_tokens=size.get("recompute", 4),
                            repeats=size.get("repeats", 3))
    speedup = paired.ratio("cached")["median"]
    elem = torch.empty((), dtype=dtype).element_size()
    rows = []
    for provider in paired.names:
        flops, nbytes = decode_costs(model, t, provider == "cached", elem)
        fields = paired.row_fields(provider, key="tokens_per_s")
        fields["speedup"] = speedup  # both rows: what the cache buys over recomputing
        rows.append(dict(provider=provider, label=f"{provider} (ms per token)", kind="torch", **fields,
                         tokens=size.get("new", 64) if provider == "cached" else size.get("recompute", 4),
                         flops=flops, bytes=nbytes, dtype=dtype))
    return rows


KV_CACHE_DECODE = register(
    Entry(
        name="kv_cache_decode",
        module="06_kv_cache",
        description="SmolLM2-135M, batch 1: ms for the next tokens after T tokens, recomputing them vs a KV cache, "
                    "in turn (paired speedup, identical tokens enforced)",
        run=_run_decode,
        gpu_sizes=[{"T": t, "new": 64, "recompute": 64, "repeats": 5} for t in (128, 512, 2048, 4096)],
        cpu_sizes=[{"T": t, "new": 64, "recompute": r, "repeats": 3} for t, r in zip(DECODE_LENGTHS, (8, 4, 1))],
        gpu_dtype=torch.float32,
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
