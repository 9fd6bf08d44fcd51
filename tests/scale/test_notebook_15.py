"""Notebook 15's graded exercises, run in-process (no kernel): the instructor's solutions pass every
test cell, hidden parts included, and typical wrong answers fail them.

The setup cell runs once for the module (it loads no model). Every test cell builds what it
reads: exercise 3's visible test times a short run of a one-layer model itself, against a stated
peak, rather than reading the run the ``mfu_live`` cell measures. The whole notebook (measurements, widgets, the engine, the benchmark) is executed by the
course-wide notebook tests.
"""

from __future__ import annotations

import ast

import pytest

import llmu  # noqa: F401
from llmu import course

NOTEBOOK = course.repo_root() / "solutions" / "15_scale" / "15_scale.ipynb"


EXERCISES = {f"ex{n}": course.Exercise.numbered(n) for n in (1, 2, 3, 4)}
EXERCISES["ex5"] = course.Exercise.numbered(5, after=("ex5_helpers",))
EXERCISES["ex6"] = course.Exercise.numbered(6, after=("ex6_helpers",))


def _recorded_runs(namespace):
    """Stands in for exercise 5's experiment cell (a minute of training): exercise 6's hidden test
    fits the learner's ``my_runs``, here the default grid's runs with the losses seed 0 gave."""
    from llmu.scale.parametric import recorded_runs

    namespace["my_runs"] = recorded_runs(0)


WRONG = {
    # exercise, replaced text, replacement, the test cell that must catch it
    "ex1: forward only (2 per parameter)": ("ex1", "per_token = 6 * n_matmul", "per_token = 2 * n_matmul",
                                            "test_ex1_visible"),
    "ex1: no attention": ("ex1", "per_token = 6 * n_matmul + 6 * shape.num_hidden_layers * d_attn * (seq_len + 1)",
                          "per_token = 6 * n_matmul", "test_ex1_visible"),
    "ex1: T instead of T + 1": ("ex1", "(seq_len + 1)", "seq_len", "test_ex1_visible"),
    "ex1: tied head dropped": ("ex1", "if not shape.tie_word_embeddings:", "if True:", "test_ex1_visible"),
    "ex1: untied embedding counted": ("ex1", "if not shape.tie_word_embeddings:", "if False:", "test_ex1_hidden"),
    "ex1: d_attn = hidden_size": ("ex1", "d_attn = shape.num_attention_heads * shape.head_dim",
                                  "d_attn = shape.hidden_size", "test_ex1_hidden"),
    "ex2: exponents swapped": ("ex2", "n = g * (flops / 6) ** (fit.beta / s)", "n = g * (flops / 6) ** (fit.alpha / s)",
                               "test_ex2_visible"),
    "ex2: 20 tokens per parameter": ("ex2",
                                     "n = g * (flops / 6) ** (fit.beta / s)\n    d = (flops / 6) ** (fit.alpha / s) / g",
                                     "n = math.sqrt(flops / 120)\n    d = 20 * n", "test_ex2_visible"),
    "ex2: C instead of C/6": ("ex2", "n = g * (flops / 6) ** (fit.beta / s)", "n = g * flops ** (fit.beta / s)",
                              "test_ex2_visible"),
    "ex2: G inverted": ("ex2", "g = (fit.alpha * fit.A / (fit.beta * fit.B))",
                        "g = (fit.beta * fit.B / (fit.alpha * fit.A))", "test_ex2_visible"),
    "ex2: bad budget accepted": ("ex2",
                                 '    if not flops > 0:\n        raise ValueError(f"flops must be positive, got {flops}")\n',
                                 "", "test_ex2_hidden"),
    "ex3: warm-up kept": ("ex3", "times = list(step_seconds)[warmup:]", "times = list(step_seconds)",
                          "test_ex3_visible"),
    "ex3: peak over achieved": ("ex3", "return flops_per_step / statistics.median(times) / peak_flops",
                                "return peak_flops / (flops_per_step / statistics.median(times))", "test_ex3_visible"),
    "ex3: mean step time": ("ex3", "statistics.median(times)", "statistics.mean(times)", "test_ex3_hidden"),
    "ex3: fastest step": ("ex3", "statistics.median(times)", "min(times)", "test_ex3_hidden"),
    "ex4: batch ignored": ("ex4", "tokens_per_s = batch / max(memory_s, compute_s)",
                           "tokens_per_s = 1 / max(memory_s, compute_s)", "test_ex4_visible"),
    "ex4: dollars per second": ("ex4", "dollars_per_hour / (3600 * tokens_per_s) * 1e6",
                                "dollars_per_hour / tokens_per_s * 1e6", "test_ex4_visible"),
    "ex4: KV cache ignored": ("ex4", "(weights + batch * context * kv)", "weights", "test_ex4_hidden"),
    "ex4: one cache for the batch": ("ex4", "batch * context * kv", "context * kv", "test_ex4_hidden"),
    "ex4: compute roof ignored": ("ex4", "max(memory_s, compute_s)", "memory_s", "test_ex4_hidden"),
    "ex5: log10 instead of ln": ("ex5", "math.log(run.params)", "math.log10(run.params)", "test_ex5_visible"),
    "ex5: N_opt left as ln N": ("ex5", "n_opt.append(math.exp(x_min))", "n_opt.append(x_min)", "test_ex5_visible"),
    "ex5: b taken equal to a": ("ex5", "b, _ = np.polyfit(np.log(budgets), np.log(d_opt), 1)", "b = a", "test_ex5_visible"),
    "ex5: the lowest run instead of the vertex": ("ex5", "x_min = -p1 / (2 * p2)", "x_min = x[np.argmin(y)]",
                                                  "test_ex5_hidden"),
    "ex5: k left as ln k": ("ex5", '"k": math.exp(ln_k)', '"k": ln_k', "test_ex5_hidden"),
    "ex5: budgets in the order met": ("ex5", "budgets, n_opt = sorted(profiles), []", "budgets, n_opt = list(profiles), []",
                                      "test_ex5_hidden"),
    "ex5: a hill accepted": ("ex5", "        if p2 <= 0:\n", "        if False:\n", "test_ex5_hidden"),
    "ex5: a vertex outside the sizes accepted": ("ex5", "        if not x.min() <= x_min <= x.max():\n", "        if False:\n",
                                                 "test_ex5_hidden"),
    "ex5: a single budget accepted": ("ex5", "    if len(profiles) < 2:\n", "    if False:\n", "test_ex5_hidden"),
    "ex6: residuals of L, not of log L": ("ex6", "r = torch.logsumexp(torch.stack(terms), dim=0) - log_loss",
                                          "r = torch.logsumexp(torch.stack(terms), dim=0).exp() - log_loss.exp()",
                                          "test_ex6_visible"),
    "ex6: squared loss": ("ex6", "huber = torch.where(r.abs() <= delta, 0.5 * r**2, delta * (r.abs() - 0.5 * delta))",
                          "huber = 0.5 * r**2", "test_ex6_visible"),
    "ex6: one start, at zero": ("ex6", "starts = grid[objective(grid).argsort()[:16]]",
                                "starts = torch.zeros(1, 5, dtype=torch.float64)", "test_ex6_hidden"),
    "ex6: torch's default max_iter and tolerances": ("ex6", "max_iter=100, tolerance_grad=1e-12, tolerance_change=1e-15,\n"
                                                     "                                  line_search_fn",
                                                     "line_search_fn", "test_ex6_visible"),
    "ex6: no E term": ("ex6", "terms = torch.broadcast_tensors(e, a - alpha * log_n, b - beta * log_d)",
                       "terms = torch.broadcast_tensors(a - alpha * log_n, b - beta * log_d)", "test_ex6_visible"),
    "ex6: A and B returned as logs": ("ex6", '"A": math.exp(a), "B": math.exp(b)', '"A": a, "B": b', "test_ex6_visible"),
    "ex6: a = alpha / (alpha + beta)": ("ex6", "a, b = beta / (alpha + beta), alpha / (alpha + beta)",
                                        "a, b = alpha / (alpha + beta), beta / (alpha + beta)", "test_ex6_visible"),
    "ex6: G without its power": ("ex6", "g = (alpha * big_a / (beta * big_b)) ** (1 / (alpha + beta))",
                                 "g = alpha * big_a / (beta * big_b)", "test_ex6_visible"),
    "ex6: D_opt without the 6": ("ex6", '"k_d": 1 / (6 * k)', '"k_d": 1 / k', "test_ex6_visible"),
    "ex6: four runs accepted": ("ex6", "    if len(runs) < 5:\n", "    if False:\n", "test_ex6_hidden"),
    "ex6: a non-positive loss accepted": ("ex6", "torch.isfinite(values).all() and (values > 0).all()",
                                          "torch.isfinite(values).all()", "test_ex6_hidden"),
    "ex6: a negative exponent accepted": ("ex6", "    if min(big_a, big_b, alpha, beta) <= 0:\n",
                                          "    if min(big_a, big_b) <= 0:\n", "test_ex6_hidden"),
}

# What the named test cell says for the wrong answers of exercise 6 that need explaining.
EX6_MESSAGES = {
    "ex6: residuals of L, not of log L": "within 0.5 % of llmu's optimum",
    "ex6: squared loss": "within 0.5 % of llmu's optimum",
    "ex6: one start, at zero": "with one diverged run",
    "ex6: torch's default max_iter and tolerances": "E within 2 % of the true 1.69",
    "ex6: no E term": "E within 2 % of the true 1.69",
    "ex6: A and B returned as logs": "A and B within a factor of 1.5",
    "ex6: a = alpha / (alpha + beta)": "a = beta / (alpha + beta) and b = alpha / (alpha + beta)",
    "ex6: G without its power": "k = G / 6^a",
    "ex6: D_opt without the 6": "k_d = 1 / (6 k)",
    "ex6: a negative exponent accepted": "no optimum",
}


# The exercise file's two tests: every solution passes its test cells; every wrong answer is
# caught by the test cell named for it (cell metadata is checked in tests/course/test_notebooks.py).
(notebook, test_solutions_pass_all_tests, test_wrong_answers_fail,
 test_library_answers_fail) = course.exercise_tests(
    NOTEBOOK, EXERCISES, WRONG, setup_hook=_recorded_runs)


@pytest.mark.parametrize("case", list(EX6_MESSAGES))
def test_ex6_wrong_answers_name_the_property(case, notebook, tmp_path):
    message = str(notebook.check_caught(*WRONG[case], workdir=tmp_path))
    assert EX6_MESSAGES[case] in message, message


def test_ex6_solution_is_a_design_of_30_to_50_lines():
    """Exercise 6's reference answer is a real design: 30 to 50 lines of code in its solution regions."""
    assert 30 <= course.solution_code_lines(course.cells_by_grade_id(NOTEBOOK)["ex6_solution"]) <= 50


def test_ex6_prose_figures_are_llmus():
    """The figures section 5.2 and the summary quote for the default grid's runs are what llmu's fit gives
    on the recorded losses of seeds 0, 1 and 2, and what exercise 5's approach gives on them."""
    from llmu.scale import isoflop, parametric

    cells = course.cells_by_grade_id(NOTEBOOK)
    a3 = [parametric.allocation_law(parametric.fit_runs(parametric.recorded_runs(s))).a for s in (0, 1, 2)]
    a2 = [isoflop.fit_isoflop(parametric.recorded_runs(s)).a for s in (0, 1, 2)]
    assert [round(a, 2) for a in a3] == [0.29, 0.25, 0.30], a3
    assert [round(a, 2) for a in a2] == [0.42, 0.38, 0.53], a2
    assert "0.25 to 0.30 over three seeds" in " ".join(cells["summary"].split())
    written = " ".join(cells["ex6_written"].split())
    assert "approach 2 gave $a = 0.42$ and approach 3 gives $a = 0.29$" in written
    assert "approach 3 gave 0.29, 0.25 and 0.30 where approach 2 gave 0.42, 0.38 and 0.53" in written


def test_no_test_cell_reads_the_measured_run():
    # the mfu_live cell's run, roof and local_mfu belong to the demo; the graded cells build their own
    for grade_id, source in course.cells_by_grade_id(NOTEBOOK).items():
        if grade_id.startswith("test_"):
            names = {node.id for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Name)}
            assert not names & {"run", "roof", "local_mfu"}, grade_id


def test_each_letter_keeps_one_meaning():
    """B is Chinchilla's fitted constant and L the loss: the batch is b (as in module 05) and the
    layers are n_layers in the prose of sections 1, 4 and 5."""
    import re

    cells = course.cells_by_grade_id(NOTEBOOK)
    for grade_id in ("flops_md", "serve_md", "bench_md"):
        maths = " ".join(re.findall(r"\$\$?(.+?)\$\$?", cells[grade_id], re.DOTALL))
        maths = maths.replace(r"\partial L", "")  # the loss
        assert not re.search(r"(?<![\\\w])[BL](?!\w)", maths), f"{grade_id}: B or L used for a batch or layers: {maths}"
    assert "B = 410.7" in cells["chin_md"]


def test_the_experiment_audit_catches_losses_that_training_does_not_give(notebook, tmp_path):
    """Exercise 5's experiment is graded on the learner's runs, audited: the grader trains the
    cheapest run (first) and one drawn at random again, and their losses must be the recorded ones,
    to the bit. Runs whose losses were
    written by hand (here: the published law's, on the default plan) fail that audit."""
    import pytest

    from llmu.grading import CheckFailed
    from llmu.scale import chinchilla, isoflop

    ns = notebook.namespace("ex5", tmp_path)
    plan = isoflop.isoflop_grid()
    ns["my_runs"] = [isoflop.IsoRun(r.config, r.budget, r.params, r.steps, r.batch, r.seq_len,
                                    loss=chinchilla.HOFFMANN_2022.loss(r.params, r.tokens)) for r in plan]
    with pytest.raises(CheckFailed, match="trained again by the grader"):
        course.exec_cell(notebook.cells["test_ex5_experiment"], ns, tmp_path, "test_ex5_experiment")
