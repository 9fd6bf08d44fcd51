"""Notebook 16's graded exercises, run in-process (no kernel, no model): the instructor's solutions
pass every test cell, hidden parts included, and typical wrong answers fail the cell named for
them.

The exercises are bookkeeping on plain Python data (packing a step, a scheduler step, the
prefix-cache keys) checked against the engine's own ``PackedInputs``, ``Scheduler`` (through
``llmu.engine.timeline.simulate``) and ``BlockManager``: every comparison is exact, there is no
tolerance to explain. The whole notebook (the model cells, the measurement, the widgets) is
executed by the course-wide notebook tests.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import llmu  # noqa: F401
from llmu import course

NOTEBOOK = Path(__file__).resolve().parents[2] / "solutions" / "16_serving_engine" / "16_serving_engine.ipynb"


@pytest.fixture(scope="module")
def cells():
    # Cell metadata (unique grade_ids, points, markers, no outputs) is checked for every notebook
    # in tests/course/test_notebooks.py; this file runs the exercises.
    return course.cells_by_grade_id(NOTEBOOK)


def _namespace(cells):
    return course.setup_namespace(cells)


EXERCISES = {
    # exercise: (solution cell, helper cells run before it, test cells)
    "ex1": ("ex1_solution", ["ex1_reference"], ["test_ex1_visible", "test_ex1_hidden"]),
    "ex2": ("ex2_solution", ["ex2_harness"], ["test_ex2_visible", "test_ex2_hidden"]),
    "ex3": ("ex3_solution", [], ["test_ex3_visible", "test_ex3_hidden"]),
}


def _run(cells, exercise, solution_source, tests):
    solution, helpers, _ = EXERCISES[exercise]
    ns = _namespace(cells)
    for name in helpers:
        exec(cells[name], ns)  # noqa: S102
    exec(solution_source, ns)  # noqa: S102
    for name in tests:
        exec(cells[name], ns)  # noqa: S102  (hidden-test markers are comments: the hidden part runs too)


def test_setup_cell_loads_no_model(cells):
    """The exercises must run without the model: the setup cell only imports."""
    assert "load_model(" not in cells["setup"]


@pytest.mark.parametrize("exercise", list(EXERCISES))
def test_solutions_pass_all_tests(exercise, cells):
    solution, _, tests = EXERCISES[exercise]
    _run(cells, exercise, cells[solution], tests)


WRONG = {
    # case: (exercise, replaced text, replacement, the test cell that must catch it)
    "ex1: positions are packed rows": ("ex1", "positions += range(start, end)",
                                       "positions += range(len(positions), len(positions) + n)", "test_ex1_visible"),
    "ex1: slots ignore the block table": ("ex1", "table[p // block_size] * block_size + p % block_size", "p",
                                          "test_ex1_visible"),
    "ex1: every sequence samples": ("ex1", "if end == len(token_ids):", "if True:", "test_ex1_hidden"),
    "ex1: context_lens without the new positions": ("ex1", "context_lens.append(end)", "context_lens.append(start)",
                                                    "test_ex1_hidden"),
    "ex2: budget not spent by admissions": ("ex2", "budget -= chunk", "pass", "test_ex2_visible"),
    "ex2: running sequences take no block": ("ex2", 'free_blocks -= max(0, need - seq["num_blocks"])', "pass",
                                             "test_ex2_visible"),
    "ex2: no chunking": ("ex2", 'chunk = min(seq["num_tokens"], budget)', 'chunk = seq["num_tokens"]',
                         "test_ex2_hidden"),
    "ex2: max_num_seqs ignored": ("ex2", " and len(running) < max_num_seqs", "", "test_ex2_hidden"),
    "ex2: blocks ignored on admission": ("ex2", "if need > free_blocks:", "if False:", "test_ex2_hidden"),
    "ex3: no chain": ("ex3", "hash((parent, tuple(", "hash((None, tuple(", "test_ex3_visible"),
    "ex3: the whole prompt reused": ("ex3", "min(hits * block_size, len(token_ids) - 1)", "hits * block_size",
                                     "test_ex3_hidden"),
    "ex3: no stop at the first miss": ("ex3", "            break\n        hits += 1",
                                       "            continue\n        hits += 1", "test_ex3_hidden"),
}


@pytest.mark.parametrize("case", list(WRONG))
def test_wrong_answers_fail(case, cells):
    exercise, old, new, test_cell = WRONG[case]
    solution, helpers, _ = EXERCISES[exercise]
    assert cells[solution].count(old) == 1, f"{case}: {old!r} must occur once in {solution}"
    with pytest.raises(AssertionError):
        _run(cells, exercise, cells[solution].replace(old, new), [test_cell])


def test_hidden_tests_are_not_in_the_visible_part(cells):
    """Each hidden test cell runs a visible check first, then the hidden block."""
    for name in ("test_ex1_hidden", "test_ex2_hidden", "test_ex3_hidden"):
        before, _, after = cells[name].partition(course.BEGIN_HIDDEN)
        assert after, f"{name} has no hidden block"
        assert "check" in before, f"{name}: the learner should see at least one check before the hidden block"
