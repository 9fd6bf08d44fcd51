"""Notebook 12's graded exercises, run in-process (no kernel): the instructor's solutions pass every
test cell, hidden parts included, and typical wrong answers fail them.

The whole notebook (the calculator, the widgets, the two training runs, SmolLM2, the benchmark) is
executed by the course-wide notebook tests. Exercise 4 is a Triton kernel: its cell is compiled
from a file (Triton reads a kernel's source back), and its launcher cell runs after it. Its wrong
answers are chosen so that every address stays inside the tensors: in the interpreter an
out-of-bounds access reads or writes whatever memory is there. Exercise 6 is the learner's whole
MoE layer (``MyMoELayer``), graded on behaviour against ``reference.moe_reference`` in float64
with the layout-free checks of ``llmu.grading.moe``.
"""

from __future__ import annotations

import pytest

import llmu  # noqa: F401  (Triton mode first: the exercise kernel is defined below)
from llmu import course

NOTEBOOK = course.repo_root() / "solutions" / "12_mixture_of_experts" / "12_mixture_of_experts.ipynb"


EXERCISES = {
    "ex1": course.Exercise.numbered(1),
    "ex2": course.Exercise.numbered(2),
    "ex3": course.Exercise.numbered(3),
    "ex4": course.Exercise("ex4_kernel", ("test_ex4_visible", "test_ex4_hidden"), after=("ex4_launcher",)),
    "ex5": course.Exercise.numbered(5),
    "ex6": course.Exercise.numbered(6),
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
    "ex5: the bias in the gate weights": ("ex5", "weights = probs.gather(-1, experts)",
                                          "weights = (probs + self.bias[layer]).gather(-1, experts)", "test_ex5_visible"),
    "ex5: no bias in the choice": ("ex5", "(probs + self.bias[layer]).topk", "probs.topk", "test_ex5_visible"),
    "ex5: layer 0's bias for every layer": ("ex5", "(probs + self.bias[layer]).topk", "(probs + self.bias[0]).topk",
                                            "test_ex5_visible"),
    "ex5: never renormalised": ("ex5", "        if self.renormalize:\n            weights = weights / weights.sum(dim=-1, keepdim=True)\n",
                                "", "test_ex5_visible"),
    "ex5: always renormalised": ("ex5", "        if self.renormalize:\n", "        if True:\n", "test_ex5_hidden"),
    "ex5: updated by the size of the imbalance": ("ex5", "self.rate * torch.sign(fair - load.detach().float())",
                                                  "self.rate * (fair - load.detach().float())", "test_ex5_visible"),
    "ex5: updated towards the load": ("ex5", "torch.sign(fair - load.detach().float())",
                                      "torch.sign(load.detach().float() - fair)", "test_ex5_visible"),
    "ex5: weights detached": ("ex5", "weights = probs.gather(-1, experts)", "weights = probs.gather(-1, experts).detach()",
                              "test_ex5_hidden"),
    "ex5: rate not checked": ("ex5", "not (math.isfinite(rate) and rate > 0)", "rate < 0", "test_ex5_hidden"),
    "ex5: load's shape not checked": ("ex5", " or load.shape != self.bias.shape", "", "test_ex5_hidden"),
    "ex6: capacity without the ceiling": ("ex6", "math.ceil(self.capacity_factor * num_tokens * self.k / self.num_experts - 1e-9)",
                                          "int(self.capacity_factor * num_tokens * self.k / self.num_experts)",
                                          "test_ex6_visible"),
    "ex6: k counted as 1 in the capacity": ("ex6", "self.capacity_factor * num_tokens * self.k / self.num_experts",
                                            "self.capacity_factor * num_tokens / self.num_experts", "test_ex6_visible"),
    "ex6: dropped by gate score, not by position": (
        "ex6", "rank = (one_hot.cumsum(dim=0) * one_hot).sum(dim=-1) - 1",
        "score = weights.reshape(-1).detach()\n"
        "        rank = ((flat[None, :] == flat[:, None]) & (score[None, :] > score[:, None])).sum(dim=1)",
        "test_ex6_visible"),
    "ex6: first choices queued before second choices (GShard)": (
        "ex6", "rank = (one_hot.cumsum(dim=0) * one_hot).sum(dim=-1) - 1",
        "by_choice = torch.nn.functional.one_hot(experts.T.reshape(-1), num_experts)\n"
        "        rank = ((by_choice.cumsum(dim=0) * by_choice).sum(dim=-1) - 1).view(k, -1).T.reshape(-1)",
        "test_ex6_visible"),
    "ex6: gate weights never renormalised": ("ex6", "        if self.renormalize:\n            weights = weights / weights.sum(dim=-1, keepdim=True)\n",
                                             "", "test_ex6_visible"),
    "ex6: gate weights always renormalised": ("ex6", "        if self.renormalize:\n", "        if True:\n", "test_ex6_hidden"),
    "ex6: combine without the gate weights": ("ex6", "out * weights.reshape(-1)[order, None]", "out", "test_ex6_visible"),
    "ex6: dropped copies still computed and added": (
        "ex6", "counts = torch.bincount(flat[kept], minlength=num_experts)\n"
               "        order = torch.sort(torch.where(kept, flat, num_experts), stable=True).indices[: int(kept.sum())]",
        "counts = torch.bincount(flat, minlength=num_experts)\n"
        "        order = torch.sort(flat, stable=True).indices", "test_ex6_visible"),
    "ex6: weights renormalised over the kept copies": (
        "ex6", "out * weights.reshape(-1)[order, None]",
        "out * (weights * ~kept.view(n, k) * 0 + weights * kept.view(n, k) / (weights * kept.view(n, k)).sum(-1, keepdim=True)"
        ").reshape(-1)[order, None]", "test_ex6_visible"),
    "ex6: a dropped token passes x through (residual inside the layer)": (
        "ex6", "torch.zeros_like(x2).index_add(", "(x2 * (~kept.view(n, k)).all(-1, keepdim=True).to(x2.dtype)).index_add(",
        "test_ex6_visible"),
    "ex6: z-loss on the probabilities": ("ex6", "torch.logsumexp(logits, dim=-1)", "torch.logsumexp(probs, dim=-1)",
                                         "test_ex6_visible"),
    "ex6: f of the lb loss counted after dropping": ("ex6", "f = tokens_per_expert.to(probs.dtype) / (n * k)",
                                                     "f = counts.to(probs.dtype) / counts.sum()", "test_ex6_visible"),
    "ex6: capacity from one sequence's length": ("ex6", "capacity = self.capacity(n)", "capacity = self.capacity(x.shape[-2])",
                                                 "test_ex6_hidden"),
    "ex6: the router gets no gradient (weights detached)": ("ex6", "weights, experts = probs.topk(k, dim=-1)",
                                                            "weights, experts = probs.detach().topk(k, dim=-1)",
                                                            "test_ex6_hidden"),
    "ex6: a Python loop over the token copies": (
        "ex6", "y = torch.zeros_like(x2).index_add(0, order // k, out * weights.reshape(-1)[order, None])",
        "y = torch.zeros_like(x2)\n"
        "        for row, copy in enumerate(order.tolist()):\n"
        "            y[copy // k] = y[copy // k] + out[row] * weights.reshape(-1)[copy]", "test_ex6_hidden"),
    "ex6: k not checked": ("ex6", "if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= num_experts:",
                           "if False:", "test_ex6_hidden"),
    "ex6: load_weights' shapes not checked": ("ex6", "if tuple(w.shape) != tuple(param.shape):", "if False:",
                                              "test_ex6_hidden"),
}


# The exercise file's two tests: every solution passes its test cells; every wrong answer is
# caught by the test cell named for it (cell metadata is checked in tests/course/test_notebooks.py).
(notebook, test_solutions_pass_all_tests, test_wrong_answers_fail,
 test_library_answers_fail) = course.exercise_tests(
    NOTEBOOK, EXERCISES, WRONG)


# -- exercise 5's experiment: graded on the outcome of a run the grader trains itself --------------
# (the solution's rate passes it in the course-wide run of the whole notebook)

def _experiment(notebook, workdir, rate: str | None = None):
    """Run exercise 5's experiment cell (its rate replaced by ``rate``) and then its test cell, on
    the instructor's class; section 5's two runs stand in as 2-step runs (the cell only prints them).
    Each costs two 300-step trainings: the learner's run and the grader's own."""
    import torch

    from llmu.moe.train import train

    ns = notebook.namespace("ex5", workdir)
    ns["runs"] = {a: train(aux_weight=a, steps=2, batch_size=2, seq_len=8) for a in (0.0, 0.01)}
    cell = notebook.cells["ex5_experiment"]
    if rate is not None:
        assert "MY_RATE = 3e-3" in cell, "the solution's rate changed: update this test"
        cell = cell.replace("MY_RATE = 3e-3", f"MY_RATE = {rate}")
    threads = torch.get_num_threads()
    try:
        course.exec_cell(cell, ns, workdir, "ex5_experiment")
        course.exec_cell(notebook.cells["test_ex5_experiment"], ns, workdir, "test_ex5_experiment")
    finally:
        torch.set_num_threads(threads)
    return ns


@pytest.mark.slow
@pytest.mark.parametrize("rate, failed", [("1e-4", "balance: the loads' cv"), ("0.03", "quality: the LM loss")])
def test_the_experiment_fails_a_rate_too_small_or_too_large(notebook, tmp_path, rate, failed):
    with pytest.raises(AssertionError, match=failed):
        _experiment(notebook, tmp_path, rate)


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


# -- exercise 6: the learner's whole MoE layer ---------------------------------------------------

# Its wrong answers fail with a message that names the property, not only "values differ".
EX6_MESSAGES = {
    "ex6: capacity without the ceiling": "capacity C = ceil(capacity_factor * T * k / E) = ceil(12.33) = 13: got 12",
    "ex6: k counted as 1 in the capacity": "capacity C = ceil(capacity_factor * T * k / E) = ceil(12.33) = 13: got 7",
    "ex6: dropped by gate score, not by position": "aux.dropped: the copies over capacity, in token order",
    "ex6: first choices queued before second choices (GShard)": "aux.dropped: the copies over capacity, in token order",
    "ex6: gate weights never renormalised": "no capacity, top-2 renormalised: y equals reference.moe_reference",
    "ex6: gate weights always renormalised": "renormalize=False: the gate weights are the raw top-2 probabilities",
    "ex6: dropped copies still computed and added": "capacity 13: y equals reference.moe_reference",
    "ex6: weights renormalised over the kept copies": "capacity 13: y equals reference.moe_reference",
    "ex6: z-loss on the probabilities": "aux.z_loss: the mean over tokens of logsumexp(router logits)^2",
    "ex6: f of the lb loss counted after dropping": "aux.lb_loss: exercise 2's loss, alpha = 0.01, f over all T*k copies "
                                                    "before dropping",
    "ex6: capacity from one sequence's length": "the capacity counts all 39 tokens (C = 13): got 5",
    "ex6: the router gets no gradient (weights detached)": "the router's gradient (through the gate weights",
    "ex6: a Python loop over the token copies": "no Python loop over the tokens",
    "ex6: load_weights' shapes not checked": "raised RuntimeError",
}


@pytest.mark.parametrize("case", list(EX6_MESSAGES))
def test_ex6_wrong_answers_name_the_property(case, notebook, tmp_path):
    message = str(notebook.check_caught(*WRONG[case], workdir=tmp_path))
    assert EX6_MESSAGES[case] in message, message


def test_ex6_solution_is_a_design_of_40_to_65_lines():
    """The layer's reference answer is a real design: 40 to 65 lines of code in its solution region."""
    lines = course.solution_code_lines(course.cells_by_grade_id(NOTEBOOK)["ex6_solution"])
    assert 40 <= lines <= 65, lines


def test_ex6_figures_stated():
    """Exercise 6's statement: the visible case's capacity and drops, the batch's capacity against one
    sequence's, and C = T at capacity factor E / k, recomputed with llmu.moe.reference."""
    import math

    import torch

    from llmu.moe import reference

    cell = course.cells_by_grade_id(NOTEBOOK)["test_ex6_visible"]
    start = cell.index("_H6, _F6, _E6 = ")
    ns = {"torch": torch, "math": math}
    exec(cell[start:cell.index("\n\n", start)], ns)  # noqa: S102 - the test cell's own seeded inputs
    aux = reference.route(ns["_x6"], ns["_rw6"], 2, capacity_factor=1.0)
    copies = aux.dropped.numel()
    assert (aux.capacity, aux.num_dropped, copies) == (13, 6, 74)
    text = _prose("ex6_md")
    assert f"({aux.capacity} slots per expert; {aux.num_dropped} of the {copies} copies are dropped)" in text
    batch, one = (reference.expert_capacity(n, 6, 2, 1.0) for n in (39, 13))
    assert f"({batch} slots over 39 tokens, where one sequence alone would get {one})" in text
    assert reference.expert_capacity(50, 6, 2, 3.0) == 50 and "factors 3 ($C = T$)" in text
