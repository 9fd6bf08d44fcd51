"""Module 10: quantization — integer and FP8 formats, the quantized linear layer, RTN/GPTQ/AWQ.

- ``formats``: ``w ≈ (q - z) * s`` per group, packing, FP8, GGUF Q4_1/Q8_0 as quantized tensors;
- ``linear``: :class:`QuantLinear`, a drop-in for the model's ``Linear``;
- ``apply``: :func:`quantize_model` (a quantized copy of a model), :func:`model_nbytes`, and
  :func:`from_gguf_model` (the model on the file's own Q4_1 blocks);
- ``gptq`` / ``awq`` / ``calibration``: the data-aware methods; ``kernels``: Triton int4/int8 matmuls;
- ``outliers``: activation outliers measured on the model, and why they defeat per-tensor scales;
- ``bench`` / ``bench_kernels``: int8 weight-only decoding against float32 on the real model; the
  kernels against bf16 matmuls.
"""

from llmu.quant.apply import METHODS, from_gguf_model, model_nbytes, quantize_model, quantized_layers
from llmu.quant.formats import (
    BITS,
    FP8_FORMATS,
    GRANULARITIES,
    VALUE_FORMATS,
    QuantizedTensor,
    dequantize,
    fake_quantize,
    from_fp8,
    from_gguf,
    pack_int4,
    quant_params,
    quantize,
    quantize_minmax,
    representable_values,
    to_fp8,
    unpack_int4,
)
from llmu.quant.linear import QuantLinear

__all__ = [
    "BITS", "FP8_FORMATS", "GRANULARITIES", "METHODS", "VALUE_FORMATS", "QuantLinear", "QuantizedTensor",
    "dequantize", "fake_quantize", "from_fp8", "from_gguf", "from_gguf_model", "model_nbytes", "pack_int4", "quant_params",
    "quantize", "quantize_minmax", "quantize_model", "quantized_layers", "representable_values", "to_fp8", "unpack_int4",
]
