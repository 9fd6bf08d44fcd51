"""Notebook 03's graded exercises, run in-process (no kernel): the instructor's solutions pass every
test cell, hidden parts included, typical wrong answers fail the cell named for them, and llmu's
own versions (``llmu.layers.reference``, the Triton kernels, the model's modules) score nothing.

The hidden tests of exercises 3, 5 and 6 compare with SmolLM2 itself. Exercise 3's test cell gets
the model from ``load_model()`` itself; exercises 5 and 6 read the model, its config, the tokenizer
and the prompt from the locked ``finale_model`` cell just before them, so no test reads what a
demonstration cell (``model_load``, ``model_layout``) defined. Exercise 5 assembles the learner's
earlier parts, and exercise 6 (the capstone: the decoder as the learner's own modules, loaded with
SmolLM2 and trained with llmu's AdamW by ``llmu.grading.decoder.train_bytes``) may reuse them, so those
solution cells run first. The whole notebook (widgets, the layout experiment, the benchmark) is
executed by the course-wide notebook tests.

The cells make their tensors without naming a device; they are run with ``kernel_device()`` as
torch's default device (a no-op in the interpreter, cuda when the kernels are compiled, where
``load_model`` puts the model too), so the exercise kernel gets tensors it can read.
"""

from __future__ import annotations

import pytest

import llmu  # noqa: F401  (Triton mode first: the exercise kernel is defined below)
from llmu import course

# The tests of exercises 3, 5 and 6 load SmolLM2.
pytestmark = pytest.mark.slow

NOTEBOOK = course.repo_root() / "solutions" / "03_rope_swiglu_rmsnorm" / "03_rope_swiglu_rmsnorm.ipynb"

PARTS = ("apply_rope", "rms_norm", "swiglu")   # the solutions the block and the model are built from
FINALE = "finale_model"                         # the locked cell exercises 5 and 6 read the model from

EXERCISES = {
    "ex1": course.Exercise("apply_rope", ("test_rope_visible", "test_rope_hidden")),
    "ex2": course.Exercise("rms_norm", ("test_rmsnorm_visible", "test_rmsnorm_hidden")),
    "ex3": course.Exercise("swiglu", ("test_swiglu_visible", "test_swiglu_hidden")),
    "ex4": course.Exercise("rms_norm_kernel", ("test_triton_visible", "test_triton_hidden"),
                           after=("rms_norm_launcher",)),                 # my_rms_norm launches the kernel
    "ex5": course.Exercise("decoder_block", ("test_block_visible", "test_block_hidden"), before=(*PARTS, FINALE)),
    "ex6": course.Exercise("ex6_solution", ("test_ex6_visible", "test_ex6_hidden", "test_ex6_training"),
                           before=(*PARTS, FINALE)),
}


def test_finale_prompt_is_section_ones(notebook):
    """The ``finale_model`` cell encodes the chat prompt that the ``model_layout`` demo runs."""
    chat = 'tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])'
    assert chat in notebook.cells["model_layout"]
    assert chat in notebook.cells[FINALE]


HALF = "x1 * cos - x2 * sin, x1 * sin + x2 * cos"

WRONG = {
    # case: (exercise, replaced text, replacement, the test cell that must catch it)
    "ex1: half layout pairs neighbours": ("ex1", "x1, x2 = xf[..., : d // 2], xf[..., d // 2 :]",
                                          "x1, x2 = xf[..., 0::2], xf[..., 1::2]", "test_rope_visible"),
    "ex1: rotation the other way": ("ex1", HALF, "x1 * cos + x2 * sin, -x1 * sin + x2 * cos", "test_rope_visible"),
    "ex1: interleaved results concatenated": ("ex1", f"torch.stack([{HALF}], dim=-1).flatten(-2)",
                                              f"torch.cat([{HALF}], dim=-1)", "test_rope_hidden"),
    "ex1: float32 returned": ("ex1", "return out.to(x.dtype)", "return out", "test_rope_hidden"),
    "ex1: x rotated in place": ("ex1", "return out.to(x.dtype)", "return x.copy_(out)", "test_rope_hidden"),
    "ex1: unknown layout accepted": ("ex1", 'raise ValueError(f"unknown layout {layout!r}")', "out = xf",
                                     "test_rope_hidden"),
    "ex2: mean over the rows": ("ex2", "mean(dim=-1, keepdim=True)", "mean(dim=0, keepdim=True)",
                                "test_rmsnorm_visible"),
    "ex2: sum instead of mean": ("ex2", "xf.pow(2).mean(dim=-1, keepdim=True)", "xf.pow(2).sum(dim=-1, keepdim=True)",
                                 "test_rmsnorm_visible"),
    "ex2: weight forgotten": ("ex2", "(xf * inv_rms * weight.float())", "(xf * inv_rms)", "test_rmsnorm_visible"),
    "ex2: eps outside the root": ("ex2", "torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)",
                                  "1 / (xf.pow(2).mean(dim=-1, keepdim=True).sqrt() + eps)", "test_rmsnorm_hidden"),
    "ex2: float32 returned": ("ex2", ".to(x.dtype)", "", "test_rmsnorm_hidden"),
    "ex3: silu on both branches": ("ex3", "* (x @ w_up.T)", "* F.silu(x @ w_up.T)", "test_swiglu_visible"),
    "ex3: gate and up swapped": ("ex3", "F.silu(x @ w_gate.T) * (x @ w_up.T)", "F.silu(x @ w_up.T) * (x @ w_gate.T)",
                                 "test_swiglu_visible"),
    "ex3: ReLU gate": ("ex3", "F.silu(", "F.relu(", "test_swiglu_visible"),
    "ex3: sigmoid gate": ("ex3", "F.silu(", "torch.sigmoid(", "test_swiglu_visible"),
    "ex4: mean over BLOCK_SIZE": ("ex4", "tl.sum(x * x, axis=0) / n_cols", "tl.sum(x * x, axis=0) / BLOCK_SIZE",
                                  "test_triton_visible"),
    "ex4: padding loads ones": ("ex4", "x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)",
                                "x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=1.0)",
                                "test_triton_visible"),
    "ex4: weight forgotten": ("ex4", "y = x / tl.sqrt(mean_sq + eps) * w", "y = x / tl.sqrt(mean_sq + eps)",
                              "test_triton_visible"),
    "ex4: rows assumed packed": ("ex4", "x_ptr + row * x_row_stride", "x_ptr + row * n_cols", "test_triton_hidden"),
    "ex5: no residual around attention": ("ex5", "x = x + o @ a.o_proj.weight.T", "x = o @ a.o_proj.weight.T",
                                          "test_block_visible"),
    "ex5: not causal": ("ex5", "causal=True", "causal=False", "test_block_visible"),
    "ex5: heads not transposed": ("ex5", "q = (h @ a.q_proj.weight.T).view(b, t, nq, hd).transpose(1, 2)",
                                  "q = (h @ a.q_proj.weight.T).view(b, nq, t, hd)", "test_block_visible"),
    "ex5: first norm's gain twice": ("ex5", "layer.post_attention_layernorm.weight", "layer.input_layernorm.weight",
                                     "test_block_visible"),
    "ex5: layer 0's attention hard-coded": ("ex5", "a = layer.self_attn", "a = model.layers[0].self_attn",
                                            "test_block_hidden"),
    "ex6: init std 1": ("ex6", "torch.empty(d_out, d_in).normal_(0.0, 0.02)", "torch.empty(d_out, d_in).normal_(0.0, 1.0)",
                        "test_ex6_visible"),
    "ex6: keys and values as wide as the queries": ("ex6", "self.wk = MyLinear(d_model, n_kv_heads * self.hd)",
                                                    "self.wk = MyLinear(d_model, n_heads * self.hd)", "test_ex6_visible"),
    "ex6: KV heads tiled, not grouped": ("ex6", "k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)",
                                         "k, v = k.repeat(1, group, 1, 1), v.repeat(1, group, 1, 1)", "test_ex6_visible"),
    "ex6: no causal mask": ("ex6", 'p = scores.masked_fill(future, float("-inf")).softmax(dim=-1)',
                            "p = scores.softmax(dim=-1)", "test_ex6_visible"),
    "ex6: interleaved RoPE pairs": ("ex6", 'angles.sin().float(), "half")', 'angles.sin().float(), "interleaved")',
                                    "test_ex6_visible"),
    "ex6: gate and up swapped in the mapping": ("ex6", "(mine.mlp.gate.weight, m.gate_proj.weight), (mine.mlp.up.weight, m.up_proj.weight)",
                                                "(mine.mlp.gate.weight, m.up_proj.weight), (mine.mlp.up.weight, m.gate_proj.weight)",
                                                "test_ex6_visible"),
    "ex6: RoPE base fixed at SmolLM2's": ("ex6", "self.head_dim, self.base = head_dim, base",
                                          "self.head_dim, self.base = head_dim, 1e5", "test_ex6_hidden"),
    "ex6: eps fixed at 1e-5": ("ex6", "self.weight, self.eps = nn.Parameter(torch.ones(d_model)), eps",
                               "self.weight, self.eps = nn.Parameter(torch.ones(d_model)), 1e-5", "test_ex6_hidden"),
    "ex6: tie_embeddings ignored": ("ex6", "self.head = None if tie_embeddings else MyLinear(d_model, vocab_size)",
                                    "self.head = MyLinear(d_model, vocab_size)", "test_ex6_hidden"),
    "ex6: no ValueError": ("ex6", "if d_model % n_heads or n_heads % n_kv_heads:", "if False:", "test_ex6_hidden"),
    "ex6: norm gains frozen": ("ex6", "nn.Parameter(torch.ones(d_model))", "nn.Parameter(torch.ones(d_model), requires_grad=False)",
                               "test_ex6_training"),
    "ex6: attention's gradient cut off": ("ex6", "x = x + self.attn(self.norm1(x))", "x = x + self.attn(self.norm1(x)).detach()",
                                          "test_ex6_training"),
}


# The exercise file's tests: every solution passes its test cells; every wrong answer is caught by
# the test cell named for it; llmu's own answer fails every test cell of its exercise (cell
# metadata is checked in tests/course/test_notebooks.py).
(notebook, test_solutions_pass_all_tests, test_wrong_answers_fail,
 test_library_answers_fail) = course.exercise_tests(
    NOTEBOOK, EXERCISES, WRONG, on_kernel_device=True)


DELEGATING = {
    # a body that calls the library object the test hands in: nothing to see in the code's names
    "ex5": ("decoder_block", "    return layer(x, cos, sin, backend=model.attention_backend)[0]\n"),
}

#: Appended to the capstone's solution: a mapping that keeps the llmu model it is handed and a
#: forward that calls it. No llmu name appears in the code.
KEEPS_THE_MODEL = """
def my_load_weights(my_lm, model):
    my_lm.kept = [model]
    return my_lm


_own_forward = MyLM.forward


def _forward_through_the_kept_model(self, ids):
    if hasattr(self, "kept"):
        return self.kept[0](ids).logits
    return _own_forward(self, ids)


MyLM.forward = _forward_through_the_kept_model
"""


def _fails_every_test_cell_on_the_call(notebook, exercise, source, tmp_path):
    ns = notebook.namespace(exercise, tmp_path, source)
    for test in notebook.exercises[exercise].tests:
        with pytest.raises(AssertionError, match="while it ran, your code called llmu.models.llama"):
            course.exec_cell(notebook.cells[test], ns, tmp_path, test)


@pytest.mark.parametrize("exercise", list(DELEGATING))
def test_calling_the_layer_handed_in_scores_nothing(exercise, notebook, tmp_path):
    """``return layer(x, ...)`` refers to no llmu name, so only the own-work check's ``run`` (the
    submission run once with the answer classes' forward made to trip) sees it: every test cell of
    the exercise must fail on it with the own-work message."""
    cell, body = DELEGATING[exercise]
    before, _, after = course.solution_region(notebook.cells[cell])
    _fails_every_test_cell_on_the_call(notebook, exercise, course.answer_from_solution(before + body + after), tmp_path)


def test_a_decoder_that_runs_the_model_it_was_loaded_from_scores_nothing(notebook, tmp_path):
    """The capstone's ``my_load_weights`` that keeps llmu's model, and a ``MyLM.forward`` that calls
    it, pass every logit comparison; the own-work check runs the mapping and the forward on a small
    llmu decoder with its forward made to trip, and every test cell fails on it."""
    source = course.answer_from_solution(notebook.cells["ex6_solution"]) + KEEPS_THE_MODEL
    _fails_every_test_cell_on_the_call(notebook, "ex6", source, tmp_path)


def test_the_benchmark_times_your_kernel_beside_llmus(notebook, tmp_path):
    """The benchmark cell passes exercise 4's kernel (through ``my_rms_norm``) as llmu's kernel of
    ``rms_norm`` is called, ``fn(x, w)`` with llmu's eps: with the solution in place it gives llmu's
    output, here on rows of SmolLM2's 576 (a ragged 1024-wide block). Needs no model."""
    assert notebook.check_bench_yours(tmp_path, {"rms_norm": "ex4"},
                                      sizes={"rms_norm": {"M": 4, "N": 576}}) == {"rms_norm": "ok"}
