"""The serving benchmark: every configuration produces the same greedy tokens, and rows are complete."""

from __future__ import annotations

import pytest

from llmu.bench.registry import REGISTRY, load_all
from llmu.engine import bench


def test_serving_entry_is_registered():
    load_all()
    entry = REGISTRY["serving_throughput"]
    assert entry.module == "16_serving_engine" and entry.run is not None
    assert entry.cpu_sizes[0]["requests"] == 32, "the issue's CPU target is stated for 32 requests"


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
