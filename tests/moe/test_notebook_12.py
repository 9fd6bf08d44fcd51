"""Notebook 12's graded exercises, run in-process (no kernel): the instructor's solutions pass every
test cell, hidden parts included, and typical wrong answers fail them.

The whole notebook (the calculator, the widgets, the two training runs, SmolLM2, the benchmark) is
executed by the course-wide notebook tests. Exercise 4 is a Triton kernel: its cell is compiled
from a file (Triton reads a kernel's source back), and its launcher cell runs after it. Its wrong
answers are chosen so that every address stays inside the tensors: in the interpreter an
out-of-bounds access reads or writes whatever memory is there.
"""

from __future__ import annotations

import llmu  # noqa: F401  (Triton mode first: the exercise kernel is defined below)
from llmu import course

NOTEBOOK = course.repo_root() / "solutions" / "12_mixture_of_experts" / "12_mixture_of_experts.ipynb"


EXERCISES = {
    "ex1": course.Exercise.numbered(1),
    "ex2": course.Exercise.numbered(2),
    "ex3": course.Exercise.numbered(3),
    "ex4": course.Exercise("ex4_kernel", ("test_ex4_visible", "test_ex4_hidden"), after=("ex4_launcher",)),
}


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


# The exercise file's two tests: every solution passes its test cells; every wrong answer is
# caught by the test cell named for it (cell metadata is checked in tests/course/test_notebooks.py).
(notebook, test_solutions_pass_all_tests, test_wrong_answers_fail,
 test_library_answers_fail) = course.exercise_tests(
    NOTEBOOK, EXERCISES, WRONG)


# -- the figures the prose states, recomputed from llmu.moe (no model) ----------------------------

def _prose(grade_id):
    """A cell's text with its line breaks and indentation folded into single spaces."""
    return " ".join(course.cells_by_grade_id(NOTEBOOK)[grade_id].split())


def test_smollm2_with_eight_experts_stated():
    from llmu.moe import params

    dense, moe = params.SMOLLM2_135M, params.with_experts(params.SMOLLM2_135M, 8, 2)
    c0, c1 = params.count_parameters(dense), params.count_parameters(moe)
    f0, f1 = params.flops_per_token(dense, context=1024), params.flops_per_token(moe, context=1024)
    assert abs(f1["attention"] - f0["attention"]) < 1e-6 * f0["attention"]     # attention costs both the same
    assert (f"it stores {c1.total / c0.total:.1f} times the parameters, while each token multiplies with "
            f"{c1.active / c0.active:.1f} times as many weights ({f1['total'] / f0['total']:.1f} times the FLOPs "
            "at 1,024 tokens of context") in _prose("smol_md")                 # 5.1, 1.6, 1.5


def test_drops_of_an_unskewed_router_stated():
    import math

    import torch

    from llmu.moe import reference

    cell = course.cells_by_grade_id(NOTEBOOK)["capacity_picture"]
    ns = {"torch": torch, "math": math}
    exec(cell.split("\n\ndef ")[0], ns)  # noqa: S102 - the notebook's own demo inputs (seeded)
    copies = ns["T_demo"] * 2
    dropped = {cf: reference.route(ns["x_demo"], ns["router_demo"], 2, capacity_factor=cf).num_dropped
               for cf in (1.0, 1.25)}
    assert dropped[1.25] == 0
    assert f"a factor of 1 drops {dropped[1.0]} of the {copies:,} copies, 1.25 none" in _prose("capacity_read")


def test_the_benchmark_times_your_kernel_beside_llmus(notebook, tmp_path):
    """The benchmark cell passes exercise 4's kernel, through its launcher ``my_gather_rows``, as
    llmu's ``gather_rows`` is called: with the solution in place, it gives llmu's rows on the entry's
    inputs (74 rows and 200 columns: ragged tiles both ways)."""
    assert notebook.check_bench_yours(tmp_path, {"moe_gather_rows": "ex4"},
                                      sizes={"moe_gather_rows": {"T": 37, "k": 2, "E": 6, "H": 200}}) == \
        {"moe_gather_rows": "ok"}
