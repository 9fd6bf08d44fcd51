"""GGUF block quantization, undone in torch: Q8_0 and Q4_1.

A GGUF file stores most weight matrices in *blocks* of 32 consecutive values of a row. Each block
keeps one or two float16 numbers for the whole block and a small integer per value; the float of
element ``i`` is rebuilt from its integer and the block's floats. Two formats matter for the course's
model (SmolLM2-135M as shipped in Q4_1):

Q8_0 (34 bytes per 32 values, 8.5 bits per value)::

    bytes 0..1   d        float16 scale
    bytes 2..33  q[0..31] int8
    value[i] = d * q[i]

Q4_1 (20 bytes per 32 values, 5 bits per value)::

    bytes 0..1   d        float16 scale
    bytes 2..3   m        float16 minimum (offset)
    bytes 4..19  16 bytes, two 4-bit codes each:
                 the LOW nibble of byte j is element j       (j = 0..15)
                 the HIGH nibble of byte j is element j + 16
    value[i] = d * q[i] + m            with q[i] in 0..15

Q8_0 is symmetric (zero is exactly representable); Q4_1 is asymmetric: its 16 levels span
``[m, m + 15 d]``, the range of the block. Note the nibble order: the two halves of the block, not
neighbouring elements, share a byte.

The arithmetic is done in float32 in the same order as the ``gguf`` package's numpy reference
(``d * q`` rounded, then ``+ m`` rounded), so the results are equal bit for bit, which the tests
check on the real model's tensors.
"""

from __future__ import annotations

import numpy as np
import torch

from llmu.checks import require_tensor

#: ggml type ids (``enum ggml_type`` in ggml.h) of the formats llmu reads.
F32, F16, Q4_1, Q8_0, BF16 = 0, 1, 3, 8, 30

#: ggml type id -> (values per block, bytes per block)
BLOCK = {Q4_1: (32, 20), Q8_0: (32, 34)}

TYPE_NAMES = {F32: "F32", F16: "F16", Q4_1: "Q4_1", Q8_0: "Q8_0", BF16: "BF16"}


def _as_blocks(raw: torch.Tensor, qtype: int, name: str = "raw") -> torch.Tensor:
    """View ``raw`` (uint8, any shape) as ``(n_blocks, bytes_per_block)``."""
    require_tensor(name, raw, dtypes=(torch.uint8,), device=None)
    per_block = BLOCK[qtype][1]
    if raw.numel() % per_block:
        raise ValueError(
            f"{name} holds {raw.numel()} bytes, not a whole number of {TYPE_NAMES[qtype]} blocks of {per_block} bytes"
        )
    return raw.reshape(-1, per_block)


def dequantize_q8_0(raw: torch.Tensor) -> torch.Tensor:
    """Q8_0 blocks (uint8) -> float32 values, ``(n_blocks * 32,)``."""
    blocks = _as_blocks(raw, Q8_0)
    d = blocks.view(torch.float16)[:, 0:1].float()  # (n, 1) scale: bytes 0..1 read as float16
    q = blocks[:, 2:].contiguous().view(torch.int8).float()  # (n, 32) codes in -128..127
    return q.mul_(d).reshape(-1)  # q * d


def dequantize_q4_1(raw: torch.Tensor) -> torch.Tensor:
    """Q4_1 blocks (uint8) -> float32 values, ``(n_blocks * 32,)``."""
    blocks = _as_blocks(raw, Q4_1)
    halves = blocks.view(torch.float16)  # (n, 10): the block's bytes read two by two
    d = halves[:, 0:1].float()  # (n, 1) scale, bytes 0..1
    m = halves[:, 1:2].float()  # (n, 1) minimum, bytes 2..3
    packed = blocks[:, 4:].contiguous()  # (n, 16): byte j holds elements j and j + 16
    q = torch.stack([packed & 0x0F, packed >> 4], dim=1)  # (n, 2, 16): low nibbles, then high
    q = q.reshape(-1, 32).float()  # (n, 32) codes in 0..15, in element order
    return q.mul_(d).add_(m).reshape(-1)  # d * q + m, rounded after each step


def dequantize(raw, qtype: int, shape=None) -> torch.Tensor:
    """Turn one GGUF tensor's stored bytes into float32 values.

    ``raw``: the tensor's data as stored (a uint8 torch tensor or numpy array of blocks for the
    quantized types; float arrays are accepted for F32/F16/BF16). ``qtype``: the ggml type id (an
    int or ``gguf.GGMLQuantizationType``). ``shape``: the logical shape in torch order
    (rows, columns); defaults to ``(-1, row_length)`` as far as it can be inferred, else flat.
    """
    qtype = int(qtype)
    if isinstance(raw, np.ndarray):
        raw = torch.from_numpy(np.ascontiguousarray(raw))
    if not isinstance(raw, torch.Tensor):
        raise TypeError(f"raw must be a torch.Tensor or numpy array, got {type(raw).__name__}")
    if qtype == F32:
        out = raw.contiguous().view(torch.float32) if raw.dtype == torch.uint8 else raw.float()
    elif qtype == F16:
        out = (raw.contiguous().view(torch.float16) if raw.dtype == torch.uint8 else raw.to(torch.float16)).float()
    elif qtype == BF16:
        out = (raw.contiguous().view(torch.bfloat16) if raw.dtype == torch.uint8 else raw.to(torch.bfloat16)).float()
    elif qtype == Q8_0:
        out = dequantize_q8_0(raw)
    elif qtype == Q4_1:
        out = dequantize_q4_1(raw)
    else:
        raise NotImplementedError(f"llmu dequantizes F32, F16, BF16, Q8_0 and Q4_1; got ggml type {qtype}")
    if shape is not None:
        return out.reshape(tuple(shape))
    if raw.ndim == 2 and qtype in BLOCK:
        return out.reshape(raw.shape[0], -1)
    return out.reshape(raw.shape) if raw.dtype != torch.uint8 else out


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """float values (a multiple of 32) -> Q8_0 blocks, as ggml rounds them (for tests and demos)."""
    x = x.float().reshape(-1, 32)
    amax = x.abs().amax(dim=1, keepdim=True)
    d = amax / 127
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(x * inv).clamp(-128, 127).to(torch.int8)
    d16 = d.to(torch.float16)
    return torch.cat([d16.view(torch.uint8), q.view(torch.uint8)], dim=1).contiguous()


def quantize_q4_1(x: torch.Tensor) -> torch.Tensor:
    """float values (a multiple of 32) -> Q4_1 blocks: 16 levels spanning each block's [min, max]."""
    x = x.float().reshape(-1, 32)
    lo = x.amin(dim=1, keepdim=True)
    hi = x.amax(dim=1, keepdim=True)
    d = (hi - lo) / 15
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round((x - lo) * inv).clamp(0, 15).to(torch.uint8)
    packed = q[:, :16] | (q[:, 16:] << 4)
    head = torch.cat([d.to(torch.float16).view(torch.uint8), lo.to(torch.float16).view(torch.uint8)], dim=1)
    return torch.cat([head, packed], dim=1).contiguous()
