"""measure_machine, the GEMV sweep, token_latency and latency_metrics on the real model.

No test bounds how long a measurement took (that depends on the load of the machine): that the
budget bounds measure_machine's timed loops is checked on a clock the test moves itself."""

from __future__ import annotations

import math

import pytest
import torch

import llmu  # noqa: F401
from llmu.bench import machine
from llmu.roofline import gemv_sweep, latency_metrics, measure_machine, model_weight_bytes, token_latency

MAX_RUNS = 1000        # llmu.bench.machine.best_rate stops after this many timed runs


def test_measure_machine_is_positive_and_consistent():
    m = measure_machine(budget_s=1.0, matmul_n=256, copy_mb=16)
    assert m.peak_flops > 1e8 and m.bandwidth > 1e8        # any CPU of this century beats 0.1 G/s
    assert m.ridge == pytest.approx(m.peak_flops / m.bandwidth)
    assert m.copy_bytes == 16 * 2**20 and m.runs_matmul >= 3 and m.runs_copy >= 3
    # the loops stop at the budget or at their cap of runs, whichever comes first: never unbounded
    assert m.runs_matmul <= MAX_RUNS and m.runs_copy <= MAX_RUNS and m.seconds > 0
    roof = m.roof()
    assert roof.source == "measured" and roof.peak_flops == m.peak_flops
    assert "GFLOP/s" in str(m) and set(m.as_dict()) >= {"peak_flops", "bandwidth", "ridge"}
    assert torch.get_num_threads() >= 1


def test_the_budget_bounds_the_timed_loops(fake_clock):
    """How many runs the budget allows, on a clock the test controls (not the machine's, whose speed
    depends on its load). A timed run reads the clock twice (start, end), plus once for the budget
    check after the first three runs: each run costs 2 or 3 ticks, so a roof's half of the budget,
    ``half`` ticks, allows between ``half / 3`` and ``half / 2 + 1`` runs. Every run lasts exactly
    one tick, which gives the rates exactly."""
    tick = 2.0**-10                             # a power of two: the clock's sums are exact
    fake_clock(machine, tick)                   # each read of the clock moves it one tick
    budget = 2.0
    m = measure_machine(budget_s=budget, matmul_n=64, copy_mb=1)
    half = budget / 2 / tick                    # each roof's share of the budget, in ticks
    for runs in (m.runs_matmul, m.runs_copy):
        assert half / 3 <= runs <= half / 2 + 1
    assert m.peak_flops == 2 * 64**3 / tick
    assert m.bandwidth == 2 * m.copy_bytes / tick
    # a budget too large for the cap: the loops stop at MAX_RUNS runs
    fake_clock(machine, 2.0**-20)
    capped = measure_machine(budget_s=budget, matmul_n=16, copy_mb=1)
    assert capped.runs_matmul == capped.runs_copy == MAX_RUNS


def test_measure_machine_restores_threads():
    before = torch.get_num_threads()
    measure_machine(budget_s=0.2, matmul_n=64, copy_mb=1, threads=1)
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("kwargs, match", [
    (dict(budget_s=0), "budget_s"), (dict(matmul_n=8), "matmul_n"), (dict(copy_mb=0), "copy_mb"),
    (dict(threads=0), "threads"),
])
def test_measure_machine_bad_inputs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        measure_machine(**kwargs)
    with pytest.raises(TypeError, match="dtype"):
        measure_machine(dtype=torch.int32)


def test_gemv_sweep_rows():
    rows = gemv_sweep(shapes=[(256, 128)], dtypes=[torch.float32, torch.bfloat16], budget_s=0.05)
    assert [r["dtype"] for r in rows] == ["float32", "bfloat16"]
    for r in rows:
        assert r["weight_bytes"] == 256 * 128 * r["elem_bytes"]
        assert r["flops"] == 2 * 256 * 128 and r["ms"] > 0
        assert r["gbs"] == pytest.approx(r["bytes"] / (r["ms"] * 1e-3) / 1e9)


def test_token_latency_by_hand():
    lat = token_latency(10.0, [10.5, 10.7, 10.9, 11.1])
    assert lat.ttft == pytest.approx(0.5) and lat.ttlt == pytest.approx(1.1)
    assert lat.tpot == pytest.approx(0.2) and lat.n_tokens == 4
    assert lat.ttlt == pytest.approx(lat.ttft + (lat.n_tokens - 1) * lat.tpot)
    one = token_latency(0.0, [0.3])
    assert one.ttft == one.ttlt == 0.3 and math.isnan(one.tpot)


@pytest.mark.parametrize("start, times, match", [
    (0.0, [], "empty"), (1.0, [0.5, 2.0], "before start"), (0.0, [1.0, 0.9], "non-decreasing"),
    (0.0, [1.0, float("inf")], "finite"),
])
def test_token_latency_bad_inputs(start, times, match):
    with pytest.raises(ValueError, match=match):
        token_latency(start, times)


@pytest.mark.slow
def test_latency_metrics_on_the_model(smollm2):
    model, _ = smollm2
    rows = latency_metrics(model, prompt_lens=(4, 48), new_tokens=5, warmup=True)
    assert [r["prompt_len"] for r in rows] == [4, 48]
    for r in rows:
        n = r["new_tokens"]
        assert n == 5                                  # EOS is ignored: exactly new_tokens
        assert 0 < r["ttft_s"] < r["ttlt_s"]
        # By definition TTLT = TTFT + (n-1) * mean gap: only float rounding separates them.
        assert r["ttlt_s"] == pytest.approx(r["ttft_s"] + (n - 1) * r["tpot_s"], rel=1e-9)
        # With the median gap instead of the mean the identity is approximate: the mean and the
        # median of the gaps both lie in [min gap, max gap], so they differ by at most the spread.
        spread = r["gap_max_s"] - r["gap_min_s"]
        assert abs(r["ttlt_s"] - (r["ttft_s"] + (n - 1) * r["gap_median_s"])) <= (n - 1) * spread + 1e-9
        # The generator's own clocks sit inside ours: the prefill's forward pass is part of TTFT,
        # and prefill + decode steps are part of TTLT (ours also counts the loop around them).
        assert r["prefill_s"] <= r["ttft_s"]
        assert r["prefill_s"] + r["decode_s"] <= r["ttlt_s"] + 1e-6
        assert r["decode_path"] == "decode_step"       # the stock float32 model: llmu.models.decode_step


@pytest.mark.slow
def test_latency_metrics_bad_inputs(smollm2):
    model, _ = smollm2
    with pytest.raises(ValueError, match="new_tokens"):
        latency_metrics(model, (4,), new_tokens=1)
    with pytest.raises(ValueError, match="prompt_lens"):
        latency_metrics(model, (0,), new_tokens=2)
    with pytest.raises(ValueError, match="prompt_lens"):
        latency_metrics(model, (8192,), new_tokens=2)
    with pytest.raises(ValueError, match="repeats"):
        latency_metrics(model, (4,), new_tokens=2, repeats=0)


@pytest.mark.slow
def test_model_weight_bytes_counts_tied_weights_once(smollm2):
    model, _ = smollm2
    n = model_weight_bytes(model)
    # SmolLM2-135M: about 135 M parameters (embeddings tied to the output), 4 bytes each in fp32.
    assert 4 * 130e6 < n < 4 * 140e6
