"""Prefill vs decode, and the roofline (course module 05).

- :mod:`llmu.roofline.model`: FLOPs, bytes and arithmetic intensity of a GEMM (prefill) and a GEMV
  (decode); ``roofline(intensity, peak_flops, bandwidth)``, ``ridge_point``, ``bound``; the
  :class:`Roof` of a device and ``gpu_roofs()`` from the datasheet table ``llmu.bench.peaks``;
- :mod:`llmu.roofline.measure`: ``measure_machine()`` (this machine's matmul FLOP/s and copy
  bandwidth), ``gemv_sweep()`` (a GEMV at several dtypes), ``token_latency()`` and
  ``latency_metrics()`` (TTFT, TPOT, TTLT of the real model);
- :mod:`llmu.roofline.decode_cost`: ``step_cost()``, the operations of one decode step of a
  Llama-family config with their FLOPs and bytes, ``predict_time()``, their time on a device's
  roofline, and ``measure_decode_steps()``, real steps of the model at several batch sizes;
- :mod:`llmu.roofline.points`: the registered ops as points, prefill-like or decode-like;
- :mod:`llmu.roofline.plot`: ``roofline_figure()`` (imports plotly on first use);
- :mod:`llmu.roofline.kernels`: ``matmul()``, a tiled Triton matmul with its tiles chosen for the
  GPU (``Tiles``, ``default_tiles``, ``shared_memory_bytes``); imported on its own, not here;
- :mod:`llmu.roofline.bench`: the ``gemm`` and ``gemv`` benchmark entries (PyTorch's matmul, and
  the Triton matmul for ``gemm``).

Course notebook: ``05_prefill_decode``.
"""

from llmu.roofline.decode_cost import StepOp, measure_decode_steps, predict_time, step_cost, step_totals
from llmu.roofline.measure import (
    MachineRoof,
    TokenLatency,
    gemv_sweep,
    latency_metrics,
    measure_machine,
    model_weight_bytes,
    token_latency,
)
from llmu.roofline.model import (
    DEFAULT_GPUS,
    Roof,
    bound,
    gemm_bytes,
    gemm_flops,
    gemm_intensity,
    gemv_bytes,
    gemv_flops,
    gemv_intensity,
    gpu_roofs,
    ridge_point,
    roofline,
)
from llmu.roofline.points import PHASES, phase_of, registry_points


def roofline_figure(*args, **kwargs):
    """See :func:`llmu.roofline.plot.roofline_figure` (imports plotly on first use)."""
    from llmu.roofline.plot import roofline_figure as _figure

    return _figure(*args, **kwargs)


__all__ = [
    "gemm_flops", "gemm_bytes", "gemm_intensity", "gemv_flops", "gemv_bytes", "gemv_intensity",
    "roofline", "ridge_point", "bound", "Roof", "gpu_roofs", "DEFAULT_GPUS",
    "MachineRoof", "measure_machine", "gemv_sweep", "model_weight_bytes", "TokenLatency", "token_latency",
    "latency_metrics", "PHASES", "phase_of", "registry_points", "roofline_figure",
    "StepOp", "step_cost", "step_totals", "predict_time", "measure_decode_steps",
]
