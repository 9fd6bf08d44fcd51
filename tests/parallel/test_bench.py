"""The ``all_reduce`` benchmark entry (llmu.parallel.bench): registered for module 14, measured on
real gloo processes through ``llmu.bench.run`` (one launch of 2 ranks, small messages), and skipped
with a reason where NCCL has fewer than two GPUs."""

from __future__ import annotations

import math

import torch

import llmu  # noqa: F401  (sets the Triton mode before anything imports triton)
import llmu.bench
from llmu.bench.registry import TOPICS, load_all
from llmu.parallel import bench as PB
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
