"""Benchmark entries of module 05: a GEMM (prefill) and a GEMV (decode), PyTorch's own matmul.

``gemm``: ``x (M x K) @ W^T`` with ``W`` of ``N x K``, the shape of a linear layer applied to
``M`` tokens at once (prefill). FLOPs ``2 M N K``; bytes, each operand crossing the bus once,
``elem (M K + N K + M N)`` (see ``llmu.roofline.model``).

``gemv``: the same with ``M = B`` small: one decode step of ``B`` sequences through one weight
matrix. FLOPs ``2 B N K``, bytes ``elem (N K + B K + B N)``: the weight dominates, so the
intensity is about ``2 B / elem`` FLOP per byte (``B`` in bf16). Timing ``B = 1, 4, 16, 64``
shows the time hardly changing while the FLOPs grow, until the point reaches the ridge.

Both are timed through ``torch.nn.functional.linear`` (cuBLAS on a GPU, oneDNN/MKL on a CPU), the
matmul every other module uses. ``gemm`` also times the course's own tiled Triton matmul,
:func:`llmu.roofline.kernels.matmul` (``W^T`` passed as a transposed view, no copy), with its tiles
chosen for the GPU; the notebook's exercise 5 sets the learner's kernel beside it. A GEMV is left
to ``F.linear``: a tiled GEMM kernel spends almost all of its ``M = 1`` tile on padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmu.bench.registry import Entry, Provider, register
from llmu.roofline.kernels import matmul
from llmu.roofline.model import gemm_bytes, gemm_flops


def _setup(size, device, dtype):
    g = torch.Generator(device="cpu").manual_seed(0)
    m = size.get("M", size.get("B", 1))
    x = torch.randn(m, size["K"], generator=g)
    w = torch.randn(size["N"], size["K"], generator=g) / size["K"] ** 0.5
    return x.to(device=device, dtype=dtype), w.to(device=device, dtype=dtype)


def gemm_entry_flops(size) -> float:
    return gemm_flops(size["M"], size["N"], size["K"])


def gemm_entry_bytes(size, elem: int) -> float:
    return gemm_bytes(size["M"], size["N"], size["K"], elem)


def gemv_entry_flops(size) -> float:
    return gemm_flops(size["B"], size["N"], size["K"])


def gemv_entry_bytes(size, elem: int) -> float:
    return gemm_bytes(size["B"], size["N"], size["K"], elem)


_LINEAR = {"torch": Provider(lambda x, w: F.linear(x, w), "builtin", "F.linear (x @ W^T)")}

GEMM = register(
    Entry(
        name="gemm",
        module="05_prefill_decode",
        description="prefill: x (M x K) @ W^T, W of N x K (2MNK FLOPs)",
        providers={**_LINEAR, "llmu triton": Provider(lambda x, w: matmul(x, w.t()), "triton", "llmu Triton matmul")},
        setup=_setup,
        flops=gemm_entry_flops,
        bytes=gemm_entry_bytes,
        gpu_sizes=[{"M": m, "N": 4096, "K": 4096} for m in (256, 1024, 4096)] + [{"M": 8192, "N": 8192, "K": 8192}],
        cpu_sizes=[{"M": m, "N": 1024, "K": 1024} for m in (64, 256, 512)],
        x_axis="M",
    )
)

GEMV = register(
    Entry(
        name="gemv",
        module="05_prefill_decode",
        description="decode: B tokens (B = 1 is a GEMV) @ W^T, W of N x K (2BNK FLOPs, the weight read once)",
        providers=dict(_LINEAR),
        setup=_setup,
        flops=gemv_entry_flops,
        bytes=gemv_entry_bytes,
        gpu_sizes=[{"B": b, "N": 4096, "K": 4096} for b in (1, 4, 16, 64)] + [{"B": 1, "N": 8192, "K": 8192}],
        # 4096 x 4096 fp32 weights are 64 MiB, more than a CPU's last-level cache: the read goes to memory.
        cpu_sizes=[{"B": b, "N": 4096, "K": 4096} for b in (1, 8)],
        x_axis="B",
    )
)
