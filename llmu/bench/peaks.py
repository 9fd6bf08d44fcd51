"""Peak throughput of the GPUs the course is measured on.

A timing alone says little; a timing next to what the chip could do says how good it is. For every
known GPU this table holds the dense (no 2:4 sparsity) tensor-core peak per dtype, in TFLOP/s, and
the memory bandwidth in GB/s. ``fraction of peak`` in a result row is the achieved TFLOP/s over the
first and the achieved GB/s over the second; for an op, whichever is higher says which roof it is
running against (module 05 draws this as a roofline).

Sources: NVIDIA's product datasheets (H200 SXM/NVL datasheet 2024; H100 datasheet, SXM5 and PCIe;
A100 datasheet, 40 GB and 80 GB; L4 datasheet; T4 datasheet). The datasheets quote tensor-core
figures "with sparsity"; the dense numbers below are half of those. FP32 is the plain (non-tensor)
CUDA-core rate, which is what a float32 matmul runs at under PyTorch's default matmul precision
("highest", no TF32). Peaks are at boost clock: sustained clocks under load are often lower, so a
real kernel rarely gets above 70-80 % of the FLOP/s peak or 85-90 % of the bandwidth peak.

CPUs have no entry: their peak depends on the core count, the vector units and the clock, and is
reported as ``None`` unless measured.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Peak:
    """What one device can do at best: TFLOP/s per dtype name, and memory bandwidth in GB/s."""

    name: str
    tflops: dict[str, float] = field(default_factory=dict)
    bandwidth_gbs: float | None = None

    def tflops_for(self, dtype) -> float | None:
        """The dense peak for ``dtype`` (a torch dtype or its name), or None when not known."""
        return self.tflops.get(dtype_name(dtype))

    def as_dict(self) -> dict:
        return {"name": self.name, "tflops": dict(self.tflops), "bandwidth_gbs": self.bandwidth_gbs}


# (pattern, Peak): the first regular expression found (case-insensitively) in
# torch.cuda.get_device_name() wins, so the more specific names come first ("H100 PCIe" before
# "H100"); word boundaries keep "L4" from matching an L40S.
GPU_PEAKS: list[tuple[str, Peak]] = [
    (r"\bH200 NVL\b", Peak("NVIDIA H200 NVL",
                      {"bfloat16": 835.5, "float16": 835.5, "float8_e4m3fn": 1670.5, "float32": 60.0},
                      4800.0)),
    (r"\bH200\b", Peak("NVIDIA H200 SXM",
                  {"bfloat16": 989.5, "float16": 989.5, "float8_e4m3fn": 1979.0, "float32": 67.0},
                  4800.0)),
    (r"\bH100 PCIe\b", Peak("NVIDIA H100 PCIe",
                       {"bfloat16": 756.5, "float16": 756.5, "float8_e4m3fn": 1513.0, "float32": 51.0},
                       2000.0)),
    (r"\bH100\b", Peak("NVIDIA H100 SXM",
                  {"bfloat16": 989.5, "float16": 989.5, "float8_e4m3fn": 1979.0, "float32": 67.0},
                  3350.0)),
    (r"\bA100-SXM4-80GB\b", Peak("NVIDIA A100 SXM 80GB",
                            {"bfloat16": 312.0, "float16": 312.0, "float32": 19.5}, 2039.0)),
    (r"\bA100 80GB PCIe\b", Peak("NVIDIA A100 PCIe 80GB",
                            {"bfloat16": 312.0, "float16": 312.0, "float32": 19.5}, 1935.0)),
    (r"\bA100\b", Peak("NVIDIA A100 40GB",
                  {"bfloat16": 312.0, "float16": 312.0, "float32": 19.5}, 1555.0)),
    (r"\bL4\b", Peak("NVIDIA L4",
                {"bfloat16": 121.0, "float16": 121.0, "float8_e4m3fn": 242.5, "float32": 30.3}, 300.0)),
    # Turing has no bfloat16 tensor cores: bf16 runs far below the fp16 figure, so it has no peak.
    (r"\bT4\b", Peak("NVIDIA T4", {"float16": 65.0, "float32": 8.1}, 320.0)),
]


def dtype_name(dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``; strings pass through."""
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    return str(dtype).removeprefix("torch.")


def peak_for(device_name: str | None) -> Peak | None:
    """The :class:`Peak` of a GPU from its name as torch reports it, or None when unknown (CPUs)."""
    if not device_name:
        return None
    for pattern, peak in GPU_PEAKS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return peak
    return None
