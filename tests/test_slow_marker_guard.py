"""tests/conftest.py keeps the real model out of `make test-fast`: a test that loads SmolLM2 must be
marked ``slow``. Checked here on throw-away test files, run by pytest in a subprocess with the
suite's own conftest. Nothing is read from disk: each test file puts a stand-in model in
``load_model``'s in-process cache, and ``load_model`` hands it out, as it hands out SmolLM2 on every
call after the first. Loading another GGUF file (tests write small ones) is not loading the model."""

from __future__ import annotations

import shutil
from pathlib import Path

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).with_name("conftest.py")

LOADS = '''
import pytest
import torch
from llmu.models import load_model, loading

FAKE = object()  # stands in for SmolLM2 (the default path, None) in load_model's cache
loading._CACHE[("None", torch.float32, "cpu")] = FAKE
loading._CACHE[("None", torch.float32, "cpu", "sdpa")] = FAKE

def _load():  # a cache hit: no file is read
    assert load_model(device="cpu") is FAKE

def test_another_gguf_file_is_not_the_model():
    loading._CACHE[("tiny.gguf", torch.float32, "cpu")] = FAKE
    loading._CACHE[("tiny.gguf", torch.float32, "cpu", "sdpa")] = FAKE
    assert load_model(path="tiny.gguf", device="cpu") is FAKE

def test_unmarked_loader():
    _load()

@pytest.mark.slow
def test_marked_loader():
    _load()

def test_no_model():
    assert 1 + 1 == 2

@pytest.fixture(scope="module")
def model_fixture():
    _load()

def test_unmarked_through_a_fixture(model_fixture):
    pass
'''


def test_an_unmarked_test_that_loads_the_model_fails(pytester):
    shutil.copy(CONFTEST, pytester.path / "conftest.py")
    pytester.makepyfile(test_loads=LOADS)
    result = pytester.runpytest_subprocess("-p", "no:randomly", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=3, failed=1, errors=1)
    # pytest prints set-up errors before failures
    result.stdout.fnmatch_lines(["*test_unmarked_through_a_fixture loads SmolLM2*set-up*not marked slow*",
                                 "*test_unmarked_loader loads SmolLM2*run*not marked slow*"])


def test_the_smollm2_fixture_without_the_slow_marker_is_a_collection_error(pytester):
    shutil.copy(CONFTEST, pytester.path / "conftest.py")
    pytester.makepyfile(test_fixture="def test_uses_model(smollm2):\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:randomly", "-p", "no:cacheprovider", "--collect-only")
    assert result.ret != 0
    result.stderr.fnmatch_lines(["*use the `smollm2` fixture*not marked slow*", "*test_uses_model*"])
