"""A first look at Triton: vector addition and a row-wise softmax.

Triton's programming model in four words: **programs, blocks, masks, pointers**.

- A kernel launch starts a *grid* of programs. Each program runs the same function and asks
  ``tl.program_id(0)`` which one it is.
- A program does not handle one element, as a CUDA thread would, but a whole *block* of them:
  ``tl.arange(0, BLOCK_SIZE)`` is a vector of offsets, and every operation on it is a vector
  operation. ``BLOCK_SIZE`` must be a compile-time constant (``tl.constexpr``) and a power of two.
- When the problem size is not a multiple of the block, the last program's block hangs over the
  end of the data. A *mask* (a vector of booleans) switches those lanes off for loads and stores.
- Tensors arrive as *pointers* to their first element; ``ptr + offsets`` is a block of addresses.

Both kernels here follow the layout used throughout llmu: a private ``@triton.jit`` function whose
name starts with ``_`` and a host-side *launcher* that validates its inputs, allocates the output,
picks the grid and launches. On a machine without a GPU, ``import llmu`` has switched Triton to
its interpreter, and the same kernels run on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmu.checks import FLOAT_DTYPES, require_power_of_two, require_same_dtype, require_tensor

__all__ = ["add", "softmax", "DEFAULT_ADD_BLOCK", "MAX_SOFTMAX_BLOCK"]

#: Elements per program in :func:`add` unless the caller picks another block size.
DEFAULT_ADD_BLOCK = 1024
#: The widest column block :func:`softmax` uses; longer rows are processed in several blocks.
MAX_SOFTMAX_BLOCK = 4096


# --------------------------------------------------------------------------------------------
# Vector addition
# --------------------------------------------------------------------------------------------


@triton.jit
def _add_kernel(x_ptr, y_ptr, out_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    # 1. Which block of the vector is mine?  Program p covers [p*BLOCK_SIZE, (p+1)*BLOCK_SIZE).
    pid = tl.program_id(axis=0)
    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    # 2. The last block may run past the end: switch those lanes off.
    mask = offsets < n_elements
    # 3. Load, add, store. Masked-off lanes are neither read nor written. The sum is formed in
    #    float32 and rounded once to the output dtype: the same correctly rounded result as a
    #    16-bit add, and Triton's CPU interpreter cannot do bfloat16 arithmetic directly.
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    y = tl.load(y_ptr + offsets, mask=mask).to(tl.float32)
    tl.store(out_ptr + offsets, (x + y).to(out_ptr.dtype.element_ty), mask=mask)


def add(x: torch.Tensor, y: torch.Tensor, *, block_size: int = DEFAULT_ADD_BLOCK) -> torch.Tensor:
    """``x + y`` computed by :func:`_add_kernel`, one program per ``block_size`` elements.

    ``x`` and ``y`` must have the same shape and dtype (float32, float16 or bfloat16), live on the
    kernel device and be contiguous (the kernel sees them as flat arrays). No broadcasting.
    """
    require_tensor("x", x, dtypes=FLOAT_DTYPES)
    require_tensor("y", y, dtypes=FLOAT_DTYPES)
    require_same_dtype(x=x, y=y)
    if x.shape != y.shape:
        raise ValueError(f"y must have the shape of x {tuple(x.shape)}, got {tuple(y.shape)} (add does not broadcast)")
    if x.device != y.device:
        raise ValueError(f"y is on {y.device} but x is on {x.device}; they must match")
    for name, t in (("x", x), ("y", y)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (the kernel reads it as a flat array); call .contiguous()")
    require_power_of_two("block_size", block_size)
    out = torch.empty_like(x)
    n = x.numel()
    if n == 0:
        return out
    grid = (triton.cdiv(n, block_size),)  # enough programs to cover every element once
    _add_kernel[grid](x, y, out, n, BLOCK_SIZE=block_size)
    return out


# --------------------------------------------------------------------------------------------
# Row-wise softmax
# --------------------------------------------------------------------------------------------


@triton.jit
def _softmax_kernel(
    x_ptr,
    out_ptr,
    n_cols,
    x_row_stride,
    out_row_stride,
    BLOCK_SIZE: tl.constexpr,
):
    # One program per row. Columns are visited in blocks of BLOCK_SIZE, so rows of any length work;
    # when the row fits in one block (the common case) each loop below runs once.
    row = tl.program_id(axis=0)
    x_row = x_ptr + row * x_row_stride
    out_row = out_ptr + row * out_row_stride
    cols = tl.arange(0, BLOCK_SIZE)

    # Pass 1: the row maximum m and the sum s of exp(x - m), kept up to date block by block
    # ("online" softmax): when a block raises the maximum from m to m_new, the sum so far is
    # rescaled by exp(m - m_new). Masked lanes read -inf, which adds exp(-inf) = 0 to the sum.
    # A block of nothing but -inf (a fully masked stretch of the row) leaves the maximum at -inf;
    # m_safe = 0 then stands in for it so that no exp(-inf - (-inf)) = NaN enters the sum.
    m = -float("inf")
    s = 0.0
    for start in range(0, n_cols, BLOCK_SIZE):
        mask = start + cols < n_cols
        x = tl.load(x_row + start + cols, mask=mask, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe), axis=0)
        m = m_new

    # Pass 2: exp(x - m) / s, written in the output's dtype. Subtracting the maximum keeps every
    # exponent <= 0, so exp() never overflows, however large the scores are.
    for start in range(0, n_cols, BLOCK_SIZE):
        mask = start + cols < n_cols
        x = tl.load(x_row + start + cols, mask=mask, other=-float("inf")).to(tl.float32)
        y = tl.exp(x - m) / s
        tl.store(out_row + start + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def softmax(x: torch.Tensor, *, block_size: int | None = None) -> torch.Tensor:
    """Softmax over the last dimension of a 1-D or 2-D tensor, one Triton program per row.

    ``block_size`` (a power of two) is the number of columns a program handles at once; by default
    the row length rounded up to a power of two, capped at :data:`MAX_SOFTMAX_BLOCK`. Longer rows
    are processed in several blocks (two passes over the row, see :func:`_softmax_kernel`).
    The kernel computes in float32 and returns ``x``'s dtype. A row of all ``-inf`` gives NaN,
    as ``torch.softmax`` does.
    """
    require_tensor("x", x, ndim=(1, 2), dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    x2 = x.unsqueeze(0) if x.ndim == 1 else x
    n_rows, n_cols = x2.shape
    if block_size is None:
        block_size = min(triton.next_power_of_2(max(n_cols, 1)), MAX_SOFTMAX_BLOCK)
    require_power_of_two("block_size", block_size)
    out = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    if n_rows and n_cols:
        _softmax_kernel[(n_rows,)](x2, out, n_cols, x2.stride(0), out.stride(0), BLOCK_SIZE=block_size)
    return out.reshape(x.shape)
