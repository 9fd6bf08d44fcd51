"""PyTorch references of module 06: the KV cache's size, its update, and attention against it.

Decoding produces one token per step. Without a cache, step ``t`` runs the model over all ``t``
tokens again, although the keys and values of the first ``t - 1`` positions are exactly what the
previous step computed (a causal model's past never depends on its future). A KV cache keeps
them: per layer, a preallocated ``(B, Hkv, max_len, D)`` tensor for keys and one for values. Each
step then computes q, k, v for the ONE new token, writes k and v at the next free position
(:func:`cache_update`) and lets the new query attend to everything stored so far
(:func:`attend_cached`). In a batch, sequences have different lengths: ``lengths[b]`` says how
many positions of sequence ``b``'s cache are valid; the rest is padding that must never be read.

The memory it costs, for every layer, both K and V, every cached position of every sequence:

    bytes = 2 * layers * kv_heads * head_dim * context * batch * bytes_per_value

(:func:`kv_cache_bytes`). Flash-decoding splits the cached positions into ``S`` stretches,
attends to each separately (:func:`split_partials`) and merges the partial results exactly with
their log-sum-exps (:func:`combine_partials_reference`); ``llmu.kvcache.kernels`` does both in
Triton.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from llmu.attention.reference import repeat_kv

__all__ = [
    "kv_cache_bytes", "cache_update", "attend_cached", "split_partials", "combine_partials_reference",
    "check_decode_inputs", "decode_recompute", "decode_cached", "DecodeTrace",
]


# ----------------------------------------------------------------------------------------------
# How big is it?
# ----------------------------------------------------------------------------------------------


def _bytes_per_value(dtype_or_bytes) -> float:
    if isinstance(dtype_or_bytes, torch.dtype):
        return torch.empty((), dtype=dtype_or_bytes).element_size()
    if isinstance(dtype_or_bytes, str):
        named = {"fp32": 4, "float32": 4, "fp16": 2, "float16": 2, "bf16": 2, "bfloat16": 2,
                 "fp8": 1, "float8": 1, "int8": 1, "int4": 0.5}
        if dtype_or_bytes.lower() not in named:
            raise ValueError(f"dtype_or_bytes: unknown dtype name {dtype_or_bytes!r}; use one of {sorted(named)}")
        return named[dtype_or_bytes.lower()]
    if isinstance(dtype_or_bytes, bool) or not isinstance(dtype_or_bytes, (int, float)) or dtype_or_bytes <= 0:
        raise ValueError(f"dtype_or_bytes must be a torch dtype, a dtype name or a positive byte count, "
                         f"got {dtype_or_bytes!r}")
    return dtype_or_bytes


def kv_cache_bytes(layers: int, kv_heads: int, head_dim: int, context: int, batch: int = 1,
                   dtype_or_bytes=torch.float16) -> float:
    """Bytes of a KV cache: ``2 (K and V) * layers * kv_heads * head_dim * context * batch * bytes``.

    ``kv_heads`` is the number of KEY/VALUE heads: equal to the query heads for multi-head
    attention, fewer with grouped-query attention (8 for LLaMA-2-70B and Llama-3-8B, 3 for
    SmolLM2-135M). ``dtype_or_bytes``: a torch dtype, a name (``"fp16"``, ``"int8"``, ``"int4"``...)
    or bytes per value. Example: LLaMA-2-70B, 8192 tokens, batch 16, fp16, counted as if it
    used multi-head attention (64 KV heads) gives 343.6 GB; with its real 8 KV heads, 42.9 GB.
    """
    for name, value in dict(layers=layers, kv_heads=kv_heads, head_dim=head_dim, context=context, batch=batch).items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return 2 * layers * kv_heads * head_dim * context * batch * _bytes_per_value(dtype_or_bytes)


# ----------------------------------------------------------------------------------------------
# Writing to it and attending to it
# ----------------------------------------------------------------------------------------------


def _check_lengths(name: str, lengths: torch.Tensor, batch: int, max_len: int, *, allow_zero: bool) -> None:
    if not isinstance(lengths, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of integers, got {type(lengths).__name__}")
    if lengths.is_floating_point() or lengths.is_complex() or lengths.dtype == torch.bool:
        raise TypeError(f"{name} must hold integers, got dtype {lengths.dtype}")
    if tuple(lengths.shape) != (batch,):
        raise ValueError(f"{name} must have shape (B,) = ({batch},), got {tuple(lengths.shape)}")
    if batch:
        lo, hi = (int(x) for x in lengths.aminmax())
        least = 0 if allow_zero else 1
        if lo < least:
            raise ValueError(f"{name} must be >= {least}, got a minimum of {lo}")
        if hi > max_len:
            raise ValueError(f"{name} must be <= the cache's max_len {max_len}, got a maximum of {hi}")


def check_decode_inputs(q, cache_k, cache_v, lengths) -> None:
    """Shapes, dtypes and devices for one decode step; raise ValueError/TypeError naming the argument."""
    for name, t in dict(q=q, cache_k=cache_k, cache_v=cache_v).items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if q.ndim != 3:
        raise ValueError(f"q must be (B, H, D): one new query per sequence and head; got shape {tuple(q.shape)}")
    if cache_k.ndim != 4:
        raise ValueError(f"cache_k must be (B, Hkv, max_len, D), got shape {tuple(cache_k.shape)}")
    if cache_v.shape != cache_k.shape:
        raise ValueError(f"cache_v must have cache_k's shape {tuple(cache_k.shape)}, got {tuple(cache_v.shape)}")
    b, h, d = q.shape
    bk, hkv, max_len, dk = cache_k.shape
    if bk != b:
        raise ValueError(f"cache_k has batch {bk} but q has batch {b}")
    if dk != d:
        raise ValueError(f"cache_k has head_dim {dk} but q has head_dim {d}")
    if hkv == 0 or h % hkv:
        raise ValueError(f"the query-head count (q: {h}) must be a multiple of the KV-head count (cache_k: {hkv})")
    for name, t in dict(cache_k=cache_k, cache_v=cache_v).items():
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}; they must match")
    for name, t in dict(cache_k=cache_k, cache_v=cache_v, lengths=lengths).items():
        if isinstance(t, torch.Tensor) and t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; they must match")
    _check_lengths("lengths", lengths, b, max_len, allow_zero=False)


def cache_update(cache_k: torch.Tensor, cache_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 lengths: torch.Tensor) -> torch.Tensor:
    """Write new keys and values after each sequence's cached ones, in place; return the new lengths.

    ``cache_k``, ``cache_v``: ``(B, Hkv, max_len, D)``; ``k``, ``v``: ``(B, Hkv, T, D)``, the ``T``
    new positions of every sequence; ``lengths``: ``(B,)`` positions each sequence already holds.
    Sequence ``b``'s new keys go to positions ``lengths[b] .. lengths[b] + T - 1``. Writing past
    ``max_len`` raises ``ValueError`` (nothing is written then).
    """
    for name, t in dict(cache_k=cache_k, cache_v=cache_v, k=k, v=v).items():
        if not isinstance(t, torch.Tensor) or t.ndim != 4:
            raise ValueError(f"{name} must be a 4-D tensor (B, Hkv, T, D), got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if cache_v.shape != cache_k.shape:
        raise ValueError(f"cache_v must have cache_k's shape {tuple(cache_k.shape)}, got {tuple(cache_v.shape)}")
    b, hkv, max_len, d = cache_k.shape
    if v.shape != k.shape or k.shape[0] != b or k.shape[1] != hkv or k.shape[3] != d:
        raise ValueError(f"k and v must be (B={b}, Hkv={hkv}, T, D={d}); got {tuple(k.shape)} and {tuple(v.shape)}")
    for name, t in dict(k=k, cache_v=cache_v, v=v).items():
        if t.dtype != cache_k.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but cache_k has {cache_k.dtype}; they must match")
        if t.device != cache_k.device:
            raise ValueError(f"{name} is on {t.device} but cache_k is on {cache_k.device}; they must match")
    _check_lengths("lengths", lengths, b, max_len, allow_zero=True)
    t = k.shape[2]
    over = int((lengths + t).max()) if b else 0
    if over > max_len:
        raise ValueError(f"cache is full: writing {t} new position(s) after lengths up to {over - t} needs "
                         f"{over} positions, but the cache holds max_len={max_len}")
    for i, start in enumerate(lengths.tolist()):
        cache_k[i, :, start:start + t] = k[i]
        cache_v[i, :, start:start + t] = v[i]
    return lengths + t


def attend_cached(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, lengths: torch.Tensor,
                  scale: float | None = None) -> torch.Tensor:
    """One decode step of attention: ``softmax(q k^T * scale) v`` over each sequence's valid positions.

    ``q``: ``(B, H, D)``, the new token's queries; ``cache_k``, ``cache_v``: ``(B, Hkv, max_len, D)``
    (``H`` a multiple of ``Hkv``: query head ``h`` uses KV head ``h // (H // Hkv)``); ``lengths``
    ``(B,)``: sequence ``b`` sees positions ``0 .. lengths[b] - 1`` (the new token's own key is
    already in the cache). No causal mask is needed: the new token is the last one, and every
    cached position is in its past. Positions past ``lengths[b]`` hold anything (even nan): they
    are masked out of the scores and zeroed out of the values. Returns ``(B, H, D)`` in q's dtype.
    """
    check_decode_inputs(q, cache_k, cache_v, lengths)
    b, h, d = q.shape
    hkv, max_len = cache_k.shape[1], cache_k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    valid = torch.arange(max_len, device=q.device)[None, :] < lengths.to(q.device)[:, None]   # (B, max_len)
    k = repeat_kv(cache_k, h // hkv).float()                                                   # (B, H, max_len, D)
    v = repeat_kv(cache_v, h // hkv).float().masked_fill(~valid[:, None, :, None], 0.0)
    scores = torch.einsum("bhd,bhtd->bht", q.float(), k) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1)
    return torch.einsum("bht,bhtd->bhd", p, v).to(q.dtype)


# ----------------------------------------------------------------------------------------------
# Flash-decoding in torch: split the cache, attend to each stretch, merge
# ----------------------------------------------------------------------------------------------


def split_bounds(length: int, num_splits: int, block: int = 1) -> list[tuple[int, int]]:
    """The ``[start, end)`` stretch of every split: ``ceil(length / S)`` positions each, rounded up to
    a multiple of ``block`` (the kernel's loop step), so the last splits may be short or empty."""
    per_split = -(-length // num_splits)                 # ceil(length / S): -(-a // b) is ceil(a / b)
    chunk = -(-per_split // block) * block                # rounded up to a multiple of block
    return [(min(s * chunk, length), min((s + 1) * chunk, length)) for s in range(num_splits)]


def split_partials(q, cache_k, cache_v, lengths, num_splits: int, scale: float | None = None, block: int = 1):
    """Phase 1 of flash-decoding: each split's normalised output and log-sum-exp.

    Returns ``partial_out`` ``(B, H, S, D)`` and ``partial_lse`` ``(B, H, S)``, both float32, in the
    format :func:`combine_partials_reference` (and ``kernels.combine_partials``) merge. An empty
    split has output 0 and lse ``-inf``.
    """
    check_decode_inputs(q, cache_k, cache_v, lengths)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    b, h, d = q.shape
    group = h // cache_k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(b, h, num_splits, d, dtype=torch.float32, device=q.device)
    lse = torch.full((b, h, num_splits), float("-inf"), dtype=torch.float32, device=q.device)
    for i, n in enumerate(lengths.tolist()):
        k = cache_k[i].float().repeat_interleave(group, dim=0)  # (H, max_len, D)
        v = cache_v[i].float().repeat_interleave(group, dim=0)
        for s, (start, end) in enumerate(split_bounds(n, num_splits, block)):
            if start == end:
                continue
            scores = torch.einsum("hd,htd->ht", q[i].float(), k[:, start:end]) * scale
            m = scores.max(dim=-1, keepdim=True).values          # the split's own maximum
            p = torch.exp(scores - m)
            l = p.sum(dim=-1, keepdim=True)                       # and its own denominator
            out[i, :, s] = torch.einsum("ht,htd->hd", p, v[:, start:end]) / l
            lse[i, :, s] = (m + torch.log(l))[:, 0]
    return out, lse


def combine_partials_reference(partial_out: torch.Tensor, partial_lse: torch.Tensor) -> torch.Tensor:
    """Phase 2: ``sum_s exp(lse_s - M) o_s / sum_s exp(lse_s - M)``, ``M = max_s lse_s`` (0 if all empty)."""
    m = partial_lse.max(dim=-1, keepdim=True).values
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)     # every split empty: no -inf - -inf
    w = torch.exp(partial_lse - m)                               # (B, H, S); empty splits weigh 0
    o = torch.where(w[..., None] > 0, partial_out, torch.zeros_like(partial_out))
    total = w.sum(dim=-1, keepdim=True)
    return (w[..., None] * o).sum(dim=-2) / torch.where(total > 0, total, torch.ones_like(total))


# ----------------------------------------------------------------------------------------------
# Greedy decoding on a real model, without and with a cache
# ----------------------------------------------------------------------------------------------


@dataclass
class DecodeTrace:
    """The greedy tokens of one decoding run and the seconds each step took.

    ``step_s[0]`` is the first step (the whole prompt, both ways); ``step_s[1:]`` the later ones.
    """

    tokens: list[int] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)

    @property
    def ms_per_token(self) -> float:
        """Median milliseconds of the steps after the first (the decode steps)."""
        later = sorted(self.step_s[1:]) or self.step_s
        return 1e3 * later[len(later) // 2]


def _ids(ids, device) -> torch.Tensor:
    t = torch.as_tensor(ids, device=device)
    if t.ndim == 1:
        t = t[None]
    if t.ndim != 2 or t.shape[0] != 1 or t.is_floating_point() or t.shape[1] == 0:
        raise ValueError(f"ids must be one non-empty sequence of token ids, got shape {tuple(t.shape)}")
    return t


@torch.inference_mode()
def decode_recompute(model, ids, n: int) -> DecodeTrace:
    """``n`` greedy tokens, each step running the model over the WHOLE sequence so far (no cache)."""
    seq = _ids(ids, model.device)
    trace = DecodeTrace()
    for _ in range(n):
        start = time.perf_counter()
        logits = model(seq, last_only=True).logits[0, -1]
        token = int(logits.argmax())
        trace.step_s.append(time.perf_counter() - start)
        trace.tokens.append(token)
        seq = torch.cat([seq, torch.tensor([[token]], device=seq.device)], dim=1)
    return trace


@torch.inference_mode()
def decode_cached(model, ids, n: int) -> DecodeTrace:
    """``n`` greedy tokens with a KV cache: the prompt once, then one token per step."""
    seq = _ids(ids, model.device)
    cache = model.new_cache(batch_size=1, max_len=seq.shape[1] + n)
    trace = DecodeTrace()
    step_in = seq
    for _ in range(n):
        start = time.perf_counter()
        logits = model(step_in, cache=cache, last_only=True).logits[0, -1]
        token = int(logits.argmax())
        trace.step_s.append(time.perf_counter() - start)
        trace.tokens.append(token)
        step_in = torch.tensor([[token]], device=seq.device)
    return trace
