"""Notebook 10's graded exercises, run in-process (no kernel): the instructor's solutions pass every
test cell, hidden parts included, and typical wrong answers fail them.

The test cells take their SmolLM2 matrices from the setup cell's model, which loads once for the
module; no demonstration cell runs here. The whole notebook (plots, perplexity table, model cells,
benchmark) is executed by the course-wide notebook tests. The int4 GEMV kernel's cells move their
tensors to ``kernel_device()`` themselves (``gemv_inputs`` in the launcher cell). Exercise 5's
experiment is graded on a perplexity its test cell measures again: the solution's plan passes it,
and plans over the budget, incomplete, or no better than uniform RTN fail it, whatever perplexity
the learner recorded.
"""

from __future__ import annotations

import pytest

import llmu  # noqa: F401  (Triton mode first: the exercise kernel is defined below)
from llmu import course

# The notebook's setup cell, which every exercise here runs first, loads SmolLM2.
pytestmark = pytest.mark.slow

NOTEBOOK = course.repo_root() / "solutions" / "10_quantization" / "10_quantization.ipynb"


EXERCISES = {
    "ex1": course.Exercise.numbered(1),
    "ex2": course.Exercise.numbered(2),
    "ex3": course.Exercise.numbered(3),
    "ex4": course.Exercise("ex4_kernel", ("test_ex4_visible", "test_ex4_hidden"), after=("ex4_launcher",)),
    # exercise 1's quantizer and the helper cell (SHAPES, plan_ppl) come first: the experiment uses both
    "ex5": course.Exercise.numbered(5, before=("ex1_solution", "ex5_helpers")),
}


WRONG = {
    # exercise, replaced text, replacement, the test cell that must catch it
    "ex1: floor instead of round": ("ex1", "torch.round(groups / scale[..., None])", "torch.floor(groups / scale[..., None])",
                                    "test_ex1_visible"),
    "ex1: range without zero": ("ex1", "lo = groups.amin(dim=2).clamp(max=0)", "lo = groups.amin(dim=2)",
                                "test_ex1_visible"),
    "ex1: zero scales kept": ("ex1", "        scale = (hi - lo) / (2**bits - 1)\n"
                                     "        scale = torch.where(scale > 0, scale, torch.ones_like(scale))\n",
                              "        scale = (hi - lo) / (2**bits - 1)\n", "test_ex1_hidden"),
    "ex1: symmetric zero point at the top": ("ex1", "zero = torch.full_like(scale, 2.0 ** (bits - 1))",
                                             "zero = torch.full_like(scale, 2.0 ** bits - 1)", "test_ex1_hidden"),
    "ex1: bad group size accepted": ("ex1", "    if k % group_size:\n        raise ValueError",
                                     "    if False:\n        raise ValueError", "test_ex1_hidden"),
    "ex1: dequantize without the zero": ("ex1", "((q - zero[..., None]) * scale[..., None])", "(q * scale[..., None])",
                                         "test_ex1_visible"),
    "ex2: nibbles swapped": ("ex2", "codes[..., 0::2] | (codes[..., 1::2] << 4)", "codes[..., 1::2] | (codes[..., 0::2] << 4)",
                             "test_ex2_visible"),
    "ex2: large codes accepted": ("ex2", "if codes.numel() and int(codes.max()) > 15:", "if False:", "test_ex2_hidden"),
    "ex3: no error feedback": ("ex3", "        W[:, j + 1:] -= err[:, None] * U[j, j + 1:][None, :]\n", "",
                               "test_ex3_visible"),
    "ex3: error not divided by U[j, j]": ("ex3", "err = (W[:, j] - (q - zero) * scale) / U[j, j]",
                                          "err = W[:, j] - (q - zero) * scale", "test_ex3_hidden"),
    "ex3: no damping": ("ex3", "H[range(k), range(k)] += percdamp * torch.diagonal(H).mean()", "pass",
                        "test_ex3_hidden"),
    "ex3: caller's weights modified": ("ex3", "W = w.detach().float().clone()", "W = w.detach().float()",
                                       "test_ex3_hidden"),
    "ex4: codes paired with the wrong inputs": ("ex4", "(lo - z) * s * x_even[None, :] + (hi - z) * s * x_odd[None, :]",
                                                "(lo - z) * s * x_odd[None, :] + (hi - z) * s * x_even[None, :]",
                                                "test_ex4_visible"),
    "ex4: group of the byte index": ("ex4", "grp = (2 * j) // G", "grp = j // G", "test_ex4_visible"),
    "ex4: zero point ignored": ("ex4", "(lo - z) * s * x_even[None, :] + (hi - z) * s * x_odd[None, :]",
                                "lo * s * x_even[None, :] + hi * s * x_odd[None, :]", "test_ex4_visible"),
    "ex4: last step not masked": ("ex4", "col_ok = j < half", "col_ok = j < 2 * half", "test_ex4_hidden"),
    "ex5: scales and zeros not counted": ("ex5", "total_bits += n * k * bits + 32 * n * (k // group_size)",
                                          "total_bits += n * k * bits", "test_ex5_visible"),
    "ex5: one 16-bit float per group": ("ex5", "total_bits += n * k * bits + 32 * n * (k // group_size)",
                                        "total_bits += n * k * bits + 16 * n * (k // group_size)", "test_ex5_visible"),
    "ex5: lowest scores first": ("ex5", "key=lambda name: -scores[name]", "key=lambda name: scores[name]",
                                 "test_ex5_visible"),
    "ex5: stops at the first that does not fit": ("ex5", "            plan[name] = high\n            total += extra\n",
                                                  "            plan[name] = high\n            total += extra\n"
                                                  "        else:\n            break\n", "test_ex5_visible"),
    "ex5: the budget's edge refused": ("ex5", "if total + extra <= allowed:", "if total + extra < allowed:",
                                       "test_ex5_visible"),
    "ex5: ordered by score per weight": ("ex5", "key=lambda name: -scores[name]",
                                         "key=lambda name: -scores[name] / (shapes[name][0] * shapes[name][1])",
                                         "test_ex5_hidden"),
    "ex5: ties in reverse order": ("ex5", "for name in sorted(shapes, key=lambda name: -scores[name]):",
                                   "for name in sorted(reversed(list(shapes)), key=lambda name: -scores[name]):",
                                   "test_ex5_hidden"),
    "ex5: a budget below low accepted": ("ex5", "    if total > allowed:\n        raise ValueError",
                                         "    if False:\n        raise ValueError", "test_ex5_hidden"),
    "ex5: group size not checked": ("ex5", "        if k % group_size:\n            raise ValueError",
                                    "        if False:\n            raise ValueError", "test_ex5_hidden"),
}


# The exercise file's two tests: every solution passes its test cells; every wrong answer is
# caught by the test cell named for it (cell metadata is checked in tests/course/test_notebooks.py).
(notebook, test_solutions_pass_all_tests, test_wrong_answers_fail,
 test_library_answers_fail) = course.exercise_tests(
    NOTEBOOK, EXERCISES, WRONG)


# -- exercise 5's experiment: graded on a perplexity the grader measures itself ---------------------
# (the solution's plan passes it in the course-wide run of the whole notebook, and below)

def _experiment(notebook, workdir, recorded: dict | None = None):
    """Run exercise 5's experiment cell and then its test cell, with the instructor's my_quantize and
    my_plan. With ``recorded``, the experiment cell is not run: the names it would set get these
    values instead, as a learner could set them by hand."""
    ns = notebook.namespace("ex5", workdir)
    if recorded is None:
        course.exec_cell(notebook.cells["ex5_experiment"], ns, workdir, "ex5_experiment")
    else:
        ns.update(recorded)
    course.exec_cell(notebook.cells["test_ex5_experiment"], ns, workdir, "test_ex5_experiment")
    return ns


def test_the_experiment_passes_the_solutions_plan(notebook, tmp_path):
    ns = _experiment(notebook, tmp_path)
    assert ns["my_ppl"] <= 25.5 and ns["results"]["RTN 4-bit g64"][1] > 25.5


@pytest.mark.parametrize("plan, recorded_ppl, failed", [
    ("{name: (4, 64) for name in SHAPES}", 20.0, "quality: the held-out perplexity"),  # uniform RTN, an edited number
    ("{name: (8, 64) for name in SHAPES}", 18.0, "the budget: MY_PLAN costs 8.5000"),
    ("{name: (4, 64) for name in list(SHAPES)[1:]}", 20.0, "MY_PLAN gives every projection a format"),
    ("{name: (4, 128) for name in SHAPES}", 20.0, "MY_PLAN gives every projection a format"),
])
def test_the_experiment_fails_a_plan_out_of_budget_or_no_better_than_uniform(notebook, tmp_path, plan,
                                                                              recorded_ppl, failed):
    ns = notebook.namespace("ex5", tmp_path)
    with pytest.raises(AssertionError, match=failed):
        _experiment(notebook, tmp_path, recorded={"MY_PLAN": eval(plan, ns), "my_ppl": recorded_ppl})  # noqa: S307


def test_the_experiment_is_refused_without_its_names(notebook, tmp_path):
    ns = notebook.namespace("ex5", tmp_path)
    with pytest.raises(AssertionError, match="your experiment ran"):
        course.exec_cell(notebook.cells["test_ex5_experiment"], ns, tmp_path, "test_ex5_experiment")


def test_the_benchmark_times_your_kernel_beside_llmus(notebook, tmp_path):
    """The benchmark cell hands exercise 4's GEMV (through my_int4_gemv, once per token) the int4_gemv
    entry's inputs as llmu's kernel takes them: with the solution in place, it gives llmu's output.
    Two tokens; N = 37 leaves the last block of 16 rows ragged, K / 2 = 80 bytes the last step of 32."""
    assert notebook.check_bench_yours(tmp_path, {"int4_gemv": "ex4"},
                                      sizes={"int4_gemv": {"M": 2, "N": 37, "K": 160, "G": 32}}) == {"int4_gemv": "ok"}
