"""Notebook 02's graded exercises, run in-process (no kernel, no model): the instructor's solutions
pass every test cell, hidden parts included, and typical wrong answers fail them.

The whole notebook (model cells, widgets, benchmark) is executed by the course-wide notebook tests.

The cells make their tensors without naming a device; they are run with ``kernel_device()`` as
torch's default device (a no-op in the interpreter, cuda when the kernels are compiled), so the
exercise kernel gets tensors it can read.
"""

from __future__ import annotations

from pathlib import Path

import llmu  # noqa: F401  (Triton mode first: the exercise kernel is defined below)
from llmu import course

NOTEBOOK = Path(__file__).resolve().parents[2] / "solutions" / "02_attention" / "02_attention.ipynb"


EXERCISES = {"ex1": course.Exercise.numbered(1), "ex2": course.Exercise.numbered(2),
             "ex3": course.Exercise.numbered(3, after=["ex3_launcher"])}


WRONG = {
    # exercise, replaced text, replacement, the test cell that must catch it
    "ex1: no max subtraction": ("ex1", "z = z - z.amax(dim=-1, keepdim=True)", "z = z", "test_ex1_hidden"),
    "ex2: top-left causal mask": ("ex2", "j > i + (tk - tq)", "j > i", "test_ex2_hidden"),
    "ex3: sum not rescaled": ("ex3", "s = s * tl.exp(m - m_safe) +", "s = s +", "test_ex3_visible"),
    "ex3: NaN on -inf blocks": ("ex3", 'tl.where(m_new == -float("inf"), 0.0, m_new)', "m_new", "test_ex3_hidden"),
}


# The exercise file's two tests: every solution passes its test cells; every wrong answer is
# caught by the test cell named for it (cell metadata is checked in tests/course/test_notebooks.py).
notebook, test_solutions_pass_all_tests, test_wrong_answers_fail = course.exercise_tests(
    NOTEBOOK, EXERCISES, WRONG, on_kernel_device=True, warnings_to_ignore=["ignore::RuntimeWarning"])
