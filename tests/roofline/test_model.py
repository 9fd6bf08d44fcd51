"""Module 05's formulas: GEMM/GEMV FLOPs, bytes and intensity (hand-computed), the roofline,
the ridge point, memory- vs compute-bound, and the device table."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import llmu  # noqa: F401
from llmu.roofline import (
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


def test_gemm_by_hand():
    # (2 x 3) @ (3 x 4): 8 outputs, each 3 multiplies and 3 adds = 48 FLOPs.
    assert gemm_flops(2, 4, 3) == 48
    # A has 6 elements, B 12, C 8: 26 elements, 4 bytes each in fp32.
    assert gemm_bytes(2, 4, 3, 4) == 104
    assert gemm_intensity(2, 4, 3, 4) == pytest.approx(48 / 104)
    # Square n: 2 n^3 / (3 n^2 elem) = 2n / (3 elem); n = 4096, bf16: 4096 / 3.
    assert gemm_intensity(4096, 4096, 4096, 2) == pytest.approx(4096 / 3)


def test_gemv_by_hand():
    # 1 x 4096 @ (4096 x 4096)^T: 2 * 4096^2 FLOPs; bytes 2 * (4096^2 + 2 * 4096) in bf16.
    assert gemv_flops(4096, 4096) == 2 * 4096**2
    assert gemv_bytes(4096, 4096, 2) == 2 * (4096**2 + 2 * 4096)
    assert gemv_intensity(4096, 4096, 2) == pytest.approx(4096 / 4098)   # just under 1 FLOP/byte
    assert gemv_intensity(4096, 4096, 4) == pytest.approx(0.5 * 4096 / 4098)
    assert gemv_flops(5, 7) == gemm_flops(1, 5, 7) and gemv_bytes(5, 7, 2) == gemm_bytes(1, 5, 7, 2)


def test_decode_batch_intensity_grows_like_the_batch():
    # A batch of b decode rows through one weight: about 2b/elem = b FLOP/byte in bf16.
    for b in (1, 2, 8, 32):
        assert gemm_intensity(b, 8192, 8192, 2) == pytest.approx(b, rel=0.01)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 5000), st.integers(1, 5000), st.integers(1, 5000), st.sampled_from([1, 2, 4]))
def test_intensity_bounds(m, n, k, elem):
    i = gemm_intensity(m, n, k, elem)
    # Each output needs 2K FLOPs and at least one written element, so I <= 2K/elem; and by AM-GM
    # MNK/(MK+KN+MN) <= min(M,N,K), so I <= 2 min(M,N,K)/elem.
    assert 0 < i <= 2 * min(m, n, k) / elem + 1e-9


def test_roofline_is_the_minimum_of_the_two_roofs():
    peak, bw = 100e12, 2e12           # ridge at 50 FLOP/byte
    assert ridge_point(peak, bw) == 50
    assert roofline(1.0, peak, bw) == 2e12            # memory roof: I * W
    assert roofline(50.0, peak, bw) == 100e12          # the ridge: both
    assert roofline(1000.0, peak, bw) == 100e12        # compute roof
    assert roofline(0, peak, bw) == 0
    xs = [0.5, 10, 50, 400]
    np.testing.assert_allclose(roofline(xs, peak, bw), [1e12, 20e12, 100e12, 100e12])
    t = roofline(torch.tensor([0.5, 400.0]), peak, bw)
    assert isinstance(t, torch.Tensor)
    torch.testing.assert_close(t, torch.tensor([1e12, 100e12]))
    assert bound(49.9, peak, bw) == "memory" and bound(50, peak, bw) == "compute"


def test_bad_inputs():
    with pytest.raises(ValueError, match="peak_flops"):
        roofline(1.0, 0, 1e9)
    with pytest.raises(ValueError, match="bandwidth"):
        ridge_point(1e12, -1)
    with pytest.raises(ValueError, match="intensity"):
        roofline(-1.0, 1e12, 1e9)
    with pytest.raises(ValueError, match="intensity"):
        roofline([1.0, float("nan")], 1e12, 1e9)
    with pytest.raises(ValueError, match="intensity"):
        bound(0.0, 1e12, 1e9)
    with pytest.raises(ValueError, match="M"):
        gemm_flops(0, 4, 4)
    with pytest.raises(TypeError, match="K"):
        gemm_bytes(4, 4, 2.5)
    with pytest.raises(ValueError, match="elem_bytes"):
        gemv_bytes(4, 4, 0)
    with pytest.raises(ValueError, match="bandwidth"):
        Roof("x", 1e12, 0.0)


def test_gpu_roofs_come_from_the_peak_table():
    roofs = {r.name: r for r in gpu_roofs("bfloat16")}
    assert set(roofs) == {"NVIDIA H200 SXM", "NVIDIA H100 SXM", "NVIDIA A100 SXM 80GB", "NVIDIA L4", "NVIDIA T4"}
    h200 = roofs["NVIDIA H200 SXM"]
    assert h200.peak_flops == pytest.approx(989.5e12) and h200.bandwidth == pytest.approx(4800e9)
    assert h200.ridge == pytest.approx(989.5e12 / 4800e9)
    # The T4 has no bf16 tensor cores: its fp16 peak stands in, and the roof says so.
    assert roofs["NVIDIA T4"].dtype == "float16"
    assert gpu_roofs("float32")[0].peak_flops == pytest.approx(67e12)
    assert all(r.bound(1.0) == "memory" for r in roofs.values())       # decode GEMV, bf16: everywhere
    assert all(r.bound(4096 / 3) == "compute" for r in roofs.values())  # 4096^3 GEMM: everywhere
    with pytest.raises(ValueError, match="unknown GPU"):
        gpu_roofs(names=["NVIDIA B200"])
    assert math.isclose(roofs["NVIDIA L4"].attainable(1.0), 300e9)
