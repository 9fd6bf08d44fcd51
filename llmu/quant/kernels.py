"""Triton kernels of module 10: matrix products that read quantized weights.

A weight-only quantized layer keeps its weights as small integer codes and computes
``y = x @ W^T`` with ``W`` rebuilt *inside the kernel*, in registers, from the codes and the group
scales and zeros of :mod:`llmu.quant.formats`::

    W[n, k] = (q[n, k] - zero[n, k // G]) * scale[n, k // G]

Nothing the size of ``W`` in floating point is ever written to memory: that is the whole point.

The napkin math
---------------
One weight of a bfloat16 layer is 2 bytes. One int4 weight is half a byte, plus its share of the
group's scale and zero: ``2 * 4 / G`` bytes in float32 as stored here (``2 * 2 / G`` with fp16),
0.0625 bytes at ``G = 128``. So an int4 layer is ``0.5 + 8 / G`` bytes per weight against 2:

    bf16       2        bytes/weight
    int8       1 + 4/K  (one float32 scale per output row)
    int4 G=128 0.5625   (3.6x fewer bytes than bf16)
    int4 G=32  0.75     (2.7x)

*Decode is memory-bound.* At batch ``M = 1`` a ``(4096, 4096)`` layer does ``2 * 4096 * 4096 =
34 MFLOP`` and reads 34 MB of bf16 weights: 1 FLOP per byte, where an H200 (4.8 TB/s, ~990
TFLOP/s dense bf16) needs ~200 FLOPs per byte before arithmetic is the limit. The time is the
time to read the weights, so reading 3.6x fewer bytes is up to 3.6x faster (4x in the limit of
large groups); the few extra integer and float operations per weight that unpacking costs are
free, hidden under the memory traffic. This is why weight-only int4 is the standard trick of
local and batch-1 serving.

*Prefill is compute-bound.* At ``M = 4096`` tokens the same layer does 137 GFLOP for the same
weight bytes (and 2 * 34 MB of activations): ~1400 FLOPs per byte in bf16, well past the ridge
point. The tensor cores set the time, and they multiply bf16 (or fp16) operands, so the int4 tile
must be dequantized to bf16 before ``tl.dot`` — int4 buys nothing here (the unpacking is extra
work on the critical path, so the int4 GEMM is at best as fast as the bf16 one). Weight-only
quantization saves *memory* (the model fits, the KV cache gets more room) and decode time; to
speed up prefill the activations must be quantized too (int8 x int8 or FP8 tensor-core products),
which is another design.

The kernels
-----------
``int4_matmul(x, packed, scale, zero, group_size)``
    ``x`` ``(..., K)`` float32/float16/bfloat16; ``packed`` ``(N, K / 2)`` uint8, two codes a byte
    (:func:`llmu.quant.formats.pack_int4`: input ``2j`` in the low nibble, ``2j + 1`` in the high
    one); ``scale``, ``zero`` ``(N, K / G)`` float32. Returns ``x @ W^T`` ``(..., N)`` in ``x``'s
    dtype. 4-bit codes only: 2- and 3-bit formats (``formats.BITS``) are stored one code a byte
    and have no kernel here (dequantize them, or store them as 4-bit codes: a 2- or 3-bit code is
    a valid 4-bit code with the same scale and zero). Two code paths, picked by the number of
    rows ``M``:

    - **GEMV** (``M <= GEMV_MAX_M``, decode): one program per (block of ``BLOCK_N`` outputs, row
      of ``x``). It streams ``K`` a tile of ``BLOCK_KH`` bytes at a time, splits each byte into its
      two nibbles *in registers*, and multiplies the low nibbles by the even inputs of ``x`` and
      the high nibbles by the odd inputs — no interleaving is ever needed. When a tile lies inside
      one group (``G`` a multiple of the tile's ``2 * BLOCK_KH`` inputs) the scale and zero are
      applied once per tile and row: ``s * (sum q x - z * sum x)``.
    - **GEMM** (prefill): one program per ``(BLOCK_M, BLOCK_N)`` output tile; each step loads a
      ``(BLOCK_KH, BLOCK_N)`` tile of bytes (``W^T``), dequantizes both nibble halves to ``x``'s
      dtype and runs two ``tl.dot``: even inputs of ``x`` with the low half, odd with the high.

``int8_matmul(x, codes, scale)``
    ``codes`` ``(N, K)`` int8, symmetric (``W[n, k] = codes[n, k] * scale[n]``), one float32
    ``scale`` per output row. The scale does not depend on ``k``, so it is applied once, to the
    finished dot product: ``y[m, n] = scale[n] * sum_k x[m, k] codes[n, k]``. Same two paths.
    (A ``QuantizedTensor`` with ``bits=8, symmetric=True, granularity="channel"`` stores unsigned
    codes ``c + 128``: ``int8_codes`` converts them.)

All kernels accumulate in float32 and return ``x``'s dtype. ``path="gemv"``/``"gemm"`` forces a
path (the tests run both on the same inputs). The launchers check types, shapes, devices and the
format (``K`` even, ``G`` even and dividing ``K``), never the *values* (a zero scale or a nan in
``x`` is the caller's business; reading values would cost a GPU a synchronisation per call).
In Triton's interpreter (no GPU) bfloat16 tiles go through float32 before ``tl.dot``: the
interpreter's numpy has no bfloat16 product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmu import runtime
from llmu.checks import FLOAT_DTYPES, require_tensor

__all__ = ["int4_matmul", "int8_matmul", "int8_codes", "choose_path", "GEMV_MAX_M", "PATHS"]

#: Up to this many rows of ``x`` the GEMV path runs (one program per row and output block).
GEMV_MAX_M = 4
PATHS = ("gemv", "gemm")
_MAX_GRID_Y = 65535      # CUDA's limit on the second grid dimension (the GEMV's rows)


# ----------------------------------------------------------------------------------------------
# int4 GEMV: one program per (block of BLOCK_N outputs, row of x); 0.5 byte read per weight
# ----------------------------------------------------------------------------------------------


@triton.jit
def _tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Output tile (row, column) of program ``pid``, ``GROUP_M`` tile rows at a time: neighbouring
    programs then share the same weight tiles while they are in L2 (Triton's matmul tutorial)."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    rows_here = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % rows_here, (pid % per_group) // rows_here


@triton.jit
def _int4_gemv_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, y_ptr,
    N, KH, G,                            # outputs, bytes per weight row (K / 2), group size
    stride_xm, stride_xk,
    stride_wn, stride_wk,
    stride_sn, stride_sg,
    stride_zn, stride_zg,
    stride_ym, stride_yn,
    BLOCK_N: tl.constexpr,
    BLOCK_KH: tl.constexpr,              # bytes (2 * BLOCK_KH inputs) per loop step
    GROUP_TILE: tl.constexpr,            # True when every tile lies inside one group
):
    pid_n = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_j = tl.arange(0, BLOCK_KH)
    x_row = x_ptr + m * stride_xm
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N], tl.float32)
    for j0 in range(0, KH, BLOCK_KH):
        j = j0 + offs_j
        j_ok = j < KH
        # -- x: the even inputs meet the low nibbles, the odd inputs the high ones
        x_lo = tl.load(x_row + (2 * j) * stride_xk, mask=j_ok, other=0.0).to(tl.float32)
        x_hi = tl.load(x_row + (2 * j + 1) * stride_xk, mask=j_ok, other=0.0).to(tl.float32)
        # -- the weight bytes of the tile, two codes each, unpacked in registers
        b = tl.load(w_rows + j[None, :] * stride_wk, mask=n_ok[:, None] & j_ok[None, :], other=0)
        q_lo = (b & 0xF).to(tl.float32)
        q_hi = (b >> 4).to(tl.float32)
        if GROUP_TILE:
            # -- one group for the whole tile: sum q x first, scale and zero once per row
            g = (2 * j0) // G
            s = tl.load(s_ptr + offs_n * stride_sn + g * stride_sg, mask=n_ok, other=0.0)
            z = tl.load(z_ptr + offs_n * stride_zn + g * stride_zg, mask=n_ok, other=0.0)
            qx = tl.sum(q_lo * x_lo[None, :] + q_hi * x_hi[None, :], axis=1)
            acc += s * (qx - z * tl.sum(x_lo + x_hi, axis=0))
        else:
            # -- groups change inside the tile: the scale and zero of each byte (G is even, so
            #    both nibbles of a byte share a group)
            g = (2 * j) // G
            sz_mask = n_ok[:, None] & j_ok[None, :]
            s = tl.load(s_ptr + offs_n[:, None] * stride_sn + g[None, :] * stride_sg, mask=sz_mask, other=0.0)
            z = tl.load(z_ptr + offs_n[:, None] * stride_zn + g[None, :] * stride_zg, mask=sz_mask, other=0.0)
            acc += tl.sum(((q_lo - z) * x_lo[None, :] + (q_hi - z) * x_hi[None, :]) * s, axis=1)
    tl.store(y_ptr + m * stride_ym + offs_n * stride_yn, acc.to(y_ptr.dtype.element_ty), mask=n_ok)


# ----------------------------------------------------------------------------------------------
# int4 GEMM: one program per (BLOCK_M, BLOCK_N) tile; dequantize the B tile, then tl.dot
# ----------------------------------------------------------------------------------------------


@triton.jit
def _int4_gemm_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, y_ptr,
    M, N, KH, G,
    stride_xm, stride_xk,
    stride_wn, stride_wk,
    stride_sn, stride_sg,
    stride_zn, stride_zg,
    stride_ym, stride_yn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    GROUP_M: tl.constexpr,               # tiles of M grouped so neighbouring programs share W tiles in L2
    GROUP_TILE: tl.constexpr,
    UPCAST: tl.constexpr,                # True in the interpreter for bfloat16: dot in float32
    PRECISION: tl.constexpr,
):
    # -- program id -> (tile row, tile column), GROUP_M tile rows at a time
    pid_m, pid_n = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    offs_j = tl.arange(0, BLOCK_KH)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for j0 in range(0, KH, BLOCK_KH):
        j = j0 + offs_j
        j_ok = j < KH
        # -- A: the even and the odd inputs of the tile, (BLOCK_M, BLOCK_KH) each
        x_mask = m_ok[:, None] & j_ok[None, :]
        x_lo = tl.load(x_rows + (2 * j)[None, :] * stride_xk, mask=x_mask, other=0.0)
        x_hi = tl.load(x_rows + (2 * j + 1)[None, :] * stride_xk, mask=x_mask, other=0.0)
        # -- B: (BLOCK_KH, BLOCK_N) bytes of W^T, both nibbles, dequantized in registers
        w_mask = j_ok[:, None] & n_ok[None, :]
        b = tl.load(w_cols + j[:, None] * stride_wk, mask=w_mask, other=0)
        q_lo = (b & 0xF).to(tl.float32)
        q_hi = (b >> 4).to(tl.float32)
        if GROUP_TILE:
            g = (2 * j0) // G
            s = tl.load(s_ptr + offs_n * stride_sn + g * stride_sg, mask=n_ok, other=0.0)[None, :]
            z = tl.load(z_ptr + offs_n * stride_zn + g * stride_zg, mask=n_ok, other=0.0)[None, :]
        else:
            g = (2 * j) // G
            s = tl.load(s_ptr + offs_n[None, :] * stride_sn + g[:, None] * stride_sg, mask=w_mask, other=0.0)
            z = tl.load(z_ptr + offs_n[None, :] * stride_zn + g[:, None] * stride_zg, mask=w_mask, other=0.0)
        if UPCAST:
            x_lo = x_lo.to(tl.float32)
            x_hi = x_hi.to(tl.float32)
        w_lo = ((q_lo - z) * s).to(x_lo.dtype)
        w_hi = ((q_hi - z) * s).to(x_lo.dtype)
        # -- two products of half the tile's depth each: even inputs x low nibbles, odd x high
        acc = tl.dot(x_lo, w_lo, acc, input_precision=PRECISION)
        acc = tl.dot(x_hi, w_hi, acc, input_precision=PRECISION)
    y = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :] * stride_yn
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# ----------------------------------------------------------------------------------------------
# int8 (symmetric, one scale per output row): the scale waits until the dot product is done
# ----------------------------------------------------------------------------------------------


@triton.jit
def _int8_gemv_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr,
    N, K,
    stride_xm, stride_xk,
    stride_wn, stride_wk,
    stride_s,
    stride_ym, stride_yn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_row = x_ptr + m * stride_xm
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        # -- one byte per weight, the code itself: sum_k x[k] * c[n, k]
        xv = tl.load(x_row + k * stride_xk, mask=k_ok, other=0.0).to(tl.float32)
        c = tl.load(w_rows + k[None, :] * stride_wk, mask=n_ok[:, None] & k_ok[None, :], other=0).to(tl.float32)
        acc += tl.sum(c * xv[None, :], axis=1)
    # -- the row's scale, once
    s = tl.load(s_ptr + offs_n * stride_s, mask=n_ok, other=0.0)
    tl.store(y_ptr + m * stride_ym + offs_n * stride_yn, (acc * s).to(y_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _int8_gemm_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_xk,
    stride_wn, stride_wk,
    stride_s,
    stride_ym, stride_yn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m, pid_n = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        a = tl.load(x_rows + k[None, :] * stride_xk, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
        # -- codes -128..127 are exact in float16 and bfloat16: convert, then a plain tl.dot
        c = tl.load(w_cols + k[:, None] * stride_wk, mask=k_ok[:, None] & n_ok[None, :], other=0)
        acc = tl.dot(a, c.to(a.dtype), acc, input_precision=PRECISION)
    s = tl.load(s_ptr + offs_n * stride_s, mask=n_ok, other=0.0)
    y = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :] * stride_yn
    tl.store(y, (acc * s[None, :]).to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


def choose_path(m: int) -> str:
    """``"gemv"`` for up to :data:`GEMV_MAX_M` rows (decode), ``"gemm"`` above (prefill)."""
    return "gemv" if m <= GEMV_MAX_M else "gemm"


def _dot_options(dtype):
    """``(UPCAST, PRECISION)``: bfloat16 dots go through float32 in the interpreter; fp32 is IEEE."""
    upcast = dtype == torch.bfloat16 and runtime.interpreting()
    return upcast, ("ieee" if dtype == torch.float32 or upcast else "tf32")


def _check_x(x, k: int, weight_name: str) -> torch.Tensor:
    """``x`` ``(..., K)`` float on the weights' device; returns it as ``(M, K)`` (a view when it can)."""
    require_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.ndim == 0:
        raise ValueError("x must have at least 1 dimension (..., in_features), got a scalar")
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features (last dim) but {weight_name} holds K = {k}")
    return x.reshape(-1, k)


def _check_path(path, m: int) -> str:
    if path is None:
        return choose_path(m)
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS} or None, got {path!r}")
    if path == "gemv" and m > _MAX_GRID_Y:
        raise ValueError(f"path='gemv' runs one program per row of x (at most {_MAX_GRID_Y}), got {m} rows: "
                         "use path='gemm' or None")
    return path


def _gemv_blocks(n: int, kh: int, group_size: int | None = None) -> tuple[int, int, int]:
    """``(BLOCK_N, BLOCK_KH, num_warps)`` of the GEMV. On a GPU: few rows per program (many programs
    to keep every memory channel busy), up to 128 bytes of each row per step. In the interpreter
    every program is Python: big tiles, few programs. The tile is shrunk (not below 16 bytes) until
    it fits inside one group when it can, so the scale and zero are applied once per tile."""
    if runtime.interpreting():
        block_n, block_kh = min(64, max(16, triton.next_power_of_2(n))), min(64, max(16, triton.next_power_of_2(kh)))
    else:
        block_n, block_kh = 8, 128
    if group_size is not None:
        for cand in (block_kh, block_kh // 2, block_kh // 4, block_kh // 8):
            if cand >= 16 and group_size % (2 * cand) == 0:
                return block_n, cand, 4
    return block_n, block_kh, 4


def _gemm_blocks(m: int, n: int, kh: int, dtype: torch.dtype = torch.float16) -> tuple[int, int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_KH, num_warps, num_stages)`` of the GEMMs.

    Each pipeline stage keeps one tile of ``x``, of the packed weights and, for groups smaller
    than a tile, of the scales and zeros in shared memory. With float32 ``x`` three or four stages
    need up to 236 KB (``llmu gpu-compile`` measured it), past an A100's 163 KB and an H100's
    227 KB: float32 gets two stages."""
    if runtime.interpreting():
        return (min(32, max(16, triton.next_power_of_2(m))), min(64, max(16, triton.next_power_of_2(n))),
                min(32, max(16, triton.next_power_of_2(kh))), 4, 1)
    two_byte = dtype != torch.float32
    if m <= 64:
        return 16 if m <= 16 else 64, 64, 64, 4, 4 if two_byte else 2
    return 128, 128, 32, 8, 3 if two_byte else 2


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                group_size: int, *, path: str | None = None) -> torch.Tensor:
    """``x @ W^T`` with ``W[n, k] = (q[n, k] - zero[n, k // G]) * scale[n, k // G]`` read as packed int4.

    ``x`` ``(..., K)`` float32/float16/bfloat16; ``packed`` ``(N, K / 2)`` uint8 (low nibble = even
    input); ``scale``, ``zero`` ``(N, K / G)`` float32; ``group_size`` ``G``: an even divisor of
    ``K`` (``K`` itself for one group per row). ``path``: ``None`` (by the rows of ``x``: see
    :func:`choose_path`), ``"gemv"`` or ``"gemm"``. Returns ``(..., N)`` in ``x``'s dtype.
    """
    require_tensor("packed", packed, ndim=2, dtypes=(torch.uint8,))
    require_tensor("scale", scale, ndim=2, dtypes=(torch.float32,))
    require_tensor("zero", zero, ndim=2, dtypes=(torch.float32,))
    n, kh = packed.shape
    if n == 0 or kh == 0:
        raise ValueError(f"packed must hold at least one byte per row, got shape {tuple(packed.shape)}")
    k = 2 * kh
    x2 = _check_x(x, k, "packed (two codes per byte)")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if k % group_size:
        raise ValueError(f"group_size {group_size} does not divide the input dimension K = {k}")
    if group_size % 2:
        raise ValueError(f"group_size must be even (both codes of a packed byte share one group), got {group_size}")
    groups = k // group_size
    for name, t in (("scale", scale), ("zero", zero)):
        if tuple(t.shape) != (n, groups):
            raise ValueError(f"{name} must have shape (N, K / group_size) = {(n, groups)}, got {tuple(t.shape)}")
    for name, t in (("packed", packed), ("scale", scale), ("zero", zero)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}; they must match")
    m = x2.shape[0]
    path = _check_path(path, m)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*x.shape[:-1], n)
    common = (*x2.stride(), *packed.stride(), *scale.stride(), *zero.stride(), *y.stride())
    if path == "gemv":
        block_n, block_kh, warps = _gemv_blocks(n, kh, group_size)
        _int4_gemv_kernel[(triton.cdiv(n, block_n), m)](
            x2, packed, scale, zero, y, n, kh, group_size, *common,
            BLOCK_N=block_n, BLOCK_KH=block_kh, GROUP_TILE=group_size % (2 * block_kh) == 0, num_warps=warps,
        )
    else:
        block_m, block_n, block_kh, warps, stages = _gemm_blocks(m, n, kh, x.dtype)
        upcast, precision = _dot_options(x.dtype)
        grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
        _int4_gemm_kernel[grid](
            x2, packed, scale, zero, y, m, n, kh, group_size, *common,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_KH=block_kh, GROUP_M=8,
            GROUP_TILE=group_size % (2 * block_kh) == 0, UPCAST=upcast, PRECISION=precision,
            num_warps=warps, num_stages=stages,
        )
    return y.reshape(*x.shape[:-1], n)


def int8_matmul(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, *, path: str | None = None) -> torch.Tensor:
    """``x @ W^T`` with ``W[n, k] = codes[n, k] * scale[n]``: int8 weights, one float32 scale per row.

    ``x`` ``(..., K)`` float32/float16/bfloat16; ``codes`` ``(N, K)`` int8; ``scale`` ``(N,)``
    float32 (an ``(N, 1)`` column is accepted too). Returns ``(..., N)`` in ``x``'s dtype.
    """
    require_tensor("codes", codes, ndim=2, dtypes=(torch.int8,))
    require_tensor("scale", scale, ndim=(1, 2), dtypes=(torch.float32,))
    n, k = codes.shape
    if n == 0 or k == 0:
        raise ValueError(f"codes must be a non-empty (N, K) matrix, got shape {tuple(codes.shape)}")
    if scale.ndim == 2:
        if scale.shape[1] != 1:
            raise ValueError(f"scale must be (N,) or (N, 1): one scale per output row, got {tuple(scale.shape)}")
        scale = scale[:, 0]
    if scale.shape[0] != n:
        raise ValueError(f"scale must have N = {n} entries (one per row of codes), got {scale.shape[0]}")
    x2 = _check_x(x, k, "codes")
    for name, t in (("codes", codes), ("scale", scale)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}; they must match")
    m = x2.shape[0]
    path = _check_path(path, m)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y.reshape(*x.shape[:-1], n)
    common = (*x2.stride(), *codes.stride(), scale.stride(0), *y.stride())
    if path == "gemv":
        block_n, block_kh, warps = _gemv_blocks(n, k // 2)
        _int8_gemv_kernel[(triton.cdiv(n, block_n), m)](
            x2, codes, scale, y, n, k, *common, BLOCK_N=block_n, BLOCK_K=2 * block_kh, num_warps=warps,
        )
    else:
        block_m, block_n, block_kh, warps, stages = _gemm_blocks(m, n, k // 2, x.dtype)
        upcast, precision = _dot_options(x.dtype)
        grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
        _int8_gemm_kernel[grid](
            x2, codes, scale, y, m, n, k, *common,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=2 * block_kh, GROUP_M=8, UPCAST=upcast, PRECISION=precision,
            num_warps=warps, num_stages=stages,
        )
    return y.reshape(*x.shape[:-1], n)


def int8_codes(qt) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes int8 (N, K), scale float32 (N,))`` for :func:`int8_matmul` from a ``QuantizedTensor``
    of 8 bits, symmetric, one scale per row (``granularity`` ``"channel"`` or ``"tensor"``)."""
    if qt.bits != 8 or not qt.symmetric or qt.scale.shape[1] != 1:
        raise ValueError(f"int8_matmul takes 8-bit symmetric codes with one scale per row; got bits={qt.bits}, "
                         f"symmetric={qt.symmetric}, granularity={qt.granularity!r}")
    codes = (qt.codes.to(torch.int16) - 128).to(torch.int8)   # unsigned codes c + 128 -> signed c
    return codes, qt.scale[:, 0].contiguous()
