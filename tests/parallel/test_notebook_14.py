"""Notebook 14's graded exercises, run in-process (no kernel): the instructor's solutions pass every
test cell, hidden parts included, and typical wrong answers fail them.

The exercises are pure functions (a notebook cell cannot start processes: ``launch`` refuses
functions defined in a notebook), so everything here runs in this process, in a second or two.
The whole notebook (the launches on real processes, widgets, the benchmark) is executed by the
course-wide notebook tests.
"""

from __future__ import annotations

import llmu  # noqa: F401
from llmu import course

NOTEBOOK = course.repo_root() / "solutions" / "14_parallelism" / "14_parallelism.ipynb"


EXERCISES = {f"ex{n}": course.Exercise.numbered(n) for n in (1, 2, 3, 4)}


WRONG = {
    # case: (exercise, replaced text, replacement, the test cell that must catch it)
    "ex1: stage 2 shards the weights": ("ex1", "params = w * num_params / (n if stage >= 3 else 1)",
                                        "params = w * num_params / (n if stage >= 2 else 1)", "test_ex1_visible"),
    "ex1: stage 1 shards nothing": ("ex1", "optimizer = k * num_params / (n if stage >= 1 else 1)",
                                    "optimizer = k * num_params / (n if stage >= 2 else 1)", "test_ex1_visible"),
    "ex1: float32 with K = 12": ("ex1", '"float32": (4, 4, 8)', '"float32": (4, 4, 12)', "test_ex1_hidden"),
    "ex1: no check of the stage": ("ex1", "if stage not in (0, 1, 2, 3):", "if stage not in range(0, 5):",
                                   "test_ex1_hidden"),
    "ex1: no check of the precision": ("ex1", "if precision not in sizes:", "if False:", "test_ex1_hidden"),
    "ex2: down split by rows": ("ex2", "w_down[:, block]", "w_down[block]", "test_ex2_visible"),
    "ex2: up from the other end": ("ex2", "return w_gate[block], w_up[block], w_down[:, block]",
                                   "return w_gate[block], w_up.flip(0)[block], w_down[:, block]", "test_ex2_visible"),
    "ex2: strided instead of contiguous": ("ex2", "block = slice(rank * size, (rank + 1) * size)",
                                           "block = slice(rank, ffn, world_size)", "test_ex2_hidden"),
    "ex2: uneven split accepted": ("ex2", "if ffn % world_size:", "if False:", "test_ex2_hidden"),
    "ex2: rank not checked": ("ex2", "if not 0 <= rank < world_size:", "if False:", "test_ex2_hidden"),
    "ex3: GPipe instead of 1F1B": ("ex3", "warmup = min(num_stages - rank - 1, m)", "warmup = m", "test_ex3_visible"),
    "ex3: one warm-up forward too many": ("ex3", "warmup = min(num_stages - rank - 1, m)",
                                          "warmup = min(num_stages - rank, m)", "test_ex3_visible"),
    "ex3: backward before forward in the steady state": (
        "ex3", 'order += [Action("F", warmup + i), Action("B", i)]',
        'order += [Action("B", i), Action("F", warmup + i)]', "test_ex3_visible"),
    "ex3: warm-up not capped by m": ("ex3", "warmup = min(num_stages - rank - 1, m)", "warmup = num_stages - rank - 1",
                                     "test_ex3_hidden"),
    "ex4: reduce-scatter replaces": ("ex4", "chunks[(r + 1) % p][index] = chunks[(r + 1) % p][index] + data",
                                     "chunks[(r + 1) % p][index] = data", "test_ex4_visible"),
    "ex4: all-gather sends the wrong chunk": ("ex4", "messages = [(r, (r + 1 - s) % p, chunks[r][(r + 1 - s) % p].clone())",
                                              "messages = [(r, (r - s) % p, chunks[r][(r - s) % p].clone())",
                                              "test_ex4_visible"),
    "ex4: inputs modified in place": ("ex4", "chunks = [[c.clone() for c in torch.tensor_split(t, p)] for t in tensors]",
                                      "chunks = [list(torch.tensor_split(t, p)) for t in tensors]\n"
                                      "    for c in chunks:\n        for x in c:\n            x.mul_(1.0)\n"
                                      "    tensors[0].add_(1.0)", "test_ex4_visible"),
    "ex4: one phase only": ("ex4", "    for s in range(p - 1):                                   # all-gather",
                            "    for s in range(0):                                       # all-gather",
                            "test_ex4_visible"),
}


# The exercise file's two tests: every solution passes its test cells; every wrong answer is
# caught by the test cell named for it (cell metadata is checked in tests/course/test_notebooks.py).
notebook, test_solutions_pass_all_tests, test_wrong_answers_fail = course.exercise_tests(
    NOTEBOOK, EXERCISES, WRONG)
