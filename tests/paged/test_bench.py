"""Module 09's benchmark entries: registered, their formulas by hand, providers that agree, a CPU run.

Providers are compared in float32 with atol 2e-5: the same attention computed by different
kernels (paged and contiguous, Triton and PyTorch), which differ by rounding only.
"""

from __future__ import annotations

import pytest
import torch

import llmu  # noqa: F401
from llmu.bench.registry import LOAD_ERRORS, REGISTRY, TOPICS, load_all
from llmu.paged import bench

pytestmark = pytest.mark.kernels

ENTRIES = [bench.PAGED_DECODE, bench.PAGED_PREFILL]


def test_entries_are_registered_with_the_sizes_that_matter():
    assert "paged" in TOPICS
    load_all(strict=False)               # another topic's bench failing to import is not this test's concern
    assert "llmu.paged.bench" not in LOAD_ERRORS
    for entry in ENTRIES:
        assert REGISTRY[entry.name] is entry and entry.module == "09_paged_attention"
        assert set(entry.providers) == {"llmu triton", "llmu triton contiguous", "llmu torch"}
        assert [p.kind for p in entry.providers.values()] == ["triton", "triton", "torch"]
        assert "contiguous" in entry.providers["llmu triton contiguous"].label
        assert entry.gpu_dtype == torch.bfloat16
        assert all(s["D"] == 128 and s["Hkv"] == 8 and s["block_size"] == 16 for s in entry.gpu_sizes)
    dec = bench.PAGED_DECODE.gpu_sizes
    assert {s["B"] for s in dec} == {32, 64} and {s["H"] for s in dec} == {32, 64}
    assert min(s["T"] for s in dec) == 1024 and max(s["T"] for s in dec) == 8192
    pre = bench.PAGED_PREFILL.gpu_sizes
    assert any(s["q"] == s["ctx"] for s in pre) and any(s["q"] < s["ctx"] for s in pre)


def test_decode_formulas_by_hand():
    # B=2 sequences of T=40 positions, H=8 query heads on Hkv=2, D=4, blocks of 16 (3 per sequence)
    size = {"B": 2, "H": 8, "Hkv": 2, "T": 40, "D": 4, "block_size": 16}
    assert bench.decode_flops(size) == 4 * 2 * 8 * 40 * 4
    kv = 2 * 2 * 2 * 40 * 4            # K and V: B * Hkv * T * D each
    qo = 2 * 2 * 8 * 4                 # q and out: B * H * D each
    tables = 2 * 3 * 4                 # B * ceil(40 / 16) int32
    assert bench.decode_bytes(size, 2) == 2 * (kv + qo) + tables


def test_prefill_formulas_by_hand():
    # one chunk of q=3 queries ending a context of 5: they see 3, 4 and 5 keys = 12 pairs
    assert bench.prefill_pairs(5, 3) == 12
    assert bench.prefill_pairs(4, 4) == 1 + 2 + 3 + 4
    size = {"B": 2, "H": 6, "Hkv": 3, "ctx": 5, "q": 3, "D": 8, "block_size": 16}
    assert bench.prefill_flops(size) == 4 * 2 * 6 * 8 * 12
    assert bench.prefill_bytes(size, 4) == 4 * (2 * 2 * 3 * 5 * 8 + 2 * 2 * 6 * 3 * 8) + 2 * 1 * 4


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e.name)
def test_providers_agree_on_a_small_size(entry, kdev):
    size = dict(entry.cpu_sizes[0])
    size.update({"T": 40} if "T" in size else {"ctx": 40, "q": 24})
    inputs = entry.setup(size, kdev, torch.float32)
    ref = entry.providers["llmu torch"].fn(*inputs)
    for name in ("llmu triton", "llmu triton contiguous"):
        got = entry.providers[name].fn(*inputs)
        if got.ndim == 4:   # FlashAttention's (B, H, q, D) -> packed (B * q, H, D)
            got = got.transpose(1, 2).flatten(0, 1)
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=0)


def test_setup_shuffles_blocks_and_copies_them_contiguously():
    size = {"B": 2, "H": 4, "Hkv": 2, "T": 40, "D": 16, "block_size": 16}
    q, kc, vc, tables, lens, cu, k, v = bench.PAGED_DECODE.setup(size, "cpu", torch.float32)
    assert kc.shape == (6, 16, 2, 16) and tables.shape == (2, 3) and lens.tolist() == [40, 40]
    assert sorted(tables.flatten().tolist()) == list(range(6)) and tables.flatten().tolist() != list(range(6))
    assert cu.tolist() == [0, 1, 2] and k.shape == (2, 2, 40, 16)
    # position 17 of sequence 1: row 1 of its second block
    assert torch.equal(k[1, :, 17], kc[tables[1, 1], 1]) and torch.equal(v[1, :, 17], vc[tables[1, 1], 1])


def test_cpu_sizes_run_through_the_runner(check_cpu_sizes_run):
    check_cpu_sizes_run(ENTRIES)


def test_kv_waste_entry_reports_every_policy():
    from llmu.bench.registry import REGISTRY, load_all

    load_all()
    entry = REGISTRY["kv_waste"]
    assert entry.module == "09_paged_attention" and entry.run is not None
    rows = entry.run({"requests": 16, "max_len": 512, "block_size": 16}, "cpu")
    by = {r["provider"]: r for r in rows}
    assert set(by) == {"max_len", "max_tokens", "exact", "paged"}
    assert by["paged"]["kv_waste"] < by["exact"]["kv_waste"] < by["max_len"]["kv_waste"]
    assert all(0 <= r["kv_waste"] <= r["kv_waste_peak"] < 1 for r in rows)
