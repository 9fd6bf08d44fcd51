"""Module 06's benchmark entries: registered, their formulas, and the whole-model measurement."""

from __future__ import annotations

import pytest
import torch

import llmu  # noqa: F401
from llmu.bench.registry import REGISTRY
from llmu.kvcache import bench

pytestmark = pytest.mark.kernels


def test_entries_are_registered_with_the_sizes_that_matter():
    assert REGISTRY["kv_cache_decode"] is bench.KV_CACHE_DECODE
    assert {s["T"] for s in bench.KV_CACHE_DECODE.cpu_sizes} >= {512, 2048}
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
    assert m["length"] == 8 and m["recompute_ms"] > 0 and m["cached_ms"] > 0
    assert m["speedup"] == m["recompute_ms"] / m["cached_ms"]
    flops_c, bytes_c = bench.decode_costs(model, 8, True, 4)
    flops_r, bytes_r = bench.decode_costs(model, 8, False, 4)
    assert flops_r > 7 * flops_c and bytes_c > bytes_r        # recompute: 8x the matmuls; cached: reads the cache
