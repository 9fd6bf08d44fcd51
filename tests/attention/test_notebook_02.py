"""Notebook 02's graded exercises, run in-process (no kernel, no model): the instructor's solutions
pass every test cell, hidden parts included, and typical wrong answers fail them.

The whole notebook (model cells, widgets, benchmark) is executed by the course-wide notebook tests.

The cells make their tensors without naming a device; they are run with ``kernel_device()`` as
torch's default device (a no-op in the interpreter, cuda when the kernels are compiled), so the
exercise kernel gets tensors it can read.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

import llmu  # noqa: F401  (Triton mode first: the exercise kernel is defined below)
from llmu import course
from llmu.runtime import kernel_device

NOTEBOOK = Path(__file__).resolve().parents[2] / "solutions" / "02_attention" / "02_attention.ipynb"


@pytest.fixture(scope="module")
def cells():
    # Cell metadata (unique grade_ids, points, markers, no outputs) is checked for every notebook
    # in tests/course/test_notebooks.py; this file runs the exercises.
    return course.cells_by_grade_id(NOTEBOOK)


def _on_kernel_device():
    """Torch's default device set to the kernel device while the cells run (nothing to do on CPU)."""
    dev = kernel_device()
    return contextlib.nullcontext() if dev.type == "cpu" else torch.device(dev)


def _namespace(cells):
    return course.setup_namespace(cells)


def _define(ns, source, tmp_path, name):
    """Define a solution cell's names in ``ns`` (kernels are compiled from a file: Triton needs one)."""
    course.exec_cell(source, ns, tmp_path, name)


def _run_test(ns, source):
    exec(source, ns)  # noqa: S102  (hidden-test markers are comments: the hidden part runs too)


EXERCISES = {
    "ex1": ("ex1_solution", [], ["test_ex1_visible", "test_ex1_hidden"]),
    "ex2": ("ex2_solution", [], ["test_ex2_visible", "test_ex2_hidden"]),
    "ex3": ("ex3_solution", ["ex3_launcher"], ["test_ex3_visible", "test_ex3_hidden"]),
}


@pytest.mark.parametrize("exercise", list(EXERCISES))
def test_solutions_pass_all_tests(exercise, cells, tmp_path):
    solution, extra, tests = EXERCISES[exercise]
    with _on_kernel_device():
        ns = _namespace(cells)
        _define(ns, cells[solution], tmp_path, f"sol_{exercise}")
        for name in extra:
            exec(cells[name], ns)  # noqa: S102
        for name in tests:
            _run_test(ns, cells[name])


WRONG = {
    # exercise, replaced text, replacement, the test cell that must catch it
    "ex1: no max subtraction": ("ex1", "z = z - z.amax(dim=-1, keepdim=True)", "z = z", "test_ex1_hidden"),
    "ex2: top-left causal mask": ("ex2", "j > i + (tk - tq)", "j > i", "test_ex2_hidden"),
    "ex3: sum not rescaled": ("ex3", "s = s * tl.exp(m - m_safe) +", "s = s +", "test_ex3_visible"),
    "ex3: NaN on -inf blocks": ("ex3", 'tl.where(m_new == -float("inf"), 0.0, m_new)', "m_new", "test_ex3_hidden"),
}


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the NaN case warns in the interpreter
@pytest.mark.parametrize("case", list(WRONG))
def test_wrong_answers_fail(case, cells, tmp_path):
    exercise, old, new, test_cell = WRONG[case]
    solution, extra, _ = EXERCISES[exercise]
    assert old in cells[solution]
    with _on_kernel_device():
        ns = _namespace(cells)
        _define(ns, cells[solution].replace(old, new), tmp_path, f"wrong_{exercise}_{abs(hash(case))}")
        for name in extra:
            exec(cells[name], ns)  # noqa: S102
        with pytest.raises(AssertionError):
            _run_test(ns, cells[test_cell])
