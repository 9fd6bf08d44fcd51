"""Recorded GPU results: where they live (package data), how they are labelled, and the sentence
the notebooks print about them.

The fake results files here are written by the tests into a temporary folder and never committed:
the only files in ``llmu/data/gpu_results/`` are real GPU runs of ``benchmarks/gpu.sh``.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
import torch

import llmu
import llmu.bench as bench
from llmu.bench import results
from llmu.bench.registry import Entry, Provider

ROOT = Path(__file__).resolve().parents[2]


def _entry(name="recorded_test") -> Entry:
    return Entry(
        name=name, module="99_test", description="y = 2x",
        providers={"ref": Provider(lambda x: x * 2, "torch", "llmu reference")},
        setup=lambda size, device, dtype: (torch.arange(size["N"], device=device, dtype=dtype),),
        flops=lambda s: s["N"], bytes=lambda s, e: 2 * s["N"] * e, x_axis="N",
        cpu_sizes=[{"N": 256}, {"N": 4096}],
    )


def _timer(fn):
    fn()
    return {"ms": 0.01, "ms_min": 0.01, "ms_max": 0.01, "ms_p20": 0.01, "ms_p80": 0.01, "n_samples": 1}


def _fake_gpu_file(folder: Path, name="recorded_test", gpu="NVIDIA H200", date="2025-03-04") -> Path:
    """A results file as gpu.sh would write it on ``gpu``: measured on the CPU here, relabelled."""
    res = bench.run(entries=[_entry(name)], device="cpu", timer=_timer)
    res["created"] = f"{date}T05:06:07+00:00"
    res["environment"].update(gpu_name=gpu, torch="2.11.0+cu130", triton="3.6.0", cuda="13.0")
    return bench.save(res, folder / f"{gpu.split()[-1].lower()}-{date}.json")


# ---------------------------------------------------------------------------------------------
# Where recorded results live
# ---------------------------------------------------------------------------------------------

def test_results_dir_is_package_data():
    """The folder is inside the llmu package, documented, and listed in pyproject.toml's package
    data, so a wheel install (Colab's `pip install git+...`) carries the recorded files."""
    package = Path(llmu.__file__).resolve().parent
    assert results.RESULTS_DIR == package / "data" / "gpu_results"
    assert (results.RESULTS_DIR / "README.md").is_file()
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "data/gpu_results/*.json" in package_data["llmu"]
    assert not (ROOT / "benchmarks" / "results").exists(), "recorded results moved to llmu/data/gpu_results/"


def test_results_dir_honours_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("LLMU_RESULTS_DIR", raising=False)
    assert bench.results_dir() == results.RESULTS_DIR
    monkeypatch.setenv("LLMU_RESULTS_DIR", str(tmp_path))
    assert bench.results_dir() == tmp_path


def test_committed_results_were_measured_on_a_gpu():
    """Every shipped results file (there may be none yet) loads and names the GPU it was measured
    on: no CPU rehearsal, no hand-made file."""
    for path in sorted(results.RESULTS_DIR.glob("*.json")):
        env = bench.load(path)["environment"]
        assert env.get("gpu_name") and str(env.get("bench_device", "")).startswith("cuda"), path.name
        assert env.get("torch") and env.get("cuda"), f"{path.name}: the versions label the notebooks' rows"


# ---------------------------------------------------------------------------------------------
# Labels and the notebooks' sentence
# ---------------------------------------------------------------------------------------------

def test_run_label_names_gpu_date_and_versions(tmp_path):
    data = bench.load(_fake_gpu_file(tmp_path))
    assert bench.run_label(data) == "H200, 2025-03-04 (torch 2.11.0, Triton 3.6.0, CUDA 13.0)"
    data["environment"].update(triton=None, cuda=None)
    assert bench.run_label(data) == "H200, 2025-03-04 (torch 2.11.0)"


def test_summary_says_plainly_when_nothing_is_recorded(tmp_path):
    assert bench.recorded_summary(directory=tmp_path / "missing").startswith(
        "No GPU results have been recorded yet;")
    assert bench.recorded_summary("gemm", directory=tmp_path).startswith(
        "No GPU results for gemm have been recorded yet;")


def test_summary_names_each_recorded_run(tmp_path, monkeypatch):
    _fake_gpu_file(tmp_path)
    _fake_gpu_file(tmp_path, gpu="NVIDIA A100-SXM4-80GB", date="2025-04-01")
    monkeypatch.setenv("LLMU_RESULTS_DIR", str(tmp_path))
    text = bench.recorded_summary("recorded_test")
    assert text == ("GPU results for recorded_test recorded on A100-SXM4-80GB, 2025-04-01 (torch 2.11.0, "
                    "Triton 3.6.0, CUDA 13.0); H200, 2025-03-04 (torch 2.11.0, Triton 3.6.0, CUDA 13.0).")
    assert bench.recorded_summary().startswith("GPU results recorded on A100")
    assert bench.recorded_summary("other_entry").startswith("No GPU results for other_entry have been recorded yet")
    rows = bench.recorded("recorded_test")
    assert {r["run_label"] for r in rows} == {
        "H200, 2025-03-04 (torch 2.11.0, Triton 3.6.0, CUDA 13.0)",
        "A100-SXM4-80GB, 2025-04-01 (torch 2.11.0, Triton 3.6.0, CUDA 13.0)"}


def test_figure_labels_recorded_runs_in_legend_and_title(tmp_path, monkeypatch):
    _fake_gpu_file(tmp_path)
    monkeypatch.setenv("LLMU_RESULTS_DIR", str(tmp_path))
    live = bench.run(entries=[_entry()], device="cpu", timer=_timer)
    fig = bench.figure(live, "recorded_test")
    dashed = [t for t in fig.data if t.line.dash == "dash"]
    assert len(fig.data) == 2 and len(dashed) == 1
    assert dashed[0].name == "llmu reference · H200 2025-03-04"
    assert "dashed: recorded on H200, 2025-03-04 (torch 2.11.0, Triton 3.6.0, CUDA 13.0)" in fig.layout.title.text

    # recorded rows given as the rows to plot (notebook 16) are drawn dashed and labelled too
    fig = bench.figure(bench.recorded("recorded_test"), "recorded_test", recorded=False)
    assert [t.line.dash for t in fig.data] == ["dash"] and "recorded on H200" in fig.layout.title.text


def test_figure_says_when_no_gpu_results_are_recorded(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMU_RESULTS_DIR", str(tmp_path))
    live = bench.run(entries=[_entry()], device="cpu", timer=_timer)
    fig = bench.figure(live, "recorded_test")
    assert [t.line.dash for t in fig.data] == ["solid"]
    assert "no GPU results for recorded_test have been recorded yet" in fig.layout.title.text
    assert "<br>" not in bench.figure(live, "recorded_test", recorded=False).layout.title.text


def test_broken_files_are_skipped_with_a_warning(tmp_path):
    (tmp_path / "broken.json").write_text(json.dumps({"rows": [], "schema_version": -1}))
    with pytest.warns(UserWarning, match="skipping broken.json"):
        assert bench.recorded_summary(directory=tmp_path).startswith("No GPU results")
