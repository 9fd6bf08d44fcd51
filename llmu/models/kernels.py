"""Triton kernels that dequantize GGUF blocks (Q8_0, Q4_1) from their raw bytes.

The block layouts are explained in ``llmu.models.quants``, whose torch functions these kernels
are tested against (bit for bit, and against the ``gguf`` package).

Each program takes ``BLOCKS`` consecutive quantization blocks and writes their ``BLOCKS x 32``
floats. The float16 scale (and minimum) are assembled from two bytes (little endian) and
reinterpreted as a float16: the kernel reads the file's bytes exactly as they are stored.

Bit-exactness on a GPU: a compiler likes to fuse ``d * q + m`` into one fused multiply-add, which
rounds once instead of twice and can differ from the reference in the last bit. The launcher
therefore turns floating-point contraction off (``enable_fp_fusion=False``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmu import runtime
from llmu.checks import require_positive, require_power_of_two, require_tensor
from llmu.models.quants import BLOCK, Q4_1, Q8_0, TYPE_NAMES


@triton.jit
def _half_from_bytes(ptr):
    """Read a little-endian float16 at ``ptr`` (a tensor of byte pointers) and widen it to float32."""
    lo = tl.load(ptr).to(tl.uint16)
    hi = tl.load(ptr + 1).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _dequant_q8_0_kernel(raw_ptr, out_ptr, n_blocks, BLOCKS: tl.constexpr):
    # which quantization blocks this program handles; the last program may run past the end
    blk = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
    keep = blk < n_blocks
    blk = tl.where(keep, blk, 0)  # out-of-range rows read block 0 and are not stored
    base = raw_ptr + blk.to(tl.int64) * 34  # 34 bytes per block
    # 1. the block scale d: bytes 0..1
    d = _half_from_bytes(base)
    # 2. the 32 int8 codes: bytes 2..33
    e = tl.arange(0, 32)
    q = tl.load(base[:, None] + 2 + e[None, :]).to(tl.int8, bitcast=True).to(tl.float32)
    # 3. value = q * d
    out = q * d[:, None]
    tl.store(out_ptr + blk.to(tl.int64)[:, None] * 32 + e[None, :], out, mask=keep[:, None])


@triton.jit
def _dequant_q4_1_kernel(raw_ptr, out_ptr, n_blocks, BLOCKS: tl.constexpr):
    blk = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
    keep = blk < n_blocks
    blk = tl.where(keep, blk, 0)
    base = raw_ptr + blk.to(tl.int64) * 20  # 20 bytes per block
    # 1. scale d (bytes 0..1) and minimum m (bytes 2..3)
    d = _half_from_bytes(base)
    m = _half_from_bytes(base + 2)
    # 2. element e lives in byte 4 + (e mod 16): low nibble for e < 16, high nibble for e >= 16
    e = tl.arange(0, 32)
    byte = tl.load(base[:, None] + 4 + (e % 16)[None, :])
    shift = ((e // 16) * 4).to(tl.uint8)
    q = ((byte >> shift[None, :]) & 0xF).to(tl.float32)
    # 3. value = d * q + m (two roundings, as in the reference: contraction is off at launch)
    out = d[:, None] * q + m[:, None]
    tl.store(out_ptr + blk.to(tl.int64)[:, None] * 32 + e[None, :], out, mask=keep[:, None])


_KERNELS = {Q8_0: _dequant_q8_0_kernel, Q4_1: _dequant_q4_1_kernel}


def dequantize_blocks(raw: torch.Tensor, qtype: int, *, blocks_per_program: int | None = None) -> torch.Tensor:
    """Dequantize GGUF blocks with a Triton kernel; returns float32 values ``(n_blocks * 32,)``.

    ``raw``: uint8 tensor of whole blocks on the kernel device, contiguous (any shape whose last
    dimension is a multiple of the block size in bytes, e.g. ``(rows, bytes_per_row)``).
    ``qtype``: ``quants.Q8_0`` or ``quants.Q4_1``.
    """
    qtype = int(qtype)
    if qtype not in _KERNELS:
        raise ValueError(f"qtype must be Q8_0 ({Q8_0}) or Q4_1 ({Q4_1}), got {qtype}")
    require_tensor("raw", raw, dtypes=(torch.uint8,))
    if not raw.is_contiguous():
        raise ValueError("raw must be contiguous (the kernel walks the bytes block after block)")
    per_block = BLOCK[qtype][1]
    if raw.numel() == 0 or raw.numel() % per_block or (raw.ndim > 0 and raw.shape[-1] % per_block):
        raise ValueError(
            f"raw must hold whole {TYPE_NAMES[qtype]} blocks of {per_block} bytes (per row), got shape {tuple(raw.shape)}"
        )
    if blocks_per_program is None:
        # the interpreter pays per program, a GPU wants many programs in flight
        blocks_per_program = 4096 if runtime.interpreting() else 64
    require_power_of_two("blocks_per_program", blocks_per_program)
    n_blocks = raw.numel() // per_block
    require_positive("n_blocks", n_blocks, integer=True)
    out = torch.empty(n_blocks * 32, dtype=torch.float32, device=raw.device)
    grid = (triton.cdiv(n_blocks, blocks_per_program),)
    _KERNELS[qtype][grid](raw, out, n_blocks, BLOCKS=blocks_per_program, enable_fp_fusion=False)
    return out
