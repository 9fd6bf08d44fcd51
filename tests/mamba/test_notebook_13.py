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
