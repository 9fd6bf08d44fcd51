"""RMSNorm as Triton kernels: forward, and backward for both the input and the gain.

For one row ``x`` of length ``N`` (the hidden size):

.. math::

    r = \\frac{1}{\\sqrt{\\tfrac1N \\sum_j x_j^2 + \\varepsilon}}, \\qquad
    \\hat x = x\\,r, \\qquad y = \\hat x \\odot w .

Backward, with ``g = dy ⊙ w`` (the gradient that reaches ``x̂``):

.. math::

    dx = r\\,\\Big(g - \\hat x\\,\\tfrac1N\\sum_j g_j \\hat x_j\\Big), \\qquad
    dw = \\sum_{\\text{rows}} dy \\odot \\hat x .

``dx`` is row-local: one program per block of rows. ``dw`` sums over every row of the batch, so
each program accumulates its rows into a private partial sum, writes it to row ``pid`` of a
``(programs, N)`` buffer, and the host adds the few partial rows up (the scheme of Triton's
layer-norm tutorial and Liger-Kernel, without atomics, so the result is deterministic).

Every kernel loads in the storage dtype (fp32, fp16 or bf16) and computes in fp32.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from llmu import runtime
from llmu.checks import FLOAT_DTYPES, require_same_device, require_tensor

#: The longest row the kernels hold in registers at once.
MAX_HIDDEN = 65536


@triton.jit
def _rms_norm_fwd_kernel(
    X, W, Y, RSTD,
    stride_x, stride_y,
    M, N, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Step 1: this program owns rows [pid*BLOCK_M, pid*BLOCK_M + BLOCK_M) and the whole row width.
    pid = tl.program_id(0)
    rows = (pid * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # int64: row * stride can pass 2**31
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    mask = row_ok[:, None] & col_ok[None, :]
    # Step 2: load the tile in its storage dtype and widen to fp32 (padding lanes read 0, so they
    # add nothing to the sum of squares).
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    # Step 3: one reciprocal root-mean-square per row; divide by the true N, not by BLOCK_N.
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / N + eps)
    # Step 4: rescale, apply the gain, store in the output dtype; keep rstd for the backward pass.
    y = x * rstd[:, None] * w[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=row_ok)


@triton.jit
def _rms_norm_bwd_kernel(
    DY, X, W, RSTD, DX, DW_PARTIAL,
    stride_dy, stride_x, stride_dx,
    M, N, rows_per_program,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Step 1: this program owns a contiguous band of rows_per_program rows (a multiple of BLOCK_M)
    # and walks it BLOCK_M rows at a time.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    row_start = pid * rows_per_program
    for r0 in range(row_start, row_start + rows_per_program, BLOCK_M):
        rows = (r0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_ok = rows < M
        mask = row_ok[:, None] & col_ok[None, :]
        # Step 2: reload x and the saved rstd, rebuild x_hat (cheaper than storing it).
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        x_hat = x * rstd[:, None]
        # Step 3: dx = rstd * (g - x_hat * mean(g * x_hat)), with g = dy * w.
        g = dy * w[None, :]
        c = tl.sum(g * x_hat, axis=1) / N
        dx = (g - x_hat * c[:, None]) * rstd[:, None]
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        # Step 4: this band's share of dw (masked rows are zero, so they add nothing).
        dw_acc += tl.sum(dy * x_hat, axis=0)
    # Step 5: one partial row per program; the host sums them.
    tl.store(DW_PARTIAL + pid * N + cols, dw_acc, mask=col_ok)


def _block_m(block_n: int) -> int:
    """Rows per program: enough to keep about 4096 elements in flight, at most 16."""
    return max(1, min(16, 4096 // block_n))


def _num_warps(elements: int) -> int:
    """Warps per program on a GPU, growing with the tile so that no thread holds too many values."""
    return 4 if elements < 2048 else 8 if elements < 8192 else 16


def _num_partials(n_blocks: int) -> int:
    """How many programs (and partial dw rows) the backward pass uses."""
    if runtime.interpreting():
        cap = 4  # each program is a Python loop in the interpreter: few, long programs are fastest
    else:
        cap = 4 * runtime.sm_count()
    return max(1, min(n_blocks, cap))


def _check(x: torch.Tensor, weight: torch.Tensor, eps) -> None:
    require_tensor("x", x, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    require_tensor("weight", weight, ndim=1, dtypes=FLOAT_DTYPES)
    require_same_device(x=x, weight=weight)
    if x.ndim < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last dimension, got shape {tuple(x.shape)}")
    if weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight must have shape ({x.shape[-1]},) to match x's last dimension, got {tuple(weight.shape)}")
    if x.shape[-1] > MAX_HIDDEN:
        raise ValueError(f"x's last dimension is {x.shape[-1]}; this kernel holds a whole row and supports up to {MAX_HIDDEN}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel; return ``(y, rstd)`` with ``rstd`` fp32 of shape ``x.shape[:-1]``."""
    _check(x, weight, eps)
    n = x.shape[-1]
    x2 = x.reshape(-1, n)  # a view when rows are evenly strided; a copy otherwise (still correct)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    rstd = torch.empty((m,), dtype=torch.float32, device=x.device)
    if m:
        block_n = triton.next_power_of_2(n)
        block_m = _block_m(block_n)
        weight = weight.contiguous()
        _rms_norm_fwd_kernel[(triton.cdiv(m, block_m),)](
            x2, weight, y, rstd, x2.stride(0), y.stride(0), m, n, float(eps),
            BLOCK_M=block_m, BLOCK_N=block_n, num_warps=_num_warps(block_m * block_n),
        )
    return y.view(x.shape), rstd.view(x.shape[:-1])


def rms_norm_backward(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the backward kernel; return ``(dx, dw)`` in the dtypes of ``x`` and ``weight``.

    ``rstd`` is what :func:`rms_norm_forward` returned for the same ``x``, ``weight`` and ``eps``.
    """
    _check(x, weight, 0.0)
    require_tensor("dy", dy, dtypes=FLOAT_DTYPES)
    require_tensor("rstd", rstd, dtypes=(torch.float32,))
    if dy.shape != x.shape:
        raise ValueError(f"dy must have x's shape {tuple(x.shape)}, got {tuple(dy.shape)}")
    if rstd.shape != x.shape[:-1]:
        raise ValueError(f"rstd must have shape {tuple(x.shape[:-1])} (one value per row of x), got {tuple(rstd.shape)}")
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    dy2 = dy.reshape(-1, n)
    if dy2.stride(-1) != 1:
        dy2 = dy2.contiguous()
    rstd = rstd.reshape(-1).contiguous()
    m = x2.shape[0]
    dx = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return dx.view(x.shape), torch.zeros_like(weight)
    block_n = triton.next_power_of_2(n)
    block_m = _block_m(block_n)
    n_blocks = triton.cdiv(m, block_m)
    programs = _num_partials(n_blocks)
    rows_per_program = triton.cdiv(n_blocks, programs) * block_m
    programs = triton.cdiv(m, rows_per_program)
    partial = torch.empty((programs, n), dtype=torch.float32, device=x.device)
    _rms_norm_bwd_kernel[(programs,)](
        dy2, x2, weight.contiguous(), rstd, dx, partial,
        dy2.stride(0), x2.stride(0), dx.stride(0),
        m, n, rows_per_program,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=_num_warps(block_m * block_n),
    )
    dw = partial.sum(dim=0).to(weight.dtype)
    return dx.view(x.shape), dw


class RMSNormFunction(torch.autograd.Function):
    """``rms_norm`` with a Triton forward and a Triton backward (for ``x`` and ``weight``)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = rms_norm_forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_backward(dy, x, weight, rstd)
        return (dx if ctx.needs_input_grad[0] else None), (dw if ctx.needs_input_grad[1] else None), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """RMSNorm over the last dimension of ``x`` with gain ``weight``, as a Triton kernel.

    ``x``: ``(..., N)`` fp32/fp16/bf16, contiguous in its last dimension; ``weight``: ``(N,)`` of
    any float dtype. The output has ``x``'s dtype and shape. Differentiable in ``x`` and ``weight``
    (``dw`` comes back in ``weight``'s dtype). Equals :func:`llmu.layers.reference.rms_norm`.
    """
    _check(x, weight, eps)
    return RMSNormFunction.apply(x, weight, eps)
