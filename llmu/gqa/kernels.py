"""Triton decode kernel of module 07: grouped-query attention that reads each KV head once.

At decode time a sequence brings one new query per query head, and each of the ``H`` query heads
attends to the ``T`` cached keys and values of its KV head ``h // G`` (``G = H / Hkv`` query heads
per KV head). The arithmetic is tiny (two dot products of ``D`` numbers per cached position); the
cost is reading the cache. How many times the cache is read depends on how the work is cut:

- **per head** (``grouped=False``): one program per (sequence, *query* head, split). The ``G``
  programs of a group each stream the same KV head from memory: ``G`` reads of every key and value.
- **grouped** (``grouped=True``, the default): one program per (sequence, *KV* head, split). The
  ``G`` queries of the group form a ``(G, D)`` tile, every block of keys is loaded once and scored
  against all of them with one ``tl.dot`` (a ``(G, D) x (D, BLOCK_N)`` product), and the
  probabilities meet the values in a second ``tl.dot``. One read of the cache, whatever ``G``.

Both cut each sequence into ``num_splits`` stretches (flash-decoding: more programs to fill a GPU)
and write per-split partial results, which :func:`llmu.kvcache.kernels.combine_partials` (module 06)
merges with their log-sum-exps. Module 06's ``decode_attention`` is the grouped variant of the same
idea; this file keeps the per-head variant beside it, behind one switch, so that the benchmark
measures exactly what grouping saves.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from llmu import runtime
from llmu.checks import FLOAT_DTYPES, require_positive, require_same_device, require_same_dtype, require_tensor
from llmu.kvcache.kernels import combine_partials

__all__ = ["gqa_decode", "gqa_decode_partials", "BLOCK_N", "HEAD_DIMS"]

#: Cached positions one program scores per loop step.
BLOCK_N = 64
#: Head dims the kernel supports (``tl.arange`` needs a power of two, ``tl.dot`` at least 16).
HEAD_DIMS = (16, 32, 64, 128, 256)


@triton.jit
def _gqa_decode_kernel(
    q_ptr, k_ptr, v_ptr, len_ptr, po_ptr, plse_ptr,
    programs_per_batch, num_splits, scale,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_pb, stride_ph, stride_ps, stride_pd,
    stride_lb, stride_lh, stride_ls,
    GROUP: tl.constexpr,        # query heads per KV head, H / Hkv
    GROUPED: tl.constexpr,      # True: a program serves a KV head's GROUP queries; False: one query head
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,      # query rows of the tile, padded to a power of two >= 16 for tl.dot
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,    # "ieee" for float32 (no TF32 rounding on a GPU), "tf32" otherwise
):
    pid = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    b = pid // programs_per_batch
    j = pid % programs_per_batch

    # 1. Which query heads this program serves, and the KV head they share.
    g = tl.arange(0, BLOCK_G)
    if GROUPED:
        kvh = j                       # program = KV head: its GROUP query heads kvh*G .. kvh*G + G-1
        heads = kvh * GROUP + g
        rows = g < GROUP
    else:
        kvh = j // GROUP              # program = query head j, reading KV head j // G on its own
        heads = j + g
        rows = g < 1

    # 2. This split's stretch [start, end) of sequence b, in whole blocks of BLOCK_N positions.
    length = tl.load(len_ptr + b).to(tl.int32)
    chunk = tl.cdiv(tl.cdiv(length, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, length)

    # 3. The queries as a (BLOCK_G, D) tile; rows past the group are zeros and never stored.
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=rows[:, None], other=0.0)
    k_base = k_ptr + b * stride_kb + kvh * stride_kh
    v_base = v_ptr + b * stride_vb + kvh * stride_vh
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)   # running max of each row's scores
    l = tl.zeros([BLOCK_G], tl.float32)                 # running sum of exp(score - m)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)     # running sum of exp(score - m) * v

    # 4. Online softmax over the stretch: each key/value block is loaded ONCE for all the rows.
    for n0 in range(start, end, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        valid = offs < end
        k = tl.load(k_base + offs[:, None] * stride_kt + d[None, :] * stride_kd, mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale       # (BLOCK_G, BLOCK_N)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + offs[:, None] * stride_vt + d[None, :] * stride_vd, mask=valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new

    # 5. Partial result in module 06's format: output normalised over the split, and its
    #    log-sum-exp; an empty split writes 0 and -inf (combine_partials gives it weight 0).
    has = l > 0
    out = tl.where(has[:, None], acc / tl.where(has, l, 1.0)[:, None], 0.0)
    lse = tl.where(has, m + tl.log(tl.where(has, l, 1.0)), float("-inf"))
    tl.store(po_ptr + b * stride_pb + heads[:, None] * stride_ph + split * stride_ps + d[None, :] * stride_pd,
             out, mask=rows[:, None])
    tl.store(plse_ptr + b * stride_lb + heads * stride_lh + split * stride_ls, lse, mask=rows)


def _validate(q, k_cache, v_cache, lengths):
    require_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    require_tensor("k_cache", k_cache, ndim=4, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    require_tensor("v_cache", v_cache, ndim=4, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    require_same_dtype(q=q, k_cache=k_cache, v_cache=v_cache)
    require_same_device(q=q, k_cache=k_cache, v_cache=v_cache)
    if q.dtype == torch.bfloat16 and runtime.interpreting():
        # the interpreter computes tl.dot with numpy, which has no bfloat16: it would return garbage
        raise TypeError("q: bfloat16 needs a GPU (Triton's interpreter has no bfloat16 tl.dot); use float16 or float32")
    b, h, d = q.shape
    bk, hkv, max_len, dk = k_cache.shape
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(f"v_cache must have k_cache's shape {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    if bk != b:
        raise ValueError(f"k_cache has batch {bk} but q has batch {b}")
    if dk != d:
        raise ValueError(f"k_cache has head_dim {dk} but q has head_dim {d}")
    if hkv == 0 or h % hkv:
        raise ValueError(f"the query-head count of q ({h}) must be a multiple of the KV-head count of "
                         f"k_cache ({hkv}): every KV head serves the same number of query heads")
    if d not in HEAD_DIMS:
        raise ValueError(f"q: head_dim must be one of {HEAD_DIMS}, got {d}")
    if max_len == 0:
        raise ValueError("k_cache holds no positions (max_len = 0)")
    if lengths is None:
        return torch.full((b,), max_len, dtype=torch.int32, device=q.device)
    require_tensor("lengths", lengths, ndim=1, dtypes=(torch.int32, torch.int64))
    require_same_device(q=q, lengths=lengths)
    if lengths.shape[0] != b:
        raise ValueError(f"lengths must have one entry per sequence ({b}), got {lengths.shape[0]}")
    if b and (int(lengths.min()) < 1 or int(lengths.max()) > max_len):
        raise ValueError(f"lengths must lie in 1 .. max_len = {max_len}, got {lengths.tolist()}")
    return lengths


def _default_splits(max_length: int, programs: int, device) -> int:
    if torch.device(device).type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        wanted = -(-2 * sms // max(1, programs))          # about two programs per multiprocessor
        return int(max(1, min(wanted, -(-max_length // 256), 128)))
    return int(max(1, min(4, -(-max_length // BLOCK_N))))  # interpreter: a few, to exercise the merge


def gqa_decode_partials(q, k_cache, v_cache, lengths=None, *, num_splits: int = 1, scale: float | None = None,
                        grouped: bool = True):
    """Phase 1 only: ``(partial_out (B, H, S, D), partial_lse (B, H, S))`` float32, the format of
    :func:`llmu.kvcache.kernels.combine_partials`."""
    lengths = _validate(q, k_cache, v_cache, lengths)
    require_positive("num_splits", num_splits, integer=True)
    b, h, d = q.shape
    hkv = k_cache.shape[1]
    group = h // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    partial_out = torch.empty((b, h, num_splits, d), dtype=torch.float32, device=q.device)
    partial_lse = torch.empty((b, h, num_splits), dtype=torch.float32, device=q.device)
    per_batch = hkv if grouped else h
    if b:
        _gqa_decode_kernel[(b * per_batch, num_splits)](
            q, k_cache, v_cache, lengths, partial_out, partial_lse,
            per_batch, num_splits, scale,
            *q.stride(), *k_cache.stride(), *v_cache.stride(), *partial_out.stride(), *partial_lse.stride(),
            GROUP=group, GROUPED=bool(grouped), HEAD_DIM=d,
            BLOCK_G=max(16, triton.next_power_of_2(group if grouped else 1)), BLOCK_N=BLOCK_N,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        )
    return partial_out, partial_lse


def gqa_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor | None = None,
               *, num_splits: int | None = None, scale: float | None = None, grouped: bool = True) -> torch.Tensor:
    """One decode step of grouped-query attention against a padded KV cache.

    ``q (B, H, D)``: the new token's queries; ``k_cache``, ``v_cache`` ``(B, Hkv, max_len, D)`` with
    ``H`` a multiple of ``Hkv`` (``Hkv = H``: MHA; ``Hkv = 1``: MQA); ``lengths (B,)``: sequence
    ``b`` attends to positions ``0 .. lengths[b]-1`` (default: all ``max_len``). ``grouped``: one
    program per KV head (each key read once) or per query head (each key read ``H/Hkv`` times);
    the result is the same. Returns ``(B, H, D)`` in q's dtype.
    """
    lengths = _validate(q, k_cache, v_cache, lengths)
    if num_splits is None:
        longest = int(lengths.max()) if lengths.numel() else 1
        num_splits = _default_splits(longest, q.shape[0] * (k_cache.shape[1] if grouped else q.shape[1]), q.device)
    partial_out, partial_lse = gqa_decode_partials(q, k_cache, v_cache, lengths, num_splits=num_splits,
                                                   scale=scale, grouped=grouped)
    return combine_partials(partial_out, partial_lse, out_dtype=q.dtype)
