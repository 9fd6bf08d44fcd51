"""llmu.scale.chinchilla: the rule of thumb, the fitted law's closed-form optimum, published runs."""

from __future__ import annotations

import math

import pytest

import llmu  # noqa: F401
from llmu.scale import chinchilla as C


def test_published_constants():
    fit = C.HOFFMANN_2022
    assert (fit.E, fit.A, fit.B, fit.alpha, fit.beta) == (1.69, 406.4, 410.7, 0.34, 0.28)
    a, b = fit.exponents
    assert a + b == pytest.approx(1) and round(a, 2) == 0.45 and round(b, 2) == 0.55


def test_rule_of_thumb_spends_the_budget():
    n, d = C.rule_of_thumb(5.88e23)
    assert n == pytest.approx(70e9, rel=1e-9) and d == pytest.approx(1.4e12, rel=1e-9)
    n, d = C.rule_of_thumb(1e20, tokens_per_parameter=100)
    assert 6 * n * d == pytest.approx(1e20) and d / n == pytest.approx(100)


@pytest.mark.parametrize("flops", [1e18, 5.88e23, 3.8e25])
def test_compute_optimal_is_the_minimum_on_the_isoflop_curve(flops):
    n, d = C.compute_optimal(flops)
    assert 6 * n * d == pytest.approx(flops, rel=1e-12)
    # a fine scan of sizes around the optimum: none is lower (the curve is smooth, so 0.1 % steps suffice)
    sizes = [n * math.exp(k / 1000) for k in range(-300, 301)]
    losses = C.isoflop_losses(flops, sizes)
    assert min(range(len(sizes)), key=losses.__getitem__) == 300


def test_optimum_scales_with_the_exponents():
    n1, d1 = C.compute_optimal(1e21)
    n2, d2 = C.compute_optimal(1e23)
    a, b = C.HOFFMANN_2022.exponents
    assert n2 / n1 == pytest.approx(100 ** a) and d2 / d1 == pytest.approx(100 ** b)


def test_published_runs():
    runs = {r.name: r for r in C.PUBLISHED_RUNS}
    assert runs["Chinchilla"].tokens_per_parameter == pytest.approx(20)
    assert runs["Gopher"].flops == pytest.approx(6 * 280e9 * 300e9)
    assert runs["Llama 3 8B"].tokens_per_parameter > 1800
    # Chinchilla's loss beats Gopher's at about the same budget, by the fitted law too
    assert C.HOFFMANN_2022.loss(70e9, 1.4e12) < C.HOFFMANN_2022.loss(280e9, 300e9)


def test_bad_inputs():
    with pytest.raises(ValueError, match="flops"):
        C.compute_optimal(0)
    with pytest.raises(TypeError, match="fit"):
        C.compute_optimal(1e20, fit=(1.69, 406.4))
    with pytest.raises(ValueError, match="alpha"):
        C.LossFit(1.0, 1.0, 1.0, 0.0, 0.3)
    with pytest.raises(ValueError, match="n_params"):
        C.isoflop_losses(1e20, [1e9, -1])
