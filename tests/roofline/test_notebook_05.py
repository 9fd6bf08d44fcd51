"""Notebook 05's graded exercises, run in-process (no kernel, no model): the instructor's solutions
pass every test cell, hidden parts included, and typical wrong answers fail them.

The whole notebook (model cells, widgets, benchmark) is executed by the course-wide notebook tests.
"""

from __future__ import annotations

from pathlib import Path

import llmu  # noqa: F401
from llmu import course

NOTEBOOK = Path(__file__).resolve().parents[2] / "solutions" / "05_prefill_decode" / "05_prefill_decode.ipynb"


EXERCISES = {f"ex{n}": course.Exercise.numbered(n) for n in (1, 2, 3, 4)}


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


# The exercise file's two tests: every solution passes its test cells; every wrong answer is
# caught by the test cell named for it (cell metadata is checked in tests/course/test_notebooks.py).
notebook, test_solutions_pass_all_tests, test_wrong_answers_fail = course.exercise_tests(
    NOTEBOOK, EXERCISES, WRONG)
