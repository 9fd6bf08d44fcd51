"""Module 10's kernel benchmark entries: registered, their formulas by hand, providers that agree,
a CPU run through the runner.

Providers are compared in float32: the Triton kernel and torch dequantize-then-matmul compute the
same product (atol 1e-4 on outputs of size ~0.5: rounding only); bf16 ``F.linear`` on the
unquantized weights differs from them by the quantization error itself, which the test bounds
loosely (an error of 20 % of the output's norm; 4-bit RTN with G = 64 gives about 10 %: the
point is only that it is the same layer).
"""

from __future__ import annotations

import pytest
import torch

import llmu  # noqa: F401
from llmu.bench.registry import REGISTRY
from llmu.quant import bench_kernels as bench

pytestmark = pytest.mark.kernels

ENTRIES = [bench.INT4_GEMV, bench.INT4_GEMM, bench.INT8_GEMV]


def test_entries_are_registered_with_the_sizes_that_matter():
    for entry in ENTRIES:
        assert REGISTRY[entry.name] is entry and entry.module == "10_quantization"
        assert set(entry.providers) == {"llmu triton", "torch bf16", "llmu torch"}
        assert [p.kind for p in entry.providers.values()] == ["triton", "builtin", "torch"]
        assert entry.gpu_dtype == torch.bfloat16 and entry.x_axis == "M"
        assert entry.cpu_sizes and entry.gpu_sizes
    gemv = bench.INT4_GEMV.gpu_sizes
    assert {s["M"] for s in gemv} == {1, 4, 16} and all(s["G"] == 128 for s in gemv)
    assert {(s["N"], s["K"]) for s in gemv} == set(bench.LAYERS)
    assert {11008, 14336} <= {s["N"] for s in gemv} | {s["K"] for s in gemv}
    gemm = bench.INT4_GEMM.gpu_sizes
    assert min(s["M"] for s in gemm) == 512 and max(s["M"] for s in gemm) == 4096
    assert {s["M"] for s in bench.INT8_GEMV.gpu_sizes} == {1, 16}


def test_formulas_by_hand():
    # M=2 tokens, N=6 outputs, K=8 inputs, groups of 4: 48 weights
    size = {"M": 2, "N": 6, "K": 8, "G": 4}
    assert bench.matmul_flops(size) == 2 * 2 * 6 * 8
    packed = 6 * 8 // 2                   # 24 bytes: half a byte per weight
    scales_zeros = 2 * 4 * 6 * 2          # float32 scale and zero for 6 rows x 2 groups
    xy = 2 * (2 * 8 + 2 * 6)              # bf16 x read and y written
    assert bench.int4_bytes(size, 2) == packed + scales_zeros + xy == 24 + 96 + 56
    size8 = {"M": 2, "N": 6, "K": 8}
    assert bench.int8_bytes(size8, 2) == 48 + 4 * 6 + xy
    # the napkin math of the module: at batch 1 a 4096 x 4096 int4 layer (G = 128) moves 3.5x
    # fewer bytes than its bf16 weights alone
    big = {"M": 1, "N": 4096, "K": 4096, "G": 128}
    assert 3.4 < 2 * 4096 * 4096 / bench.int4_bytes(big, 2) < 3.6


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.name)
def test_providers_agree_on_a_small_size(entry, kdev):
    size = dict(entry.cpu_sizes[0], M=3, N=40, K=256)
    if "G" in size:
        size["G"] = 64
    inputs = entry.setup(size, kdev, torch.float32)
    ref = entry.providers["llmu torch"].fn(*inputs)
    assert ref.shape == (3, 40)
    torch.testing.assert_close(entry.providers["llmu triton"].fn(*inputs), ref, atol=1e-4, rtol=1e-5)
    exact = entry.providers["torch bf16"].fn(*inputs)
    assert (exact - ref).norm() < 0.2 * exact.norm()


def test_cpu_sizes_run_through_the_runner(check_cpu_sizes_run):
    check_cpu_sizes_run(ENTRIES)
