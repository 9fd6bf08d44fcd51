"""FlashAttention-2 in Triton: forward and backward.

``flash_attention(q, k, v, causal=False, scale=None)`` computes ``softmax(q k^T * scale + mask) v``
for ``q`` ``(B, H, Tq, D)`` and ``k``, ``v`` ``(B, Hkv, Tk, D)`` (grouped-query attention when
``Hkv < H``: query head ``h`` reads KV head ``h // (H / Hkv)``), and is differentiable. With
``causal`` the queries are the *last* ``Tq`` of the ``Tk`` positions (bottom-right alignment), so
query ``i`` sees keys ``0 .. Tk - Tq + i``; that needs ``Tq <= Tk``.

Three kernels, in the order of the FlashAttention-2 paper:

``_fwd_kernel``
    One program per (block of ``BLOCK_M`` queries, batch·head). The query tile stays in registers;
    the program streams the key/value blocks, keeps the running max ``m``, running sum ``l`` and
    the unnormalised output ``acc`` (the online softmax), and writes ``out = acc / l`` and the
    log-sum-exp ``lse = m + log l`` (natural log). Exponentials are taken as ``exp2`` of scores
    pre-multiplied by ``log2(e)``: the same numbers, one multiply cheaper on a GPU. Key blocks that
    every row of the tile sees whole are processed without masks; only the blocks on the causal
    diagonal and the ragged last block pay for them.

``_bwd_preprocess_kernel``
    ``D = rowsum(dO * O)``, one number per query row (it equals ``rowsum(P * dP)``, the term the
    softmax's Jacobian subtracts).

``_bwd_dkdv_kernel`` and ``_bwd_dq_kernel``
    The backward recomputes ``P = exp(S - lse)`` tile by tile from the saved ``lse`` instead of
    reading a stored ``P``. One program per block of keys accumulates ``dK`` and ``dV`` over all the
    query blocks of all the query heads that share its KV head (so grouped-query gradients need no
    atomics); one program per block of queries accumulates ``dQ`` over the key blocks.

``FlashAttentionFunction`` (an ``autograd.Function``) saves exactly ``(q, k, v, o, lse)``.

Accumulation is float32 whatever the input dtype; float32 inputs use IEEE products in ``tl.dot``
(no TF32 rounding on a GPU). Head dims: 16, 32, 64, 128.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from llmu import runtime
from llmu.checks import require_attention_inputs, require_tensor
from llmu.flash.reference import attention_function

__all__ = ["flash_attention", "flash_attention_forward", "flash_attention_backward",
           "FlashAttentionFunction", "HEAD_DIMS", "default_blocks"]

#: Head dims the kernels support: ``tl.arange`` needs a power of two, ``tl.dot`` at least 16.
HEAD_DIMS = (16, 32, 64, 128)
_LOG2E = 1.4426950408889634   # log2(e): exp(x) = exp2(x * log2(e)); the kernels write it out (globals are not constexpr)


def default_blocks(head_dim: int, backward: bool = False,
                   dtype: torch.dtype = torch.float16) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` for a launch.

    In the interpreter, fewer bigger tiles run faster (one numpy call per tile operation). On a
    GPU the tiles must fit in registers and shared memory: 128 queries × 64 keys for the forward
    (Triton's tutorial sizes on Hopper), smaller for the backward, which holds more tiles at once.
    A row of a tile is ``head_dim * element size`` bytes; ``llmu gpu-compile`` measured what these
    tiles need and the limits below follow from it:

    - a T4 (compute capability 7.5) has 64 KB of shared memory and no asynchronous copies to
      pipeline: tiles of at most 16 KB of queries (8 KB in the backward) and 8 KB of keys, one stage;
    - an A100 (163 KB): the float32 forward at head_dim 128 needs 225 KB with Hopper's tiles, so
      it takes 64 × 64 tiles and two stages.
    """
    if runtime.interpreting():
        return 64, 64, 4, 1
    row_bytes = head_dim * torch.empty((), dtype=dtype).element_size()
    cap = runtime.capability() or (9, 0)
    if cap < (8, 0):  # the backward keeps more tiles (dq, dk, dv, the scores) alive: half the rows
        rows = (8192 if backward else 16384) // row_bytes
        return max(16, min(64, rows)), max(16, min(32, 8192 // row_bytes)), 4, 1
    if not backward and row_bytes > 256 and cap < (9, 0):
        return 64, 64, 4, 2
    if backward:
        return (64, 64, 4, 2) if head_dim <= 64 else (64, 32, 4, 2)
    return (128, 64, 4, 3) if head_dim <= 64 else (128, 64, 8, 3)


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------


@triton.jit
def _fwd_inner(acc, m_i, l_i, q, k_base, v_base, stride_kt, stride_kd, stride_vt, stride_vd,
               offs_m, offs_d, lo, hi, tk, offset, qk_scale,
               BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
               PRECISION: tl.constexpr):
    """Online softmax over the key blocks [lo, hi); MASKED adds the bounds and causal masks."""
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        # 1. Load one block of keys (as K^T, (D, BLOCK_N)) and of values ((BLOCK_N, D)).
        if MASKED:
            kt = tl.load(k_base + offs_n[None, :] * stride_kt + offs_d[:, None] * stride_kd,
                         mask=offs_n[None, :] < tk, other=0.0)
            v = tl.load(v_base + offs_n[:, None] * stride_vt + offs_d[None, :] * stride_vd,
                        mask=offs_n[:, None] < tk, other=0.0)
        else:
            kt = tl.load(k_base + offs_n[None, :] * stride_kt + offs_d[:, None] * stride_kd)
            v = tl.load(v_base + offs_n[:, None] * stride_vt + offs_d[None, :] * stride_vd)
        # 2. Scores of the tile, in log2 units: s = q k^T * scale * log2(e).
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
        if MASKED:
            visible = offs_n[None, :] < tk
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= offs_m[:, None] + offset)
            s = tl.where(visible, s, -float("inf"))
        # 3. New running max; rescale the old sum and accumulator by exp2(m_old - m_new).
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        # 4. Accumulate P V (P cast to V's dtype: tl.dot takes one dtype on both sides).
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr,
    num_heads, tq, tk, qk_scale,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_ob, stride_oh, stride_ot, stride_od,
    stride_lb, stride_lh, stride_lt,
    GROUP: tl.constexpr,          # query heads per KV head
    CAUSAL: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)     # int64: batch * stride can pass 2**31 on big inputs
    b = bh // num_heads
    h = bh % num_heads
    kvh = h // GROUP                       # grouped-query attention: the KV head this head reads
    offset = tk - tq                       # query row i sits at key position offset + i

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < tq

    # 1. The query tile, loaded once; rows past tq read zeros and are never stored.
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None], other=0.0)
    k_base = k_ptr + b * stride_kb + kvh * stride_kh
    v_base = v_ptr + b * stride_vb + kvh * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)   # running max (log2 units)
    l_i = tl.zeros([BLOCK_M], tl.float32)                 # running sum of exp2(s - m)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)       # running sum of exp2(s - m) v

    # 2. Which key blocks to visit. Causal: a key j is visible to every row of the tile when
    #    j <= start_m + offset (the first row's last key), and to none when j > the last row's.
    if CAUSAL:
        full_end = (tl.minimum(tk, start_m + offset + 1) // BLOCK_N) * BLOCK_N
        hi = tl.minimum(tk, start_m + BLOCK_M + offset)
    else:
        full_end = (tk // BLOCK_N) * BLOCK_N
        hi = tk
    # 3. Whole blocks without masks, then the diagonal / ragged blocks with them.
    acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, k_base, v_base, stride_kt, stride_kd, stride_vt, stride_vd,
                               offs_m, offs_d, 0, full_end, tk, offset, qk_scale,
                               BLOCK_N, False, CAUSAL, PRECISION)
    acc, m_i, l_i = _fwd_inner(acc, m_i, l_i, q, k_base, v_base, stride_kt, stride_kd, stride_vt, stride_vd,
                               offs_m, offs_d, full_end, hi, tk, offset, qk_scale,
                               BLOCK_N, True, CAUSAL, PRECISION)

    # 4. Normalise once and write the output and the log-sum-exp (back to natural-log units).
    #    Every valid row sees key 0, so l_i > 0 there; padding rows are guarded and not stored.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    tl.store(o_ptr + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_ot + offs_d[None, :] * stride_od,
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
    lse = (m_i + tl.log2(l_safe)) * 0.6931471805599453
    tl.store(lse_ptr + b * stride_lb + h * stride_lh + offs_m * stride_lt, lse, mask=row_ok)


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------


@triton.jit
def _bwd_preprocess_kernel(
    o_ptr, do_ptr, delta_ptr,
    num_heads, tq,
    stride_ob, stride_oh, stride_ot, stride_od,
    stride_db, stride_dh, stride_dt, stride_dd,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    bh = tl.program_id(1).to(tl.int64)
    b = bh // num_heads
    h = bh % num_heads
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < tq
    o = tl.load(o_ptr + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_ot + offs_d[None, :] * stride_od,
                mask=row_ok[:, None], other=0.0).to(tl.float32)
    do = tl.load(do_ptr + b * stride_db + h * stride_dh + offs_m[:, None] * stride_dt + offs_d[None, :] * stride_dd,
                 mask=row_ok[:, None], other=0.0).to(tl.float32)
    # D_i = sum_d dO_id * O_id; delta is a contiguous (B*H, tq) float32 buffer
    tl.store(delta_ptr + bh * tq + offs_m, tl.sum(do * o, axis=1), mask=row_ok)


@triton.jit
def _bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
    num_heads, num_kv_heads, tq, tk, sm_scale,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_db, stride_dh, stride_dt, stride_dd,
    stride_lb, stride_lh, stride_lt,
    GROUP: tl.constexpr,
    CAUSAL: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    start_n = tl.program_id(0) * BLOCK_N
    bkv = tl.program_id(1).to(tl.int64)
    b = bkv // num_kv_heads
    kvh = bkv % num_kv_heads
    offset = tk - tq
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    col_ok = offs_n < tk

    # 1. This program's block of keys and values, loaded once.
    k = tl.load(k_ptr + b * stride_kb + kvh * stride_kh + offs_n[:, None] * stride_kt + offs_d[None, :] * stride_kd,
                mask=col_ok[:, None], other=0.0)
    v = tl.load(v_ptr + b * stride_vb + kvh * stride_vh + offs_n[:, None] * stride_vt + offs_d[None, :] * stride_vd,
                mask=col_ok[:, None], other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    qk_scale = sm_scale * 1.4426950408889634

    # 2. Causal: query rows before start_n - offset see none of these keys; start at their block.
    if CAUSAL:
        lo = (tl.maximum(start_n - offset, 0) // BLOCK_M) * BLOCK_M
    else:
        lo = 0
    # 3. Every query head of the group reads this KV head: sum their contributions here.
    for g in range(GROUP):
        h = kvh * GROUP + g
        q_base = q_ptr + b * stride_qb + h * stride_qh
        do_base = do_ptr + b * stride_db + h * stride_dh
        for m0 in range(lo, tq, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            row_ok = offs_m < tq
            q = tl.load(q_base + offs_m[:, None] * stride_qt + offs_d[None, :] * stride_qd,
                        mask=row_ok[:, None], other=0.0)
            do = tl.load(do_base + offs_m[:, None] * stride_dt + offs_d[None, :] * stride_dd,
                         mask=row_ok[:, None], other=0.0)
            lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + offs_m * stride_lt, mask=row_ok, other=0.0)
            delta = tl.load(delta_ptr + (b * num_heads + h) * tq + offs_m, mask=row_ok, other=0.0)
            # recompute P^T for this tile, (BLOCK_N, BLOCK_M): P_ij = exp(s_ij - lse_i)
            st = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale
            visible = col_ok[:, None] & row_ok[None, :]
            if CAUSAL:
                visible = visible & (offs_n[:, None] <= offs_m[None, :] + offset)
            # masked scores become -inf before the exponential, so that they give exactly 0
            st = tl.where(visible, st - lse[None, :] * 1.4426950408889634, -float("inf"))
            pt = tl.exp2(st)
            # dV += P^T dO
            dv += tl.dot(pt.to(do.dtype), do, input_precision=PRECISION)
            # dP^T = V dO^T;  dS^T = P^T * (dP^T - D)
            dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)
            dst = pt * (dpt - delta[None, :])
            # dK += dS^T Q   (the scale is applied once, at the end)
            dk += tl.dot(dst.to(q.dtype), q, input_precision=PRECISION)

    dk = dk * sm_scale
    tl.store(dk_ptr + bkv * tk * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :],
             dk.to(dk_ptr.dtype.element_ty), mask=col_ok[:, None])
    tl.store(dv_ptr + bkv * tk * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :],
             dv.to(dv_ptr.dtype.element_ty), mask=col_ok[:, None])


@triton.jit
def _bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
    num_heads, tq, tk, sm_scale,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_db, stride_dh, stride_dt, stride_dd,
    stride_lb, stride_lh, stride_lt,
    GROUP: tl.constexpr,
    CAUSAL: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    b = bh // num_heads
    h = bh % num_heads
    kvh = h // GROUP
    offset = tk - tq
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < tq

    # 1. This program's queries, their output gradients, lse and D, loaded once.
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None], other=0.0)
    do = tl.load(do_ptr + b * stride_db + h * stride_dh + offs_m[:, None] * stride_dt + offs_d[None, :] * stride_dd,
                 mask=row_ok[:, None], other=0.0)
    lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + offs_m * stride_lt, mask=row_ok, other=0.0)
    delta = tl.load(delta_ptr + bh * tq + offs_m, mask=row_ok, other=0.0)
    lse2 = lse * 1.4426950408889634
    qk_scale = sm_scale * 1.4426950408889634
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    k_base = k_ptr + b * stride_kb + kvh * stride_kh
    v_base = v_ptr + b * stride_vb + kvh * stride_vh

    hi = tl.minimum(tk, start_m + BLOCK_M + offset) if CAUSAL else tk
    # 2. Stream the key blocks this tile can see.
    for n0 in range(0, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        col_ok = offs_n < tk
        kt = tl.load(k_base + offs_n[None, :] * stride_kt + offs_d[:, None] * stride_kd, mask=col_ok[None, :], other=0.0)
        vt = tl.load(v_base + offs_n[None, :] * stride_vt + offs_d[:, None] * stride_vd, mask=col_ok[None, :], other=0.0)
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
        visible = row_ok[:, None] & col_ok[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None] + offset)
        p = tl.exp2(tl.where(visible, s - lse2[:, None], -float("inf")))   # masked: exactly 0
        # dP = dO V^T;  dS = P * (dP - D);  dQ += dS K
        dp = tl.dot(do, vt, input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(kt.dtype), tl.trans(kt), input_precision=PRECISION)

    dq = dq * sm_scale
    tl.store(dq_ptr + bh * tq * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :],
             dq.to(dq_ptr.dtype.element_ty), mask=row_ok[:, None])


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


def _validate(q, k, v, causal, scale):
    b, h, hkv, tq, tk, d = require_attention_inputs(q, k, v, causal=causal)
    if d not in HEAD_DIMS:
        raise ValueError(f"q: head_dim must be one of {HEAD_DIMS}, got {d}")
    if tk < 1:
        raise ValueError(f"k: kv_len must be >= 1, got {tk}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale)):
        raise ValueError(f"scale must be a finite number or None, got {scale!r}")


def _precision(dtype):
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_blocks(block_m, block_n):
    for name, val in (("block_m", block_m), ("block_n", block_n)):
        if not isinstance(val, int) or val < 16 or val & (val - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {val!r}")


def flash_attention_forward(q, k, v, *, causal: bool = False, scale: float | None = None,
                            block_m: int | None = None, block_n: int | None = None):
    """Forward only: ``(out, lse)``, ``out`` in ``q``'s dtype, ``lse`` ``(B, H, Tq)`` float32."""
    _validate(q, k, v, causal, scale)
    b, h, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    bm, bn, warps, stages = default_blocks(d, dtype=q.dtype)
    if runtime.interpreting():
        bm = min(bm, max(16, triton.next_power_of_2(tq)))   # a decode step (Tq = 1): a tile of 16 rows, not 64
    block_m, block_n = block_m or bm, block_n or bn
    _check_blocks(block_m, block_n)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    out = torch.empty((b, h, tq, d), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, tq), dtype=torch.float32, device=q.device)
    if b * h * tq == 0:
        return out, lse
    grid = (triton.cdiv(tq, block_m), b * h)
    _fwd_kernel[grid](
        q, k, v, out, lse,
        h, tq, tk, scale * _LOG2E,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), *lse.stride(),
        GROUP=h // hkv, CAUSAL=bool(causal), HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n,
        PRECISION=_precision(q.dtype), num_warps=warps, num_stages=stages,
    )
    return out, lse


def flash_attention_backward(q, k, v, o, lse, do, *, causal: bool = False, scale: float | None = None,
                             block_m: int | None = None, block_n: int | None = None):
    """``(dq, dk, dv)`` from the saved ``(q, k, v, o, lse)`` and the output gradient ``do``."""
    _validate(q, k, v, causal, scale)
    b, h, tq, d = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    require_tensor("o", o, ndim=4, dtypes=(q.dtype,))
    require_tensor("do", do, ndim=4, dtypes=(q.dtype,))
    require_tensor("lse", lse, ndim=3, dtypes=(torch.float32,))
    if o.shape != q.shape or do.shape != q.shape or tuple(lse.shape) != (b, h, tq):
        raise ValueError(f"o and do must have q's shape {tuple(q.shape)} and lse {(b, h, tq)}; got "
                         f"{tuple(o.shape)}, {tuple(do.shape)}, {tuple(lse.shape)}")
    bm, bn, warps, stages = default_blocks(d, backward=True, dtype=q.dtype)
    block_m, block_n = block_m or bm, block_n or bn
    _check_blocks(block_m, block_n)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    dq = torch.empty((b, h, tq, d), dtype=q.dtype, device=q.device)
    dk = torch.empty((b, hkv, tk, d), dtype=k.dtype, device=q.device)
    dv = torch.empty((b, hkv, tk, d), dtype=v.dtype, device=q.device)
    if b * h * tq == 0:
        return dq, dk.zero_(), dv.zero_()
    delta = torch.empty((b * h, tq), dtype=torch.float32, device=q.device)
    _bwd_preprocess_kernel[(triton.cdiv(tq, block_m), b * h)](
        o, do, delta, h, tq, *o.stride(), *do.stride(), HEAD_DIM=d, BLOCK_M=block_m,
    )
    common = dict(GROUP=h // hkv, CAUSAL=bool(causal), HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n,
                  PRECISION=_precision(q.dtype), num_warps=warps, num_stages=stages)
    strides = (*q.stride(), *k.stride(), *v.stride(), *do.stride(), *lse.stride())
    _bwd_dkdv_kernel[(triton.cdiv(tk, block_n), b * hkv)](
        q, k, v, do, lse, delta, dk, dv, h, hkv, tq, tk, scale, *strides, **common,
    )
    _bwd_dq_kernel[(triton.cdiv(tq, block_m), b * h)](
        q, k, v, do, lse, delta, dq, h, tq, tk, scale, *strides, **common,
    )
    return dq, dk, dv


FlashAttentionFunction = attention_function(
    "FlashAttentionFunction",
    lambda q, k, v, causal, scale, block_m, block_n: flash_attention_forward(
        q, k, v, causal=causal, scale=scale, block_m=block_m, block_n=block_n),
    lambda q, k, v, o, lse, do, causal, scale: flash_attention_backward(
        q, k, v, o, lse, do.contiguous(), causal=causal, scale=scale),
    """FlashAttention-2 forward and backward; saves exactly ``(q, k, v, o, lse)`` for the backward.

    ``FlashAttentionFunction.apply(q, k, v, causal=False, scale=None, block_m=None, block_n=None)``
    (``apply`` takes its arguments by position only); ``q``, ``k``, ``v`` 4-D ``(B, H, N, D)`` or
    3-D ``(B, N, D)`` for one head. Returns ``(o, lse)`` shaped like ``q`` and ``q`` without ``D``.
    """)


def flash_attention(q, k, v, *, causal: bool = False, scale: float | None = None, return_lse: bool = False,
                    block_m: int | None = None, block_n: int | None = None):
    """FlashAttention-2: ``softmax(q k^T * scale + mask) v``, differentiable, scores never stored.

    ``q`` ``(B, H, Tq, D)``, ``k``/``v`` ``(B, Hkv, Tk, D)``, one float dtype, on the kernel device;
    or all three 3-D ``(B, T, D)`` for one head. ``D`` in :data:`HEAD_DIMS`. Returns ``out``
    (``q``'s dtype and shape), or ``(out, lse)`` with ``return_lse``. ``block_m``/``block_n``
    override the tile sizes (powers of two >= 16).
    """
    out, lse = FlashAttentionFunction.apply(q, k, v, bool(causal), scale, block_m, block_n)
    return (out, lse) if return_lse else out
