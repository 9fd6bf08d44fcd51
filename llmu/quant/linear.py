"""The quantized linear layer: a drop-in for ``llmu.models.Linear`` that stores codes and scales.

``QuantLinear`` keeps a :class:`~llmu.quant.formats.QuantizedTensor` (codes, scales, zeros) instead
of a float weight matrix and computes ``y = x W^T + b`` with ``W = dequantize(qt)``. *Weight-only*
quantization: the activations ``x`` stay in floating point; only the weights shrink, which is what
makes decoding faster (every decoded token reads every weight once, so fewer bytes per weight means
fewer bytes moved per token) as long as the matmul reads the small codes and never writes out the
float matrix.

How ``forward`` computes, first match wins (``last_path`` records which one ran):

1. ``"kernel int4"`` / ``"kernel int8"``: on a CUDA tensor, the Triton kernels of
   ``llmu.quant.kernels`` (imported on first use; skipped when absent), which unpack the codes in
   registers and never materialise ``W``;
2. ``"int8pack"``: 8-bit symmetric per-channel weights (one scale per output row) with an activation
   dtype PyTorch's built-in ``aten._weight_int8pack_mm`` runs fast (bf16 on CPU; the op gpt-fast uses
   for int8 weight-only). On CPU it also accepts float16 and float32 but runs a scalar loop for them,
   ten times slower than ``F.linear``, so they take path 3;
3. ``"int8 scaled"``: the same weights with any other activations: a per-row scale comes out of the dot
   product, ``y_n = s_n * (x . q_n)``, so the int8 codes are cast to float (no subtract, no multiply)
   and the scale is applied to the ``N`` outputs instead of the ``N x K`` weights;
4. ``"dequantize"``: everything else: ``F.linear(x, dequantize(qt))`` — correct for every format,
   and as slow as it sounds (it writes the whole float matrix on every call). ``cache=True`` keeps
   the dequantized matrix (fast, and as big as the float layer it replaced: for experiments only).

AWQ's unfused form: ``input_scale`` ``(K,)`` multiplies ``x`` before the matmul, so the layer computes
``(x * input_scale) W'^T`` where ``W'`` is the quantized weight (see ``llmu.quant.awq``, which sets
it when the scale cannot be folded into the previous operation).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmu.quant.formats import QuantizedTensor, dequantize, pack_int4, quantize

__all__ = ["QuantLinear", "int8pack_available"]

#: Activation dtypes for which ``aten._weight_int8pack_mm`` is fast, per device type (measured on CPU:
#: bf16 runs a vectorised kernel, float16 and float32 a scalar loop ten times slower than F.linear).
INT8PACK_FAST = {"cpu": (torch.bfloat16,), "cuda": (torch.bfloat16, torch.float16)}


def int8pack_available(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether PyTorch's int8 weight-only matmul has a kernel for ``device`` here (not every build has a
    CUDA one) and is fast for ``dtype`` activations."""
    device = torch.device(device)
    if dtype not in INT8PACK_FAST.get(device.type, ()) or getattr(torch.ops.aten, "_weight_int8pack_mm", None) is None:
        return False
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key("aten::_weight_int8pack_mm", device.type.upper())
    except (AttributeError, RuntimeError):  # a torch without the query: trust the op's presence
        return True


def _kernels():
    """``llmu.quant.kernels`` or None when it is not there (the Triton kernels are optional)."""
    try:
        from llmu.quant import kernels
    except ModuleNotFoundError as exc:
        if exc.name not in ("llmu.quant.kernels", "triton"):
            raise
        return None
    return kernels


class QuantLinear(nn.Module):
    """``y = x dequantize(qt)^T + bias``, storing only the codes, scales and zeros of ``qt``.

    >>> layer = QuantLinear.from_linear(model.layers[0].mlp.up_proj, bits=4, group_size=64)  # doctest: +SKIP

    ``qt``: the quantized ``(out_features, in_features)`` weight. ``bias``: ``(out_features,)`` or
    None. ``input_scale``: ``(in_features,)`` or None; when set, ``x * input_scale`` is what meets
    the weights. ``cache``: keep the dequantized weight after the first call (see module docstring).
    The tensors are buffers: ``.to(device)`` moves them and ``state_dict`` holds them.
    """

    def __init__(self, qt: QuantizedTensor, bias: torch.Tensor | None = None, *,
                 input_scale: torch.Tensor | None = None, cache: bool = False):
        super().__init__()
        if not isinstance(qt, QuantizedTensor):
            raise TypeError(f"qt must be a QuantizedTensor, got {type(qt).__name__}")
        qt.validate("qt")
        n, k = qt.shape
        self.out_features, self.in_features = n, k
        self.bits, self.group_size, self.symmetric = qt.bits, qt.group_size, qt.symmetric
        self.granularity, self.dtype = qt.granularity, qt.dtype
        self.register_buffer("codes", qt.codes)
        self.register_buffer("scale", qt.scale)
        self.register_buffer("zero", qt.zero)
        self.register_buffer("offset", qt.offset)
        for name, t, size in (("bias", bias, n), ("input_scale", input_scale, k)):
            if t is not None:
                if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                    raise TypeError(f"{name} must be a floating-point tensor, got "
                                    f"{getattr(t, 'dtype', type(t).__name__)}")
                if tuple(t.shape) != (size,):
                    raise ValueError(f"{name} must have shape ({size},), got {tuple(t.shape)}")
                if not torch.isfinite(t).all():
                    raise ValueError(f"{name} holds inf or nan")
                if name == "input_scale" and (t == 0).any():
                    raise ValueError("input_scale holds zeros: it would erase input channels")
                t = t.detach().clone()
            self.register_buffer(name, t)
        self.cache = bool(cache)
        # the int8 form of symmetric per-channel 8-bit codes (q - 128 as int8, the stored bits with
        # the top one flipped): what aten._weight_int8pack_mm and the int8 kernel read
        int8_rows = qt.bits == 8 and qt.symmetric and qt.offset is None and qt.group_size == k
        self.register_buffer("_codes_i8", (qt.codes ^ 0x80).view(torch.int8) if int8_rows else None,
                             persistent=False)
        self.register_buffer("_packed", None, persistent=False)
        self.register_buffer("_weight", None, persistent=False)
        self.last_path: str | None = None

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_linear(cls, linear: nn.Module, bits: int = 4, **fmt) -> QuantLinear:
        """Round-to-nearest quantization of a ``Linear``'s weight (``fmt``: ``symmetric``,
        ``granularity``, ``group_size``, as :func:`~llmu.quant.formats.quantize`); the linear's
        own weight is read, never modified."""
        weight = getattr(linear, "weight", None)
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"linear must have a weight tensor, got {type(linear).__name__}")
        bias = getattr(linear, "bias", None)
        return cls(quantize(weight.detach(), bits, **fmt), None if bias is None else bias.detach())

    @property
    def qt(self) -> QuantizedTensor:
        """The stored weight as a :class:`QuantizedTensor` (views of the buffers)."""
        return QuantizedTensor(self.codes, self.scale, self.zero, self.bits, self.group_size, self.symmetric,
                               self.granularity, self.dtype, offset=self.offset)

    def dequantized(self) -> torch.Tensor:
        """The ``(out_features, in_features)`` float weight the codes stand for (in ``qt.dtype``)."""
        return dequantize(self.qt)

    @property
    def nbytes(self) -> int:
        """Bytes of the weight as stored (codes packed to ``bits``, fp16 scales/zeros), plus bias and
        input scale at their own dtypes. Caches (``cache=True``, the int8 view) are not counted; a
        GGUF Q4_1 weight counts two fp16 per block (its ``d`` and ``m``; ``zero`` is derived)."""
        extra = sum(t.numel() * t.element_size() for t in (self.bias, self.input_scale) if t is not None)
        return self.qt.nbytes + extra

    # -- forward --------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise TypeError(f"x must be a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}")
        if x.ndim == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"x must end in in_features={self.in_features}, got shape {tuple(x.shape)}")
        if self.input_scale is not None:
            x = x * self.input_scale.to(x.dtype)
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        y = self._matmul(x2)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x (M, K) @ W^T`` by the first path that applies (module docstring)."""
        if x.is_cuda and not self.cache:
            y = self._kernel_matmul(x)
            if y is not None:
                return y.to(x.dtype)
        if self._codes_i8 is not None and not self.cache:
            if int8pack_available(x.device, x.dtype):
                self.last_path = "int8pack"
                return torch.ops.aten._weight_int8pack_mm(x.contiguous(), self._codes_i8,
                                                          self.scale[:, 0].to(x.dtype))
            self.last_path = "int8 scaled"  # codes up to 127 are exact in bf16 and fp16 too
            return F.linear(x, self._codes_i8.to(x.dtype)) * self.scale[:, 0].to(x.dtype)
        self.last_path = "dequantize"
        if self.cache:
            if self._weight is None or self._weight.dtype != x.dtype or self._weight.device != x.device:
                self._weight = self.dequantized().to(device=x.device, dtype=x.dtype)
            return F.linear(x, self._weight)
        return F.linear(x, self.dequantized().to(x.dtype))

    def _kernel_matmul(self, x: torch.Tensor) -> torch.Tensor | None:
        """The Triton kernels, when ``llmu.quant.kernels`` is there and takes this input; else None."""
        kernels = _kernels()
        if kernels is None or self.offset is not None:
            return None
        try:
            if self.bits == 4 and hasattr(kernels, "int4_matmul"):
                if self._packed is None:
                    self._packed = pack_int4(self.codes)
                y = kernels.int4_matmul(x.contiguous(), self._packed, self.scale, self.zero, self.group_size)
                self.last_path = "kernel int4"
                return y
            if self._codes_i8 is not None and hasattr(kernels, "int8_matmul"):
                y = kernels.int8_matmul(x.contiguous(), self._codes_i8, self.scale[:, 0].contiguous())
                self.last_path = "kernel int8"
                return y
        except (ValueError, TypeError):  # a launcher that refuses this input (dtype, shape): torch does it
            return None
        return None

    def extra_repr(self) -> str:
        fmt = f"bits={self.bits}, {'symmetric' if self.symmetric else 'asymmetric'}, granularity={self.granularity}"
        if self.granularity == "group":
            fmt += f", group_size={self.group_size}"
        return (f"in_features={self.in_features}, out_features={self.out_features}, {fmt}, "
                f"bias={self.bias is not None}, input_scale={self.input_scale is not None}, nbytes={self.nbytes}")
