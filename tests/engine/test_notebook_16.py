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

import llmu  # noqa: F401
from llmu import course

NOTEBOOK = Path(__file__).resolve().parents[2] / "solutions" / "16_serving_engine" / "16_serving_engine.ipynb"


EXERCISES = {
    "ex1": course.Exercise.numbered(1, before=["ex1_reference"]),
    "ex2": course.Exercise.numbered(2, before=["ex2_harness"]),
    "ex3": course.Exercise.numbered(3),
}


def test_setup_cell_loads_no_model(notebook):
    """The exercises must run without the model: the setup cell only imports."""
    assert "load_model(" not in notebook.cells["setup"]


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


# The exercise file's two tests: every solution passes its test cells; every wrong answer is
# caught by the test cell named for it (cell metadata is checked in tests/course/test_notebooks.py).
notebook, test_solutions_pass_all_tests, test_wrong_answers_fail = course.exercise_tests(
    NOTEBOOK, EXERCISES, WRONG)


def test_hidden_tests_are_not_in_the_visible_part(notebook):
    """Each hidden test cell runs a visible check first, then the hidden block."""
    for name in ("test_ex1_hidden", "test_ex2_hidden", "test_ex3_hidden"):
        before, _, after = notebook.cells[name].partition(course.BEGIN_HIDDEN)
        assert after, f"{name} has no hidden block"
        assert "check" in before, f"{name}: the learner should see at least one check before the hidden block"
