"""Notebook 11's graded exercises, run in-process (no kernel): the instructor's solutions pass every
test cell, hidden parts included, and typical wrong answers fail them.

The exercise cells read the setup cell's model and tokenizer, so it runs once for the module. The
whole notebook (measurements, widgets, the live speedup, the benchmark) is executed by the
course-wide notebook tests. Exercise 2 uses exercise 1's residual, exercise 4 uses exercises 2 and
3, so each exercise runs on top of the solutions of the ones it builds on.
"""

from __future__ import annotations

import pytest

import llmu  # noqa: F401
from llmu import course

# The notebook's setup cell, which every exercise here runs first, loads SmolLM2.
pytestmark = pytest.mark.slow

NOTEBOOK = course.repo_root() / "solutions" / "11_speculative_decoding" / "11_speculative_decoding.ipynb"


EXERCISES = {
    "ex1": course.Exercise.numbered(1),
    "ex2": course.Exercise.numbered(2, before=["ex1_solution"]),
    "ex3": course.Exercise.numbered(3),
    "ex4": course.Exercise.numbered(4, before=["ex1_solution", "ex2_solution", "ex3_solution"]),
}


WRONG = {
    # exercise, replaced text, replacement, the test cell that must catch it
    "ex1: not normalised": ("ex1", "diff / torch.where(total > 0, total, torch.ones_like(total))", "diff",
                            "test_ex1_visible"),
    "ex1: max(0, q - p)": ("ex1", "diff = (p.float() - q.float()).clamp(min=0)", "diff = (q.float() - p.float()).clamp(min=0)",
                           "test_ex1_visible"),
    "ex1: no fallback when p == q": ("ex1", "torch.where(total > 0, diff / torch.where(total > 0, total, torch.ones_like(total)), p.float())",
                                     "diff / total", "test_ex1_hidden"),
    "ex2: accept when u < p": ("ex2", "if not u[i] * q[i, x] < p[i, x]:", "if not u[i] < p[i, x]:", "test_ex2_visible"),
    "ex2: resample from p, not the residual": ("ex2", "weights = my_residual(p[i], q[i])", "weights = p[i].float()",
                                               "test_ex2_visible"),
    "ex2: bonus from the last proposal's p": ("ex2", "inverse_cdf(p[gamma].float()[None]", "inverse_cdf(p[gamma - 1].float()[None]",
                                              "test_ex2_visible"),
    "ex2: accept when u * q <= p": ("ex2", "if not u[i] * q[i, x] < p[i, x]:", "if not u[i] * q[i, x] <= p[i, x]:",
                                    "test_ex2_hidden"),
    "ex3: never feeds a held last token": ("ex3", "limit = min(len(held), len(context) - 1)", "limit = min(len(held), len(context))",
                                           "test_ex3_visible"),
    "ex3: no crop": ("ex3", "    cache.crop(n)\n", "", "test_ex3_visible"),
    "ex3: held not checked": ("ex3", "if len(held) != cache.length:", "if False:", "test_ex3_visible"),
    "ex4: proposals checked against the next row": ("ex4", "tokens[n] == best[n]:", "tokens[n] == best[n + 1]:",
                                                    "test_ex4_visible"),
    "ex4: target token dropped": ("ex4", "new = tokens[:n] + [best[n]]", "new = tokens[:n] or [best[n]]", "test_ex4_visible"),
    "ex4: argmax when nothing is proposed": ("ex4", "new = [int(reference.inverse_cdf(p[:1], torch.rand(1, generator=generator))[0])]",
                                             "new = [int(p[0].argmax())]", "test_ex4_hidden"),
}


# The exercise file's two tests: every solution passes its test cells; every wrong answer is
# caught by the test cell named for it (cell metadata is checked in tests/course/test_notebooks.py).
(notebook, test_solutions_pass_all_tests, test_wrong_answers_fail,
 test_library_answers_fail) = course.exercise_tests(
    NOTEBOOK, EXERCISES, WRONG)
