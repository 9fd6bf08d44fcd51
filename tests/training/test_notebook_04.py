"""Notebook 04's graded exercises, run in-process (no kernel): the instructor's solutions pass every
test cell, hidden parts included, and typical wrong answers fail them.

The exercises use small random tensors and the tiny llmu model, so only the setup cell's imports
(and its tokenizer and recorded runs) are needed; the training runs, the memory measurement and
the benchmark are executed by the course-wide notebook tests. Exercise 2's kernel calls the
``logits_tile`` helper of the cell before it, so that cell runs first.
"""

from __future__ import annotations

import llmu  # noqa: F401  (runtime setup first: Triton's interpreter on a CPU)
from llmu import course

NOTEBOOK = course.repo_root() / "solutions" / "04_training" / "04_training.ipynb"


EXERCISES = {
    "ex1": course.Exercise.numbered(1),
    "ex2": course.Exercise.numbered(2, before=["ex2_helper"]),     # the logits_tile helper its kernel calls
    "ex3": course.Exercise.numbered(3),
    "ex4": course.Exercise.numbered(4),
}


WRONG = {
    # case: (exercise, replaced text, replacement, the test cell that must catch it)
    "ex1: no shift": ("ex1", "pred = logits[:, :-1].float()", "pred = logits[:, 1:].float()", "test_ex1_visible"),
    "ex1: mean over every position": ("ex1", "return -(token_logp * mask).sum() / mask.sum()",
                                      "return -(token_logp * mask).sum() / mask.numel()", "test_ex1_visible"),
    "ex1: mean of per-row means": ("ex1", "return -(token_logp * mask).sum() / mask.sum()",
                                   "return (-(token_logp * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()",
                                   "test_ex1_hidden"),
    "ex1: no error without labels": ("ex1", 'raise ValueError("labels hold no trained token")', "pass",
                                     "test_ex1_hidden"),
    "ex1: half precision kept": ("ex1", "pred = logits[:, :-1].float()", "pred = logits[:, :-1]", "test_ex1_hidden"),
    "ex2: sum not rescaled": ("ex2", "s = s * tl.exp(m - m_new) + ", "s = s + ", "test_ex2_visible"),
    "ex2: no running max": ("ex2", "tl.sum(tl.exp(z - m_new[:, None]), axis=1)", "tl.sum(tl.exp(z), axis=1)",
                            "test_ex2_visible"),
    "ex2: padded columns count": ("ex2", '        z = tl.where(cmask[None, :], z, float("-inf"))\n', "",
                                  "test_ex2_visible"),
    "ex2: ignored rows kept": ("ex2", "loss = tl.where(y != ignore_index, lse - z_target, 0.0)", "loss = lse - z_target",
                               "test_ex2_hidden"),
    "ex3: B random": ("ex3", "self.lora_B = nn.Parameter(torch.zeros(out_features, r, dtype=weight.dtype))",
                      "self.lora_B = nn.Parameter(torch.randn(out_features, r, dtype=weight.dtype))", "test_ex3_visible"),
    "ex3: base not frozen": ("ex3", "self.base = base.requires_grad_(False)", "self.base = base.requires_grad_(True)",
                             "test_ex3_visible"),
    "ex3: scaling r / alpha": ("ex3", "self.scaling = r, alpha, alpha / r", "self.scaling = r, alpha, r / alpha",
                               "test_ex3_visible"),
    "ex3: A at zero": ("ex3", "a = torch.rand(r, in_features, dtype=torch.float32) * (2 * bound) - bound",
                       "a = torch.zeros(r, in_features)", "test_ex3_hidden"),
    "ex3: A not scaled to the fan-in": ("ex3", "bound = 1.0 / math.sqrt(in_features)", "bound = 1.0",
                                        "test_ex3_hidden"),
    "ex3: delta without scaling": ("ex3", "return (self.lora_B @ self.lora_A) * self.scaling",
                                   "return self.lora_B @ self.lora_A", "test_ex3_hidden"),
    "ex4: chosen and rejected swapped": ("ex4", "beta * (chosen - rejected)", "beta * (rejected - chosen)",
                                         "test_ex4_visible"),
    "ex4: beta forgotten": ("ex4", "beta * (chosen - rejected)", "(chosen - rejected)", "test_ex4_visible"),
    "ex4: sum over pairs": ("ex4", "(chosen - rejected)).mean()", "(chosen - rejected)).sum()", "test_ex4_visible"),
    "ex4: log of sigmoid": ("ex4", "-F.logsigmoid(beta * (chosen - rejected)).mean()",
                            "-torch.log(torch.sigmoid(beta * (chosen - rejected))).mean()", "test_ex4_hidden"),
    "ex4: reference not detached": ("ex4", "chosen = policy_chosen - ref_chosen.detach()",
                                    "chosen = policy_chosen - ref_chosen", "test_ex4_hidden"),
}


# The exercise file's two tests: every solution passes its test cells; every wrong answer is
# caught by the test cell named for it (cell metadata is checked in tests/course/test_notebooks.py).
(notebook, test_solutions_pass_all_tests, test_wrong_answers_fail,
 test_library_answers_fail) = course.exercise_tests(
    NOTEBOOK, EXERCISES, WRONG)


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
    """The benchmark cell passes exercise 2's launcher as llmu's forward kernel of the entry is
    called: with the solution in place, my_fused_ce gives llmu's (mean loss, lse of every row) on the
    entry's inputs, here with N, H and V none a multiple of the blocks (a ragged last tile of each)."""
    assert notebook.check_bench_yours(tmp_path, {"fused_linear_cross_entropy_fwd": "ex2"},
                                      sizes={"fused_linear_cross_entropy_fwd": {"N": 45, "H": 40, "V": 333}}) == \
        {"fused_linear_cross_entropy_fwd": "ok"}
