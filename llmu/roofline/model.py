"""The roofline model: arithmetic intensity, attainable performance, ridge point.

An op that performs ``F`` floating-point operations and moves ``Q`` bytes between memory and the
chip has an **arithmetic intensity** ``I = F / Q`` (FLOP per byte). A device that can do at most
``P`` FLOP/s and move at most ``W`` bytes/s runs it at best at

    attainable(I) = min(P, I * W)

The two roofs meet at the **ridge point** ``I* = P / W``. Left of it an op is *memory-bound*
(more bandwidth would speed it up, faster ALUs would not); right of it it is *compute-bound*.

Matrix products, the bulk of an LLM's work, are where the two phases of generation part ways:

* ``C (M x N) = A (M x K) @ B (K x N)`` costs ``2 M N K`` FLOPs (one multiply and one add per
  term) and, if every operand crosses the memory bus exactly once, ``elem * (M K + K N + M N)``
  bytes. With ``M = N = K = n`` the intensity is ``2 n / (3 elem)``: it grows with ``n``.
* **Prefill** pushes ``M = T`` prompt tokens through each weight matrix ``(K x N)`` at once: a
  GEMM, intensity of the order of ``T`` (for ``T`` much smaller than ``N`` and ``K``,
  ``I ~ 2 T / elem``).
* **Decode** pushes one token per sequence: ``M = 1``, a matrix-vector product (GEMV). The
  weight matrix, ``K N`` elements, is read to do ``2 K N`` FLOPs: ``I ~ 2 / elem`` FLOP per byte,
  1 FLOP/byte in bf16, whatever the model. A batch of ``b`` sequences decoding together gives
  ``M = b`` and ``I ~ 2 b / elem``: batching is how decode climbs toward the ridge.

Units: FLOPs and FLOP/s, bytes and bytes/s (SI, not GiB). ``roofline`` accepts a number, a
sequence, a numpy array or a torch tensor for the intensity and returns the same kind.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from llmu.bench.peaks import GPU_PEAKS, Peak, dtype_name

__all__ = [
    "gemm_flops", "gemm_bytes", "gemm_intensity", "gemv_flops", "gemv_bytes", "gemv_intensity",
    "roofline", "ridge_point", "bound", "Roof", "gpu_roofs", "DEFAULT_GPUS",
]


def _dim(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a positive int, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _positive(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise TypeError(f"{name} must be a positive number, got {value!r}")
    value = float(value)
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return value


# ---------------------------------------------------------------------------------------------
# Matrix products: FLOPs, bytes, intensity
# ---------------------------------------------------------------------------------------------

def gemm_flops(M: int, N: int, K: int) -> float:
    """FLOPs of ``(M x K) @ (K x N)``: ``M N`` outputs, each a dot product of ``K`` multiply-adds."""
    return 2.0 * _dim("M", M) * _dim("N", N) * _dim("K", K)


def gemm_bytes(M: int, N: int, K: int, elem_bytes: float = 2) -> float:
    """Bytes of ``(M x K) @ (K x N)`` if each operand crosses the memory bus once: read ``A`` and
    ``B``, write ``C``, all with ``elem_bytes`` per element (2 for bf16, 4 for fp32).

    This is the *minimum* traffic (a perfect cache); a real kernel reads tiles of ``A`` or ``B``
    more than once when they do not fit on chip, so its true intensity is at most this.
    """
    M, N, K = _dim("M", M), _dim("N", N), _dim("K", K)
    return _positive("elem_bytes", elem_bytes) * (M * K + K * N + M * N)


def gemm_intensity(M: int, N: int, K: int, elem_bytes: float = 2) -> float:
    """FLOP per byte of a GEMM: ``2 M N K / (elem (M K + K N + M N))``."""
    return gemm_flops(M, N, K) / gemm_bytes(M, N, K, elem_bytes)


def gemv_flops(N: int, K: int) -> float:
    """FLOPs of a matrix-vector product ``x (1 x K) @ W^T`` with ``W`` of ``N x K``: ``2 N K``."""
    return gemm_flops(1, N, K)


def gemv_bytes(N: int, K: int, elem_bytes: float = 2) -> float:
    """Bytes of a GEMV: the weight matrix ``N K``, the input vector ``K`` and the output ``N``."""
    return gemm_bytes(1, N, K, elem_bytes)


def gemv_intensity(N: int, K: int, elem_bytes: float = 2) -> float:
    """FLOP per byte of a GEMV: ``2 N K / (elem (N K + K + N))``, just under ``2 / elem``."""
    return gemm_intensity(1, N, K, elem_bytes)


# ---------------------------------------------------------------------------------------------
# The roofline
# ---------------------------------------------------------------------------------------------

def roofline(intensity, peak_flops: float, bandwidth: float):
    """Attainable FLOP/s at ``intensity`` FLOP/byte: ``min(peak_flops, intensity * bandwidth)``.

    ``peak_flops`` in FLOP/s, ``bandwidth`` in bytes/s. ``intensity`` may be a number (a float is
    returned), a list or numpy array (a numpy array is returned) or a torch tensor (a tensor).
    Intensities must be >= 0 (an op that moves bytes and computes nothing sits at 0 FLOP/s).
    """
    peak_flops = _positive("peak_flops", peak_flops)
    bandwidth = _positive("bandwidth", bandwidth)
    try:
        import torch

        if isinstance(intensity, torch.Tensor):
            if not intensity.is_floating_point():
                intensity = intensity.double()
            if bool((intensity < 0).any()) or not bool(torch.isfinite(intensity).all()):
                raise ValueError("intensity must be finite and >= 0")
            return torch.clamp(intensity * bandwidth, max=peak_flops)
    except ImportError:  # pragma: no cover - torch is a dependency of llmu
        pass
    if isinstance(intensity, bool):
        raise TypeError(f"intensity must be a number or an array, got {intensity!r}")
    if isinstance(intensity, (int, float, np.integer, np.floating)):
        value = float(intensity)
        if not (value >= 0 and math.isfinite(value)):
            raise ValueError(f"intensity must be finite and >= 0, got {intensity!r}")
        return min(peak_flops, value * bandwidth)
    arr = np.asarray(intensity, dtype=float)
    if arr.size and (not np.all(np.isfinite(arr)) or np.any(arr < 0)):
        raise ValueError("intensity must be finite and >= 0")
    return np.minimum(peak_flops, arr * bandwidth)


def ridge_point(peak_flops: float, bandwidth: float) -> float:
    """The intensity (FLOP/byte) where the two roofs meet: ``peak_flops / bandwidth``."""
    return _positive("peak_flops", peak_flops) / _positive("bandwidth", bandwidth)


def bound(intensity: float, peak_flops: float, bandwidth: float) -> str:
    """``"memory"`` if an op of this intensity is limited by bandwidth on this device (it is left
    of the ridge), else ``"compute"``. Exactly at the ridge both limits coincide: ``"compute"``."""
    value = _positive("intensity", intensity)
    return "memory" if value < ridge_point(peak_flops, bandwidth) else "compute"


# ---------------------------------------------------------------------------------------------
# Devices
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Roof:
    """One device's roofline: a name, its peak FLOP/s for one dtype, its bandwidth in bytes/s."""

    name: str
    peak_flops: float
    bandwidth: float
    dtype: str = "bfloat16"
    source: str = "datasheet"  # "datasheet" (llmu.bench.peaks) or "measured"

    def __post_init__(self):
        _positive("peak_flops", self.peak_flops)
        _positive("bandwidth", self.bandwidth)

    @property
    def ridge(self) -> float:
        """The ridge point in FLOP/byte."""
        return ridge_point(self.peak_flops, self.bandwidth)

    def attainable(self, intensity):
        """:func:`roofline` on this device."""
        return roofline(intensity, self.peak_flops, self.bandwidth)

    def bound(self, intensity: float) -> str:
        """``"memory"`` or ``"compute"`` (see :func:`bound`)."""
        return bound(intensity, self.peak_flops, self.bandwidth)

    @property
    def label(self) -> str:
        return f"{self.name} ({self.dtype}, {self.source})"

    @classmethod
    def from_peak(cls, peak: Peak, dtype="bfloat16", fallback: str | None = "float16") -> Roof:
        """The roof of a :class:`llmu.bench.peaks.Peak` for ``dtype``; when the table has no peak
        for it (the T4 has no bf16 tensor cores), the ``fallback`` dtype's, named in ``dtype``."""
        name = dtype_name(dtype)
        tflops = peak.tflops_for(name)
        if tflops is None and fallback is not None:
            name, tflops = fallback, peak.tflops_for(fallback)
        if tflops is None or peak.bandwidth_gbs is None:
            raise ValueError(f"{peak.name} has no peak for {dtype_name(dtype)} in llmu.bench.peaks")
        return cls(peak.name, tflops * 1e12, peak.bandwidth_gbs * 1e9, name, "datasheet")


#: The GPUs the course compares (names as in ``llmu.bench.peaks.GPU_PEAKS``).
DEFAULT_GPUS = ("NVIDIA H200 SXM", "NVIDIA H100 SXM", "NVIDIA A100 SXM 80GB", "NVIDIA L4", "NVIDIA T4")


def gpu_roofs(dtype="bfloat16", names=DEFAULT_GPUS) -> list[Roof]:
    """Roofs of the named GPUs from ``llmu.bench.peaks`` for ``dtype`` (dense tensor-core peak;
    ``"float32"`` gives the CUDA-core rate). ``names=None`` gives every GPU in the table."""
    peaks = {peak.name: peak for _, peak in GPU_PEAKS}
    if names is None:
        names = list(peaks)
    unknown = [n for n in names if n not in peaks]
    if unknown:
        raise ValueError(f"unknown GPU name(s) {unknown}; known: {sorted(peaks)}")
    return [Roof.from_peak(peaks[n], dtype) for n in names]
