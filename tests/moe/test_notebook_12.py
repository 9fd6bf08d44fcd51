"""Notebook 12's graded exercises, run in-process (no kernel): the instructor's solutions pass every
test cell, hidden parts included, and typical wrong answers fail them.

The whole notebook (the calculator, the widgets, the two training runs, SmolLM2, the benchmark) is
executed by the course-wide notebook tests. Exercise 4 is a Triton kernel: its cell is compiled
from a file (Triton reads a kernel's source back), and its launcher cell runs after it. Its wrong
answers are chosen so that every address stays inside the tensors: in the interpreter an
out-of-bounds access reads or writes whatever memory is there.
"""

from __future__ import annotations

import pytest

import llmu  # noqa: F401  (Triton mode first: the exercise kernel is defined below)
from llmu import course

NOTEBOOK = course.repo_root() / "solutions" / "12_mixture_of_experts" / "12_mixture_of_experts.ipynb"


@pytest.fixture(scope="module")
def cells():
    # Cell metadata (unique grade_ids, points, markers, no outputs) is checked for every notebook
    # in tests/course/test_notebooks.py; this file runs the exercises.
    return course.cells_by_grade_id(NOTEBOOK)


EXERCISES = {
    # exercise: (solution cell, cells that run after it, test cells)
    "ex1": ("ex1_solution", [], ["test_ex1_visible", "test_ex1_hidden"]),
    "ex2": ("ex2_solution", [], ["test_ex2_visible", "test_ex2_hidden"]),
    "ex3": ("ex3_solution", [], ["test_ex3_visible", "test_ex3_hidden"]),
    "ex4": ("ex4_kernel", ["ex4_launcher"], ["test_ex4_visible", "test_ex4_hidden"]),
}


def _prepare(cells, exercise, source, workdir, name):
    _, after, _ = EXERCISES[exercise]
    ns = course.setup_namespace(cells)
    course.exec_cell(source, ns, workdir, name)
    for cell in after:
        exec(cells[cell], ns)  # noqa: S102
    return ns


@pytest.mark.parametrize("exercise", list(EXERCISES))
def test_solutions_pass_all_tests(exercise, cells, tmp_path):
    solution, _, tests = EXERCISES[exercise]
    ns = _prepare(cells, exercise, cells[solution], tmp_path, f"sol_{exercise}")
    for name in tests:
        exec(cells[name], ns)  # noqa: S102  (hidden-test markers are comments: the hidden part runs too)


WRONG = {
    # exercise, replaced text, replacement, the test cell that must catch it
    "ex1: never renormalised": ("ex1", "    if renormalize:\n        weights = weights / weights.sum(dim=-1, keepdim=True)\n",
                                "", "test_ex1_visible"),
    "ex1: always renormalised": ("ex1", "    if renormalize:\n", "    if True:\n", "test_ex1_visible"),
    "ex1: least probable experts": ("ex1", "probs.topk(k, dim=-1)", "probs.topk(k, dim=-1, largest=False)",
                                    "test_ex1_visible"),
    "ex1: softmax in the logits' dtype": ("ex1", "torch.softmax(logits.float(), dim=-1)", "torch.softmax(logits, dim=-1)",
                                          "test_ex1_hidden"),
    "ex1: k not checked": ("ex1", "    if not 1 <= k <= num_experts:\n", "    if False:\n", "test_ex1_hidden"),
    "ex2: f over T, not T*k": ("ex2", "f = counts / experts.numel()", "f = counts / experts.shape[0]", "test_ex2_visible"),
    "ex2: no factor E": ("ex2", "alpha * num_experts * (f * P).sum()", "alpha * (f * P).sum()", "test_ex2_visible"),
    "ex2: P summed, not averaged": ("ex2", "P = probs.mean(dim=0)", "P = probs.sum(dim=0)", "test_ex2_visible"),
    "ex2: f replaced by P": ("ex2", "f = counts / experts.numel()", "f = probs.mean(dim=0)", "test_ex2_visible"),
    "ex2: P detached": ("ex2", "P = probs.mean(dim=0)", "P = probs.detach().mean(dim=0)", "test_ex2_hidden"),
    "ex2: f carries the gradient instead of P": ("ex2", "f = counts / experts.numel()\n    P = probs.mean(dim=0)",
                                                 "f = counts / experts.numel() + 0 * probs.mean(dim=0)\n"
                                                 "    P = probs.mean(dim=0).detach()", "test_ex2_hidden"),
    "ex3: offsets without the leading 0": ("ex3", "offsets[1:] = counts.cumsum(0)", "offsets[:-1] = counts.cumsum(0)",
                                           "test_ex3_visible"),
    "ex3: dropped copies sorted first": ("ex3", "key = torch.where(kept, flat, num_experts)", "key = flat",
                                         "test_ex3_visible"),
    "ex3: not sorted by expert": ("ex3", "order = torch.sort(key, stable=True).indices[: int(offsets[-1])]",
                                  "order = torch.nonzero(kept).flatten()", "test_ex3_visible"),
    "ex3: experts in descending order": ("ex3", "torch.sort(key, stable=True)", "torch.sort(-key, stable=True)",
                                         "test_ex3_visible"),
    "ex4: column tile ignored": ("ex4", "cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)",
                                 "cols = tl.arange(0, BLOCK_H)", "test_ex4_visible"),
    "ex4: row tile not scaled": ("ex4", "rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)",
                                 "rows = tl.program_id(0) + tl.arange(0, BLOCK_M)", "test_ex4_visible"),
    "ex4: X addressed with Y's stride": ("ex4", "src[:, None] * stride_x", "src[:, None] * stride_y", "test_ex4_hidden"),
}


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # nan in the interpreter's numpy
@pytest.mark.parametrize("case", list(WRONG))
def test_wrong_answers_fail(case, cells, tmp_path):
    exercise, old, new, test_cell = WRONG[case]
    solution, _, tests = EXERCISES[exercise]
    assert old in cells[solution], f"{case}: the solution no longer contains {old!r}"
    ns = _prepare(cells, exercise, cells[solution].replace(old, new), tmp_path, f"wrong_{exercise}_{abs(hash(case))}")
    course.expect_test_failure(cells, ns, tests, test_cell)
