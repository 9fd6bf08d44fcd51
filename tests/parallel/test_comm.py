"""The α–β cost model (llmu.parallel.comm): the formulas by hand, the links against their vendor
figures, the ring/tree crossover, nccl-tests' bus bandwidth and the fit. Pure arithmetic: equalities
hold to float rounding (relative 1e-12)."""

from __future__ import annotations

import math

import pytest

from llmu.parallel import comm as C

ALPHA, BETA = 5e-6, 100e9


def close(a, b, rel=1e-12):
    return math.isclose(a, b, rel_tol=rel)


def test_formulas_by_hand():
    n = 1e9
    # p = 8: 14 steps of alpha, 2·7/8 of the message at beta
    assert close(C.ring_all_reduce_time(n, 8, alpha=ALPHA, beta=BETA), 14 * ALPHA + 1.75 * n / BETA)
    assert close(C.all_gather_time(n, 8, alpha=ALPHA, beta=BETA), 7 * ALPHA + 0.875 * n / BETA)
    # an all-reduce is a reduce-scatter followed by an all-gather
    for p in (2, 3, 8, 64):
        assert close(C.ring_all_reduce_time(n, p, alpha=ALPHA, beta=BETA),
                     C.reduce_scatter_time(n, p, alpha=ALPHA, beta=BETA) + C.all_gather_time(n, p, alpha=ALPHA, beta=BETA))
    assert close(C.tree_all_reduce_time(n, 8, alpha=ALPHA, beta=BETA), 6 * (ALPHA + n / BETA))
    assert close(C.tree_all_reduce_time(n, 5, alpha=ALPHA, beta=BETA), 6 * (ALPHA + n / BETA))   # ceil(log2 5) = 3
    for f in (C.ring_all_reduce_time, C.all_gather_time, C.tree_all_reduce_time):
        assert f(n, 1, alpha=ALPHA, beta=BETA) == 0.0                                        # nothing to send
    assert close(C.ring_all_reduce_time(n, 8, C.NVLINK4), 14 * C.NVLINK4.alpha + 1.75 * n / C.NVLINK4.beta)


def test_ring_bandwidth_term_is_bounded_and_latency_grows():
    big, small = 1e10, 1.0
    ring = [C.ring_all_reduce_time(big, p, alpha=0.0, beta=BETA) for p in (2, 8, 1024)]
    assert ring == sorted(ring) and ring[-1] < 2 * big / BETA
    assert C.ring_all_reduce_time(small, 1024, alpha=ALPHA, beta=BETA) > 100 * C.tree_all_reduce_time(small, 1024, alpha=ALPHA, beta=BETA)


def test_crossover():
    for p in (4, 8, 64):
        n = C.crossover_bytes(p, alpha=ALPHA, beta=BETA)
        assert 0 < n < math.inf
        assert close(C.ring_all_reduce_time(n, p, alpha=ALPHA, beta=BETA), C.tree_all_reduce_time(n, p, alpha=ALPHA, beta=BETA), 1e-9)
        assert C.ring_all_reduce_time(2 * n, p, alpha=ALPHA, beta=BETA) < C.tree_all_reduce_time(2 * n, p, alpha=ALPHA, beta=BETA)
        assert C.ring_all_reduce_time(n / 2, p, alpha=ALPHA, beta=BETA) > C.tree_all_reduce_time(n / 2, p, alpha=ALPHA, beta=BETA)
    # p = 2: ring and tree both send the whole message once each way; the ring never loses
    assert C.crossover_bytes(2, alpha=ALPHA, beta=BETA) == 0.0


def test_links_against_vendor_figures():
    assert close(2 * C.NVLINK4.beta, 900e9)          # H100/H200: 900 GB/s bidirectional
    assert close(2 * C.NVLINK5.beta, 1.8e12)         # B200: 1.8 TB/s bidirectional
    assert close(C.INFINIBAND_NDR.beta * 8, 400e9)   # 400 Gb/s per port, per direction
    assert 62e9 < C.PCIE5_X16.beta < 64e9            # 32 GT/s x 16 lanes, 128b/130b
    assert set(C.LINKS) == {link.name for link in (C.NVLINK4, C.NVLINK5, C.INFINIBAND_NDR, C.PCIE5_X16)}


def test_bus_bandwidth_of_the_ideal_ring_is_the_link():
    for p in (2, 4, 8):
        t = C.ring_all_reduce_time(1e9, p, alpha=0.0, beta=BETA)
        assert close(C.bus_bandwidth(1e9, t, p), BETA)
        t = C.all_gather_time(1e9, p, alpha=0.0, beta=BETA)
        assert close(C.bus_bandwidth(1e9, t, p, "all_gather"), BETA)
    assert close(C.bus_bandwidth(1e9, 1.0, 2), 1e9)   # p = 2: busbw = algbw


def test_fit_recovers_alpha_and_beta():
    sizes = [4 ** k * 1024 for k in range(8)]
    for p in (2, 4):
        times = [C.ring_all_reduce_time(n, p, alpha=ALPHA, beta=BETA) for n in sizes]
        a, b = C.fit_alpha_beta(sizes, times, p)
        assert close(a, ALPHA, 1e-9) and close(b, BETA, 1e-9)
    # pure bandwidth: alpha fitted as 0
    a, b = C.fit_alpha_beta([1e6, 2e6], [1e-3, 2e-3], 2)
    assert a == 0.0 and close(b, 1e9, 1e-9)


def test_bad_input():
    with pytest.raises(ValueError, match="n_bytes"):
        C.ring_all_reduce_time(-1, 2, C.NVLINK4)
    with pytest.raises(ValueError, match="p "):
        C.ring_all_reduce_time(10, 0, C.NVLINK4)
    with pytest.raises(ValueError, match="beta"):
        C.all_gather_time(10, 2, alpha=1e-6, beta=0)
    with pytest.raises(ValueError, match="alpha"):
        C.all_gather_time(10, 2)
    with pytest.raises(TypeError, match="link"):
        C.tree_all_reduce_time(10, 2, "nvlink")
    with pytest.raises(ValueError, match="op"):
        C.bus_bandwidth(10, 1.0, 2, "broadcast")
    with pytest.raises(ValueError, match="seconds"):
        C.bus_bandwidth(10, 0, 2)
    with pytest.raises(ValueError, match="two different sizes"):
        C.fit_alpha_beta([1, 1], [1, 2], 2)
    with pytest.raises(ValueError, match="p=1"):
        C.fit_alpha_beta([1, 2], [1, 2], 1)
    with pytest.raises(ValueError, match="Link.beta"):
        C.Link("x", 0, 1e-6, "")
