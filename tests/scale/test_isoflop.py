"""llmu.scale.isoflop: the grid's budgets, the reference fits on synthetic profiles, one tiny real grid."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import llmu  # noqa: F401
from llmu.models import LlamaConfig, byte_llama_config
from llmu.scale import chinchilla as C, isoflop as I
from llmu.scale.flops import matmul_parameters, train_step_flops

# ----------------------------------------------------------------------------------------------
# fit_parabola, fit_power_law
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("x0, y0, curvature", [(3.0, 1.5, 2.0), (9.8, 2.31, 0.07), (-1.0, 0.0, 40.0)])
def test_fit_parabola_finds_the_vertex_of_exact_data(x0, y0, curvature):
    x = [x0 + d for d in (-1.3, -0.4, 0.2, 0.9, 2.0)]      # not symmetric around the vertex
    vertex = I.fit_parabola(x, [y0 + curvature * (v - x0) ** 2 for v in x])
    assert vertex == pytest.approx((x0, y0), abs=1e-9)
    assert vertex.log_n == vertex[0] and vertex.loss == vertex[1]


def test_fit_parabola_on_noisy_data():
    rng = np.random.default_rng(0)
    x = np.linspace(8.0, 12.0, 9)
    y = 2.0 + 0.1 * (x - 10.3) ** 2 + rng.normal(0.0, 0.005, x.size)
    vertex = I.fit_parabola(x.tolist(), y.tolist())
    assert vertex.log_n == pytest.approx(10.3, abs=0.1) and vertex.loss == pytest.approx(2.0, abs=0.01)


def test_fit_parabola_refuses_what_has_no_minimum():
    with pytest.raises(ValueError, match="at least 3 points"):
        I.fit_parabola([1.0, 2.0], [3.0, 2.0])
    with pytest.raises(ValueError, match="distinct"):
        I.fit_parabola([1.0, 1.0, 2.0], [3.0, 2.9, 2.0])
    with pytest.raises(ValueError, match="opens downwards"):
        I.fit_parabola([1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 2.2, 1.5])
    with pytest.raises(ValueError, match="same length"):
        I.fit_parabola([1.0, 2.0, 3.0], [1.0, 2.0])
    with pytest.raises(TypeError, match=r"loss\[1\]"):
        I.fit_parabola([1.0, 2.0, 3.0], [1.0, "2", 3.0])
    with pytest.raises(ValueError, match=r"log_n\[2\]"):
        I.fit_parabola([1.0, 2.0, math.nan], [1.0, 2.0, 3.0])
    with pytest.raises(TypeError, match="log_n"):
        I.fit_parabola(3.0, [1.0, 2.0, 3.0])


@pytest.mark.parametrize("k, a", [(0.084, 0.5), (3.5, 0.27), (2e3, -0.05)])
def test_fit_power_law_recovers_coefficient_and_exponent(k, a):
    budgets = [1e9, 3e9, 1e10, 3e10, 1e11]
    coefficient, exponent = I.fit_power_law(budgets, [k * c ** a for c in budgets])
    assert coefficient == pytest.approx(k, rel=1e-9) and exponent == pytest.approx(a, abs=1e-12)
    # noise of 1 % on each value moves the exponent by about 1 % / ln(100) ≈ 0.002 at most
    rng = np.random.default_rng(1)
    noisy = [k * c ** a * math.exp(rng.normal(0.0, 0.01)) for c in budgets]
    assert I.fit_power_law(budgets, noisy)[1] == pytest.approx(a, abs=0.01)


def test_fit_power_law_bad_inputs():
    with pytest.raises(ValueError, match=r"values\[1\] must be positive"):
        I.fit_power_law([1e9, 1e10], [1.0, 0.0])
    with pytest.raises(ValueError, match=r"budgets\[0\] must be positive"):
        I.fit_power_law([-1e9, 1e10], [1.0, 2.0])
    with pytest.raises(ValueError, match="2 distinct budgets"):
        I.fit_power_law([1e9, 1e9], [1.0, 2.0])
    with pytest.raises(ValueError, match="same length"):
        I.fit_power_law([1e9, 1e10, 1e11], [1.0, 2.0])


# ----------------------------------------------------------------------------------------------
# fit_isoflop on runs whose losses a Chinchilla law gives
# ----------------------------------------------------------------------------------------------

#: A law of the shape of Hoffmann et al.'s, its constants moved so that the exponents differ from
#: theirs (a = 0.4 here) and the optimum sits at 14 K to 56 K parameters for 1e10 to 3e11 FLOPs, with
#: losses near 2 nats: the scale of the grid this CPU trains.
TINY_LAW = C.LossFit(E=1.3, A=27.0, B=18.0, alpha=0.45, beta=0.3, source="made up for the test")
PLACEHOLDER = byte_llama_config(16, 1, max_len=64, head_dim=16)


def synthetic_runs(law: C.LossFit, budgets, sizes_at) -> list[I.IsoRun]:
    """Runs whose loss is ``law.loss(N, C / (6N))`` exactly, for the sizes ``sizes_at(C)``."""
    return [I.IsoRun(PLACEHOLDER, c, n, steps=1, batch=1, seq_len=1, loss=law.loss(n, c / (6 * n)))
            for c in budgets for n in sizes_at(c)]


@pytest.mark.parametrize("law", [C.HOFFMANN_2022, TINY_LAW], ids=["hoffmann", "tiny"])
def test_fit_isoflop_recovers_the_closed_form_exponents(law):
    budgets = [1e10, 3e10, 1e11, 3e11]
    # sizes placed the same way around each budget's true optimum: the fitted vertex misses that
    # optimum by the same factor at every budget (the profile's shape in ln N does not change with
    # C), so the exponents come out exact, and N_opt is within a few per cent
    spread = [math.exp(u) for u in (-1.2, -0.6, 0.0, 0.6, 1.2)]
    fit = I.fit_isoflop(synthetic_runs(law, budgets, lambda c: [C.compute_optimal(c, law)[0] * s for s in spread]))
    a, b = law.exponents
    assert fit.a == pytest.approx(a, abs=1e-6) and fit.b == pytest.approx(b, abs=1e-6)
    assert fit.a + fit.b == pytest.approx(1.0, abs=1e-12)
    for c, n, d in zip(fit.budgets, fit.n_opt, fit.d_opt):
        assert n == pytest.approx(C.compute_optimal(c, law)[0], rel=0.05) and 6 * n * d == pytest.approx(c)
    n, d = fit.predict(1e13)
    assert n == pytest.approx(C.compute_optimal(1e13, law)[0], rel=0.05) and 6 * n * d == pytest.approx(1e13)
    # the vertices' losses through a pure power law: within 1 % of the law's minimum between the
    # budgets (the parabola's bottom is not quite the curve's, and E + K·C^-γ is not a power law)
    true_min = law.loss(*C.compute_optimal(5e10, law))
    assert fit.predict_loss(5e10) == pytest.approx(true_min, rel=0.01)


def test_fit_isoflop_with_one_ladder_of_sizes_for_every_budget():
    # the realistic grid: the same sizes at every budget, the optimum moving through them
    budgets = [1e10, 3e10, 1e11]
    sizes = [4e3 * 1.6 ** k for k in range(9)]              # 4 K to 172 K parameters
    runs = synthetic_runs(TINY_LAW, budgets, lambda c: sizes)
    fit = I.fit_isoflop(runs)
    assert fit.a == pytest.approx(TINY_LAW.exponents[0], abs=0.02)
    assert list(fit.n_opt) == sorted(fit.n_opt)              # N_opt grows with C
    # the runs may come in any order: they are grouped by budget, and sorted by size within one
    shuffled = runs[::-1][1::2] + runs[::-1][0::2]
    assert I.fit_isoflop(shuffled) == fit
    profiles = I.group_by_budget(shuffled)
    assert list(profiles) == budgets and all([r.params for r in p] == sizes for p in profiles.values())


def test_fit_isoflop_refuses_a_valley_it_did_not_see():
    sizes = [1e3, 2e3, 4e3]                                  # all far left of the optimum: loss only falls
    with pytest.raises(ValueError, match="outside the sizes trained"):
        I.fit_isoflop(synthetic_runs(TINY_LAW, [1e10, 1e11], lambda c: sizes))
    with pytest.raises(ValueError, match="at least 2 budgets"):
        I.fit_isoflop(synthetic_runs(TINY_LAW, [1e10], lambda c: [1e4, 2e4, 4e4]))
    with pytest.raises(ValueError, match="budget 1e\\+11: fit_parabola needs at least 3 points"):
        I.fit_isoflop(synthetic_runs(TINY_LAW, [1e10], lambda c: [1e4, 2e4, 4e4])
                      + synthetic_runs(TINY_LAW, [1e11], lambda c: [1e4, 2e4]))
    untrained = I.isoflop_grid([1e10], [(16, 1)])
    with pytest.raises(ValueError, match="run_grid first"):
        I.fit_isoflop(untrained)
    with pytest.raises(TypeError, match=r"runs\[0\]"):
        I.fit_isoflop([(1e4, 2.0)])
    with pytest.raises(TypeError, match="runs"):
        I.fit_isoflop([])
    with pytest.raises(ValueError, match="flops"):
        I.fit_isoflop(synthetic_runs(TINY_LAW, [1e10, 1e11], lambda c: [1e4, 3e4, 9e4])).predict(0.0)


# ----------------------------------------------------------------------------------------------
# isoflop_grid: every run spends its budget
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("batch, seq_len", [(I.BATCH, I.SEQ_LEN), (4, 32)])
def test_grid_spends_each_budget(batch, seq_len):
    budgets = [2e10, 6e10, 2e11]
    plan = I.isoflop_grid(budgets, I.SIZES, tokens_per_parameter=None, batch=batch, seq_len=seq_len)
    assert len(plan) == len(budgets) * len(I.SIZES)
    assert [run.budget for run in plan] == [c for c in budgets for _ in I.SIZES]
    for run in plan:
        n = matmul_parameters(run.config)
        assert run.params == n and run.tokens == run.steps * batch * seq_len and run.loss is None
        assert run.flops == 6 * n * run.tokens and run.tokens_per_parameter == run.tokens / n
        # D is a whole number of steps: the nearest one, within half a step of the budget
        assert abs(run.flops - run.budget) <= 0.5 * 6 * n * batch * seq_len
        assert abs(run.flops / run.budget - 1) <= 1 / (2 * run.steps) <= 1 / (2 * I.MIN_STEPS)
        assert run.flops_with_attention == run.steps * train_step_flops(run.config, batch, seq_len) > run.flops
    # within a budget the larger model gets fewer tokens
    first = plan[:len(I.SIZES)]
    assert [r.params for r in first] == sorted(r.params for r in first)
    assert [r.tokens for r in first] == sorted((r.tokens for r in first), reverse=True)


def test_default_grid_slides_its_window_of_sizes():
    plan = I.isoflop_grid()
    widths = {c: [r.config.hidden_size for r in plan if r.budget == c] for c in I.BUDGETS}
    assert widths == {1.5e10: [8, 16, 24, 32], 3e10: [8, 16, 24, 32, 48], 6e10: [16, 24, 32, 48]}
    low, high = I.TOKENS_PER_PARAMETER_RANGE
    assert all(low <= r.budget / (6 * r.params ** 2) <= high for r in plan)
    assert all(r.config.num_hidden_layers == 1 and r.config.head_dim == I.HEAD_DIM for r in plan)
    assert all(abs(r.flops / r.budget - 1) < 2e-3 for r in plan)
    # a larger budget takes the next size in: 64x1 has 3 tokens per parameter at 8.8e10 FLOPs
    assert [r.config.hidden_size for r in I.isoflop_grid([9e10])] == [16, 24, 32, 48, 64]


def test_grid_takes_configs_and_checks_its_arguments():
    config = byte_llama_config(32, 1, max_len=64, head_dim=16)
    assert I.isoflop_grid([1e10], [config], tokens_per_parameter=None)[0].config is config
    with pytest.raises(ValueError, match="budgets: 1e\\+09 FLOPs buy"):
        I.isoflop_grid([1e9], [(64, 2)], tokens_per_parameter=None)
    with pytest.raises(ValueError, match="budgets: no size has between 3.0 and 400.0"):
        I.isoflop_grid([1e9], [(64, 2)])
    with pytest.raises(ValueError, match=r"budgets\[1\] must be positive"):
        I.isoflop_grid([1e10, 0.0], [(16, 1)])
    with pytest.raises(ValueError, match="distinct"):
        I.isoflop_grid([1e10, 1e10], [(16, 1)])
    with pytest.raises(TypeError, match="budgets"):
        I.isoflop_grid(1e10, [(16, 1)])
    with pytest.raises(TypeError, match=r"sizes\[1\]"):
        I.isoflop_grid([1e10], [(16, 1), 32])
    with pytest.raises(ValueError, match=r"sizes\[0\].*vocab_size"):
        I.isoflop_grid([1e10], [LlamaConfig(vocab_size=512, hidden_size=16, intermediate_size=64,
                                            num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1)])
    with pytest.raises(ValueError, match=r"sizes\[0\].*max_position_embeddings"):
        I.isoflop_grid([1e10], [byte_llama_config(16, 1, max_len=32, head_dim=16)])
    with pytest.raises(ValueError, match="hidden"):
        I.isoflop_grid([1e10], [(24, 1)], head_dim=16)         # 24 is not a multiple of 16
    with pytest.raises(TypeError, match="batch"):
        I.isoflop_grid([1e10], [(16, 1)], batch=2.0)
    with pytest.raises(ValueError, match="min_steps"):
        I.isoflop_grid([1e10], [(16, 1)], min_steps=0)
    with pytest.raises(TypeError, match="tokens_per_parameter"):
        I.isoflop_grid([1e10], [(16, 1)], tokens_per_parameter=20)
    with pytest.raises(ValueError, match=r"tokens_per_parameter\[0\]"):
        I.isoflop_grid([1e10], [(16, 1)], tokens_per_parameter=(0, 20))
    with pytest.raises(ValueError, match="low <= high"):
        I.isoflop_grid([1e10], [(16, 1)], tokens_per_parameter=(400, 3))


# ----------------------------------------------------------------------------------------------
# run_grid: a tiny real grid, end to end
# ----------------------------------------------------------------------------------------------

def test_run_grid_end_to_end_and_seeded():
    plan = I.isoflop_grid([1e8], [(16, 1), (32, 1)], tokens_per_parameter=None, batch=4, seq_len=16,
                          min_steps=10)
    assert [run.steps for run in plan] == [32, 11]
    threads = torch.get_num_threads()
    seen = []
    runs = I.run_grid(plan, eval_windows=8, callback=seen.append)
    assert torch.get_num_threads() == threads                 # restored after the one-thread runs
    assert seen == runs and [r.config for r in runs] == [r.config for r in plan]
    for run in runs:
        # it learned: below the uniform guess over 256 bytes, ln 256 = 5.55 nats
        assert math.isfinite(run.loss) and run.loss < math.log(256) - 1.0 and run.seconds > 0
    again = I.run_grid(plan, eval_windows=8)
    assert [r.loss for r in again] == [r.loss for r in runs]  # seeded, one thread: bit for bit
    other = I.run_grid(plan[:1], eval_windows=8, seed=1)
    assert other[0].loss != runs[0].loss


@pytest.mark.parametrize("kwargs, error, match", [
    ({"seed": -1}, ValueError, "seed"),
    ({"heldout": 1.0}, ValueError, "heldout"),
    ({"peak_lr": 0}, ValueError, "peak_lr"),
    ({"warmup_fraction": 1.0}, ValueError, "warmup_fraction"),
    ({"eval_windows": 0}, ValueError, "eval_windows"),
    ({"threads": 0}, ValueError, "threads"),
    ({"callback": 3}, TypeError, "callback"),
    ({"text": "no such text"}, ValueError, "no text named"),
])
def test_run_grid_bad_inputs(kwargs, error, match):
    plan = I.isoflop_grid([1e8], [(16, 1)], tokens_per_parameter=None, batch=4, seq_len=16, min_steps=10)
    with pytest.raises(error, match=match):
        I.run_grid(plan, **kwargs)


def test_run_grid_wants_a_plan():
    with pytest.raises(TypeError, match="plan"):
        I.run_grid([])
    with pytest.raises(TypeError, match=r"plan\[0\]"):
        I.run_grid([(16, 1)])
