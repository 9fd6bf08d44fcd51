"""Notebook 04's graded exercises, run in-process (no kernel): the instructor's solutions pass every
test cell, hidden parts included, and typical wrong answers fail them.

The exercises use small random tensors and the tiny llmu model, so only the setup cell's imports
(and its tokenizer and recorded runs) are needed; the training runs, the memory measurement and
the benchmark are executed by the course-wide notebook tests. Exercise 8's kernel calls the
``logits_tile`` helper of the cell before it, so that cell runs first; exercise 6's training loop
calls the learner's pieces of exercises 1 to 5, so their solution cells run first.
"""

from __future__ import annotations

import pytest

import llmu  # noqa: F401  (runtime setup first: Triton's interpreter on a CPU)
from llmu import course

NOTEBOOK = course.repo_root() / "solutions" / "04_training" / "04_training.ipynb"


EXERCISES = {
    "ex1": course.Exercise.numbered(1),
    "ex2": course.Exercise.numbered(2),
    "ex3": course.Exercise.numbered(3),
    "ex4": course.Exercise.numbered(4),
    "ex5": course.Exercise.numbered(5),
    # the loop is built from the learner's pieces of exercises 1 to 5
    "ex6": course.Exercise.numbered(6, before=[f"ex{n}_solution" for n in range(1, 6)]),
    "ex7": course.Exercise.numbered(7),
    "ex8": course.Exercise.numbered(8, before=["ex8_helper"]),     # the logits_tile helper its kernel calls
    "ex9": course.Exercise.numbered(9),
    "ex10": course.Exercise.numbered(10),
    "ex12": course.Exercise.numbered(12),
}


# exercise 1's update: the decay, then the moments and the step (a wrong answer moves the decay last)
_DECAY = "p.mul_(1 - lr * wd)                               # decoupled decay, first\n                "
_REST = ("m.mul_(beta1).add_(g, alpha=1 - beta1)\n                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)\n"
         "                m_hat = m / (1 - beta1 ** t)\n                v_hat = v / (1 - beta2 ** t)\n"
         "                p.sub_(lr * m_hat / (v_hat.sqrt() + eps))")

WRONG = {
    # case: (exercise, replaced text, replacement, the test cell that must catch it)
    "ex1: no bias correction": ("ex1", "m_hat = m / (1 - beta1 ** t)\n                v_hat = v / (1 - beta2 ** t)",
                                "m_hat = m\n                v_hat = v", "test_ex1_visible"),
    "ex1: coupled (L2) decay": ("ex1", "g = p.grad\n                " + _DECAY, "g = p.grad + wd * p\n                ",
                                "test_ex1_visible"),
    "ex1: decay without lr": ("ex1", "p.mul_(1 - lr * wd)", "p.mul_(1 - wd)", "test_ex1_visible"),
    "ex1: no decay at all": ("ex1", _DECAY, "", "test_ex1_visible"),
    "ex1: decay after the update": ("ex1", _DECAY + _REST, _REST + "\n                p.mul_(1 - lr * wd)", "test_ex1_hidden"),
    "ex1: eps inside the square root": ("ex1", "(v_hat.sqrt() + eps)", "(v_hat + eps).sqrt()", "test_ex1_hidden"),
    "ex1: betas swapped in m": ("ex1", "m.mul_(beta1).add_(g, alpha=1 - beta1)", "m.mul_(1 - beta1).add_(g, alpha=beta1)",
                                "test_ex1_visible"),
    "ex1: bias correction a step late": ("ex1", "t = state[\"step\"]", "t = state[\"step\"] + 1", "test_ex1_visible"),
    "ex1: group settings ignored": ("ex1", "eps, wd = group[\"eps\"], group[\"weight_decay\"]",
                                    "eps, wd = self.defaults[\"eps\"], self.defaults[\"weight_decay\"]", "test_ex1_hidden"),
    "ex2: warmup off by one": ("ex2", "(1 if warmup_start == \"one\" else 0)", "(0 if warmup_start == \"one\" else 1)",
                               "test_ex2_visible"),
    "ex2: cosine not reaching min_lr": ("ex2", "min_lr + (peak_lr - min_lr) * 0.5", "min_lr + peak_lr * 0.5",
                                       "test_ex2_visible"),
    "ex2: cosine over the whole run": ("ex2", "progress = (step - warmup) / (total - warmup)", "progress = step / total",
                                      "test_ex2_visible"),
    "ex2: no floor past total": ("ex2", "    if step >= total:\n        return min_lr\n", "", "test_ex2_hidden"),
    "ex2: any convention accepted": ("ex2", "raise ValueError(f\"warmup_start must be 'one' or 'zero', got {warmup_start!r}\")",
                                     "pass", "test_ex2_hidden"),
    "ex3: per-tensor clipping": ("ex3", "        for g in grads:\n            g.mul_(scale.to(g.dtype))",
                                 "        for g in grads:\n            g.mul_(torch.clamp(max_norm / (g.norm() + 1e-6), max=1.0))",
                                 "test_ex3_visible"),
    "ex3: clipping below max_norm too": ("ex3", "if norm > max_norm:", "if True:", "test_ex3_visible"),
    "ex3: squared norm": ("ex3", "norm = torch.sqrt(sum((g.detach().float() ** 2).sum() for g in grads))",
                          "norm = sum((g.detach().float() ** 2).sum() for g in grads)", "test_ex3_visible"),
    "ex3: norm after clipping returned": ("ex3", "    return float(norm)",
                                          "    return float(torch.sqrt(sum((g.float() ** 2).sum() for g in grads)))",
                                          "test_ex3_visible"),
    "ex3: parameters read twice": ("ex3", "        for g in grads:\n            g.mul_(scale.to(g.dtype))",
                                   "        for p in parameters:\n            if p.grad is not None:\n"
                                   "                p.grad.mul_(scale)", "test_ex3_hidden"),
    "ex4: targets not shifted": ("ex4", "return windows[:, :-1], windows[:, 1:]", "return windows[:, :-1], windows[:, :-1]",
                                 "test_ex4_visible"),
    "ex4: dtype kept": ("ex4", "windows.astype(np.int64)", "windows", "test_ex4_visible"),
    "ex4: generator ignored": ("ex4", "(batch_size,), generator=generator)", "(batch_size,))", "test_ex4_visible"),
    "ex4: last start never drawn": ("ex4", "torch.randint(0, n - context_length, ", "torch.randint(0, n - context_length - 1, ",
                                    "test_ex4_hidden"),
    "ex4: the whole file read": ("ex4", "    n = len(tokens)\n", "    tokens = np.array(tokens)\n    n = len(tokens)\n",
                                 "test_ex4_hidden"),
    "ex5: optimizer state not restored": ("ex5", "    optimizer.load_state_dict(state[\"optimizer\"])\n", "",
                                          "test_ex5_visible"),
    "ex5: iteration not returned": ("ex5", "return state[\"iteration\"]", "return 0", "test_ex5_visible"),
    "ex5: generator not restored": ("ex5", "        generator.set_state(state[\"generator\"])", "        pass",
                                    "test_ex5_hidden"),
    "ex6: resume restarts the data order": ("ex6", "my_load_checkpoint(resume_from, model, optimizer, generator)",
                                            "my_load_checkpoint(resume_from, model, optimizer)", "test_ex6_visible"),
    "ex6: checkpoint names the step just run": ("ex6", "it + 1, checkpoint_path", "it, checkpoint_path", "test_ex6_visible"),
    "ex6: resume starts at 0": ("ex6", "start = my_load_checkpoint(", "_ = my_load_checkpoint(", "test_ex6_visible"),
    "ex6: gradients never cleared": ("ex6", "        optimizer.zero_grad(set_to_none=True)\n", "", "test_ex6_visible"),
    "ex6: no optimizer step": ("ex6", "        optimizer.step()\n", "", "test_ex6_visible"),
    "ex6: rate never scheduled": ("ex6", "group[\"lr\"] = lr", "pass", "test_ex6_hidden"),
    "ex6: vectors decay too": ("ex6", "{\"params\": vectors, \"weight_decay\": 0.0}",
                               "{\"params\": vectors, \"weight_decay\": weight_decay}", "test_ex6_hidden"),
    "ex7: no shift": ("ex7", "pred = logits[:, :-1].float()", "pred = logits[:, 1:].float()", "test_ex7_visible"),
    "ex7: mean over every position": ("ex7", "return -(token_logp * mask).sum() / mask.sum()",
                                      "return -(token_logp * mask).sum() / mask.numel()", "test_ex7_visible"),
    "ex7: mean of per-row means": ("ex7", "return -(token_logp * mask).sum() / mask.sum()",
                                   "return (-(token_logp * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()",
                                   "test_ex7_hidden"),
    "ex7: no error without labels": ("ex7", 'raise ValueError("labels hold no trained token")', "pass",
                                     "test_ex7_hidden"),
    "ex7: half precision kept": ("ex7", "pred = logits[:, :-1].float()", "pred = logits[:, :-1]", "test_ex7_hidden"),
    "ex8: sum not rescaled": ("ex8", "s = s * tl.exp(m - m_new) + ", "s = s + ", "test_ex8_visible"),
    "ex8: no running max": ("ex8", "tl.sum(tl.exp(z - m_new[:, None]), axis=1)", "tl.sum(tl.exp(z), axis=1)",
                            "test_ex8_visible"),
    "ex8: padded columns count": ("ex8", '        z = tl.where(cmask[None, :], z, float("-inf"))\n', "",
                                  "test_ex8_visible"),
    "ex8: ignored rows kept": ("ex8", "loss = tl.where(y != ignore_index, lse - z_target, 0.0)", "loss = lse - z_target",
                               "test_ex8_hidden"),
    "ex9: B random": ("ex9", "self.lora_B = nn.Parameter(torch.zeros(out_features, r, dtype=weight.dtype))",
                      "self.lora_B = nn.Parameter(torch.randn(out_features, r, dtype=weight.dtype))", "test_ex9_visible"),
    "ex9: base not frozen": ("ex9", "self.base = base.requires_grad_(False)", "self.base = base.requires_grad_(True)",
                             "test_ex9_visible"),
    "ex9: scaling r / alpha": ("ex9", "self.scaling = r, alpha, alpha / r", "self.scaling = r, alpha, r / alpha",
                               "test_ex9_visible"),
    "ex9: A at zero": ("ex9", "a = torch.rand(r, in_features, dtype=torch.float32) * (2 * bound) - bound",
                       "a = torch.zeros(r, in_features)", "test_ex9_hidden"),
    "ex9: A not scaled to the fan-in": ("ex9", "bound = 1.0 / math.sqrt(in_features)", "bound = 1.0",
                                        "test_ex9_hidden"),
    "ex9: delta without scaling": ("ex9", "return (self.lora_B @ self.lora_A) * self.scaling",
                                   "return self.lora_B @ self.lora_A", "test_ex9_hidden"),
    "ex10: chosen and rejected swapped": ("ex10", "beta * (chosen - rejected)", "beta * (rejected - chosen)",
                                         "test_ex10_visible"),
    "ex10: beta forgotten": ("ex10", "beta * (chosen - rejected)", "(chosen - rejected)", "test_ex10_visible"),
    "ex10: sum over pairs": ("ex10", "(chosen - rejected)).mean()", "(chosen - rejected)).sum()", "test_ex10_visible"),
    "ex10: log of sigmoid": ("ex10", "-F.logsigmoid(beta * (chosen - rejected)).mean()",
                            "-torch.log(torch.sigmoid(beta * (chosen - rejected))).mean()", "test_ex10_hidden"),
    "ex10: reference not detached": ("ex10", "chosen = policy_chosen - ref_chosen.detach()",
                                    "chosen = policy_chosen - ref_chosen", "test_ex10_hidden"),
    "ex12: advantages over the whole batch": ("ex12", "(r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + eps)",
                                              "(r - r.mean()) / (r.std() + eps)", "test_ex12_visible"),
    "ex12: population std": ("ex12", "r.std(dim=1, keepdim=True)", "r.std(dim=1, correction=0, keepdim=True)",
                             "test_ex12_visible"),
    "ex12: std without eps": ("ex12", "(r.std(dim=1, keepdim=True) + eps)", "r.std(dim=1, keepdim=True)",
                              "test_ex12_visible"),
    "ex12: max in the surrogate": ("ex12", "surrogate = torch.minimum(", "surrogate = torch.maximum(",
                                   "test_ex12_visible"),
    "ex12: clip applied to the advantage": ("ex12", "ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv",
                                            "ratio * adv.clamp(1 - clip_eps, 1 + clip_eps)", "test_ex12_visible"),
    "ex12: KL as logp_new - logp_ref": ("ex12", "kl = torch.exp(log_ref) - log_ref - 1", "kl = -log_ref",
                                       "test_ex12_visible"),
    "ex12: mean over all tokens of the batch": ("ex12", "loss = (per_token.sum(dim=2) / n_tokens).mean()",
                                                "loss = per_token.sum() / n_tokens.sum()", "test_ex12_visible"),
    "ex12: mask ignored": ("ex12", "valid = mask.bool()", "valid = torch.ones_like(mask, dtype=torch.bool)",
                           "test_ex12_visible"),
    "ex12: sign of the loss": ("ex12", "per_token = torch.where(valid, -(surrogate - beta * kl), zero)",
                               "per_token = torch.where(valid, surrogate - beta * kl, zero)", "test_ex12_visible"),
    "ex12: clip fraction ignores the advantage's sign": (
        "ex12", "((ratio > 1 + clip_eps) & (adv > 0)) | ((ratio < 1 - clip_eps) & (adv < 0))",
        "(ratio > 1 + clip_eps) | (ratio < 1 - clip_eps)", "test_ex12_hidden"),
    "ex12: padding masked after the exponential": ("ex12", "log_ratio = torch.where(valid, logp_new - logp_old.detach(), zero)",
                                                   "log_ratio = logp_new - logp_old.detach()", "test_ex12_hidden"),
    "ex12: reference not detached": ("ex12", "logp_ref.detach() - logp_new", "logp_ref - logp_new", "test_ex12_hidden"),
    "ex12: beta = 0 refused": ("ex12", "if clip_eps <= 0 or beta < 0:", "if clip_eps <= 0 or beta <= 0:",
                               "test_ex12_hidden"),
    "ex12: G = 1 accepted": ("ex12", "if logp_new.shape[1] < 2:", "if logp_new.shape[1] < 1:", "test_ex12_hidden"),
}


# The exercise file's two tests: every solution passes its test cells; every wrong answer is
# caught by the test cell named for it (cell metadata is checked in tests/course/test_notebooks.py).
(notebook, test_solutions_pass_all_tests, test_wrong_answers_fail,
 test_library_answers_fail) = course.exercise_tests(
    NOTEBOOK, EXERCISES, WRONG)



# Exercise 12's typical mistakes fail with a message that names the property they break.
EX12_MESSAGES = {
    "ex12: advantages over the whole batch": "the gradient is -A_i / (|o_i| * P * G)",
    "ex12: std without eps": "a group with identical rewards: the loss is finite",
    "ex12: max in the surrogate": "the loss of 2 completions",
    "ex12: clip applied to the advantage": "the loss of 2 completions",
    "ex12: KL as logp_new - logp_ref": "the loss of 2 completions",
    "ex12: mean over all tokens of the batch": "the loss of 2 completions",
    "ex12: clip fraction ignores the advantage's sign": "stats['clip_fraction']",
    "ex12: padding masked after the exponential": "padding holding +-1e4",
    "ex12: reference not detached": "no gradient reaches logp_ref",
    "ex12: beta = 0 refused": "beta = 0 is allowed",
    "ex12: G = 1 accepted": "G = 1 (no baseline) raises ValueError",
}


@pytest.mark.parametrize("case", list(EX12_MESSAGES))
def test_ex12_wrong_answers_name_the_property(case, notebook, tmp_path):
    message = str(notebook.check_caught(*WRONG[case], workdir=tmp_path))
    assert EX12_MESSAGES[case] in message, message


def test_ex12_solution_is_a_design_of_25_to_40_lines():
    """The GRPO loss is a real design: its solution region has 25 to 40 lines of code."""
    lines = course.solution_code_lines(course.cells_by_grade_id(NOTEBOOK)["ex12_solution"])
    assert 25 <= lines <= 40, lines

def test_recorded_runs_fit_the_notebook():
    """The notebook replays the first steps of the recorded runs with the recorded settings: the
    file must hold runs at least that long, made with settings the functions still accept."""
    import inspect
    import math

    from llmu.data import json as data_json
    from llmu.training import runs
    from llmu.training.dpo import preference_pairs
    from llmu.training.sft import sft_examples

    rec = data_json("training_runs")
    pretrain = rec["pretrain"]
    assert len(pretrain["train"]) == pretrain["settings"]["schedule_steps"] >= 60
    assert pretrain["heldout"][0]["step"] == 0 and pretrain["heldout"][-1]["step"] == len(pretrain["train"])
    assert len(rec["sft"]["steps"]) >= 3 and len(rec["dpo"]["steps"]) >= 2
    heldout = sft_examples()[-4:]
    assert [row["instruction"] for row in rec["sft"]["heldout"]] == [ex["instruction"] for ex in heldout]
    assert rec["sft"]["n_train"] == len(sft_examples()) - 4
    assert rec["dpo"]["n_train"] == len(preference_pairs()) - 6
    assert len(rec["dpo"]["answers_after"]) == len(heldout)
    # DPO's first step: policy = reference (fresh adapters), the loss is log 2
    assert abs(rec["dpo"]["steps"][0]["loss"] - math.log(2)) < 1e-5
    for name, fn in (("sft", runs.sft_lora), ("dpo", runs.dpo_lora)):
        inspect.signature(fn).bind(None, None, [], 1, **rec["settings"][name])   # raises on a stale key
    for key in ("date", "environment", "threads", "seconds"):
        assert key in rec


# The figures the notebook's prose states, recomputed from llmu's code, SmolLM2's config and the
# recorded runs (no model).

def _prose(grade_id: str) -> str:
    return course.cells_by_grade_id(NOTEBOOK)[grade_id]


def test_logit_memory_at_eight_sequences_of_4096():
    """Section 3: the logits and their gradient at N = 8 x 4096, the naive column of the table's last
    row, and what the chunked path adds there."""
    from llmu.training.cross_entropy import memory_bytes

    assert "for n in (512, 2048, 8192, 32768):" in _prose("memory_live")    # the table's last row is 8 x 4096
    f = memory_bytes(8 * 4096, 576, 49152, vocab_chunk=16384)
    text = _prose("memory_read")
    assert f"{2 * f['logits'] / 1e9:.0f} GB" == "13 GB" and "about\n13 GB for the logits and their gradient" in text
    assert f"{f['naive'] / 2**20:.0f} MiB" == "18432 MiB" and "18432 MiB" in text
    assert f"{f['chunked'] / 2**20:.0f} MiB" == "133 MiB" and "the chunked path adds about 133 MiB" in text
    assert "a few tens of MiB" not in text


def test_smollm2_float32_weights():
    """Section 4: SmolLM2-135M's float32 weights (the tied embedding counted once)."""
    from llmu.models import LlamaConfig

    n = LlamaConfig().num_parameters()
    assert n == 134_515_008 and f"{n * 4 / 1e6:.0f} MB" == "538 MB"
    assert "about 538 MB" in _prose("sft_run_md")


def test_live_dpo_pairs_per_micro_batch():
    """Section 5: the live DPO steps take one pair at a time where the recorded run took 2."""
    from llmu.data import json as data_json

    settings = data_json("training_runs")["settings"]["dpo"]
    assert settings["batch_pairs"] == 4 and settings["micro_pairs"] == 2
    assert '"micro_pairs": 1' in _prose("dpo_live")
    assert "(4 pairs a step, taken one at a time where the\nrecorded run took 2)" in _prose("dpo_run_md")


def test_the_benchmark_times_your_kernel_beside_llmus(notebook, tmp_path):
    """The benchmark cell passes exercise 8's launcher as llmu's forward kernel of the entry is
    called: with the solution in place, my_fused_ce gives llmu's (mean loss, lse of every row) on the
    entry's inputs, here with N, H and V none a multiple of the blocks (a ragged last tile of each)."""
    assert notebook.check_bench_yours(tmp_path, {"fused_linear_cross_entropy_fwd": "ex8"},
                                      sizes={"fused_linear_cross_entropy_fwd": {"N": 45, "H": 40, "V": 333}}) == \
        {"fused_linear_cross_entropy_fwd": "ok"}


def test_the_sweep_audit_catches_a_loss_that_training_does_not_give(notebook, tmp_path):
    """Exercise 11's sweep is graded on the learner's recorded losses, audited: the grader trains the
    best run again with the learner's my_train and its held-out loss must be the recorded one, to the
    bit. A sweep of one real run (1e-2, a few seconds) passes that audit; the same run with a
    recorded loss nudged by 1e-6 fails it."""
    import pytest

    from llmu.grading import CheckFailed

    ns = notebook.namespace("ex6", tmp_path)
    cell = notebook.cells["ex11_experiment"]
    assert "SWEEP_LRS = [1e-3, 3e-3, 1e-2, 3e-2, 1e-1]" in cell, "the solution's sweep changed: update this test"
    course.exec_cell(cell.replace("SWEEP_LRS = [1e-3, 3e-3, 1e-2, 3e-2, 1e-1]", "SWEEP_LRS = [1e-2]"), ns, tmp_path,
                     "ex11_experiment")
    test = notebook.cells["test_ex11_experiment"]
    with pytest.raises(CheckFailed, match=r"at least 4 rates \(got 1\)"):       # the audit passed; the sweep is too small
        course.exec_cell(test, ns, tmp_path, "test_ex11_experiment")
    ns["my_sweep"] = {1e-2: ns["my_sweep"][1e-2] + 1e-6}
    with pytest.raises(CheckFailed, match="trained again by the grader"):
        course.exec_cell(test, ns, tmp_path, "test_ex11_experiment")
