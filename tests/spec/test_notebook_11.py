"""Notebook 11's graded exercises, run in-process (no kernel): the instructor's solutions pass every
test cell, hidden parts included, and typical wrong answers fail them.

The exercise cells read the setup cell's model and tokenizer, so it runs once for the module. The
whole notebook (measurements, widgets, the live speedup, the benchmark) is executed by the
course-wide notebook tests. Exercise 2 uses exercise 1's residual, exercise 4 uses exercises 2 and
3, so each exercise runs on top of the solutions of the ones it builds on.
"""

from __future__ import annotations

import re

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
    "ex5": course.Exercise.numbered(5),
    "ex6": course.Exercise.numbered(6),
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
    "ex5: alpha = accepted / proposed": ("ex5", "failed = sum(1 for p, a in zip(proposed, accepted) if a < p)",
                                         "failed = sum(proposed) - sum(accepted)", "test_ex5_visible"),
    "ex5: every step counted as a rejection": ("ex5", "if a < p)", "if p > 0)", "test_ex5_visible"),
    "ex5: nothing proposed divides by zero": ("ex5", "    if passed + failed == 0:\n", "    if False:\n", "test_ex5_hidden"),
    "ex5: the draft's cost left out": ("ex5", "1 + slope * g + draft_cost * g", "1 + slope * g", "test_ex5_visible"),
    "ex5: the verification's slope left out": ("ex5", "1 + slope * g + draft_cost * g", "1 + draft_cost * g",
                                               "test_ex5_hidden"),
    "ex5: the largest of tied gammas": ("ex5", "max(sorted(gammas), key=speedup)",
                                        "max(sorted(gammas, reverse=True), key=speedup)", "test_ex5_hidden"),
    "ex5: 0/0 at alpha = 1": ("ex5", "tokens = g + 1 if alpha == 1 else (1 - alpha ** (g + 1)) / (1 - alpha)",
                              "tokens = (1 - alpha ** (g + 1)) / (1 - alpha)", "test_ex5_hidden"),
    "ex5: alpha not checked": ("ex5", "not 0 <= alpha <= 1", "False", "test_ex5_hidden"),
    # exercise 6: the tree's mask and positions, greedy verification of a tree, the cache after it
    "ex6: siblings see each other": ("ex6", "            mask[i] = mask[p]", "            mask[i, prefix_len:prefix_len + i] = True",
                                     "test_ex6_visible"),
    "ex6: a node sees its parent but not the ancestors above it": ("ex6", "            mask[i] = mask[p]",
                                                                    "            mask[i, prefix_len + p] = True", "test_ex6_visible"),
    "ex6: the committed tokens hidden": ("ex6", "    mask[:, :prefix_len] = True", "    pass", "test_ex6_visible"),
    "ex6: positions = prefix + node index": ("ex6", "depth.append(0 if p == -1 else depth[p] + 1)", "depth.append(i)",
                                             "test_ex6_visible"),
    "ex6: depth counted from 1": ("ex6", "depth.append(0 if p == -1 else depth[p] + 1)",
                                  "depth.append(1 if p == -1 else depth[p] + 1)", "test_ex6_visible"),
    "ex6: token compared with the prediction at the node itself": ("ex6", "tokens[i] == best[p + 1]", "tokens[i] == best[i + 1]",
                                                                   "test_ex6_visible"),
    "ex6: no bonus token": ("ex6", "return [tokens[i] for i in path] + [best[path[-1] + 1 if path else 0]]",
                            "return [tokens[i] for i in path] or [best[0]]", "test_ex6_visible"),
    "ex6: a second target pass": ("ex6", "    best = logits[f - 1:].argmax(-1).tolist()",
                                  "    best = logits[f - 1:].argmax(-1).tolist()\n"
                                  "    with torch.no_grad():   # the context's prediction from a plain pass\n"
                                  "        best[0] = int(model(torch.tensor([list(context)], device=dev)).logits[0, -1].argmax())",
                                  "test_ex6_visible"),
    "ex6: accepted nodes' keys and values not moved": ("ex6", "        cache.k[layer][:, :, dst] = cache.k[layer][:, :, src]\n"
                                                       "        cache.v[layer][:, :, dst] = cache.v[layer][:, :, src]\n",
                                                       "        pass\n", "test_ex6_visible"),
    "ex6: a path accepted without its parent": ("ex6", " and (p == -1 or ok[p])", "", "test_ex6_hidden"),
    "ex6: the first accepted path, not the deepest": ("ex6", "if ok[i] and (last == -1 or depth[i] > depth[last]):",
                                                      "if ok[i] and (last == -1 or p == last):", "test_ex6_hidden"),
    "ex6: a node that is its own parent accepted": ("ex6", "if not -1 <= p < i:", "if not -1 <= p:", "test_ex6_visible"),
    "ex6: a parent below -1 accepted": ("ex6", "if not -1 <= p < i:", "if not p < i:", "test_ex6_hidden"),
    "ex6: lengths not checked": ("ex6", "    if len(parents) != len(tokens):\n", "    if False:\n", "test_ex6_hidden"),
}


# The exercise file's two tests: every solution passes its test cells; every wrong answer is
# caught by the test cell named for it (cell metadata is checked in tests/course/test_notebooks.py).
(notebook, test_solutions_pass_all_tests, test_wrong_answers_fail,
 test_library_answers_fail) = course.exercise_tests(
    NOTEBOOK, EXERCISES, WRONG)


# -- exercise 5's experiment: graded on the outcome of runs the grader makes itself -----------------
# (the whole notebook's run executes the experiment cell; here the test cell alone runs, on the
# instructor's answers to exercises 1-5 with the settings below, and makes the grader's runs itself)

SOLUTION_SETTINGS = {"MY_GAMMAS": [2, 4, 8], "MY_DRAFT_COST": 0.0, "MY_SLOPE": 0.15}


def _experiment(notebook, workdir, settings=None, edit=None):
    """Exercise 5's graded experiment cell on the instructor's answers (``edit``: a (text,
    replacement) in exercise 5's solution) with ``settings`` over the solution's. The experiment
    cell itself is not run (the test cell makes its own runs): ``my_sweep`` starts empty."""
    solution = notebook.cells["ex5_solution"]
    if edit is not None:
        assert edit[0] in solution, f"the solution of ex5 no longer contains {edit[0]!r}: update this test"
        solution = solution.replace(*edit)
    for name, value in SOLUTION_SETTINGS.items():
        assert f"{name} = {value!r}" in notebook.cells["ex5_experiment"], f"the solution's {name} changed: update this test"
    ns = notebook.namespace("ex5", workdir, solution)
    for n in (1, 2, 3, 4):
        course.exec_cell(notebook.cells[f"ex{n}_solution"], ns, workdir, f"ex{n}_solution")
    ns.update(SOLUTION_SETTINGS, my_sweep={}, **(settings or {}))
    course.exec_cell(notebook.cells["test_ex5_experiment"], ns, workdir, "test_ex5_experiment")
    return ns


def test_the_experiment_passes_with_the_solutions_settings(notebook, tmp_path):
    ns = _experiment(notebook, tmp_path)
    assert ns["choice"] == 8 and ns["tps"] >= 3.0


@pytest.mark.parametrize("settings, edit, failed", [
    ({"MY_GAMMAS": [1, 2, 3]}, None, "MY_GAMMAS holds 3 or 4"),
    ({"MY_DRAFT_COST": -0.1}, None, "MY_DRAFT_COST is a number in"),
    ({"MY_SLOPE": 0.9}, None, "tokens per step (at least 3.0)"),
    (None, ("failed = sum(1 for p, a in zip(proposed, accepted) if a < p)", "failed = sum(proposed) - sum(accepted)"),
     "at most 15% either way"),
], ids=["too short a sweep", "a negative cost", "a slope that favours a short gamma", "alpha = accepted / proposed"])
def test_the_experiment_fails_bad_settings_or_estimates(notebook, tmp_path, settings, edit, failed):
    with pytest.raises(AssertionError, match=re.escape(failed)):
        _experiment(notebook, tmp_path, settings, edit)


def test_the_experiment_refuses_llmus_loop(notebook, tmp_path):
    from llmu.grading import CheckFailed

    ns = notebook.namespace("ex5", tmp_path)
    ns.update(SOLUTION_SETTINGS, my_sweep={})
    course.exec_cell("from llmu.spec.experiment import llmu_generate as my_speculative_generate", ns, tmp_path, "cheat")
    with pytest.raises(CheckFailed, match="a ready-made answer"):
        course.exec_cell(notebook.cells["test_ex5_experiment"], ns, tmp_path, "test_ex5_experiment")


# -- exercise 6: the property each typical mistake is caught by ---------------------------------------

EX6_MESSAGES = {
    "ex6: siblings see each other": "the mask of parents [-1, 0, 0, 1] after 2 committed tokens",
    "ex6: positions = prefix + node index": "positions of parents [-1, 0, 0, 1] after 2 committed tokens",
    "ex6: token compared with the prediction at the node itself": "the right path (nodes 2, 4, 5)",
    "ex6: no bonus token": "the right path (nodes 2, 4, 5) and the target's token after node 5",
    "ex6: a second target pass": "exactly one pass of the model per step",
    "ex6: accepted nodes' keys and values not moved": "24 tokens with your tree step equal plain greedy decoding",
    "ex6: a path accepted without its parent": "the accepted path holds from the top",
    "ex6: the first accepted path, not the deepest": "the deeper accepted path",
}


@pytest.mark.parametrize("case", list(EX6_MESSAGES))
def test_ex6_wrong_answers_name_the_property(case, notebook, tmp_path):
    message = str(notebook.check_caught(*WRONG[case], workdir=tmp_path))
    assert EX6_MESSAGES[case] in message, message


def test_ex6_solution_is_a_design_of_30_to_50_lines():
    """Exercise 6's reference answer (the mask, the positions, the step and its cache) is a design of
    30 to 50 lines of code."""
    lines = course.solution_code_lines(course.cells_by_grade_id(NOTEBOOK)["ex6_solution"])
    assert 30 <= lines <= 50, lines
