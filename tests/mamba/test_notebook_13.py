"""Notebook 13's graded exercises, run in-process (no kernel, no model): the instructor's solutions
pass every test cell, hidden parts included, and typical wrong answers fail them.

The whole notebook (pictures, decode memory with SmolLM2, training, the benchmark) is executed by
the course-wide notebook tests. Exercise 2 uses exercise 1's ``my_discretize``; exercise 4's kernel
needs the locked cells around it (the scan operator before it, the launcher after it). Kernels are
compiled from a file (``course.exec_cell``): Triton reads a kernel's source back.
"""

from __future__ import annotations

import json
import math
import re

import llmu  # noqa: F401  (Triton mode first: the exercise kernel is defined below)
from llmu import course
from llmu.mamba import picture

NOTEBOOK = course.repo_root() / "solutions" / "13_mamba" / "13_mamba.ipynb"


EXERCISES = {
    "ex1": course.Exercise.numbered(1),
    "ex2": course.Exercise.numbered(2, before=["ex1_solution"]),
    "ex3": course.Exercise.numbered(3),
    "ex4": course.Exercise("ex4_kernel", ("test_ex4_visible", "test_ex4_hidden"), before=("ex4_helpers",),
                           after=("ex4_launcher",)),
    "ex5": course.Exercise.numbered(5, before=["ex1_solution", "ex2_solution"], after=["ex5_helpers"]),
}


WRONG = {
    # exercise, replaced text, replacement, the test cell that must catch it
    "ex1: exp(A) without the step": ("ex1", "torch.exp(delta[..., None] * A.float()[None, :, None, :])",
                                     "torch.exp(A.float()[None, :, None, :]).expand(*delta.shape, A.shape[1])",
                                     "test_ex1_visible"),
    "ex1: exp(-ΔA)": ("ex1", "torch.exp(delta[..., None] * A.float()", "torch.exp(-delta[..., None] * A.float()",
                      "test_ex1_visible"),
    "ex1: B without Δ": ("ex1", "(delta * u.float())[..., None]", "u.float()[..., None]", "test_ex1_visible"),
    "ex1: B's time and state axes swapped": ("ex1", "B.float().transpose(1, 2)[:, None]",
                                              "B.float().reshape(B.shape[0], B.shape[2], B.shape[1])[:, None]",
                                              "test_ex1_visible"),
    "ex1: exact zero-order hold for B": ("ex1", "dBu = (delta * u.float())[..., None] * B.float().transpose(1, 2)[:, None]",
                                         "dBu = (torch.expm1(delta[..., None] * A.float()[None, :, None, :]) / A.float()[None, :, None, :])"
                                         " * u.float()[..., None] * B.float().transpose(1, 2)[:, None]",
                                         "test_ex1_visible"),
    "ex1: every sequence reads sequence 0's B": ("ex1", "B.float().transpose(1, 2)[:, None]",
                                                  "B.float()[:1].transpose(1, 2)[:, None]", "test_ex1_hidden"),
    "ex2: state not carried": ("ex2", "x = dA[:, :, t] * x + dBu[:, :, t]", "x = dBu[:, :, t]", "test_ex2_visible"),
    "ex2: read out before the update": ("ex2", "        x = dA[:, :, t] * x + dBu[:, :, t]\n        ys.append((x * Ct[:, None, t]).sum(-1))",
                                        "        ys.append((x * Ct[:, None, t]).sum(-1))\n        x = dA[:, :, t] * x + dBu[:, :, t]",
                                        "test_ex2_visible"),
    "ex2: softplus before the bias": ("ex2", "    if delta_bias is not None:\n        dt = dt + delta_bias.float()[:, None]\n"
                                             "    if delta_softplus:\n        dt = F.softplus(dt)",
                                      "    if delta_softplus:\n        dt = F.softplus(dt)\n"
                                      "    if delta_bias is not None:\n        dt = dt + delta_bias.float()[:, None]",
                                      "test_ex2_visible"),
    "ex2: no D skip": ("ex2", "y = y + D.float()[:, None] * u.float()", "y = y", "test_ex2_visible"),
    "ex2: gate with sigmoid": ("ex2", "y = y * F.silu(z.float())", "y = y * torch.sigmoid(z.float())", "test_ex2_visible"),
    "ex2: softplus always": ("ex2", "    if delta_softplus:\n        dt = F.softplus(dt)", "    dt = F.softplus(dt)",
                             "test_ex2_hidden"),
    "ex2: output always float32": ("ex2", "out = y.to(u.dtype)", "out = y", "test_ex2_hidden"),
    "ex3: b parts added": ("ex3", "return a1 * a2, a2 * b1 + b2", "return a1 * a2, b1 + b2", "test_ex3_visible"),
    "ex3: the other order": ("ex3", "return a1 * a2, a2 * b1 + b2", "return a1 * a2, a1 * b2 + b1", "test_ex3_visible"),
    "ex3: a parts added": ("ex3", "return a1 * a2, a2 * b1 + b2", "return a1 + a2, a2 * b1 + b2", "test_ex3_visible"),
    "ex3: b scaled by the left a": ("ex3", "return a1 * a2, a2 * b1 + b2", "return a1 * a2, a1 * b1 + b2",
                                    "test_ex3_visible"),
    "ex4: no carried state": ("ex4", "x = P * h[:, None] + S", "x = S", "test_ex4_visible"),
    "ex4: carry from the chunk's first step": ("ex4", "t_loc[None, :] == CHUNK - 1", "t_loc[None, :] == 0",
                                               "test_ex4_visible"),
    "ex4: scan along the state axis": ("ex4", "tl.associative_scan((dA, dBu), 1, scan_op)",
                                       "tl.associative_scan((dA, dBu), 0, scan_op)", "test_ex4_visible"),
    "ex4: B and C of sequence 0 for all": ("ex4", "bc = b * N * L", "bc = b * 0", "test_ex4_visible"),
    "ex4: B u without the step": ("ex4", "dBu = (dt * u)[None, :] * Bt", "dBu = u[None, :] * Bt", "test_ex4_visible"),
    "ex5: conv padded on the right (sees the future)": ("ex5", "F.pad(xs, (self.d_conv - 1, 0))",
                                                         "F.pad(xs, (0, self.d_conv - 1))", "test_ex5_visible"),
    "ex5: Δ without softplus": ("ex5", "return F.softplus(self.dt_proj(dt)), B, C", "return self.dt_proj(dt), B, C",
                                "test_ex5_visible"),
    "ex5: forward without the gate": ("ex5", "C.transpose(1, 2), D=self.D, z=z)", "C.transpose(1, 2), D=self.D)",
                                      "test_ex5_visible"),
    "ex5: step keeps the oldest inputs": ("ex5", "(inputs[..., 1:], h)", "(inputs[..., :-1], h)", "test_ex5_visible"),
    "ex5: step forgets h": ("ex5", "-torch.exp(self.A_log)) * h +", "-torch.exp(self.A_log)) * 0 +", "test_ex5_visible"),
    "ex5: x's shape not checked": ("ex5", "if x.ndim != 3 or x.shape[-1] != self.d_model:", "if False:", "test_ex5_hidden"),
    "ex5: dt_rank given ignored": ("ex5", 'math.ceil(d_model / 16) if dt_rank == "auto" else dt_rank',
                                   "math.ceil(d_model / 16)", "test_ex5_hidden"),
    "ex5: load_from shares the library's modules": (
        "ex5", "        for mine, theirs in pairs:\n            mine.copy_(theirs)",
        "        self.in_proj, self.x_proj, self.dt_proj, self.out_proj = block.in_proj, block.x_proj, block.dt_proj, "
        "block.out_proj\n        for mine, theirs in pairs[1:3] + pairs[6:8]:\n            mine.copy_(theirs)",
        "test_ex5_hidden"),
}


# The exercise file's two tests: every solution passes its test cells; every wrong answer is
# caught by the test cell named for it (cell metadata is checked in tests/course/test_notebooks.py).
(notebook, test_solutions_pass_all_tests, test_wrong_answers_fail,
 test_library_answers_fail) = course.exercise_tests(
    NOTEBOOK, EXERCISES, WRONG)


# The figures the notebook's prose states, recomputed here: each test fails if the prose drifts
# from what the shapes or llmu's code give.

def _prose(grade_id: str) -> str:
    """A cell's text with its line breaks folded into spaces."""
    return " ".join(course.cells_by_grade_id(NOTEBOOK)[grade_id].split())


def test_expanded_scan_tensors_are_stated_at_their_size():
    # section 5's Mamba-370M-like layer: E = 2048 channels, N = 16, batch 8, 2048 tokens
    batch, channels, length, state = 8, 2048, 2048, 16
    text = _prose("chunk_md")
    assert f"$E = {channels}$ channels, $N = {state}$) at batch {batch} and {length} tokens" in text
    each = batch * channels * length * state * 4             # one float32 (batch, E, L, N) tensor
    inputs = 4 * batch * channels * length * 2               # u, Δ, z and out in bf16
    assert f"= {each / 1e9:.1f} GB, {2 * each / 1e9:.1f} GB for both" in text
    assert f"= {inputs / 1e6:.0f} MB" in text


def test_scan_combine_counts_in_the_self_check(monkeypatch):
    calls = []
    real = picture.combine
    monkeypatch.setattr(picture, "combine", lambda left, right: calls.append(1) or real(left, right))
    L = 1024
    rounds = picture.blelloch_rounds([0.5] * L, [1.0] * L)
    total, sweeps = len(calls), len(calls) - L                # the last round combines each position once
    sweep_rounds = len(rounds) - 3                             # minus the input, the reset and the last round
    hillis_steele = sum(L - 2 ** k for k in range(int(math.log2(L))))
    text = _prose("self_check")
    assert f"{sweeps} in $2\\log_2 L = {sweep_rounds}$ rounds" in text
    assert f"$3L - 2 = {total}$" in text
    assert f"= {hillis_steele}$ combines in {int(math.log2(L))} rounds" in text


def test_batch_and_channels_have_their_own_letters():
    # B is the SSM's input matrix and D its skip: neither names the batch or the channels
    nb = json.loads(NOTEBOOK.read_text())
    for cell in nb["cells"]:
        text = "".join(cell["source"])
        assert "(B, D" not in text and "(B, N, L)" not in text, text[:80]
        if cell["cell_type"] != "markdown":
            continue
        for formula in re.findall(r"\$[^$]+\$", text):
            assert not re.search(r"\((B|D)\s*,|,\s*(B|D)\s*[,)]|\bD = \d", formula), formula


def test_the_benchmark_times_your_kernel_beside_llmus(notebook, tmp_path):
    """The benchmark cell passes exercise 4's kernel, through its launcher and the torch steps it
    leaves out (Δ's bias and softplus, the skip D·u, the gate silu(z)), as llmu's kernel of the entry
    is called: with the solution in place it gives llmu's full scan on the entry's inputs (two
    sequences, L = 19 with the launcher's chunk of 8, N = 5 padded to 8)."""
    size = {"B": 2, "D": 4, "N": 5, "L": 19, "Dh": 2}
    assert notebook.check_bench_yours(tmp_path, {"mamba_selective_scan": "ex4"},
                                      sizes={"mamba_selective_scan": size}) == {"mamba_selective_scan": "ok"}


# Exercise 5's cases (the visible ones and the hidden loop): (d_model, d_state, d_conv, expand, dt_rank, L, seed).
EX5_CASES = ((16, 4, 4, 2, "auto", 11, 0), (5, 3, 2, 3, "auto", 7, 0), (7, 16, 4, 1, 3, 1, 4), (12, 5, 2, 2, 2, 37, 5),
             (20, 6, 4, 2, "auto", 29, 6), (9, 2, 3, 2, 4, 8, 7), (16, 4, 4, 2, 5, 13, 8))


def test_exercise_5_states_the_solutions_largest_difference(notebook, tmp_path):
    """ex5_md says llmu's solution is within 2e-7 of the library (forward against MambaBlock.forward,
    step by step against forward, the last state against the library's) on the tests' cases: the
    largest difference measured here, with the tests' own helpers (9e-8 when last measured,
    on outputs of about 0.5)."""
    import torch

    ns = notebook.namespace("ex5", tmp_path)
    worst = 0.0
    for H, N, K, ex, rank, L, seed in EX5_CASES:
        ref, mine = ns["block_pair"](H, seed=seed, d_state=N, d_conv=K, expand=ex, dt_rank=rank)
        x = torch.randn(2, L, H, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            want, (conv_state, ssm_state) = ref(x, return_state=True)
            got = mine(x)
        ys, (window, h), _ = ns["decode"](mine, x)
        for a, b in ((got, want), (ys, got), (h, ssm_state), (window, conv_state[..., 1:])):
            worst = max(worst, float((a - b).abs().max()))
    assert worst < 2e-7, worst
    assert "llmu's solution is within 2e-7 of the library on every case" in _prose("ex5_md")


def test_self_check_counts_the_exercise_5_state():
    d_model, d_state, d_conv, expand = 16, 4, 4, 2
    E = expand * d_model
    window, h = E * (d_conv - 1) * 4, E * d_state * 4
    text = _prose("self_check")
    assert f"$32 \\times 3 \\times 4 = {window}$ bytes and $h$ is $32 \\times 4 \\times 4 = {h}$, {window + h} bytes" in text
