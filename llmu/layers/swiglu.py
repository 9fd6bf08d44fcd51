"""The SwiGLU gate as Triton kernels: ``silu(gate) * up``, forward and backward.

In a Llama MLP, ``gate = x W_gate^T`` and ``up = x W_up^T`` are two ``(tokens, ffn)`` matrices and
the block computes ``(silu(gate) * up) W_down^T``. The two matmuls are compute-bound and belong to
cuBLAS; the elementwise part between them is memory-bound, and done in PyTorch it costs three
passes over ``(tokens, ffn)`` (sigmoid, multiply, multiply) plus their temporaries. Fused, it is
one read of ``gate`` and ``up`` and one write of the result.

With :math:`s = \\sigma(g)` and :math:`\\operatorname{silu}(g) = g\\,s`:

.. math::

    \\frac{\\partial\\,\\operatorname{silu}(g)}{\\partial g} = s\\,(1 + g\\,(1 - s)), \\qquad
    d\\text{gate} = dy \\cdot up \\cdot s\\,(1 + g(1-s)), \\qquad d\\text{up} = dy \\cdot \\operatorname{silu}(g).

The backward recomputes ``s`` from ``gate`` instead of storing it: one more sigmoid is cheaper
than another ``(tokens, ffn)`` tensor in memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmu.checks import FLOAT_DTYPES, require_same_device, require_same_dtype, require_tensor

BLOCK_N = 1024  # columns per program; rows are a grid dimension, so any width works


@triton.jit
def _swiglu_fwd_kernel(
    G, U, Y,
    stride_g, stride_u, stride_y,
    N,
    BLOCK_N: tl.constexpr,
):
    # Step 1: program (row, j) owns columns [j*BLOCK_N, (j+1)*BLOCK_N) of one row.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    # Step 2: load both halves of the gate and widen to fp32 (sigmoid in bf16 loses too much).
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    # Step 3: silu(g) * u, stored in the input dtype.
    y = g * tl.sigmoid(g) * u
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(
    DY, G, U, DG, DU,
    stride_dy, stride_g, stride_u, stride_dg, stride_du,
    N,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    # Step 1: recompute the sigmoid and silu of the gate.
    s = tl.sigmoid(g)
    silu = g * s
    # Step 2: chain rule through y = silu(g) * u.
    dg = dy * u * s * (1.0 + g * (1.0 - s))
    du = dy * silu
    tl.store(DG + row * stride_dg + cols, dg.to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + row * stride_du + cols, du.to(DU.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a ``(rows, N)`` matrix with unit column stride: a view when the rows are evenly
    strided (the usual case), a copy otherwise (correct, only slower)."""
    t2 = t.reshape(-1, t.shape[-1])
    if t2.shape[-1] > 1 and t2.stride(-1) != 1:
        t2 = t2.contiguous()
    return t2


def _check(gate: torch.Tensor, up: torch.Tensor) -> None:
    require_tensor("gate", gate, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    require_tensor("up", up, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    require_same_dtype(gate=gate, up=up)
    require_same_device(gate=gate, up=up)
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have the same shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    if gate.ndim == 0:
        raise ValueError("gate must have at least one dimension, got a scalar")


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Launch the forward kernel: a new tensor ``silu(gate) * up`` of ``gate``'s shape and dtype."""
    _check(gate, up)
    n = gate.shape[-1]
    g2, u2 = _rows(gate), _rows(up)
    y = torch.empty(g2.shape, dtype=gate.dtype, device=gate.device)
    if y.numel():
        grid = (g2.shape[0], triton.cdiv(n, BLOCK_N))
        _swiglu_fwd_kernel[grid](g2, u2, y, g2.stride(0), u2.stride(0), y.stride(0), n, BLOCK_N=BLOCK_N)
    return y.view(gate.shape)


def swiglu_backward(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the backward kernel: ``(d_gate, d_up)``, in the dtypes of ``gate`` and ``up``."""
    _check(gate, up)
    require_tensor("dy", dy, dtypes=FLOAT_DTYPES)
    if dy.shape != gate.shape:
        raise ValueError(f"dy must have gate's shape {tuple(gate.shape)}, got {tuple(dy.shape)}")
    n = gate.shape[-1]
    g2, u2, dy2 = _rows(gate), _rows(up), _rows(dy)
    dg = torch.empty(g2.shape, dtype=gate.dtype, device=gate.device)
    du = torch.empty(u2.shape, dtype=up.dtype, device=up.device)
    if dg.numel():
        grid = (g2.shape[0], triton.cdiv(n, BLOCK_N))
        _swiglu_bwd_kernel[grid](
            dy2, g2, u2, dg, du,
            dy2.stride(0), g2.stride(0), u2.stride(0), dg.stride(0), du.stride(0),
            n, BLOCK_N=BLOCK_N,
        )
    return dg.view(gate.shape), du.view(up.shape)


class SwiGLUFunction(torch.autograd.Function):
    """``silu(gate) * up`` with Triton forward and backward kernels."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return swiglu_forward(gate, up)

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        dg, du = swiglu_backward(dy, gate, up)
        return dg, du


def swiglu_fused(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in one pass, as a Triton kernel; differentiable in both inputs.

    ``gate`` and ``up``: same shape ``(..., ffn)`` and dtype (fp32/fp16/bf16), contiguous in the
    last dimension (other strides are free, so the two halves of a fused ``gate_up`` projection
    work without a copy). Computes in fp32; returns a new tensor in the input dtype. Equals
    :func:`llmu.layers.reference.silu_mul`.
    """
    _check(gate, up)
    return SwiGLUFunction.apply(gate, up)
