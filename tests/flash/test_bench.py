"""Module 08's benchmark entries: registered, their formulas, providers that agree."""

from __future__ import annotations

import pytest
import torch

import llmu  # noqa: F401
from llmu.bench.registry import REGISTRY, TOPICS, load_all
from llmu.flash import bench

pytestmark = pytest.mark.kernels


def test_entries_are_registered_with_the_sizes_that_matter():
    assert "flash" in TOPICS
    load_all()
    for entry in (bench.FLASH_FORWARD, bench.FLASH_FORWARD_BACKWARD):
        assert REGISTRY[entry.name] is entry and entry.module == "08_flash_attention"
        assert set(entry.providers) == {"llmu triton", "llmu torch", "torch sdpa", "naive"}
        ts = {s["T"] for s in entry.gpu_sizes}
        assert min(ts) == 512 and max(ts) == 16384
        assert {s["D"] for s in entry.gpu_sizes} == {64, 128}
        assert {s["causal"] for s in entry.gpu_sizes} == {True, False}
        assert all(s["B"] * s["T"] == 16384 and s["H"] * s["D"] == 2048 for s in entry.gpu_sizes)


def test_flop_formulas_follow_the_papers():
    size = {"B": 2, "H": 3, "Hkv": 3, "T": 10, "D": 4, "causal": False}
    assert bench.fwd_flops(size) == 4 * 2 * 3 * 10 * 10 * 4
    assert bench.fwd_flops(dict(size, causal=True)) == bench.fwd_flops(size) / 2
    assert bench.fwd_bwd_flops(size) == 3.5 * bench.fwd_flops(size)
    assert bench.fwd_bytes(size, 2) == 2 * (2 * 2 * 3 * 10 * 4 + 2 * 2 * 3 * 10 * 4) + 4 * 2 * 3 * 10
    assert bench.fwd_bwd_bytes(size, 2) > 2 * bench.fwd_bytes(size, 2)


@pytest.mark.parametrize("entry", [bench.FLASH_FORWARD, bench.FLASH_FORWARD_BACKWARD], ids=lambda e: e.name)
def test_providers_agree_on_a_small_size(entry, kdev):
    size = {"B": 1, "H": 2, "Hkv": 2, "T": 48, "D": 32, "causal": True}
    setup = entry.setup(size, kdev, torch.float32)
    ref = entry.providers["naive"].fn(*setup)
    for name in ("llmu triton", "llmu torch", "torch sdpa"):
        got = entry.providers[name].fn(*entry.setup(size, kdev, torch.float32))
        if isinstance(ref, torch.Tensor):
            torch.testing.assert_close(got, ref, atol=5e-5, rtol=0)
        else:
            for g, r in zip(got, ref):
                torch.testing.assert_close(g, r, atol=5e-5, rtol=0)


def test_slow_providers_refuse_big_sizes():
    q = torch.zeros(1, 1, bench.TORCH_TILED_MAX_T + 1, 16, device="cpu")
    with pytest.raises(ValueError, match="not run above"):
        bench._tiled(q, q, q, True)
