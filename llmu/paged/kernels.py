"""Triton kernels of module 09: attention that reads its keys and values through block tables.

The paged cache (``llmu.paged.reference``) keeps every layer's keys and values in one pool of
blocks, ``(num_blocks, block_size, Hkv, D)``, and gives each sequence a *block table*: position
``p`` of sequence ``b`` lives in row ``p % block_size`` of physical block
``block_tables[b, p // block_size]``. The kernels here are the contiguous kernels of the course
with one line changed — where they computed the address of position ``p`` as
``p * stride``, they now look the block up first::

    block = tl.load(table + p // BLOCK_SIZE)                 # the block-table lookup
    k     = tl.load(k_pool + (block * BLOCK_SIZE + p % BLOCK_SIZE) * stride_slot + d)

``block * BLOCK_SIZE + p % BLOCK_SIZE`` is the position's *slot*, its row in the pool flattened to
``(num_blocks * block_size, Hkv, D)``. Everything else — the online softmax, the split-K merge,
the causal limits — is unchanged.

Why the indirection costs little
--------------------------------
A program streams a tile of ``BLOCK_N`` positions at a time; the tile covers ``BLOCK_N /
block_size`` whole blocks (several blocks when they are small, part of one when they are big,
since both are powers of two and tiles start at multiples of ``BLOCK_N``). Each position's block
id is loaded from the table, but the ids of one tile sit in the same few bytes of the table, so
the memory system serves them from one cache line: what the table adds to the traffic is one
4-byte int per block, against the block's keys and values. Napkin math for one KV head of one
block of 16 positions in bfloat16 with ``D = 128``: ``2 (K and V) * 16 * 128 * 2 bytes = 8 KiB``
of cache for 4 bytes of table, 0.05 %. For a whole decode step (``B = 32`` sequences of 4096
positions, ``Hkv = 8``, ``D = 128``, bf16)::

    K and V     2 * B * ctx * Hkv * D * 2 bytes   = 537 MB   (112 us at an H200's 4.8 TB/s)
    tables      B * (ctx / 16) * 4 bytes           = 32 KB    (0.006 %)
    q and out   2 * B * H * D * 2 bytes (H = 32)   = 0.5 MB

What paging changes is locality, and it costs little too. In the pool, one KV head's key of one
position is ``D`` contiguous elements (256 bytes for ``D = 128`` in bf16: two whole 128-byte
cache lines), and the positions of a tile come from ``BLOCK_N / block_size`` blocks scattered
anywhere in the pool. Memory is read in whole lines either way, so every byte read is still a
byte used; only the address pattern is less regular than a contiguous cache's, which is why a
paged kernel gets close to a contiguous one rather than equal to it (``llmu.paged.bench``
measures the gap).

The kernels
-----------
``paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, *, scale=None, num_splits=None)``
    One query token per sequence (a decode step). Flash-decoding as in module 06
    (``llmu.kvcache.kernels``): one program per (sequence, KV head, split). The ``G = H / Hkv``
    query heads of the KV head form one ``(G, D)`` tile (padded to 16 rows for ``tl.dot``), so
    every key and value is read once whatever ``G``; each split writes a partial result and
    module 06's ``combine_partials`` merges them.

``paged_prefill_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, *, scale=None)``
    Packed query chunks of several sequences (the "varlen" layout: sequence ``i``'s queries are
    rows ``cu_seqlens_q[i] .. cu_seqlens_q[i+1] - 1`` of ``q``), each the *last* ``q_len_i``
    positions of its context (a cached prefix, or the earlier chunks of a chunked prefill, come
    first), causal bottom-right. FlashAttention-2 as in module 08 (``llmu.flash.kernels``): one
    program per (tile of ``BLOCK_M`` queries, sequence, head); a tile past its sequence's chunk
    exits at once, and the key loop stops at the tile's causal limit.

Both accumulate in float32 and return ``q``'s dtype; float32 inputs use IEEE products in
``tl.dot``. In Triton's interpreter (no GPU) bfloat16 tiles are converted to float32 inside the
kernel before each ``tl.dot`` (the interpreter's numpy has no bfloat16 product): the same answer,
a little more exact (p is not rounded to bfloat16 before ``p @ v``), only slower.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from llmu import runtime
from llmu.checks import require_positive
from llmu.flash.kernels import default_blocks
from llmu.kvcache.kernels import choose_num_splits, combine_partials
from llmu.paged import reference

__all__ = ["paged_decode_attention", "paged_decode_partials", "paged_prefill_attention", "check_block_size",
           "DECODE_BLOCK_N", "HEAD_DIMS"]

#: Cached positions a decode program handles per loop step (whatever the block size).
DECODE_BLOCK_N = 64
#: Head dims the kernels support (``tl.arange`` needs a power of two; ``tl.dot`` >= 16).
HEAD_DIMS = (16, 32, 64, 128, 256)
_LOG2E = 1.4426950408889634   # exp(x) = exp2(x * log2(e)); kernels write ln(2) out (globals are not constexpr)


# ----------------------------------------------------------------------------------------------
# Decode: one program per (sequence, KV head, split)
# ----------------------------------------------------------------------------------------------


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, len_ptr, po_ptr, plse_ptr,
    num_kv_heads, num_splits, qk_scale,
    stride_qb, stride_qh, stride_qd,
    stride_ks, stride_kh, stride_kd,     # the pool as (slots, Hkv, D): stride_ks = Hkv * D
    stride_vs, stride_vh, stride_vd,
    stride_tb, stride_tn,
    stride_pb, stride_ph, stride_ps, stride_pd,
    stride_lb, stride_lh, stride_ls,
    GROUP: tl.constexpr,        # query heads per KV head, H / Hkv
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,   # positions per cache block (a power of two)
    BLOCK_G: tl.constexpr,      # query rows of the tile: GROUP padded to a power of two >= 16
    BLOCK_N: tl.constexpr,      # positions per loop step
    UPCAST: tl.constexpr,       # True in the interpreter for bfloat16: dot in float32
    PRECISION: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    b = pid // num_kv_heads
    kvh = pid % num_kv_heads

    # -- the query heads of KV head kvh: kvh*GROUP .. kvh*GROUP + GROUP-1, one tile row each
    g = tl.arange(0, BLOCK_G)
    heads = kvh * GROUP + g
    rows = g < GROUP

    # -- this split's stretch [start, end) of the sequence, in whole tiles
    length = tl.load(len_ptr + b).to(tl.int32)
    chunk = tl.cdiv(tl.cdiv(length, num_splits), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, length)

    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=rows[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    table = table_ptr + b * stride_tb
    k_head = k_ptr + kvh * stride_kh
    v_head = v_ptr + kvh * stride_vh
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)    # running max (log2 units)
    l_i = tl.zeros([BLOCK_G], tl.float32)                  # running sum of exp2(s - m)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)        # running sum of exp2(s - m) v

    for n0 in range(start, end, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        valid = offs < end                                  # never past the sequence's length
        # -- the block-table lookup: logical block offs // BLOCK_SIZE -> physical block -> slot
        block = tl.load(table + (offs // BLOCK_SIZE) * stride_tn, mask=valid, other=0).to(tl.int64)
        slot = block * BLOCK_SIZE + offs % BLOCK_SIZE
        # -- the tile's keys, scored against the whole group at once
        k = tl.load(k_head + slot[:, None] * stride_ks + d[None, :] * stride_kd, mask=valid[:, None], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        # -- update m_i and l_i; rescale what was summed under the old max
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # -- accumulate p v
        v = tl.load(v_head + slot[:, None] * stride_vs + d[None, :] * stride_vd, mask=valid[:, None], other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    # -- the split's normalised output and natural-log lse; an empty split writes 0 and -inf
    has = l_i > 0
    l_safe = tl.where(has, l_i, 1.0)
    out = tl.where(has[:, None], acc / l_safe[:, None], 0.0)
    lse = tl.where(has, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    tl.store(po_ptr + b * stride_pb + heads[:, None] * stride_ph + split * stride_ps + d[None, :] * stride_pd,
             out, mask=rows[:, None])
    tl.store(plse_ptr + b * stride_lb + heads * stride_lh + split * stride_ls, lse, mask=rows)


# ----------------------------------------------------------------------------------------------
# Prefill: one program per (query tile, sequence, head)
# ----------------------------------------------------------------------------------------------


@triton.jit
def _prefill_inner(acc, m_i, l_i, q, table, k_head, v_head, stride_tn, stride_ks, stride_kd, stride_vs, stride_vd,
                   offs_m, offs_d, lo, hi, ctx, offset, qk_scale,
                   BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                   UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Online softmax over the positions [lo, hi); MASKED adds the length and causal masks."""
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        # -- the block-table lookup (every position below ctx has a valid block)
        if MASKED:
            in_ctx = offs_n < ctx
            block = tl.load(table + (offs_n // BLOCK_SIZE) * stride_tn, mask=in_ctx, other=0).to(tl.int64)
        else:
            block = tl.load(table + (offs_n // BLOCK_SIZE) * stride_tn).to(tl.int64)
        slot = block * BLOCK_SIZE + offs_n % BLOCK_SIZE
        # -- load the keys (as K^T, (D, BLOCK_N)) and the values ((BLOCK_N, D))
        if MASKED:
            kt = tl.load(k_head + slot[None, :] * stride_ks + offs_d[:, None] * stride_kd,
                         mask=in_ctx[None, :], other=0.0)
            v = tl.load(v_head + slot[:, None] * stride_vs + offs_d[None, :] * stride_vd,
                        mask=in_ctx[:, None], other=0.0)
        else:
            kt = tl.load(k_head + slot[None, :] * stride_ks + offs_d[:, None] * stride_kd)
            v = tl.load(v_head + slot[:, None] * stride_vs + offs_d[None, :] * stride_vd)
        if UPCAST:
            kt = kt.to(tl.float32)
            v = v.to(tl.float32)
        # -- scores in log2 units; query row i (position offset + i) sees positions <= its own
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
        if MASKED:
            visible = (offs_n[None, :] < ctx) & (offs_n[None, :] <= offs_m[:, None] + offset)
            s = tl.where(visible, s, float("-inf"))
        # -- update m_i and l_i, then the accumulator
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _paged_prefill_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, table_ptr, cu_ptr, len_ptr,
    qk_scale,
    stride_qn, stride_qh, stride_qd,
    stride_ks, stride_kh, stride_kd,     # the pool as (slots, Hkv, D)
    stride_vs, stride_vh, stride_vd,
    stride_on, stride_oh, stride_od,
    stride_tb, stride_tn,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    start_m = tl.program_id(0) * BLOCK_M
    b = tl.program_id(1).to(tl.int64)
    h = tl.program_id(2)
    kvh = h // GROUP

    # -- this sequence's chunk: rows q_start .. q_start + q_len - 1 of q; a tile past it has no work
    q_start = tl.load(cu_ptr + b).to(tl.int64)
    q_len = (tl.load(cu_ptr + b + 1) - q_start).to(tl.int32)
    if start_m >= q_len:
        return
    ctx = tl.load(len_ptr + b).to(tl.int32)
    offset = ctx - q_len                       # query row i sits at position offset + i

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < q_len
    q = tl.load(q_ptr + (q_start + offs_m[:, None]) * stride_qn + h * stride_qh + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    table = table_ptr + b * stride_tb
    k_head = k_ptr + kvh * stride_kh
    v_head = v_ptr + kvh * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    # -- positions every row of the tile sees (<= the first row's own) go without masks; the key
    #    loop stops at the last row's position (the causal limit of the tile)
    full_end = (tl.minimum(ctx, start_m + offset + 1) // BLOCK_N) * BLOCK_N
    hi = tl.minimum(ctx, start_m + BLOCK_M + offset)
    acc, m_i, l_i = _prefill_inner(acc, m_i, l_i, q, table, k_head, v_head, stride_tn, stride_ks, stride_kd,
                                   stride_vs, stride_vd, offs_m, offs_d, 0, full_end, ctx, offset, qk_scale,
                                   BLOCK_SIZE, BLOCK_N, False, UPCAST, PRECISION)
    acc, m_i, l_i = _prefill_inner(acc, m_i, l_i, q, table, k_head, v_head, stride_tn, stride_ks, stride_kd,
                                   stride_vs, stride_vd, offs_m, offs_d, full_end, hi, ctx, offset, qk_scale,
                                   BLOCK_SIZE, BLOCK_N, True, UPCAST, PRECISION)

    # -- normalise once and write (every valid row sees position 0, so l_i > 0 there)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    tl.store(o_ptr + (q_start + offs_m[:, None]) * stride_on + h * stride_oh + offs_d[None, :] * stride_od,
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


def decode_block_n(head_dim: int) -> int:
    """Cached positions per step of the paged decode loop: :data:`DECODE_BLOCK_N`, halved on a GPU
    for head_dim 256, whose 64-position key and value tiles need 80 KB of shared memory even in
    16-bit: more than a T4's 64 KB (``llmu gpu-compile`` measured it)."""
    return DECODE_BLOCK_N if runtime.interpreting() or head_dim <= 128 else DECODE_BLOCK_N // 2


def check_block_size(block_size: int) -> int:
    """The kernels take blocks of a power of two >= 16 positions (``p // block_size`` is a shift)."""
    bad_type = isinstance(block_size, bool) or not isinstance(block_size, int)
    if bad_type or block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"k_cache: block_size (dim 1) must be a power of two >= 16 for the kernels, got {block_size}")
    return block_size


def _check_scale(scale):
    if scale is None:
        return
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number or None, got {scale!r}")


def _validate(q, k_cache, v_cache):
    """Checks shared by both launchers; returns ``(num_blocks, block_size, Hkv, D, H)``."""
    nb, bs, hkv, d = reference.check_paged_cache(k_cache, v_cache, device="kernel")
    check_block_size(bs)
    h = reference.check_query(q, k_cache, device="kernel")
    if d not in HEAD_DIMS:
        raise ValueError(f"q: head_dim must be one of {HEAD_DIMS}, got {d}")
    return nb, bs, hkv, d, h


def _dot_options(dtype):
    """``(UPCAST, PRECISION)``: bfloat16 dots go through float32 in the interpreter; fp32 is IEEE."""
    upcast = dtype == torch.bfloat16 and runtime.interpreting()
    return upcast, ("ieee" if dtype == torch.float32 or upcast else "tf32")


def _check_decode(q, k_cache, v_cache, block_tables, context_lens, scale):
    """Every check of the decode launchers; returns ``(block_size, Hkv, D, H)``."""
    nb, bs, hkv, d, h = _validate(q, k_cache, v_cache)
    reference.check_block_tables(block_tables, context_lens, bs, nb, batch=q.shape[0], device="kernel")
    if block_tables.device != q.device:
        raise ValueError(f"block_tables is on {block_tables.device} but q is on {q.device}")
    _check_scale(scale)
    return bs, hkv, d, h


def _launch_decode(q, k_cache, v_cache, block_tables, context_lens, num_splits, scale, bs, hkv, d, h):
    b = q.shape[0]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    partial_out = torch.empty((b, h, num_splits, d), dtype=torch.float32, device=q.device)
    partial_lse = torch.empty((b, h, num_splits), dtype=torch.float32, device=q.device)
    if b == 0:
        return partial_out, partial_lse
    group = h // hkv
    upcast, precision = _dot_options(q.dtype)
    _paged_decode_kernel[(b * hkv, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, partial_out, partial_lse,
        hkv, num_splits, scale * _LOG2E,
        # the pool's strides from dim 1 on: (slot, KV head, feature); a block is BLOCK_SIZE slots
        *q.stride(), *k_cache.stride()[1:], *v_cache.stride()[1:], *block_tables.stride(),
        *partial_out.stride(), *partial_lse.stride(),
        GROUP=group, HEAD_DIM=d, BLOCK_SIZE=bs,
        # one row per query head of the group, padded to 16 because tl.dot needs it (FLOPs, not bytes)
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=decode_block_n(d), UPCAST=upcast, PRECISION=precision,
    )
    return partial_out, partial_lse


def paged_decode_partials(q, k_cache, v_cache, block_tables, context_lens, num_splits: int, *,
                          scale: float | None = None):
    """Phase 1 of :func:`paged_decode_attention`: ``(partial_out (B, H, S, D), partial_lse (B, H, S))``.

    Float32, the layout of ``llmu.kvcache.kernels.decode_partials``, ready for ``combine_partials``.
    Split ``s`` of a sequence of ``L`` positions covers positions ``s * c .. (s + 1) * c - 1`` with
    ``c = ceil(ceil(L / S) / 64) * 64`` (whole tiles of :data:`DECODE_BLOCK_N`); an empty split has
    lse -inf.
    """
    dims = _check_decode(q, k_cache, v_cache, block_tables, context_lens, scale)
    require_positive("num_splits", num_splits, integer=True)
    return _launch_decode(q, k_cache, v_cache, block_tables, context_lens, num_splits, scale, *dims)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, *,
                           scale: float | None = None, num_splits: int | None = None) -> torch.Tensor:
    """Attention of one new token per sequence against its paged context (flash-decoding).

    ``q`` ``(B, H, D)``; ``k_cache``/``v_cache`` ``(num_blocks, block_size, Hkv, D)`` holding every
    position (the new one included), ``block_size`` a power of two >= 16; ``block_tables``
    ``(B, max_blocks)`` int32/int64 (entries past a sequence's length are never read);
    ``context_lens`` ``(B,)``: sequence ``b`` attends to its positions ``0 .. context_lens[b] - 1``.
    ``num_splits``: splits per sequence (default: ``llmu.kvcache.kernels.choose_num_splits``; more
    splits than tiles is allowed, the extra ones are empty). Returns ``(B, H, D)`` in ``q``'s
    dtype, equal to ``reference.paged_decode_attention``.
    """
    dims = _check_decode(q, k_cache, v_cache, block_tables, context_lens, scale)
    if num_splits is None:
        longest = int(context_lens.max()) if context_lens.numel() else 1
        num_splits = choose_num_splits(q.shape[0], dims[1], longest, q.device)
    require_positive("num_splits", num_splits, integer=True)
    partial_out, partial_lse = _launch_decode(q, k_cache, v_cache, block_tables, context_lens, num_splits, scale,
                                              *dims)
    return combine_partials(partial_out, partial_lse, out_dtype=q.dtype)


def _prefill_blocks(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)``: module 08's forward tiles (which shrink to a
    T4's shared memory); smaller for D = 256 on larger GPUs, whose ``(BLOCK_M, D)`` float32
    accumulator would not fit in registers at 128 rows."""
    cap = runtime.capability() or (9, 0)
    if head_dim > 128 and not runtime.interpreting() and cap >= (8, 0):
        return 64, 32, 8, 2
    return default_blocks(head_dim, dtype=dtype)


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor,
                            *, scale: float | None = None) -> torch.Tensor:
    """Causal attention of packed query chunks against their paged contexts (FlashAttention-2).

    ``q`` ``(N, H, D)``: sequence ``i``'s queries are rows ``cu_seqlens_q[i] .. cu_seqlens_q[i+1] - 1``
    (``cu_seqlens_q`` ``(B + 1,)`` int32/int64, rising strictly from 0 to ``N``), and they are the
    last ``q_len_i`` of its ``context_lens[i]`` positions: query ``j`` sits at position
    ``context_lens[i] - q_len_i + j`` and sees the positions up to its own. The cache already holds
    every position's keys and values. Returns ``(N, H, D)`` in ``q``'s dtype, equal to
    ``reference.paged_prefill_attention``.
    """
    nb, bs, hkv, d, h = _validate(q, k_cache, v_cache)
    n = q.shape[0]
    q_lens = reference.check_cu_seqlens(cu_seqlens_q, n, context_lens, device="kernel")
    b = cu_seqlens_q.shape[0] - 1
    reference.check_block_tables(block_tables, context_lens, bs, nb, batch=b, device="kernel")
    if cu_seqlens_q.device != block_tables.device:
        raise ValueError(f"cu_seqlens_q is on {cu_seqlens_q.device} but block_tables is on {block_tables.device}")
    if block_tables.device != q.device:
        raise ValueError(f"block_tables is on {block_tables.device} but q is on {q.device}")
    _check_scale(scale)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    out = torch.empty_like(q)
    if b == 0:
        return out
    block_m, block_n, warps, stages = _prefill_blocks(d, q.dtype)
    max_q = int(q_lens.max())
    if runtime.interpreting():
        block_m = min(block_m, max(16, triton.next_power_of_2(max_q)))   # short chunks: a tile of 16, not 64
    upcast, precision = _dot_options(q.dtype)
    grid = (triton.cdiv(max_q, block_m), b, h)
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, cu_seqlens_q, context_lens,
        scale * _LOG2E,
        *q.stride(), *k_cache.stride()[1:], *v_cache.stride()[1:], *out.stride(), *block_tables.stride(),
        GROUP=h // hkv, HEAD_DIM=d, BLOCK_SIZE=bs, BLOCK_M=block_m, BLOCK_N=block_n,
        UPCAST=upcast, PRECISION=precision, num_warps=warps, num_stages=stages,
    )
    return out
