"""Notebook 05's graded exercises, run in-process (no kernel, no model): the instructor's solutions
pass every test cell, hidden parts included, and typical wrong answers fail them.

The whole notebook (model cells, widgets, benchmark) is executed by the course-wide notebook tests.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import llmu  # noqa: F401
from llmu import course

NOTEBOOK = Path(__file__).resolve().parents[2] / "solutions" / "05_prefill_decode" / "05_prefill_decode.ipynb"


@pytest.fixture(scope="module")
def cells():
    # Cell metadata (unique grade_ids, points, markers, no outputs) is checked for every notebook
    # in tests/course/test_notebooks.py; this file runs the exercises.
    return course.cells_by_grade_id(NOTEBOOK)


def _namespace(cells):
    return course.setup_namespace(cells)


EXERCISES = {
    "ex1": ("ex1_solution", ["test_ex1_visible", "test_ex1_hidden"]),
    "ex2": ("ex2_solution", ["test_ex2_visible", "test_ex2_hidden"]),
    "ex3": ("ex3_solution", ["test_ex3_visible", "test_ex3_hidden"]),
    "ex4": ("ex4_solution", ["test_ex4_visible", "test_ex4_hidden"]),
}


@pytest.mark.parametrize("exercise", list(EXERCISES))
def test_solutions_pass_all_tests(exercise, cells):
    solution, tests = EXERCISES[exercise]
    ns = _namespace(cells)
    exec(cells[solution], ns)  # noqa: S102
    for name in tests:
        exec(cells[name], ns)  # noqa: S102  (hidden-test markers are comments: the hidden part runs too)


WRONG = {
    # exercise, replaced text, replacement, the test cell that must catch it
    "ex1: output not counted": ("ex1", "(M * K + K * N + M * N)", "(M * K + K * N)", "test_ex1_visible"),
    "ex1: FLOPs without the 2": ("ex1", "flops = 2 * M * N * K", "flops = M * N * K", "test_ex1_visible"),
    "ex1: no validation": ("ex1", "raise ValueError", "pass  #", "test_ex1_hidden"),
    "ex2: max instead of min": ("ex2", "return min(", "return max(", "test_ex2_visible"),
    "ex2: no validation": ("ex2", 'raise ValueError("peak_flops', 'print("peak_flops', "test_ex2_hidden"),
    "ex3: ridge counted as memory-bound": ("ex3", "intensity < ridge", "intensity <= ridge", "test_ex3_hidden"),
    "ex3: ridge inverted": ("ex3", "ridge = peak_flops / bandwidth", "ridge = bandwidth / peak_flops",
                            "test_ex3_visible"),
    "ex4: TPOT over n gaps": ("ex4", "/ (n - 1) if n > 1", "/ n if n > 1", "test_ex4_visible"),
    "ex4: TPOT as the last gap": ("ex4", "(timestamps[-1] - timestamps[0]) / (n - 1)",
                                  "(timestamps[-1] - timestamps[-2])", "test_ex4_hidden"),
}


@pytest.mark.parametrize("case", list(WRONG))
def test_wrong_answers_fail(case, cells):
    exercise, old, new, test_cell = WRONG[case]
    solution, _ = EXERCISES[exercise]
    assert old in cells[solution]
    ns = _namespace(cells)
    exec(cells[solution].replace(old, new), ns)  # noqa: S102
    with pytest.raises(AssertionError):
        exec(cells[test_cell], ns)  # noqa: S102
