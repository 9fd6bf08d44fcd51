"""``benchmarks/gpu.sh`` rehearsed on the CPU (``LLMU_GPU_ALLOW_CPU=1``), and the report it relies on.

The GPU script runs once per GPU session, unattended, where a mistake costs the session: these
tests run it here on a tiny selection (a kernel test file of their own, one or two benchmark
entries, a short total budget) and check that its summary tells the truth: the counts of each test
slice, the priority order (fp16/bf16 first), and, when things go wrong, one named line per
failure and a non-zero exit status. Everything the script writes goes to a temporary folder
(``LLMU_GPU_LOGS``; a rehearsal keeps its results file there too, never in the package's recorded
GPU results).

The rehearsals take about 30 and 45 s on two busy cores; the rest of the file is fast.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu.sh"
sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_report  # noqa: E402  (benchmarks/gpu_report.py)

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="the GPU script needs bash and coreutils' timeout")

# A kernel test file of the rehearsals' own: one test the first slice must take (its name says
# half precision), two for the second slice. The folder must not contain a word of the first slice's
# -k expression ("gpu", "fp16", ...): -k also matches folder names.
KERNEL_TESTS = '''
import pytest
import torch

import llmu  # noqa: F401
from llmu.runtime import kernel_device
from llmu.welcome import add


@pytest.mark.kernels
def test_add_half_precision_ragged():
    x = torch.arange(37, dtype=torch.float16, device=kernel_device())
    assert torch.equal(add(x, x), x + x)


@pytest.mark.kernels
@pytest.mark.parametrize("n", [5, 1000])
def test_add_float32(n):
    x = torch.arange(n, dtype=torch.float32, device=kernel_device())
    assert torch.equal(add(x, x), 2 * x)


def test_not_a_kernel_test():  # no kernels marker: never selected
    pass
'''

# The failing rehearsal: a half-precision test that fails (first slice), one that passes and one
# that outlasts the second slice's time limit.
FAILING_TESTS = '''
import time

import pytest
import torch

import llmu  # noqa: F401
from llmu.runtime import kernel_device
from llmu.welcome import add

pytestmark = pytest.mark.kernels


def test_add_half_precision_is_wrong():
    x = torch.ones(8, dtype=torch.float16, device=kernel_device())
    assert torch.equal(add(x, x), x), "planted failure"


def test_passes():
    pass


def test_outlasts_its_slice():
    time.sleep(120)
'''

# Bench modules for LLMU_BENCH_MODULES: one that does not import, one whose entry fails.
BROKEN_MODULE = "import no_such_dependency_for_the_rehearsal  # noqa: F401\n"
FAILING_MODULE = '''
from llmu.bench.registry import Entry, Provider, register


def _boom(x):
    raise RuntimeError("planted provider failure")


register(Entry(name="rehearsal_failing_entry", module="99_rehearsal", description="always fails",
               providers={"boom": Provider(_boom, "torch")}, setup=lambda size, device, dtype: (None,),
               cpu_sizes=[{"N": 1}], gpu_sizes=[{"N": 1}]))
'''


def rehearse(workdir: Path, tests: Path, bench: str, **knobs) -> tuple[int, str, str, Path]:
    """Run gpu.sh as a CPU rehearsal; returns (exit status, summary, failures, logs folder)."""
    logs = workdir / "logs"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "LLMU_GPU", "LLMU_BENCH"))}
    env.pop("OUT", None)
    env.update(
        PYTHON=sys.executable, LLMU_GPU_ALLOW_CPU="1", LLMU_GPU_INSTALL="0", LLMU_GPU_WORKERS="1",
        LLMU_GPU_LOGS=str(logs), LLMU_GPU_TESTS=str(tests), LLMU_BENCH=bench, OMP_NUM_THREADS="1",
        LLMU_GPU_TOTAL_S="150", LLMU_GPU_BENCH_S="45", LLMU_GPU_FIRST_S="60",
        **{k: str(v) for k, v in knobs.items()},
    )
    proc = subprocess.run(["bash", str(SCRIPT)], cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=300)
    summary = (logs / "summary.txt").read_text()
    failures = (logs / "failures.txt").read_text()
    printed = proc.stdout.splitlines()
    assert all(line in printed for line in summary.splitlines()), "the summary is printed too"
    return proc.returncode, summary, failures, logs


@pytest.fixture
def workdir(tmp_path_factory):
    # A folder name free of the first slice's -k words (tmp_path would carry this test's name).
    return tmp_path_factory.mktemp("rehearsal")


def _recorded_files() -> set[Path]:
    from llmu.bench.results import RESULTS_DIR

    return set(RESULTS_DIR.glob("*.json"))


def test_rehearsal_passes_and_says_what_ran(workdir):
    tests = workdir / "test_tiny_kernels.py"
    tests.write_text(KERNEL_TESTS)
    before = _recorded_files()
    rc, summary, failures, logs = rehearse(workdir, tests, "vector_add")

    assert rc == 0, summary + failures
    assert failures == ""
    # Every step is listed with its exit status and time.
    for step in ("python environment: exit 3", "import llmu: exit 0", "llmu bench: exit 0"):
        assert step in summary
    # The first slice took the half-precision test and only it; the second the two others.
    assert "kernel tests 1/2: fp16/bf16, compiled-only: 1 passed, 0 failed, 0 skipped of 1 selected" in summary
    assert "kernel tests 2/2: the rest: 2 passed, 0 failed, 0 skipped of 2 selected" in summary
    first = (logs / "gpu-tests-1.log").read_text()
    assert "test_add_half_precision_ragged PASSED" in first and "test_add_float32" not in first
    assert "test_not_a_kernel_test" not in (logs / "gpu-tests-2.log").read_text()
    # The benchmark ran strictly; on a CPU its Triton rows are skipped, which is no failure.
    n = len(json.loads(next(logs.glob("cpu-*.json")).read_text())["rows"])
    assert f"bench: {n} rows: {n // 2} measured, {n // 2} skipped, 0 failed; 0 bench module(s) did not import" in summary
    assert "skipped (vector_add): Triton runs in its interpreter here" in summary
    assert "OK: every step passed" in summary
    # A rehearsal's results stay in its logs folder: nothing is recorded as a GPU result.
    result = json.loads(next(logs.glob("cpu-*.json")).read_text())
    assert {r["entry"] for r in result["rows"]} == {"vector_add"}
    assert _recorded_files() == before


def test_rehearsal_names_every_failure_and_exits_nonzero(workdir):
    tests = workdir / "test_failing_kernels.py"
    tests.write_text(FAILING_TESTS)
    mods = workdir / "mods"
    mods.mkdir()
    (mods / "rehearsal_broken_bench.py").write_text(BROKEN_MODULE)
    (mods / "rehearsal_failing_bench.py").write_text(FAILING_MODULE)
    rc, summary, failures, logs = rehearse(
        workdir, tests, "vector_add rehearsal_failing_entry", LLMU_GPU_REST_S=12,
        LLMU_BENCH_MODULES="rehearsal_broken_bench rehearsal_failing_bench",
        PYTHONPATH=f"{mods}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")

    assert rc == 1, summary
    lines = failures.splitlines()
    assert f"FAILED: {len(lines)} problem(s):" in summary
    # The failed test, by name, with its message.
    assert any(ln.startswith("FAILED ") and "test_add_half_precision_is_wrong" in ln and "planted failure" in ln
               for ln in lines), failures
    # The second slice ran out of time: said plainly, with what had passed before.
    assert "TIME SLICE OF 12s RAN OUT" in summary
    ran_out = [ln for ln in lines if "time slice ran out" in ln]
    assert len(ran_out) == 1 and "kernel tests 2/2" in ran_out[0] and "passed" in ran_out[0], failures
    assert "running then: ::test_outlasts_its_slice" in ran_out[0], failures
    # The bench module that did not import, by name; the row that failed, with its reason.
    assert any("rehearsal_broken_bench did not import" in ln and "no_such_dependency" in ln for ln in lines), failures
    assert any("rehearsal_failing_entry" in ln and "planted provider failure" in ln for ln in lines), failures
    assert len(lines) == 4, failures
    # The benchmark still ran and saved what it measured.
    assert "llmu bench: exit 1" in summary
    result = json.loads(next(logs.glob("cpu-*.json")).read_text())
    assert "rehearsal_broken_bench" in result["load_errors"]


def test_refuses_to_run_without_a_gpu_unless_rehearsing(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLMU_GPU", "PYTEST_"))}
    env.update(PYTHON=sys.executable, LLMU_GPU_LOGS=str(tmp_path))
    proc = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3
    assert "no CUDA device" in (tmp_path / "summary.txt").read_text()


# ------------------------------------------------------------------------------------------------
# benchmarks/gpu_report.py on pytest logs, plain and from pytest-xdist
# ------------------------------------------------------------------------------------------------

PLAIN_LOG = """\
collecting ... collected 9 items / 3 deselected / 6 selected

tests/a.py::test_ok[x must be a torch.Tensor] PASSED                     [ 16%]
tests/a.py::test_bad[dtype0] FAILED                                      [ 33%]
tests/a.py::test_teardown PASSED                                         [ 50%]
tests/a.py::test_teardown ERROR                                          [ 50%]
tests/a.py::test_skip SKIPPED (half precision kernels are tested on a GPU) [ 66%]
=========================== short test summary info ============================
FAILED tests/a.py::test_bad[dtype0] - AssertionError: Tensor-likes are not close!
ERROR tests/a.py::test_teardown - RuntimeError: boom
"""

XDIST_LOG = """\
8 workers [6 items]

[gw0] [ 16%] PASSED tests/a.py::test_ok[x must be a torch.Tensor] 
[gw1] [ 33%] FAILED tests/a.py::test_bad[dtype0] 
[gw2] [ 50%] SKIPPED tests/a.py::test_skip 
tests/a.py::test_hangs 
FAILED tests/a.py::test_bad[dtype0] - AssertionError: Tensor-likes are not close!
"""  # noqa: W291  (xdist ends its progress lines with a space; the log keeps it)


def test_report_counts_and_names_failures_in_a_plain_log():
    line, failures = gpu_report.tests_report("slice", PLAIN_LOG, 1, 100)
    assert line == "slice: 1 passed, 2 failed, 1 skipped of 6 selected"
    assert failures == [
        "FAILED tests/a.py::test_bad[dtype0] - AssertionError: Tensor-likes are not close!  [slice]",
        "ERROR tests/a.py::test_teardown - RuntimeError: boom  [slice]",
    ]


def test_report_reads_xdist_logs_and_says_when_the_slice_ran_out():
    line, failures = gpu_report.tests_report("slice", XDIST_LOG, 124, 90)
    assert line.startswith("slice: 1 passed, 1 failed, 1 skipped of 6 selected; TIME SLICE OF 90s RAN OUT")
    assert failures[0].startswith("FAILED tests/a.py::test_bad[dtype0] - AssertionError")
    assert failures[1] == ("slice: its 90s time slice ran out: 1 passed, 1 failed, 1 skipped of 6 selected "
                           "before it, 3 not run; running then: tests/a.py::test_hangs")


def test_report_collection_errors_and_unexplained_exit_codes():
    log = "collected 0 items / 1 error\nERROR tests/broken.py - ImportError: nope\n"
    assert gpu_report.tests_report("s", log, 2, 10)[1] == ["ERROR collecting tests/broken.py  [s]"]
    assert gpu_report.tests_report("s", "collected 3 items\n", 3, 10)[1] == [
        "s: pytest exited 3 without naming a failed test (see its log)"]
    # Exit 0, but the log does not show every outcome: the counts would lie, so it is a failure.
    assert "outcome of 0 tests of 3" in gpu_report.tests_report("s", "collected 3 items\n", 0, 10)[1][0]
    assert gpu_report.tests_report("s", "collected 3 items / 3 deselected / 0 selected\n", 5, 10) == (
        "s: no test selected", [])


def test_report_on_bench_results(tmp_path):
    rows = [
        {"entry": "a", "provider": "p", "label": "llmu triton", "size_label": "N=1", "status": "ok"},
        {"entry": "a", "provider": "q", "label": "torch", "size_label": "N=1", "status": "error",
         "reason": "CUDA error: out of memory"},
        {"entry": "b", "provider": "p", "size_label": "N=2", "status": "skipped", "reason": "not installed: x"},
        {"entry": "c", "provider": "p", "size_label": "N=2", "status": "skipped",
         "reason": "time budget of 10 s used up"},
    ]
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"rows": rows, "load_errors": {"llmu.x.bench": "ImportError: y"}}))
    line, failures = gpu_report.bench_report(path, 1, [])
    assert line.startswith("bench: 4 rows: 1 measured, 2 skipped, 1 failed; 1 bench module(s) did not import")
    assert "skipped (b): not installed: x" in line
    assert failures == [
        "bench: llmu.x.bench did not import, its entries were not measured: ImportError: y",
        "bench: a torch N=1: error: CUDA error: out of memory",
        "bench: c: 1 size(s) not measured, the --budget ran out before them",
    ]
    line, failures = gpu_report.bench_report(tmp_path / "missing.json", 124, [])
    assert line == "bench: no results" and failures[-1] == "bench: exited 124 and wrote no results file"
    path.write_text(json.dumps({"rows": rows[:1], "load_errors": {}, "interrupted": True}))
    assert gpu_report.bench_report(path, 124, ["a", "z"])[1] == [
        "bench: the run was interrupted after 1 rows; never reached: z"]


def test_script_mentions_no_removed_plugin_and_no_maxfail():
    text = SCRIPT.read_text()
    assert "llmu_gpu_pytest" not in text and "--maxfail" not in text
    assert "llmu_gpu_pytest" not in (REPO / "benchmarks" / "README.md").read_text()
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0


def test_module_docstring_matches_knobs():
    """Every LLMU_GPU_* knob the script reads is documented in its header."""
    import re

    text = SCRIPT.read_text()
    header = text.split("set -uo pipefail")[0]
    for knob in set(re.findall(r"\$\{(LLMU_GPU_\w+)", text)):
        assert knob in header, knob
