"""Module 10's number formats: integers with scales (and zero points), packed int4, FP8.

A weight matrix ``W`` ``(N, K)`` (``N`` outputs, ``K`` inputs, the layout of ``nn.Linear``) is
stored as small integer *codes* ``q`` and a few floats per group of ``G`` consecutive inputs of a
row::

    w ≈ (q - z) * s          q in 0 .. 2^bits - 1 (unsigned codes), one s and one z per group

- *asymmetric*: ``s = (max - min) / (2^bits - 1)``, ``z = round(-min / s)``: the group's range
  ``[min, max]`` maps onto every code, zero included exactly;
- *symmetric*: ``z = 2^(bits-1)`` for every group (codes are signed numbers shifted up) and
  ``s = absmax / (2^(bits-1) - 1)``: one float per group, and ``0`` is exact; one code (the lowest)
  is never used.

``granularity`` says what a group is: ``"tensor"`` (one scale for the whole matrix),
``"channel"`` (one per output row: ``G = K``) or ``"group"`` (``G = group_size`` inputs of a row,
32 to 128 in practice). Smaller groups follow the weights more closely and cost more floats:
``bits + 2 * 16 / G`` bits per weight with fp16 scales and zeros.

Storage for the kernels (``llmu.quant.kernels``): codes ``(N, K)`` uint8, or, for 4 bits and
below, packed two per byte along ``K`` (:func:`pack_int4`: element ``2j`` in the low nibble,
``2j + 1`` in the high one, ``(N, K / 2)`` uint8); scales and zeros ``(N, K / G)`` float32 (for
``"tensor"``/``"channel"``, ``K / G`` is 1 and a tensor scale is repeated over the rows).

FP8 (:func:`to_fp8`): torch's ``float8_e4m3fn`` (4 exponent bits, 3 mantissa bits, max 448, no
infinity) and ``float8_e5m2`` (5 and 2, max 57344, IEEE-like), after dividing by a scale that maps
the tensor's (or each row's) largest magnitude to the format's largest finite value.

GGUF blocks (:func:`from_gguf`): the course's model file stores its matrices in llama.cpp's block
formats (``llmu.models.quants``), which are this same format with ``G = 32``:

- Q8_0, ``w = d * q`` with ``q`` int8: symmetric 8-bit, ``s = d``, codes ``q + 128``, ``z = 128``;
- Q4_1, ``w = d * q + m`` with ``q`` in 0..15: asymmetric 4-bit, ``s = d``, ``z = -m / d``.

Q4_1's minimum ``m`` is any float16, so ``-m / d`` is in general *not* an integer (and rounding it
would move every value of the block). ``zero`` is therefore kept as a float32, and the converted
tensor also keeps ``m`` itself as ``offset`` (an optional ``(N, K / G)`` field): :func:`dequantize`
then computes ``q * s + offset`` in float32, in the order the file's own dequantizer uses, so the
values are equal bit for bit to ``llmu.models.quants.dequantize``. ``(q - z) * s`` with the float
``z`` stands for the same number up to float32 rounding (a few ulps), which is what a kernel that
reads ``scale`` and ``zero`` computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "BITS", "GRANULARITIES", "FP8_FORMATS", "QuantizedTensor", "quant_params", "quantize", "dequantize",
    "quantize_minmax", "fake_quantize", "pack_int4", "unpack_int4", "to_fp8", "from_fp8", "check_weight", "from_gguf",
    "representable_values", "VALUE_FORMATS",
]

#: Bit widths of the integer formats.
BITS = (2, 3, 4, 8)
GRANULARITIES = ("tensor", "channel", "group")
FP8_FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def check_weight(w: torch.Tensor, name: str = "w") -> torch.Tensor:
    """A 2-D floating-point weight matrix ``(N, K)`` with finite values."""
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(w).__name__}")
    if w.ndim != 2:
        raise ValueError(f"{name} must be a 2-D weight matrix (out_features, in_features), got shape {tuple(w.shape)}")
    if not w.is_floating_point() or w.dtype in FP8_FORMATS.values():
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {w.dtype}")
    if w.numel() == 0:
        raise ValueError(f"{name} is empty")
    if not torch.isfinite(w).all():
        raise ValueError(f"{name} holds inf or nan: nothing finite can be quantized from it")
    return w


def _check_format(bits, granularity, group_size, k: int) -> int:
    """Validate the format; return the group size G (the inputs that share a scale)."""
    if isinstance(bits, bool) or bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits!r}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    if granularity != "group":
        return k
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if k % group_size:
        fits = [d for d in (16, 32, 48, 64, 96, 128, 192, 256) if k % d == 0]
        raise ValueError(f"group_size {group_size} does not divide the input dimension {k} "
                         f"(divisors of {k} that make good groups: {', '.join(map(str, fits)) or 'none; use channel'})")
    return group_size


def quant_params(w: torch.Tensor, bits: int, *, symmetric: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point per row of ``w`` (``(R, G)``: each row one group): two ``(R, 1)`` float32.

    A group whose values are all equal gets a scale from its magnitude (or 1 when it is all
    zeros), never a zero scale: ``q = w / s`` must stay finite.
    """
    w = w.float()
    maxq = 2**bits - 1
    if symmetric:
        half = 2 ** (bits - 1)
        absmax = w.abs().amax(dim=1, keepdim=True)
        scale = absmax / (half - 1) if bits > 1 else absmax
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        zero = torch.full_like(scale, float(half))
        return scale, zero
    lo = w.amin(dim=1, keepdim=True).clamp(max=0)  # the range always contains 0: zero is exact
    hi = w.amax(dim=1, keepdim=True).clamp(min=0)
    scale = (hi - lo) / maxq
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.round(-lo / scale).clamp(0, maxq)
    return scale, zero


@dataclass
class QuantizedTensor:
    """Codes, scales and zero points of a quantized ``(N, K)`` matrix (see the module docstring)."""

    codes: torch.Tensor  # (N, K) uint8, unpacked
    scale: torch.Tensor  # (N, K // G) float32
    zero: torch.Tensor  # (N, K // G) float32 (2^(bits-1) everywhere when symmetric)
    bits: int
    group_size: int
    symmetric: bool
    granularity: str
    dtype: torch.dtype = torch.float32  # the dtype dequantize() returns
    offset: torch.Tensor | None = None  # (N, K // G) float32: GGUF Q4_1's m (w = q * s + offset), else None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def nbytes(self) -> int:
        """Storage with codes packed to ``bits`` per weight and fp16 scales (and zeros when asymmetric)."""
        n, k = self.shape
        code_bytes = n * k * self.bits / 8
        groups = 1 if self.granularity == "tensor" else self.scale.numel()
        return int(code_bytes + groups * 2 * (1 if self.symmetric else 2))

    def packed(self) -> torch.Tensor:
        """The codes two per byte (4 bits and below) as the kernels read them, else the codes."""
        return pack_int4(self.codes) if self.bits <= 4 else self.codes

    def validate(self, name: str = "qt") -> QuantizedTensor:
        """Check that the fields fit together (shapes, dtypes, code range, finite nonzero scales)."""
        if self.bits not in BITS or isinstance(self.bits, bool):
            raise ValueError(f"{name}.bits must be one of {BITS}, got {self.bits!r}")
        if self.granularity not in GRANULARITIES:
            raise ValueError(f"{name}.granularity must be one of {GRANULARITIES}, got {self.granularity!r}")
        if not isinstance(self.codes, torch.Tensor) or self.codes.dtype != torch.uint8 or self.codes.ndim != 2:
            raise TypeError(f"{name}.codes must be a 2-D uint8 tensor, got "
                            f"{getattr(self.codes, 'dtype', type(self.codes).__name__)}")
        n, k = self.codes.shape
        g = self.group_size
        if isinstance(g, bool) or not isinstance(g, int) or g < 1 or k % g:
            raise ValueError(f"{name}.group_size {g!r} does not divide the input dimension {k}")
        for field in ("scale", "zero") + (("offset",) if self.offset is not None else ()):
            t = getattr(self, field)
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
                raise TypeError(f"{name}.{field} must be a float32 tensor, got {getattr(t, 'dtype', type(t).__name__)}")
            if tuple(t.shape) != (n, k // g):
                raise ValueError(f"{name}.{field} must have shape {(n, k // g)}, got {tuple(t.shape)}")
            if not torch.isfinite(t).all():
                raise ValueError(f"{name}.{field} holds inf or nan")
        if (self.scale == 0).any():
            raise ValueError(f"{name}.scale holds zeros: every group needs a nonzero scale (w / s must be finite)")
        if self.codes.numel() and int(self.codes.max()) > 2**self.bits - 1:
            raise ValueError(f"{name}.codes exceed the {self.bits}-bit range 0..{2**self.bits - 1}")
        return self


def quantize(w: torch.Tensor, bits: int = 4, *, symmetric: bool = False, granularity: str = "group",
             group_size: int = 128) -> QuantizedTensor:
    """Round-to-nearest quantization of ``w`` ``(N, K)``; ``w`` itself is not modified."""
    check_weight(w)
    n, k = w.shape
    g = _check_format(bits, granularity, group_size, k)
    groups = w.detach().float().reshape(n * k // g, g) if granularity != "tensor" else w.detach().float().reshape(1, -1)
    scale, zero = quant_params(groups, bits, symmetric=symmetric)
    codes = torch.clamp(torch.round(groups / scale) + zero, 0, 2**bits - 1)
    if granularity == "tensor":
        scale, zero = scale.expand(n, 1), zero.expand(n, 1)
    return QuantizedTensor(codes.to(torch.uint8).reshape(n, k), scale.reshape(n, k // g).contiguous(),
                           zero.reshape(n, k // g).contiguous(), bits, g, symmetric, granularity, w.dtype)


def quantize_minmax(w: torch.Tensor, bits: int = 4, *, group_size: int = 32) -> QuantizedTensor:
    """Round-to-nearest onto each group's own range: ``w ≈ q * s + m`` with ``m`` the group's minimum
    and ``s = (max - m) / (2^bits - 1)``, GGUF Q4_1's rounding (the module's docstring).

    Unlike :func:`quantize`'s asymmetric format, the range need not contain 0 and ``m`` is any float
    (kept as ``offset``; ``zero = -m / s`` is not an integer): every code lands inside the group's
    values, so the grid is finer whenever a group's values are all of one sign or off-centre. The
    price is a float zero point, which integer kernels of the ``(q - z) * s`` form cannot use
    directly. A group whose values are all equal gets ``s = 1`` (its codes are all 0).
    """
    check_weight(w)
    n, k = w.shape
    g = _check_format(bits, "group", group_size, k)
    groups = w.detach().float().reshape(n, k // g, g)
    lo, hi = groups.amin(-1), groups.amax(-1)
    scale = (hi - lo) / (2**bits - 1)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.clamp(torch.round((groups - lo[..., None]) / scale[..., None]), 0, 2**bits - 1)
    return QuantizedTensor(codes.to(torch.uint8).reshape(n, k), scale.contiguous(), (-lo / scale).contiguous(), bits,
                           g, False, "group", w.dtype, offset=lo.contiguous())


def dequantize(qt: QuantizedTensor) -> torch.Tensor:
    """``(q - z) * s`` group by group: the ``(N, K)`` matrix the codes stand for, in ``qt.dtype``."""
    n, k = qt.shape
    g = qt.group_size
    if k % g:
        raise ValueError(f"qt.group_size {g} does not divide the input dimension {k}")
    q = qt.codes.float().reshape(n, k // g, g)
    if qt.offset is not None:  # GGUF Q4_1: q * d + m, rounded after each step like the file's dequantizer
        w = q * qt.scale[..., None] + qt.offset[..., None]
    else:
        w = (q - qt.zero[..., None]) * qt.scale[..., None]
    return w.reshape(n, k).to(qt.dtype)


def fake_quantize(w: torch.Tensor, bits: int = 4, **fmt) -> torch.Tensor:
    """``dequantize(quantize(w, ...))``: the weights a quantized model actually computes with."""
    return dequantize(quantize(w, bits, **fmt))


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte along the last dimension: ``out[..., j] = c[2j] | c[2j+1] << 4``."""
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        raise TypeError(f"codes must be a uint8 tensor, got {getattr(codes, 'dtype', type(codes).__name__)}")
    if codes.shape[-1] % 2:
        raise ValueError(f"the last dimension must be even to pack two codes per byte, got {codes.shape[-1]}")
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError(f"int4 codes must be in 0..15, got a maximum of {int(codes.max())}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_int4`: ``(..., K / 2)`` bytes to ``(..., K)`` codes in 0..15."""
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        raise TypeError(f"packed must be a uint8 tensor, got {getattr(packed, 'dtype', type(packed).__name__)}")
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def to_fp8(w: torch.Tensor, fmt: str = "e4m3", *, granularity: str = "tensor") -> tuple[torch.Tensor, torch.Tensor]:
    """``w / scale`` rounded to an FP8 format, and the float32 scale (``(1, 1)`` or ``(N, 1)``).

    The scale maps the largest magnitude (of the tensor, or of each row with
    ``granularity="channel"``) to the format's largest finite value, so nothing overflows.
    """
    check_weight(w)
    if fmt not in FP8_FORMATS:
        raise ValueError(f"fmt must be one of {sorted(FP8_FORMATS)}, got {fmt!r}")
    if granularity not in ("tensor", "channel"):
        raise ValueError(f"granularity must be 'tensor' or 'channel' for FP8, got {granularity!r}")
    dtype = FP8_FORMATS[fmt]
    wf = w.detach().float()
    absmax = wf.abs().amax() if granularity == "tensor" else wf.abs().amax(dim=1)
    absmax = absmax.reshape(-1, 1)
    scale = absmax / torch.finfo(dtype).max
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (wf / scale).to(dtype), scale


def from_fp8(w8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values an FP8 tensor and its scale stand for."""
    return (w8.float() * scale).to(dtype)


# ----------------------------------------------------------------------------------------------
# GGUF blocks as QuantizedTensors
# ----------------------------------------------------------------------------------------------


def from_gguf(raw, qtype: int | None = None, shape=None) -> QuantizedTensor:
    """A GGUF Q4_1 or Q8_0 tensor as a :class:`QuantizedTensor` (group size 32), nothing rounded.

    ``raw``: a ``GGUFTensor`` (``GGUFFile().tensor(name)``), or its stored bytes (uint8, blocks)
    with ``qtype`` (the ggml type id) and ``shape`` (torch order ``(N, K)``).

    - Q8_0 -> 8-bit symmetric: ``codes = q + 128``, ``zero = 128``, ``scale = d``;
    - Q4_1 -> 4-bit asymmetric: ``codes = q``, ``scale = d``, ``zero = -m / d`` (a float, see the
      module docstring) and ``offset = m``, so that :func:`dequantize` is bit for bit the file's.

    A block whose ``d`` is 0 (all its values equal) gets scale ``|m|`` (1 for Q8_0 or ``m = 0``),
    codes 0 and ``zero = -m / scale``: the same values, and no zero scale.
    """
    from llmu.models import quants

    if hasattr(raw, "raw") and hasattr(raw, "qtype"):  # a GGUFTensor
        qtype = raw.qtype if qtype is None else qtype
        shape = raw.shape if shape is None else shape
        raw = raw.raw
    if qtype is None or shape is None:
        raise ValueError("qtype and shape are needed when raw is a tensor of bytes (or pass a GGUFTensor)")
    qtype = int(qtype)
    if qtype not in (quants.Q4_1, quants.Q8_0):
        raise ValueError(f"qtype must be Q4_1 ({quants.Q4_1}) or Q8_0 ({quants.Q8_0}), got {qtype}")
    if isinstance(raw, np.ndarray):
        raw = torch.from_numpy(np.ascontiguousarray(raw))
    shape = tuple(int(d) for d in shape)
    if len(shape) != 2 or shape[1] % 32:
        raise ValueError(f"shape must be (N, K) with K a multiple of 32 (the block), got {shape}")
    n, k = shape
    blocks = quants._as_blocks(raw.contiguous(), qtype)  # (n * k / 32, bytes per block)
    if blocks.shape[0] != n * k // 32:
        raise ValueError(f"raw holds {blocks.shape[0]} blocks, a {shape} tensor needs {n * k // 32}")
    halves = blocks.view(torch.float16)
    d = halves[:, 0].float()
    if qtype == quants.Q8_0:
        q = blocks[:, 2:].contiguous().view(torch.int8).to(torch.int16) + 128  # -128..127 -> 0..255
        codes = q.to(torch.uint8)
        flat = d == 0
        codes[flat] = 128  # (q - 128) * 1 = 0 = d * q
        scale = torch.where(flat, torch.ones_like(d), d)
        zero = torch.full_like(scale, 128.0)
        return QuantizedTensor(codes.reshape(n, k), scale.reshape(n, k // 32), zero.reshape(n, k // 32),
                               8, 32, True, "group", torch.float32)
    m = halves[:, 1].float()
    packed = blocks[:, 4:].contiguous()  # byte j: element j (low nibble) and element j + 16 (high)
    codes = torch.cat([packed & 0x0F, packed >> 4], dim=1)  # (blocks, 32) in element order
    flat = d == 0
    codes[flat] = 0
    scale = torch.where(flat, torch.where(m != 0, m.abs(), torch.ones_like(m)), d)
    zero = -m / scale
    return QuantizedTensor(codes.reshape(n, k), scale.reshape(n, k // 32), zero.reshape(n, k // 32),
                           4, 32, False, "group", torch.float32, offset=m.reshape(n, k // 32).clone())


# ----------------------------------------------------------------------------------------------
# The values each format can hold (for the notebook's number-line plot)
# ----------------------------------------------------------------------------------------------

#: Formats :func:`representable_values` knows.
VALUE_FORMATS = ("int8", "int4", "e4m3", "e5m2", "bf16", "fp16")


def representable_values(fmt: str) -> torch.Tensor:
    """Every finite value of ``fmt``, sorted, as float64 (one ``-0.0``/``0.0`` kept as ``0.0``).

    ``"int8"``/``"int4"``: the signed integers ``-2^(b-1) .. 2^(b-1) - 1`` (multiply by a scale for
    the weights they stand for); ``"e4m3"``/``"e5m2"``: torch's FP8 types (every bit pattern);
    ``"bf16"``/``"fp16"``: the 16-bit floats (65,536 patterns). Integers are evenly spaced; floats
    are dense near zero and sparse far from it, with the same relative spacing in every binade.
    """
    if fmt == "int8":
        return torch.arange(-128, 128, dtype=torch.float64)
    if fmt == "int4":
        return torch.arange(-8, 8, dtype=torch.float64)
    dtypes = {"e4m3": FP8_FORMATS["e4m3"], "e5m2": FP8_FORMATS["e5m2"], "bf16": torch.bfloat16,
              "fp16": torch.float16}
    if fmt not in dtypes:
        raise ValueError(f"fmt must be one of {VALUE_FORMATS}, got {fmt!r}")
    dtype = dtypes[fmt]
    bits = torch.empty((), dtype=dtype).element_size() * 8
    patterns = torch.arange(2**bits, dtype=torch.int32)
    as_int = (patterns - 2**bits * (patterns >= 2 ** (bits - 1))).to(torch.int8 if bits == 8 else torch.int16)
    values = as_int.view(dtype).double()
    values = values[torch.isfinite(values)]
    return torch.unique(values + 0.0)  # + 0.0 turns -0.0 into 0.0; unique sorts
