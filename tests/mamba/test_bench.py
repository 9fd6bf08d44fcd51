"""Module 13's benchmark entry (``llmu.mamba.bench``): registered, formulas by hand, providers that agree.

- The three scans agree on one small float32 size with a ragged last chunk: the Triton kernel (in
  the interpreter here, on the kernel device) and the parallel scan against the sequential loop,
  ``rtol = atol = 1e-5`` as in ``tests/mamba/test_mamba_kernels.py`` (the same float32 operations
  bracketed differently). The two attentions agree too: module 08's kernel against SDPA,
  ``atol = 5e-5`` as in ``tests/flash/test_bench.py``.
- The entry has no entry-wide FLOP or byte count (its providers run two algorithms): the runner's
  rows carry ms only, and ``add_costs`` gives each row its own provider's counts, fractions of peak
  against float32 for the scan and the row's dtype for attention.
- The CPU sizes run through the runner with a stub timer (Triton rows skipped), bad sizes and the
  slow scans at long sequences are refused, and the figure has ``L`` on its x axis.
"""

from __future__ import annotations

import pytest
import torch

import llmu  # noqa: F401
from llmu.bench import runner
from llmu.bench.registry import REGISTRY, TOPICS, load_all
from llmu.mamba import bench

pytestmark = pytest.mark.kernels

ENTRY = bench.MAMBA_SELECTIVE_SCAN
SMALL = {"B": 2, "D": 32, "N": 16, "L": 40, "Dh": 16}   # Dh: the flash kernel takes 16 and up
TOL = dict(rtol=1e-5, atol=1e-5)


def _stub(fn):
    fn()
    return {"ms": 1.0}


def test_entry_is_registered_with_the_papers_setup():
    assert TOPICS.index("spec") < TOPICS.index("moe") < TOPICS.index("mamba") < TOPICS.index("engine")
    load_all()
    assert REGISTRY["mamba_selective_scan"] is ENTRY and ENTRY.module == "13_mamba"
    assert {n: p.kind for n, p in ENTRY.providers.items()} == {
        "llmu triton": "triton", "torch parallel": "torch", "torch sequential": "torch",
        "llmu flash": "triton", "torch sdpa": "builtin"}
    assert set(ENTRY.providers) == set(bench.SCAN_PROVIDERS + bench.ATTENTION_PROVIDERS)
    assert ENTRY.flops is None and ENTRY.bytes is None and ENTRY.x_axis == "L"
    # Gu & Dao (2023), appendix E.5: batch 1, width 1024, N = 16, L from 512 well past the 2k crossover
    assert {(s["B"], s["D"], s["N"], s["Dh"]) for s in ENTRY.gpu_sizes} == {(1, 1024, 16, 64)}
    Ls = [s["L"] for s in ENTRY.gpu_sizes]
    assert Ls == sorted(Ls) and Ls[0] == 512 and Ls[-1] >= 16384 and 2048 in Ls
    assert len({(s["B"], s["D"], s["N"], s["Dh"]) for s in ENTRY.cpu_sizes}) == 1
    assert max(s["L"] for s in ENTRY.cpu_sizes) <= bench.SEQUENTIAL_MAX_L


def test_formulas_by_hand():
    size = {"B": 2, "D": 8, "N": 4, "L": 10, "Dh": 4}
    assert bench.scan_flops(size) == 2 * 8 * 10 * (7 * 4 + 10) == 6080
    # u, delta, z read and out written (4*160), B and C read (2*80); A, D, delta_bias in float32
    assert bench.scan_bytes(size, 2) == 2 * (4 * 160 + 2 * 80) + 4 * (8 * 4 + 2 * 8) == 1792
    assert bench.attention_size(size) == {"B": 2, "H": 2, "Hkv": 2, "T": 10, "D": 4, "causal": True}
    assert bench.attention_flops(size) == 2 * 2 * 2 * 10 * 10 * 4 == 3200   # causal: half of 4·B·H·L²·Dh
    assert bench.attention_bytes(size, 2) == 2 * (4 * 2 * 2 * 10 * 4) + 4 * 2 * 2 * 10 == 1440
    assert bench.costs("torch sequential", size, 2) == (6080, 1792)
    assert bench.costs("torch sdpa", size, 2) == (3200, 1440)
    with pytest.raises(ValueError, match="provider"):
        bench.costs("naive", size, 2)


@pytest.mark.parametrize("bad, error", [
    ({"B": 1, "D": 8, "N": 4, "L": 10}, ValueError),               # no Dh
    ({"B": 1, "D": 10, "N": 4, "L": 10, "Dh": 4}, ValueError),     # D not a multiple of Dh
    ({"B": 1, "D": 8, "N": 0, "L": 10, "Dh": 4}, ValueError),
    ({"B": 1, "D": 8, "N": 4, "L": 10.0, "Dh": 4}, TypeError),
    ({"B": False, "D": 8, "N": 4, "L": 10, "Dh": 4}, TypeError),
    ((1, 8, 4, 10, 4), TypeError),
])
def test_bad_sizes_are_refused(bad, error):
    for fn in (bench.scan_flops, lambda s: bench.scan_bytes(s, 2), bench.attention_flops,
               lambda s: bench.scan_setup(s, "cpu", torch.float32)):
        with pytest.raises(error, match="size"):
            fn(bad)


def test_slow_scans_refuse_long_sequences():
    for fn, limit in ((bench.scan_sequential, bench.SEQUENTIAL_MAX_L), (bench.scan_parallel, bench.PARALLEL_MAX_L)):
        u = torch.empty(1, 1, limit + 1, device="meta")   # refused before anything is computed
        with pytest.raises(ValueError, match=f"not run above L={limit}"):
            fn(u, u, None, None, None, None, None, None)


def test_providers_agree_on_a_small_size(kdev):
    inputs = bench.scan_setup(SMALL, "cpu", torch.float32)
    assert inputs.u.shape == (2, 32, 40) and inputs.B.shape == (2, 16, 40) and inputs.q.shape == (2, 2, 40, 16)
    assert bool((inputs.A < 0).all())
    want = bench.scan_sequential(*inputs)
    torch.testing.assert_close(bench.scan_parallel(*inputs), want, **TOL)
    on_kdev = bench.ScanInputs(*(t.to(kdev) for t in inputs))
    torch.testing.assert_close(bench.scan_triton(*on_kdev).cpu(), want, **TOL)
    torch.testing.assert_close(bench.attention_flash(*on_kdev).cpu(), bench.attention_sdpa(*inputs),
                               atol=5e-5, rtol=0)


def test_cpu_sizes_run_and_add_costs():
    results = runner.run([ENTRY.name], device="cpu", sizes="cpu", entries=[ENTRY], timer=_stub)
    rows = results["rows"]
    assert len(rows) == len(ENTRY.cpu_sizes) * len(ENTRY.providers)
    for row in rows:
        if row["kind"] == "triton":
            assert row["status"] == "skipped" and row["reason"]
        else:
            assert row["status"] == "ok", row["reason"]
            assert row["ms"] == 1.0 and row["tflops"] is None and row["gbs"] is None   # no shared count
    assert bench.add_costs(results) is results
    for row in rows:
        if row["status"] != "ok":
            assert "tokens_per_s" not in row
            continue
        flops, nbytes = bench.costs(row["provider"], row["size"], 4)
        assert row["flops"] == flops and row["bytes"] == nbytes
        assert row["tflops"] == pytest.approx(flops / 1e-3 / 1e12) and row["gbs"] == pytest.approx(nbytes / 1e-3 / 1e9)
        assert row["tokens_per_s"] == pytest.approx(row["size"]["L"] / 1e-3)
        assert row["frac_flops"] is None   # no known peak on a CPU


def test_add_costs_uses_float32_peak_for_the_scan():
    size = dict(ENTRY.gpu_sizes[0])
    rows = [dict(entry=ENTRY.name, provider=p, status="ok", ms=2.0, size=size, dtype="bfloat16")
            for p in ("torch parallel", "torch sdpa")]
    rows.append(dict(entry="other", provider="torch sdpa", status="ok", ms=2.0, size=size, dtype="bfloat16"))
    bench.add_costs({"rows": rows, "environment": {"gpu_name": "NVIDIA H200"}})
    scan, attn, other = rows
    assert scan["frac_flops"] == pytest.approx(scan["tflops"] / 67.0)     # H200 float32, CUDA cores
    assert attn["frac_flops"] == pytest.approx(attn["tflops"] / 989.5)    # H200 bfloat16, tensor cores
    assert scan["gbs"] == pytest.approx(bench.scan_bytes(size, 2) / 2e-3 / 1e9)
    assert "flops" not in other


def test_add_costs_counts_your_kernel_as_a_scan():
    """The learner's kernel (``yours=`` of ``llmu.bench.run``, the notebook's benchmark cell) is a scan."""
    size = dict(ENTRY.gpu_sizes[0])
    assert bench.costs(runner.YOURS, size, 2) == bench.costs("llmu triton", size, 2)
    rows = [{"entry": ENTRY.name, "provider": runner.YOURS, "status": "ok", "ms": 2.0, "size": size,
             "dtype": "bfloat16"}]
    bench.add_costs({"rows": rows, "environment": {"gpu_name": "NVIDIA H200"}})
    assert rows[0]["flops"] == bench.scan_flops(size)
    assert rows[0]["frac_flops"] == pytest.approx(rows[0]["tflops"] / 67.0)     # H200 float32, as the scan


def test_figure_has_sequence_length_on_the_x_axis():
    pytest.importorskip("plotly")
    from llmu.bench import figure

    results = runner.run([ENTRY.name], device="cpu", sizes="cpu", entries=[ENTRY], timer=lambda fn: {"ms": 1.0})
    fig = figure(results, ENTRY.name, recorded=False)
    assert {tr.name.split(" · ")[0] for tr in fig.data} == {
        "scan: torch parallel", "scan: torch sequential", "attention: torch sdpa"}
    for trace in fig.data:
        assert list(trace.x) == [s["L"] for s in ENTRY.cpu_sizes]
    assert fig.layout.xaxis.title.text == "L"
