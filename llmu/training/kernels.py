"""Triton kernels of module 04: cross-entropy fused with the LM head's matmul.

``llmu.training.cross_entropy`` explains the algebra: the loss of a row needs its log-sum-exp,
its target's logit and (for label smoothing) the sum of its logits, all sums over the vocabulary
that an online log-sum-exp computes one tile of columns at a time; the gradient of the logits is
``g_i (softmax - (1 - eps) onehot(y) - eps / V)``. Here the same happens on chip, in the style of
Liger-Kernel's fused linear cross-entropy, with the logits' matmul inside the kernels:

Forward — :func:`_flce_forward_kernel`, one program per ``BLOCK_M`` rows of ``x``:

1. for each tile of ``BLOCK_V`` vocabulary columns, compute the logits tile
   ``x[rows] @ W[cols]^T`` with ``tl.dot`` over ``BLOCK_H`` slices of the hidden dimension
   (float32 accumulator);
2. fold it into the running max ``m``, the running ``s = sum exp(z - m)``, the target's logit
   and the row sum;
3. write ``lse = m + log s`` and the row's loss (``0`` on ignored rows): ``8·N`` bytes. The
   logits tile lives in registers and is never written: no ``(N, V)`` tensor at all.

Backward — host loop over chunks of ``row_chunk`` rows, each chunk:

1. :func:`_flce_dlogits_kernel` (grid: row tiles x vocabulary tiles) recomputes a tile of logits,
   turns it into ``dz`` with the saved ``lse`` and writes it to a ``(row_chunk, V)`` buffer,
   reused by every chunk (Liger's bound: ``row_chunk`` is chosen so the buffer is about as large
   as ``x``, :func:`llmu.training.cross_entropy.default_row_chunk`);
2. :func:`_matmul_kernel`, a plain tiled matmul that reads its operands through strides (so a
   transpose is free), computes ``dx[chunk] = dz @ W`` and accumulates ``dW += dz^T @ x[chunk]``
   into a float32 buffer. Each output tile belongs to one program, so there are no atomics and the
   result is deterministic.

Cost: forward ``2·N·H·V`` FLOPs; backward ``2·N·H·V`` to recompute the logits plus ``4·N·H·V``
for ``dx`` and ``dW`` (Liger instead computes ``dz`` during the forward pass, when the logits
are at hand, and keeps ``dx``, ``dW`` until backward: no recomputation, but gradient memory held
from forward to backward). Extra memory: ``lse`` and the row losses, one ``(row_chunk, V)``
buffer of ``dz`` in the inputs' dtype and the float32 ``dW`` accumulator.

On a GPU the forward grid has only ``ceil(N / BLOCK_M)`` programs (32 at ``N = 2048``), each
walking the whole vocabulary: fewer than an H200's 132 SMs. A production kernel splits the
vocabulary across programs too and merges the partial ``(m, s)`` pairs afterwards (the rule of
the online log-sum-exp works across programs as well as across tiles).

Dtypes: ``x`` and ``W`` share one of float32/float16/bfloat16 (``tl.dot`` takes both operands in
one dtype); products accumulate in float32 (``"ieee"`` for float32 inputs: no TF32 rounding on a
GPU). ``dz`` is stored in the inputs' dtype before its matmuls, as Liger does. In the interpreter,
bfloat16 is refused (numpy has no bfloat16 matmul). Launchers check shapes, dtypes, devices and
target ids and raise ``ValueError``/``TypeError`` naming the argument.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmu import runtime
from llmu.checks import FLOAT_DTYPES, require_positive, require_power_of_two
from llmu.training.cross_entropy import check_inputs, default_row_chunk, reduce_rows, row_gradient_scale

__all__ = ["fused_linear_cross_entropy", "flce_forward", "flce_backward", "matmul", "default_blocks"]


def default_blocks() -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_V, BLOCK_H)``: 64x128x64 compiled (a common tensor-core tile), 16x32x32 in
    the interpreter (small numpy steps; tile sizes change only the order of float32 sums)."""
    return (16, 32, 32) if runtime.interpreting() else (64, 128, 64)


# ----------------------------------------------------------------------------------------------
# Forward: logits tile by tile, online log-sum-exp, never stored
# ----------------------------------------------------------------------------------------------


@triton.jit
def _logits_tile(X, W, rows, cols, rmask, cmask, H, stride_xn, stride_xh, stride_wv, stride_wh,
                 BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, PRECISION: tl.constexpr):
    """``x[rows] @ W[cols]^T`` as a float32 ``(BLOCK_M, BLOCK_V)`` tile, over ``BLOCK_H`` slices of H."""
    z = tl.zeros((BLOCK_M, BLOCK_V), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        hs = h0 + tl.arange(0, BLOCK_H)
        hmask = hs < H
        x = tl.load(X + rows[:, None] * stride_xn + hs[None, :] * stride_xh,
                    mask=rmask[:, None] & hmask[None, :], other=0.0)
        # W is (V, H): read its tile transposed, (BLOCK_H, BLOCK_V), through the strides
        w_t = tl.load(W + cols[None, :] * stride_wv + hs[:, None] * stride_wh,
                      mask=hmask[:, None] & cmask[None, :], other=0.0)
        z = tl.dot(x, w_t, z, input_precision=PRECISION)
    return z


@triton.jit
def _flce_forward_kernel(
    X, W, Y, LSE, LOSS,
    N, H, V,
    stride_xn, stride_xh, stride_wv, stride_wh,
    ignore_index, one_minus_eps, eps_over_v,
    BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, PRECISION: tl.constexpr,
):
    # Step 1: this program owns rows [pid*BLOCK_M, (pid+1)*BLOCK_M) and their targets.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < N
    rows = rows.to(tl.int64)
    y = tl.load(Y + rows, mask=rmask, other=ignore_index).to(tl.int64)
    m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)   # running max of the logits
    s = tl.zeros((BLOCK_M,), dtype=tl.float32)                  # running sum of exp(z - m)
    z_target = tl.zeros((BLOCK_M,), dtype=tl.float32)
    z_total = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for v0 in range(0, V, BLOCK_V):
        # Step 2: one tile of logits, in registers only.
        cols = v0 + tl.arange(0, BLOCK_V)
        cmask = cols < V
        z = _logits_tile(X, W, rows, cols.to(tl.int64), rmask, cmask, H, stride_xn, stride_xh, stride_wv,
                         stride_wh, BLOCK_M, BLOCK_V, BLOCK_H, PRECISION)
        # Step 3: online log-sum-exp; columns past V count as -inf (exp gives 0).
        z_live = tl.where(cmask[None, :], z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z_live, axis=1))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z_live - m_new[:, None]), axis=1)
        m = m_new
        # Step 4: the target's logit (one column matches, or none) and the row sum.
        z_target += tl.sum(tl.where(cols[None, :] == y[:, None], z, 0.0), axis=1)
        z_total += tl.sum(tl.where(cmask[None, :], z, 0.0), axis=1)
    # Step 5: lse for the backward pass, and the smoothed loss (0 where the row is ignored).
    lse = m + tl.log(s)
    loss = lse - one_minus_eps * z_target - eps_over_v * z_total
    loss = tl.where(y != ignore_index, loss, 0.0)
    tl.store(LSE + rows, lse, mask=rmask)
    tl.store(LOSS + rows, loss, mask=rmask)


# ----------------------------------------------------------------------------------------------
# Backward: recompute a tile of logits, turn it into dz
# ----------------------------------------------------------------------------------------------


@triton.jit
def _flce_dlogits_kernel(
    X, W, Y, LSE, SCALE, DZ,
    row_start, n_rows, H, V,
    stride_xn, stride_xh, stride_wv, stride_wh, stride_dzn,
    one_minus_eps, eps_over_v,
    BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, PRECISION: tl.constexpr,
):
    # Step 1: program (i, j) owns chunk rows [i*BLOCK_M, ...) and vocabulary columns of tile j.
    local = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = local < n_rows
    rows = row_start + local.to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    cmask = cols < V
    cols = cols.to(tl.int64)
    # Step 2: the same logits as the forward pass, then the softmax from the saved lse.
    z = _logits_tile(X, W, rows, cols, rmask, cmask, H, stride_xn, stride_xh, stride_wv, stride_wh,
                     BLOCK_M, BLOCK_V, BLOCK_H, PRECISION)
    lse = tl.load(LSE + rows, mask=rmask, other=0.0)
    y = tl.load(Y + rows, mask=rmask, other=-1).to(tl.int64)
    scale = tl.load(SCALE + rows, mask=rmask, other=0.0)       # g_i, 0 on ignored rows
    p = tl.exp(z - lse[:, None])
    # Step 3: dz = g (softmax - (1 - eps) onehot(y) - eps / V), stored in the inputs' dtype.
    dz = p - eps_over_v - tl.where(cols[None, :] == y[:, None], one_minus_eps, 0.0)
    dz = dz * scale[:, None]
    tl.store(DZ + local[:, None].to(tl.int64) * stride_dzn + cols[None, :], dz.to(DZ.dtype.element_ty),
             mask=rmask[:, None] & cmask[None, :])


@triton.jit
def _matmul_kernel(
    A, B, C,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    ACCUMULATE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    # Step 1: program (i, j) owns the (BLOCK_M, BLOCK_N) tile (i, j) of C.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < M
    cmask = cols < N
    rows = rows.to(tl.int64)
    cols = cols.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Step 2: walk K; A and B are read through their strides (a transposed view costs nothing).
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < K
        a = tl.load(A + rows[:, None] * stride_am + ks[None, :] * stride_ak,
                    mask=rmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(B + ks[:, None] * stride_bk + cols[None, :] * stride_bn,
                    mask=kmask[:, None] & cmask[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    # Step 3: write, or add to what C holds (the dW accumulation over row chunks).
    c_ptrs = C + rows[:, None] * stride_cm + cols[None, :] * stride_cn
    mask = rmask[:, None] & cmask[None, :]
    if ACCUMULATE:
        acc += tl.load(c_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"   # float32: no TF32 rounding on a GPU


def _check(x, weight, target, ignore_index, label_smoothing, reduction):
    out = check_inputs(x, weight, target, ignore_index, label_smoothing, reduction, device="kernel",
                       dtypes=FLOAT_DTYPES)
    if x.dtype == torch.bfloat16 and runtime.interpreting():
        # the interpreter computes tl.dot with numpy, which has no bfloat16
        raise TypeError("x: bfloat16 needs a GPU (Triton's interpreter has no bfloat16 tl.dot); "
                        "use float32 or float16 on CPU")
    return out


def _blocks(block_m, block_v, block_h) -> tuple[int, int, int]:
    out = []
    for name, b, d in zip(("block_m", "block_v", "block_h"), (block_m, block_v, block_h), default_blocks()):
        b = require_power_of_two(name, d if b is None else b)
        if b < 16:
            raise ValueError(f"{name} must be at least 16 (tl.dot's smallest tile), got {b}")
        out.append(b)
    return tuple(out)


def matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, *, accumulate: bool = False,
           blocks: tuple[int, int, int] | None = None) -> torch.Tensor:
    """``out = a @ b`` (or ``out += a @ b``) for 2-D ``a`` ``(M, K)``, ``b`` ``(K, N)`` of one dtype, any strides.

    ``out`` ``(M, N)`` may be a view (a slice of a larger tensor) and of another dtype (float32
    for an accumulator); products accumulate in float32. Used by the backward pass; exposed so the
    notebook can show that ``dz^T @ x`` is a matmul of a transposed *view*.
    """
    if a.ndim != 2 or b.ndim != 2 or out.ndim != 2 or a.shape[1] != b.shape[0] or \
            out.shape != (a.shape[0], b.shape[1]):
        raise ValueError(f"matmul needs a (M, K), b (K, N), out (M, N); got a {tuple(a.shape)}, "
                         f"b {tuple(b.shape)}, out {tuple(out.shape)}")
    if a.dtype != b.dtype:
        raise TypeError(f"b has dtype {b.dtype} but a has {a.dtype}; tl.dot needs one dtype")
    block_m, block_n, block_k = blocks or default_blocks()
    m, k_dim = a.shape
    n = b.shape[1]
    if m == 0 or n == 0:
        return out
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _matmul_kernel[grid](a, b, out, m, n, k_dim, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                         out.stride(0), out.stride(1), ACCUMULATE=accumulate,
                         BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=_precision(a.dtype))
    return out


def flce_forward(x2, weight, target, ignore_index, label_smoothing, blocks):
    """Launch the forward kernel on checked ``(N, H)`` inputs: ``(lse, row_loss)``, float32 ``(N,)`` each."""
    block_m, block_v, block_h = blocks
    n, hidden = x2.shape
    vocab = weight.shape[0]
    lse = torch.empty(n, dtype=torch.float32, device=x2.device)
    row_loss = torch.empty(n, dtype=torch.float32, device=x2.device)
    if n:
        _flce_forward_kernel[(triton.cdiv(n, block_m),)](
            x2, weight, target, lse, row_loss,
            n, hidden, vocab,
            x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1),
            ignore_index, 1.0 - label_smoothing, label_smoothing / vocab,
            BLOCK_M=block_m, BLOCK_V=block_v, BLOCK_H=block_h, PRECISION=_precision(x2.dtype),
        )
    return lse, row_loss


def flce_backward(x2, weight, target, lse, scale, label_smoothing, row_chunk, blocks, need_dx=True, need_dw=True):
    """``(dx, dW)`` for per-row gradient scales ``scale`` ``(N,)`` float32 (``g_i``, 0 on ignored rows).

    Walks the rows ``row_chunk`` at a time; see the module docstring. ``dx`` is in ``x``'s dtype,
    ``dW`` accumulates in float32 and is returned in ``weight``'s dtype.
    """
    block_m, block_v, block_h = blocks
    n, hidden = x2.shape
    vocab = weight.shape[0]
    dx = torch.empty_like(x2) if need_dx else None
    dw32 = torch.zeros(weight.shape, dtype=torch.float32, device=x2.device) if need_dw else None
    dz = torch.empty((min(row_chunk, n), vocab), dtype=x2.dtype, device=x2.device)
    for r0 in range(0, n, row_chunk):
        rows = min(row_chunk, n - r0)
        # Step 1: dz for this chunk of rows, every vocabulary tile in one launch
        grid = (triton.cdiv(rows, block_m), triton.cdiv(vocab, block_v))
        _flce_dlogits_kernel[grid](
            x2, weight, target, lse, scale, dz,
            r0, rows, hidden, vocab,
            x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1), dz.stride(0),
            1.0 - label_smoothing, label_smoothing / vocab,
            BLOCK_M=block_m, BLOCK_V=block_v, BLOCK_H=block_h, PRECISION=_precision(x2.dtype),
        )
        dz_chunk = dz[:rows]
        # Step 2: dx[chunk] = dz @ W  and  dW += dz^T @ x[chunk]  (a transposed view, no copy)
        if need_dx:
            matmul(dz_chunk, weight, dx[r0:r0 + rows], blocks=(block_m, block_h, block_v))
        if need_dw:
            matmul(dz_chunk.T, x2[r0:r0 + rows], dw32, accumulate=True, blocks=(block_v, block_h, block_m))
    return dx, (dw32.to(weight.dtype) if need_dw else None)


class FusedLinearCrossEntropy(torch.autograd.Function):
    """Forward: :func:`flce_forward` (saves ``lse``). Backward: :func:`flce_backward`."""

    @staticmethod
    def forward(ctx, x2, weight, target, ignore_index, label_smoothing, reduction, row_chunk, blocks):
        lse, row_loss = flce_forward(x2, weight, target, ignore_index, label_smoothing, blocks)
        loss = reduce_rows(row_loss, target, ignore_index, reduction)
        ctx.save_for_backward(x2, weight, target, lse)
        ctx.settings = (ignore_index, label_smoothing, reduction, row_chunk, blocks)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        x2, weight, target, lse = ctx.saved_tensors
        ignore_index, label_smoothing, reduction, row_chunk, blocks = ctx.settings
        scale = row_gradient_scale(target, ignore_index, reduction, grad_loss.expand(x2.shape[0])).float().contiguous()
        dx, dw = flce_backward(x2, weight, target, lse, scale, label_smoothing, row_chunk, blocks,
                               need_dx=ctx.needs_input_grad[0], need_dw=ctx.needs_input_grad[1])
        return dx, dw, None, None, None, None, None, None


def fused_linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *,
                               ignore_index: int = -100, label_smoothing: float = 0.0, reduction: str = "mean",
                               row_chunk: int | None = None, block_m: int | None = None,
                               block_v: int | None = None, block_h: int | None = None) -> torch.Tensor:
    """``F.cross_entropy(x @ weight.T, target)`` without the ``(N, V)`` logits, in Triton.

    ``x`` ``(..., H)`` hidden states, ``weight`` ``(V, H)`` the LM head (same dtype), ``target``
    ``x.shape[:-1]`` int64/int32 token ids in ``[0, V)`` or ``ignore_index``. ``label_smoothing``
    in ``[0, 1]`` and ``reduction`` ``"mean"`` (over non-ignored tokens; 0 when all are ignored) or
    ``"sum"``, as in :mod:`llmu.training.cross_entropy`. Returns a float32 scalar, differentiable in
    ``x`` and ``weight``. ``row_chunk``: rows per backward chunk (default
    :func:`~llmu.training.cross_entropy.default_row_chunk`); ``block_*``: powers of two >= 16
    (defaults from :func:`default_blocks`).
    """
    x2, t1, n, hidden, vocab = _check(x, weight, target, ignore_index, label_smoothing, reduction)
    row_chunk = default_row_chunk(n, hidden, vocab) if row_chunk is None else row_chunk
    require_positive("row_chunk", row_chunk, integer=True)
    blocks = _blocks(block_m, block_v, block_h)
    if x2.shape[-1] > 1 and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return FusedLinearCrossEntropy.apply(x2, weight, t1.contiguous(), ignore_index, float(label_smoothing), reduction,
                                         row_chunk, blocks)
