"""Module 06's benchmark entries: registered, their formulas, and the whole-model measurement (recompute
and cached in turn, a paired speedup, the same tokens or an error row; on a tiny model, no timing asserted)."""

from __future__ import annotations

import pytest
import torch

import llmu  # noqa: F401
from llmu.bench.registry import REGISTRY
from llmu.kvcache import bench
from llmu.models import loading, tiny_llama

pytestmark = pytest.mark.kernels


def test_entries_are_registered_with_the_sizes_that_matter():
    assert REGISTRY["kv_cache_decode"] is bench.KV_CACHE_DECODE
    assert {s["T"] for s in bench.KV_CACHE_DECODE.cpu_sizes} >= {512, 2048}
    for size in bench.KV_CACHE_DECODE.cpu_sizes + bench.KV_CACHE_DECODE.gpu_sizes:
        assert size["new"] >= 64 and size["repeats"] >= 3 and size["recompute"] >= 1
    entry = REGISTRY["decode_attention"]
    assert set(entry.providers) == {"llmu triton", "llmu torch", "torch sdpa"}
    assert max(s["T"] for s in entry.gpu_sizes) >= 32768 and all(s["D"] == 128 for s in entry.gpu_sizes)


def test_decode_attention_formulas():
    size = {"B": 2, "H": 8, "Hkv": 2, "T": 10, "D": 4}
    assert bench.attention_flops(size) == 4 * 2 * 8 * 10 * 4
    assert bench.attention_bytes(size, 2) == 2 * (2 * 2 * 2 * 10 * 4 + 2 * 2 * 8 * 4)


def test_providers_agree_on_the_cpu_size(kdev):
    size = dict(bench.DECODE_ATTENTION.cpu_sizes[0], T=64)
    inputs = bench._attention_setup(size, kdev, torch.float32)
    ref = bench.DECODE_ATTENTION.providers["llmu torch"].fn(*inputs)
    for name in ("llmu triton", "torch sdpa"):
        torch.testing.assert_close(bench.DECODE_ATTENTION.providers[name].fn(*inputs), ref, atol=2e-5, rtol=0)


@pytest.mark.slow
def test_measure_decode_small(smollm2):
    model, _ = smollm2
    m = bench.measure_decode(model, 8, cached_steps=1)
    assert m["length"] == 8 and m["recompute_ms"] > 0 and m["cached_ms"] > 0 and m["mismatch"] is None
    assert m["speedup_min"] <= m["speedup"] <= m["speedup_max"] and m["rounds"] == 3
    flops_c, bytes_c = bench.decode_costs(model, 8, True, 4)
    flops_r, bytes_r = bench.decode_costs(model, 8, False, 4)
    assert flops_r > 7 * flops_c and bytes_c > bytes_r        # recompute: 8x the matmuls; cached: reads the cache


class _CacheGivesOtherTokens:
    """A model whose passes over the cache favour token 7: a broken cache, as the entry sees it."""

    def __init__(self, model):
        self.model, self.config, self.device = model, model.config, model.device

    def new_cache(self, **kw):
        return self.model.new_cache(**kw)

    def __call__(self, ids, cache=None, **kw):
        out = self.model(ids, cache=cache, **kw)
        if cache is not None and ids.shape[1] == 1:
            out.logits[..., 7] = 1e9
        return out


def _tiny():
    return tiny_llama(0, vocab_size=300)


def test_recompute_and_cached_run_in_turn_with_the_same_tokens():
    p = bench.compare_decode(_tiny(), 12, new_tokens=6, recompute_tokens=3, repeats=3)
    assert p.order == ["recompute", "cached"] * 3 and p.base == "recompute" and p.mismatches == {}
    assert len(p.outputs["recompute"][0]) == 3 and len(p.outputs["cached"][0]) == 7
    assert p.outputs["cached"][0][:3] == p.outputs["recompute"][0]
    m = bench.measure_decode(_tiny(), 12, cached_steps=2, repeats=2)
    assert m["rounds"] == 2 and m["mismatch"] is None and m["speedup_min"] <= m["speedup"] <= m["speedup_max"]
    with pytest.raises(ValueError, match="new_tokens and recompute_tokens"):
        bench.compare_decode(_tiny(), 12, new_tokens=0)


def test_entry_rows_on_a_tiny_model(monkeypatch):
    monkeypatch.setattr(loading, "load_model", lambda dtype, device: _tiny().to(dtype))
    rows = bench._run_decode({"T": 12, "new": 6, "recompute": 2, "repeats": 2}, "cpu")
    recompute, cached = rows
    assert [r["provider"] for r in rows] == ["recompute", "cached"]
    for r in rows:
        assert r.get("status", "ok") == "ok" and r["rounds"] == 2 and r["ratio_to"] == "recompute"
        assert r["ms"] == pytest.approx(1e3 / r["tokens_per_s"]) and r["speedup"] == cached["ratio"]
    assert recompute["ratio"] is None and recompute["tokens"] == 2 and cached["tokens"] == 6
    assert cached["ratio_min"] <= cached["ratio"] <= cached["ratio_max"]


def test_a_cache_that_changes_the_tokens_is_an_error_row(monkeypatch):
    monkeypatch.setattr(loading, "load_model", lambda dtype, device: _CacheGivesOtherTokens(_tiny().to(dtype)))
    monkeypatch.setattr(bench, "decode_costs", lambda model, length, cached, elem: (1.0, 1.0))
    recompute, cached = bench._run_decode({"T": 12, "new": 4, "recompute": 3, "repeats": 1}, "cpu")
    assert "status" not in recompute
    assert cached["status"] == "error" and "output differs from recompute's in round 1: token 1" in cached["reason"]
