"""Triton kernels of module 06: attention of one new token against a KV cache (flash-decoding).

During decoding every sequence of a batch brings ONE new query token per head, and it attends to
all the keys and values its cache holds. The work per (sequence, KV head) is a long, thin
reduction over the cache: ``T`` keys and values read once, almost no arithmetic per byte. One
program per (sequence, head) would leave most of a GPU idle (B·Hkv programs for 100+ cores), so
flash-decoding also *splits the sequence*: program (b, kv head, split) reduces only its stretch of
the cache and writes a partial result, and a second, small kernel merges the partials.

``decode_attention(q, k_cache, v_cache, lengths, *, num_splits=None, scale=None, grouped=True)``
    ``q`` ``(B, H, D)``: the new token's queries; ``k_cache``, ``v_cache`` ``(B, Hkv, max_len, D)``
    padded caches; ``lengths`` ``(B,)`` integer: sequence ``b`` attends to positions
    ``0 .. lengths[b] - 1`` of its cache (ragged batches). Grouped-query attention: query head
    ``h`` reads KV head ``h // G`` (``G = H // Hkv``). How the work is cut decides how often the
    cache is read:

    - ``grouped=True`` (the default): one program per (sequence, *KV* head, split). The ``G``
      queries of the group form a ``(G, D)`` tile, every block of keys is loaded once and scored
      against all of them with one ``tl.dot``, and the probabilities meet the values in a second
      ``tl.dot``. Every key and value is read from memory once, whatever ``G``.
    - ``grouped=False``: one program per (sequence, *query* head, split). The ``G`` programs of a
      group each stream the same KV head: ``G`` reads of every key and value for the same answer.
      It exists so that module 07's benchmark measures what grouping saves with the same kernel.

``combine_partials(partial_out, partial_lse)``
    The merge step on its own. Each split ``s`` has computed
    ``o_s = sum_j p_j v_j / l_s`` over its keys (``p_j = exp(score_j - m_s)``, ``l_s = sum_j p_j``)
    and ``lse_s = m_s + log(l_s)``, the log of its softmax denominator. The whole softmax
    denominator is ``sum_s exp(lse_s)``, so the exact attention output is the weighted mean

        out = sum_s w_s o_s / sum_s w_s,    w_s = exp(lse_s - max_s lse_s)

    (subtracting the maximum keeps every exponent <= 0, as in the softmax itself). An empty split
    (no keys) has ``lse_s = -inf`` and weight 0; a row whose splits are all empty gets 0.

Both kernels accumulate in float32; ``decode_attention`` returns the input dtype. Module 07's
``llmu.gqa.kernels.gqa_decode`` is this kernel under its own name.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from llmu import runtime
from llmu.checks import FLOAT_DTYPES, require_positive, require_same_device, require_same_dtype, require_tensor

__all__ = ["combine_partials", "decode_attention", "decode_partials", "choose_num_splits", "BLOCK_N", "HEAD_DIMS"]

#: Keys (cache positions) one program handles per loop step.
BLOCK_N = 64
#: Head dims the decode kernel supports (``tl.arange`` needs a power of two; ``tl.dot`` >= 16).
HEAD_DIMS = (16, 32, 64, 128, 256)


# ----------------------------------------------------------------------------------------------
# The merge: log-sum-exp combination of per-split partial results
# ----------------------------------------------------------------------------------------------


@triton.jit
def _combine_kernel(
    po_ptr, plse_ptr, out_ptr, lse_ptr,
    num_heads, num_splits,
    stride_pb, stride_ph, stride_ps, stride_pd,
    stride_lb, stride_lh, stride_ls,
    stride_ob, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)          # one program per (batch, head) row
    b = pid // num_heads
    h = pid % num_heads
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    smask = s < num_splits
    dmask = d < HEAD_DIM

    # 1. The splits' log-sum-exps; padding splits read -inf (weight 0), like empty ones.
    lse = tl.load(plse_ptr + b * stride_lb + h * stride_lh + s * stride_ls, mask=smask, other=-float("inf"))
    m = tl.max(lse, axis=0)
    m_safe = tl.where(m == -float("inf"), 0.0, m)  # all splits empty: avoid -inf - (-inf) = nan
    # 2. Weights relative to the largest split: exp(lse_s - max) in (0, 1], 0 for empty splits.
    w = tl.exp(lse - m_safe)
    total = tl.sum(w, axis=0)
    # 3. Weighted mean of the splits' (normalised) outputs.
    o = tl.load(po_ptr + b * stride_pb + h * stride_ph + s[:, None] * stride_ps + d[None, :] * stride_pd,
                mask=smask[:, None] & dmask[None, :], other=0.0)
    o = tl.where((w > 0)[:, None], o, 0.0)       # an empty split's output is ignored, even nan
    acc = tl.sum(w[:, None] * o, axis=0)
    out = tl.where(total > 0, acc / tl.where(total > 0, total, 1.0), 0.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d * stride_od, out.to(out_ptr.dtype.element_ty), mask=dmask)
    # 4. The merged log-sum-exp, for callers that merge again (-inf for an all-empty row).
    lse_all = tl.where(total > 0, m_safe + tl.log(tl.where(total > 0, total, 1.0)), -float("inf"))
    tl.store(lse_ptr + pid, lse_all)


def combine_partials(partial_out: torch.Tensor, partial_lse: torch.Tensor, *, out_dtype: torch.dtype | None = None,
                     return_lse: bool = False):
    """Merge per-split attention results into the attention output (the flash-decoding reduction).

    Stable signature:

    - ``partial_out``: ``(B, H, S, D)`` float32, split ``s``'s attention output *normalised over its
      own keys* (``sum_j p_j v_j / sum_j p_j``); any value where the split is empty.
    - ``partial_lse``: ``(B, H, S)`` float32, split ``s``'s natural-log softmax denominator
      ``m_s + log(sum_j exp(score_j - m_s))``; ``-inf`` for an empty split (no keys).
    - returns ``out`` ``(B, H, D)`` in ``out_dtype`` (default float32) and, with
      ``return_lse=True``, also the merged ``lse`` ``(B, H)`` float32. A row whose splits are all
      empty gets ``out = 0`` and ``lse = -inf``.

    Empty splits get weight exactly 0 and whatever they hold in ``partial_out`` (even nan) is
    ignored.
    """
    require_tensor("partial_out", partial_out, ndim=4, dtypes=(torch.float32,), last_dim_contiguous=False)
    require_tensor("partial_lse", partial_lse, ndim=3, dtypes=(torch.float32,))
    require_same_device(partial_out=partial_out, partial_lse=partial_lse)
    b, h, s, d = partial_out.shape
    if tuple(partial_lse.shape) != (b, h, s):
        raise ValueError(f"partial_lse must have shape (B, H, S) = {(b, h, s)} to match partial_out "
                         f"{tuple(partial_out.shape)}; got {tuple(partial_lse.shape)}")
    if s < 1 or d < 1:
        raise ValueError(f"partial_out needs at least one split and one feature, got shape {tuple(partial_out.shape)}")
    out_dtype = out_dtype or torch.float32
    if out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be one of {FLOAT_DTYPES}, got {out_dtype}")
    out = torch.empty((b, h, d), dtype=out_dtype, device=partial_out.device)
    lse = torch.empty((b, h), dtype=torch.float32, device=partial_out.device)
    if b * h:
        _combine_kernel[(b * h,)](
            partial_out, partial_lse, out, lse,
            h, s,
            *partial_out.stride(), *partial_lse.stride(), *out.stride(),
            HEAD_DIM=d, BLOCK_S=max(2, triton.next_power_of_2(s)), BLOCK_D=max(2, triton.next_power_of_2(d)),
        )
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------------------------
# Phase 1: every (sequence, KV head, split) program attends to its stretch of the cache
# ----------------------------------------------------------------------------------------------


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, len_ptr, po_ptr, plse_ptr,
    programs_per_seq, num_splits, scale,
    stride_qb, stride_qh, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_pb, stride_ph, stride_ps, stride_pd,
    stride_lb, stride_lh, stride_ls,
    GROUP: tl.constexpr,        # query heads per KV head, H / Hkv
    GROUPED: tl.constexpr,      # True: a program serves a KV head's GROUP queries; False: one query head
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,      # query rows of the tile, padded to a power of two >= 16 (tl.dot's smallest)
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,    # "ieee" for float32 inputs (no TF32 rounding on a GPU), "tf32" otherwise
):
    pid = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    b = pid // programs_per_seq
    j = pid % programs_per_seq

    # 1. Which query heads this program serves, and the KV head they share (query head h reads
    #    KV head h // GROUP).
    g = tl.arange(0, BLOCK_G)
    if GROUPED:
        kvh = j                       # program = KV head j: its query heads j*GROUP .. j*GROUP + GROUP-1
        heads = kvh * GROUP + g
        rows = g < GROUP
    else:
        kvh = j // GROUP              # program = query head j, streaming KV head j // GROUP on its own
        heads = j + g
        rows = g < 1

    # 2. This split's stretch [start, end) of sequence b: ceil(length / S) positions, rounded up
    #    to whole blocks; the last splits of a short sequence are short or empty.
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
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)    # running max of each row's scores
    l = tl.zeros([BLOCK_G], tl.float32)                  # running sum of exp(score - m)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)      # running sum of exp(score - m) * v

    # 4. Online softmax over the stretch, BLOCK_N cached positions at a time. Each key/value block
    #    is loaded ONCE for all the tile's rows: the whole group when GROUPED, a single head if not.
    for n0 in range(start, end, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        nmask = offs < end                               # never read past the sequence's length
        k = tl.load(k_base + offs[:, None] * stride_kt + d[None, :] * stride_kd, mask=nmask[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale          # (BLOCK_G, BLOCK_N) fp32
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)                        # rescales what was summed under the old max
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + offs[:, None] * stride_vt + d[None, :] * stride_vd, mask=nmask[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new

    # 5. The split's normalised output and log-sum-exp; an empty split writes 0 and -inf
    #    (combine_partials gives it weight 0).
    has = l > 0
    out = tl.where(has[:, None], acc / tl.where(has, l, 1.0)[:, None], 0.0)
    lse = tl.where(has, m + tl.log(tl.where(has, l, 1.0)), float("-inf"))
    tl.store(po_ptr + b * stride_pb + heads[:, None] * stride_ph + split * stride_ps + d[None, :] * stride_pd,
             out, mask=rows[:, None])
    tl.store(plse_ptr + b * stride_lb + heads * stride_lh + split * stride_ls, lse, mask=rows)


def block_n(head_dim: int) -> int:
    """Cached positions per step of the split loop: :data:`BLOCK_N`, halved on a GPU for head_dim 256,
    whose key and value tiles (64 x 256, twice, per pipeline stage) would need 276 KB of shared
    memory in float32, more than any GPU has (227 KB on an H100, 163 KB on an A100, 64 KB on a T4)."""
    return BLOCK_N if runtime.interpreting() or head_dim <= 128 else BLOCK_N // 2


def _sm_count(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(batch: int, kv_heads: int, max_length: int, device=None) -> int:
    """How many splits to cut each sequence into.

    ``kv_heads`` is the number of programs per sequence and split: the KV heads for the grouped
    kernel (the query heads when ``decode_attention`` runs with ``grouped=False``).

    On a GPU: enough (batch, KV head, split) programs to fill every streaming multiprocessor about
    twice over, but no split shorter than 256 positions (a split must read enough to hide the
    cost of writing its partial result) and at most 128 of them. In the interpreter each program
    is slow Python, so a few splits only (still more than one, to exercise the merge).
    """
    min_positions = 256
    most = max(1, -(-max_length // min_positions))
    if device is not None and torch.device(device).type == "cuda":
        wanted = -(-2 * _sm_count(device) // max(1, batch * kv_heads))
        return int(max(1, min(wanted, most, 128)))
    return int(max(1, min(4, -(-max_length // BLOCK_N))))


def _validate(q, k_cache, v_cache, lengths):
    from llmu.kvcache.reference import check_decode_inputs

    require_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    require_tensor("k_cache", k_cache, ndim=4, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    require_tensor("v_cache", v_cache, ndim=4, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    require_tensor("lengths", lengths, ndim=1, dtypes=(torch.int32, torch.int64))
    require_same_dtype(q=q, k_cache=k_cache, v_cache=v_cache)
    require_same_device(q=q, k_cache=k_cache, v_cache=v_cache, lengths=lengths)
    check_decode_inputs(q, k_cache, v_cache, lengths)
    d = q.shape[-1]
    if d not in HEAD_DIMS:
        raise ValueError(f"q: head_dim must be one of {HEAD_DIMS}, got {d}")
    if q.dtype == torch.bfloat16 and runtime.interpreting():
        # the interpreter computes tl.dot with numpy, which has no bfloat16: it would return garbage
        raise TypeError("q: bfloat16 needs a GPU (Triton's interpreter has no bfloat16 tl.dot); "
                        "use float16 or float32")


def decode_partials(q, k_cache, v_cache, lengths, num_splits: int, scale: float | None = None, *,
                    grouped: bool = True):
    """Phase 1 only: ``(partial_out (B, H, S, D), partial_lse (B, H, S))`` float32 (see the module doc).

    ``grouped=True``: one program per (sequence, KV head, split); ``False``: one per (sequence,
    query head, split). Same partials either way, only the memory traffic differs.
    """
    _validate(q, k_cache, v_cache, lengths)
    require_positive("num_splits", num_splits, integer=True)
    if not isinstance(grouped, bool):
        raise TypeError(f"grouped must be True or False, got {grouped!r}")
    b, h, d = q.shape
    hkv = k_cache.shape[1]
    group = h // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    partial_out = torch.empty((b, h, num_splits, d), dtype=torch.float32, device=q.device)
    partial_lse = torch.empty((b, h, num_splits), dtype=torch.float32, device=q.device)
    per_seq = hkv if grouped else h
    if b:
        _decode_split_kernel[(b * per_seq, num_splits)](
            q, k_cache, v_cache, lengths, partial_out, partial_lse,
            per_seq, num_splits, scale,
            *q.stride(), *k_cache.stride(), *v_cache.stride(), *partial_out.stride(), *partial_lse.stride(),
            GROUP=group, GROUPED=grouped, HEAD_DIM=d,
            # per head: one real row, padded to 16 because tl.dot needs it (wasted FLOPs, not bytes)
            BLOCK_G=max(16, triton.next_power_of_2(group if grouped else 1)), BLOCK_N=block_n(d),
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        )
    return partial_out, partial_lse


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor, *,
                     num_splits: int | None = None, scale: float | None = None, grouped: bool = True) -> torch.Tensor:
    """Attention of one new token per sequence against a padded KV cache (flash-decoding).

    ``q`` ``(B, H, D)``; ``k_cache``, ``v_cache`` ``(B, Hkv, max_len, D)`` with ``H`` a multiple of
    ``Hkv`` (``Hkv = H``: MHA; ``Hkv = 1``: MQA); ``lengths`` ``(B,)`` int32/int64, each in
    ``1 .. max_len``; ``num_splits``: splits per sequence (default :func:`choose_num_splits`; more
    splits than positions is allowed, the extra ones are empty); ``scale`` defaults to
    ``1/sqrt(D)``; ``grouped``: one program per KV head, reading each key and value once for its
    whole group of query heads (the default), or, with ``False``, one program per query head, so
    that a group's ``H/Hkv`` programs each read the same KV head (module 07 measures the
    difference). Returns ``(B, H, D)`` in q's dtype, equal to ``reference.attend_cached``.
    """
    _validate(q, k_cache, v_cache, lengths)
    if num_splits is None:
        longest = int(lengths.max()) if lengths.numel() else 1
        per_seq = k_cache.shape[1] if grouped else q.shape[1]
        num_splits = choose_num_splits(q.shape[0], per_seq, longest, q.device)
    partial_out, partial_lse = decode_partials(q, k_cache, v_cache, lengths, num_splits, scale, grouped=grouped)
    return combine_partials(partial_out, partial_lse, out_dtype=q.dtype)
