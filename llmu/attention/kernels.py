"""Triton kernels of module 02: softmax with temperature, and naive attention.

Two kernels, each with a host-side launcher that validates its inputs:

``softmax(x, temperature=1.0, dim=-1)``
    ``softmax(x / temperature)`` along one dimension, one program per row. A row that fits in one
    block is loaded once, kept in registers, and written once. A longer row (a 49152-token
    vocabulary, say) is streamed in column blocks twice: the first pass keeps a running maximum
    and a running sum of exponentials (the sum is rescaled whenever the maximum grows: the
    "online softmax" trick), the second pass writes ``exp(x/T - max) / sum``.

``attention(q, k, v, causal=False, scale=None, return_weights=False)``
    ``softmax(q k^T * scale + mask) v`` for ``q`` of shape ``(B, H, Tq, D)`` and ``k``, ``v`` of
    shape ``(B, Hkv, Tk, D)`` (grouped-query attention when ``Hkv < H``). One program handles
    one block of queries of one (batch, head) pair. It is the *naive* algorithm: the program
    writes its full rows of scores ``S = q k^T * scale`` to memory, then reads them back to
    normalise them, then once more to multiply the probabilities with ``v``. Nothing here is
    clever, and that is the point: module 08 (FlashAttention) keeps the scores on chip instead.

Both kernels compute in float32 whatever the input dtype, and write the output in the input's
dtype, like ``torch.softmax`` and ``F.scaled_dot_product_attention``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from llmu import runtime
from llmu.checks import FLOAT_DTYPES, require_attention_inputs, require_positive, require_tensor

__all__ = ["softmax", "attention", "SOFTMAX_ONE_BLOCK_MAX"]

#: Rows up to this many columns are held in registers in one block; longer rows are streamed.
SOFTMAX_ONE_BLOCK_MAX = 8192
#: Column block of the streamed (looped) softmax.
_SOFTMAX_LOOP_BLOCK = 4096


# ----------------------------------------------------------------------------------------------
# Softmax with temperature
# ----------------------------------------------------------------------------------------------


@triton.jit
def _softmax_kernel(
    x_ptr, y_ptr,
    n_cols,
    stride_xm, stride_xn, stride_ym, stride_yn,
    temperature,
    BLOCK: tl.constexpr,
    ONE_BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # int64: row * stride may not fit in 32 bits for big inputs
    x_row = x_ptr + row * stride_xm
    y_row = y_ptr + row * stride_ym
    cols = tl.arange(0, BLOCK)

    if ONE_BLOCK:
        # The whole row fits in one block: load it once (padding columns read as -inf, so that
        # they neither win the max nor add to the sum), normalise, store.
        mask = cols < n_cols
        z = tl.load(x_row + cols * stride_xn, mask=mask, other=-float("inf")).to(tl.float32)
        z = z / temperature                       # temperature, applied inside the kernel
        z = z - tl.max(z, axis=0)                 # stability: the largest exponent is exp(0) = 1
        e = tl.exp(z)
        y = e / tl.sum(e, axis=0)
        tl.store(y_row + cols * stride_yn, y.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        # Pass 1: one sweep over the row keeps the running maximum m and the running sum
        # s = sum(exp(z - m)). When a block raises the maximum, the sum so far is rescaled by
        # exp(m_old - m_new) so that it stays relative to the current maximum.
        m = -float("inf")
        s = 0.0
        for start in range(0, n_cols, BLOCK):
            offs = start + cols
            mask = offs < n_cols
            z = tl.load(x_row + offs * stride_xn, mask=mask, other=-float("inf")).to(tl.float32)
            z = z / temperature
            m_new = tl.maximum(m, tl.max(z, axis=0))
            # A row that is -inf so far (a masked prefix) has m_new = -inf: subtract 0 instead,
            # so that exp(-inf - 0) = 0 rather than exp(-inf + inf) = NaN.
            m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
            s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(z - m_safe), axis=0)
            m = m_new
        # Pass 2: read the row again and write the normalised probabilities.
        for start in range(0, n_cols, BLOCK):
            offs = start + cols
            mask = offs < n_cols
            z = tl.load(x_row + offs * stride_xn, mask=mask, other=-float("inf")).to(tl.float32)
            y = tl.exp(z / temperature - m) / s
            tl.store(y_row + offs * stride_yn, y.to(y_ptr.dtype.element_ty), mask=mask)


def _softmax_forward(x: torch.Tensor, temperature: float, dim: int) -> torch.Tensor:
    xt = x.movedim(dim, -1)
    n_cols = xt.shape[-1]
    x2 = xt.reshape(-1, n_cols)  # a view when possible, a copy otherwise; strides are passed on
    y2 = torch.empty((x2.shape[0], n_cols), dtype=x.dtype, device=x.device)
    if x2.shape[0] == 0 or n_cols == 0:
        return y2.reshape(xt.shape).movedim(-1, dim)
    if (n_cols - 1) * max(x2.stride(1), 1) >= 2**31:
        # Column offsets are 32-bit inside the kernel (rows are addressed in 64-bit).
        raise ValueError(f"x: a row spans more than 2**31 elements in memory (n_cols={n_cols}, "
                         f"stride={x2.stride(1)}); make the softmax dimension contiguous")
    one_block = n_cols <= SOFTMAX_ONE_BLOCK_MAX
    block = triton.next_power_of_2(n_cols) if one_block else _SOFTMAX_LOOP_BLOCK
    num_warps = 4 if block <= 2048 else (8 if block <= 4096 else 16)
    _softmax_kernel[(x2.shape[0],)](
        x2, y2, n_cols,
        x2.stride(0), x2.stride(1), y2.stride(0), y2.stride(1),
        temperature,
        BLOCK=block, ONE_BLOCK=one_block, num_warps=num_warps,
    )
    return y2.reshape(xt.shape).movedim(-1, dim)


class _Softmax(torch.autograd.Function):
    """Forward with the Triton kernel; backward with the softmax Jacobian-vector product.

    For ``y = softmax(x / T)``: ``dx = y * (dy - sum(dy * y)) / T`` along the softmax dimension.
    """

    @staticmethod
    def forward(ctx, x, temperature, dim):
        y = _softmax_forward(x, temperature, dim)
        ctx.save_for_backward(y)
        ctx.temperature, ctx.dim = temperature, dim
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        yf, dyf = y.float(), dy.float()
        dx = yf * (dyf - (dyf * yf).sum(dim=ctx.dim, keepdim=True)) / ctx.temperature
        return dx.to(y.dtype), None, None


def softmax(x: torch.Tensor, temperature: float = 1.0, dim: int = -1) -> torch.Tensor:
    """``softmax(x / temperature)`` along ``dim``, computed by a fused Triton kernel.

    Works for any number of leading dimensions and any row length (rows longer than
    ``SOFTMAX_ONE_BLOCK_MAX`` are streamed in blocks). Float32/16/bf16 in, same dtype out; the
    arithmetic is float32. A row whose entries are all ``-inf`` gives NaN, as in ``torch.softmax``.
    Differentiable (the backward pass is the usual formula, in torch).
    """
    require_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.ndim == 0:
        raise ValueError("x must have at least one dimension, got a 0-d tensor")
    require_positive("temperature", temperature)
    if not math.isfinite(float(temperature)):
        raise ValueError(f"temperature must be finite, got {temperature!r}")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {dim!r}")
    if not -x.ndim <= dim < x.ndim:
        raise ValueError(f"dim={dim} is out of range for x with {x.ndim} dimensions")
    dim = dim % x.ndim
    return _Softmax.apply(x, float(temperature), dim)


# ----------------------------------------------------------------------------------------------
# Naive attention
# ----------------------------------------------------------------------------------------------


@triton.jit
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, s_ptr, p_ptr,
    n_heads, group_size, q_len, kv_len, head_dim,
    scale,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kb, stride_kh, stride_kt, stride_kd,
    stride_vb, stride_vh, stride_vt, stride_vd,
    stride_ob, stride_oh, stride_ot, stride_od,
    stride_sb, stride_sh, stride_st,                # scores (and weights): contiguous last dim
    CAUSAL: tl.constexpr,
    WRITE_WEIGHTS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # Which queries: block `pid_m` of head `h` of batch `b`. Which keys: those of KV head
    # h // group_size (grouped-query attention: consecutive query heads share one KV head).
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // n_heads).to(tl.int64)
    h = (pid_bh % n_heads).to(tl.int64)
    kvh = h // group_size

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)   # query rows of this program
    offs_n = tl.arange(0, BLOCK_N)                     # key columns within a key block
    offs_d = tl.arange(0, BLOCK_D)                     # head_dim, padded to a power of two
    m_ok = offs_m < q_len
    d_ok = offs_d < head_dim

    q_base = q_ptr + b * stride_qb + h * stride_qh
    k_base = k_ptr + b * stride_kb + kvh * stride_kh
    v_base = v_ptr + b * stride_vb + kvh * stride_vh
    s_base = s_ptr + b * stride_sb + h * stride_sh
    p_base = p_ptr + b * stride_sb + h * stride_sh

    # Load this block of queries once: (BLOCK_M, BLOCK_D); padding rows and columns are 0.
    q = tl.load(q_base + offs_m[:, None] * stride_qt + offs_d[None, :] * stride_qd,
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)

    # Causal: queries are the last q_len of the kv_len positions, so query i sits at position
    # kv_len - q_len + i and sees keys 0 .. that position. Keys past the block's last query are
    # never needed: `hi` stops the loops there (this is why causal attention costs half).
    offset = kv_len - q_len
    if CAUSAL:
        hi = tl.minimum(kv_len, offset + (pid_m + 1) * BLOCK_M)
    else:
        hi = kv_len

    # Pass 1: S = q k^T * scale, masked, written to memory block by block; the row maximum m.
    m = tl.full((BLOCK_M,), -float("inf"), dtype=tl.float32)
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        n_ok = cols < kv_len
        k = tl.load(k_base + cols[:, None] * stride_kt + offs_d[None, :] * stride_kd,
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST_DOT:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        keep = n_ok[None, :]
        if CAUSAL:
            keep = keep & (cols[None, :] <= (offset + offs_m)[:, None])
        s = tl.where(keep, s, -float("inf"))
        m = tl.maximum(m, tl.max(s, axis=1))
        tl.store(s_base + offs_m[:, None] * stride_st + cols[None, :], s,
                 mask=m_ok[:, None] & n_ok[None, :])

    # Pass 2: read the scores back; l = sum(exp(S - m)), the softmax denominator.
    # (Padding query rows, past q_len, are all -inf: give them m = 0 so they stay NaN-free.)
    m = tl.where(m == -float("inf"), 0.0, m)
    l = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        n_ok = cols < kv_len
        s = tl.load(s_base + offs_m[:, None] * stride_st + cols[None, :],
                    mask=m_ok[:, None] & n_ok[None, :], other=-float("inf"))
        l += tl.sum(tl.exp(s - m[:, None]), axis=1)
    l = tl.where(l == 0.0, 1.0, l)

    # Pass 3: read the scores once more; P = exp(S - m) / l, and O = P v.
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        n_ok = cols < kv_len
        s = tl.load(s_base + offs_m[:, None] * stride_st + cols[None, :],
                    mask=m_ok[:, None] & n_ok[None, :], other=-float("inf"))
        p = tl.exp(s - m[:, None]) / l[:, None]
        if WRITE_WEIGHTS:
            tl.store(p_base + offs_m[:, None] * stride_st + cols[None, :], p,
                     mask=m_ok[:, None] & n_ok[None, :])
        v = tl.load(v_base + cols[:, None] * stride_vt + offs_d[None, :] * stride_vd,
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST_DOT:
            v = v.to(tl.float32)
        # tl.dot wants both operands in one dtype: P goes down to v's dtype (fp32 accumulate).
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)

    o_ptrs = o_ptr + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_ot + offs_d[None, :] * stride_od
    tl.store(o_ptrs, acc.to(o_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    return_weights: bool = False,
):
    """Naive scaled dot-product attention in Triton: ``softmax(q k^T * scale + mask) v``.

    ``q``: ``(B, H, Tq, D)``; ``k``, ``v``: ``(B, Hkv, Tk, D)`` with ``H`` a multiple of ``Hkv``
    (``Hkv == H``: multi-head, ``1 < Hkv < H``: grouped-query, ``Hkv == 1``: multi-query).
    ``scale`` defaults to ``1/sqrt(D)``. ``causal=True`` treats the queries as the last ``Tq`` of
    the ``Tk`` positions (so it needs ``Tq <= Tk``). Any ``D`` works: it is padded to a power of
    two inside the kernel. Returns the output ``(B, H, Tq, D)`` in ``q``'s dtype, and with
    ``return_weights=True`` also the float32 probabilities ``(B, H, Tq, Tk)``.

    The kernel writes a float32 score matrix of ``B*H*Tq*Tk`` elements to memory (that is what
    makes it naive): ``B=1, H=32, Tq=Tk=8192`` already needs 8 GiB for it.
    """
    b, h, hkv, tq, tk, d = require_attention_inputs(q, k, v, causal=causal)
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    else:
        require_positive("scale", scale)
    if d > 256:
        raise ValueError(f"head_dim must be at most 256 for this kernel, got {d}")

    # Offsets inside one (batch, head) slice are 32-bit in the kernel: refuse what would overflow.
    if tq * tk >= 2**31:
        raise ValueError(f"q_len * kv_len = {tq * tk} scores per head do not fit 32-bit offsets (and would need "
                         f"{4 * tq * tk / 2**30:.0f} GiB per head): this naive kernel is for short sequences")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if (t.shape[2] - 1) * t.stride(2) + (t.shape[3] - 1) * t.stride(3) >= 2**31:
            raise ValueError(f"{name}: one head's slice spans more than 2**31 elements in memory")

    out = torch.empty((b, h, tq, d), dtype=q.dtype, device=q.device)
    weights = (torch.zeros if causal else torch.empty)((b, h, tq, tk), dtype=torch.float32, device=q.device) \
        if return_weights else None
    if out.numel() == 0 or tk == 0:
        if tk == 0 and tq > 0:
            raise ValueError("kv_len must be positive: a query cannot attend to zero keys")
        return (out, weights) if return_weights else out

    scores = torch.empty((b, h, tq, tk), dtype=torch.float32, device=q.device)
    block_d = max(16, triton.next_power_of_2(d))   # tl.dot needs every dimension >= 16
    block_m = 64 if tq > 32 else 16                # decoding (tq = 1) wastes less with 16 rows
    block_n = 64
    grid = (triton.cdiv(tq, block_m), b * h)
    w = weights if return_weights else scores      # unused pointer when weights are not asked for
    _attention_kernel[grid](
        q, k, v, out, scores, w,
        h, h // hkv, tq, tk, d,
        float(scale),
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        scores.stride(0), scores.stride(1), scores.stride(2),
        CAUSAL=causal, WRITE_WEIGHTS=return_weights,
        # fp32 inputs: exact fp32 products, not TF32 (which keeps 10 mantissa bits).
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        # Triton's interpreter stores bfloat16 as raw 16-bit integers and its tl.dot multiplies
        # those integers: there, bf16 operands are converted to fp32 before each product.
        UPCAST_DOT=runtime.interpreting() and q.dtype == torch.bfloat16,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=4, num_stages=1,
    )
    return (out, weights) if return_weights else out
