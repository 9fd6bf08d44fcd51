"""The benchmark entries of module 14 (llmu.parallel.bench), each run through ``llmu.bench.run`` on
real gloo processes at a small size.

``all_reduce``: registered, one launch of 2 ranks on small messages, and skipped with a reason
where NCCL has fewer than two GPUs.

``pipeline_bubble``: registered, one launch of 2 ranks, one micro-batch count, a 2 ms pad; every
row is checked for consistency (the theory is the formula, each rank's bubble is ``1 - busy /
makespan`` of its recorded times, the difference is the bubble minus the theory, the rows survive a
JSON round trip) but never for the measured value: how far the bubble lies above the formula
depends on the load of the machine, which is what the benchmark is there to show.
"""

from __future__ import annotations

import math

import pytest
import torch

import llmu  # noqa: F401  (sets the Triton mode before anything imports triton)
import llmu.bench
from llmu.bench.registry import TOPICS, load_all
from llmu.parallel import bench as PB, pipeline_parallel as PP
from llmu.parallel.comm import bus_bandwidth


def test_entry_is_registered_for_module_14():
    assert "parallel" in TOPICS
    entry = load_all()["all_reduce"]
    assert entry is PB.ALL_REDUCE and entry.module == "14_parallelism" and entry.run is not None
    assert PB.CPU_BYTES == sorted(PB.CPU_BYTES) and all(n % 4 == 0 for n in PB.CPU_BYTES + PB.GPU_BYTES)


def test_run_measures_two_gloo_ranks():
    sizes = [4096, 65536, 1 << 20]
    results = llmu.bench.run(names=["all_reduce"], device="cpu",
                             sizes=[{"p": 2, "bytes_list": sizes, "repeats": 3}])
    rows = results["rows"]
    assert [r["status"] for r in rows] == ["ok"] * 3, [r["reason"] for r in rows]
    assert [r["x"] for r in rows] == sizes and all(r["x_key"] == "bytes" for r in rows)
    for r in rows:
        assert r["entry"] == "all_reduce" and r["module"] == "14_parallelism" and r["provider"] == "gloo"
        assert r["size"] == {"p": 2, "bytes": r["x"]} and r["n_samples"] == 3
        assert 0 < r["ms_min"] <= r["ms"] <= r["ms_max"]
        # the bus bandwidth column is nccl-tests' formula on the median time
        assert math.isclose(r["gbs"], bus_bandwidth(r["x"], r["ms"] / 1e3, 2) / 1e9, rel_tol=1e-9)
    llmu.bench.figure(results, "all_reduce", metric="gbs")     # the notebook's picture builds


def test_nccl_needs_two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    rows = PB.all_reduce_rows({}, "cuda")
    assert len(rows) == 1 and rows[0]["status"] == "skipped" and "2 GPUs" in rows[0]["reason"]


# ---------------------------------------------------------------------------------------------
# pipeline_bubble
# ---------------------------------------------------------------------------------------------


def test_pipeline_entry_is_registered_for_module_14():
    entry = load_all()["pipeline_bubble"]
    assert entry is PB.PIPELINE_BUBBLE and entry.module == "14_parallelism" and entry.run is not None
    assert entry.x_axis == "m" and [s["p"] for s in entry.cpu_sizes] == [2, 4]


def test_pipeline_rows_are_consistent(tmp_path):
    p, m, pad = 2, 2, 0.002
    results = llmu.bench.run(names=["pipeline_bubble"], device="cpu",
                             sizes=[{"p": p, "micro_batches": [m], "forward_s": pad}])
    rows = results["rows"]
    assert [r["status"] for r in rows] == ["ok"] * 2, [r["reason"] for r in rows]
    assert [r["provider"] for r in rows] == list(PP.SCHEDULES)
    theory = (p - 1) / (m + p - 1)
    for r in rows:
        assert r["entry"] == "pipeline_bubble" and r["module"] == "14_parallelism" and r["device"] == "cpu"
        assert r["size"] == {"p": p, "m": m} and r["x"] == m and r["x_key"] == "m"
        assert r["forward_s"] == pad and r["backward_s"] == 2 * pad
        assert r["bubble_theory"] == pytest.approx(theory, abs=1e-15)
        assert r["makespan_ideal_s"] == pytest.approx((m + p - 1) * 3 * pad)
        assert r["ms"] == pytest.approx(1e3 * r["makespan_s"]) and r["makespan_s"] > 0
        # each rank's bubble, as the rank reported it, is 1 - busy / makespan of its recorded times
        assert len(r["bubble_ranks"]) == len(r["busy_s"]) == p
        for reported, busy in zip(r["bubble_ranks"], r["busy_s"]):
            assert 0 < busy <= r["makespan_s"] + 1e-12
            assert reported == pytest.approx(1 - busy / r["makespan_s"], abs=1e-9)
        assert r["bubble"] == pytest.approx(sum(r["bubble_ranks"]) / p) and r["bubble_max"] == max(r["bubble_ranks"])
        assert r["bubble_diff"] == pytest.approx(r["bubble"] - r["bubble_theory"])
        assert r["grad_error"] <= PB.PIPELINE_GRAD_RTOL
        assert all(r[k] is None or r[k] >= 0 for k in ("load_avg_start", "load_avg_end"))
        assert f"theory {theory:.3f}" in r["reason"]
    # the results file is plain JSON and reads back as it was written
    saved = llmu.bench.load(llmu.bench.save(results, tmp_path / "pipeline.json"))
    assert saved["rows"] == rows


def test_pipeline_entry_skips_a_gpu_and_names_bad_sizes():
    (row,) = PB.pipeline_bubble_rows({"p": 2}, "cuda")
    assert row["status"] == "skipped" and "--device cpu" in row["reason"]
    for size, key in (({"p": 0}, "p"), ({"micro_batches": [0]}, "micro_batches"),
                      ({"schedules": ["zb"]}, "schedules"), ({"forward_s": 0}, "forward_s")):
        with pytest.raises(ValueError, match=rf"size\['{key}'\]"):
            PB.pipeline_bubble_rows(size, "cpu")
