"""The serving benchmark: every configuration in turn, round after round, with paired speedups; every
configuration produces the same greedy tokens (or its row is an error), and rows are complete."""

from __future__ import annotations

import pytest

from llmu.bench.registry import REGISTRY, load_all
from llmu.engine import bench
from llmu.models import loading, tiny_llama

CONFIGS = ["llmu sequential", "static batching", "continuous, contiguous KV", "continuous, paged KV",
           "paged + prefix caching"]
#: a workload small enough for a tiny model (ids from 100 up: a vocabulary of 300)
TINY = dict(requests=4, new=4, new_min=2, prompt_min=4, prompt_max=10, batch=2, kv_seqs=2, max_model_len=32,
            sequential=2, shared_prefix=16)


def _tiny():
    return tiny_llama(0, vocab_size=300, max_position_embeddings=256)


def test_serving_entry_is_registered():
    load_all()
    entry = REGISTRY["serving_throughput"]
    assert entry.module == "16_serving_engine" and entry.run is not None
    assert entry.cpu_sizes[0]["requests"] == 32, "the issue's CPU target is stated for 32 requests"
    for size in entry.cpu_sizes + entry.gpu_sizes:
        assert size["new"] >= 64 and size["repeats"] >= 3


def test_configurations_run_in_turn_with_the_same_tokens():
    p = bench.compare_serving(_tiny(), **TINY, transformers=False, repeats=2)
    assert p.order == CONFIGS * 2 and p.base == "llmu sequential" and p.reference == "continuous, paged KV"
    assert p.mismatches == {}
    assert p.outputs["llmu sequential"][0] == p.outputs["continuous, paged KV"][0][:2]
    assert p.ratio("static batching")["n"] == 2 and p.info["static batching"][0]["steps"] > 0


def test_entry_rows_on_a_tiny_model(monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setattr(loading, "load_model", lambda dtype, device: _tiny().to(dtype))
    rows = bench._run(dict(TINY, repeats=2), "cpu")
    assert [r["provider"] for r in rows] == ["transformers sequential"] + CONFIGS
    for r in rows:
        assert r.get("status", "ok") == "ok", r.get("reason")
        assert r["rounds"] == 2 and r["ratio_to"] == "transformers sequential" and r["tokens_per_s"] > 0
        assert r["ms"] == pytest.approx(1e3 / r["tokens_per_s"]) and r["load_avg_end"] is not None
    base, paged = rows[0], rows[4]
    assert base["ratio"] is None and base["speedup"] == 1.0
    assert paged["speedup"] == paged["ratio"] and paged["ratio_min"] <= paged["ratio"] <= paged["ratio_max"]
    assert paged["steps"] > 0 and 0 <= paged["kv_waste"] <= 1


def test_a_configuration_with_other_tokens_is_an_error_row(monkeypatch):
    monkeypatch.setattr(loading, "load_model", lambda dtype, device: _tiny().to(dtype))
    real = bench._sequential_llmu

    def off_by_one(model, prompts, new):
        r = real(model, prompts, new)
        r["output"][1][0] = (r["output"][1][0] + 1) % 300
        return r

    monkeypatch.setattr(bench, "_sequential_llmu", off_by_one)
    real_find = bench.importlib.util.find_spec
    monkeypatch.setattr(bench.importlib.util, "find_spec",  # as without transformers: no row of its
                        lambda name, *a: None if name == "transformers" else real_find(name, *a))
    rows = {r["provider"]: r for r in bench._run(dict(TINY, repeats=1), "cpu")}
    bad = rows["llmu sequential"]
    assert bad["status"] == "error"
    assert "differs from continuous, paged KV's in round 1: request 1, token 0" in bad["reason"]
    assert all("status" not in r for name, r in rows.items() if name != "llmu sequential")


@pytest.mark.slow
def test_every_configuration_computes_the_same_tokens(smollm2):
    model, _ = smollm2
    res = bench.measure_serving(model, requests=4, new=4, new_min=2, prompt_min=8, prompt_max=20, batch=2,
                                kv_seqs=2, max_model_len=64, sequential=4, shared_prefix=16, transformers=False)
    assert list(res) == ["llmu sequential", "static batching", "continuous, contiguous KV",
                         "continuous, paged KV", "paged + prefix caching"]
    want = res["llmu sequential"]["outputs"]
    lengths = [len(o) for o in want]
    assert all(2 <= n <= 4 for n in lengths) and len(set(lengths)) > 1, "new_min..new: varied output lengths"
    for name, r in res.items():
        assert r["tokens"] == sum(lengths) and r["tokens_per_s"] > 0
        assert r["outputs"] == want, f"{name} generated different tokens than one-at-a-time generation"
    assert res["llmu sequential"]["speedup"] == pytest.approx(1.0)
    assert res["continuous, contiguous KV"]["peak_running"] <= 2, \
        "reserving max_model_len per request: two contexts' worth of blocks fit two requests"
    assert res["paged + prefix caching"]["prefix_cached_tokens"] > 0


def test_workload_is_deterministic_and_checked():
    a = bench.serving_workload(1000, 5, 3, 9, shared_prefix=4, seed=1)
    assert a == bench.serving_workload(1000, 5, 3, 9, shared_prefix=4, seed=1)
    assert all(p[:4] == a[0][:4] and 7 <= len(p) <= 13 for p in a)
    with pytest.raises(ValueError, match="prompt_min"):
        bench.serving_workload(1000, 5, 10, 9)


@pytest.mark.slow
def test_transformers_row_is_the_baseline(smollm2):
    pytest.importorskip("transformers")
    model, _ = smollm2
    res = bench.measure_serving(model, requests=2, new=3, new_min=2, prompt_min=4, prompt_max=8, batch=2, kv_seqs=1,
                                max_model_len=32, sequential=2, transformers=True)
    assert list(res)[0] == "transformers sequential"
    assert res["transformers sequential"]["speedup"] == pytest.approx(1.0)
    assert res["transformers sequential"]["tokens"] == res["llmu sequential"]["tokens"]


def test_batch1_entry_compares_the_engine_with_generate_in_turn(monkeypatch):
    entry = load_all()["engine_batch1"]
    assert entry.run is not None and all(s["new"] >= 64 and s["repeats"] >= 3 for s in entry.cpu_sizes + entry.gpu_sizes)
    monkeypatch.setattr(loading, "load_model", lambda dtype, device: _tiny().to(dtype))
    p = bench.compare_batch1(_tiny(), prompt=8, new=6, repeats=2)
    assert p.order == ["engine, batch 1", "llmu generate"] * 2 and p.base == "llmu generate"
    assert p.mismatches == {} and p.outputs["engine, batch 1"][0] == p.outputs["llmu generate"][0]
    rows = {r["provider"]: r for r in bench._run_batch1({"prompt": 8, "new": 6, "repeats": 2}, "cpu")}
    assert rows["engine, batch 1"]["ratio_to"] == "llmu generate" and rows["engine, batch 1"]["ratio"] > 0
    assert rows["llmu generate"]["ratio"] is None and all("status" not in r for r in rows.values())


def test_batch1_entry_fails_an_engine_with_other_tokens(monkeypatch):
    monkeypatch.setattr(loading, "load_model", lambda dtype, device: _tiny().to(dtype))
    real = bench._engine_run

    def off_by_one(*a, **kw):
        r = real(*a, **kw)
        r["output"][0][2] = (r["output"][0][2] + 1) % 300
        return r

    monkeypatch.setattr(bench, "_engine_run", off_by_one)
    rows = {r["provider"]: r for r in bench._run_batch1({"prompt": 8, "new": 6, "repeats": 1}, "cpu")}
    assert rows["engine, batch 1"]["status"] == "error" and "token 2: " in rows["engine, batch 1"]["reason"]
