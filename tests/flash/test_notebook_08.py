"""Notebook 08's graded exercises, run in-process (no kernel, no model): the instructor's solutions
pass every test cell, hidden parts included, and typical wrong answers fail the cell named for
them.

Exercises 1, 2 and 4 are float32 PyTorch checked against ``torch.softmax``, naive attention,
``llmu.flash.reference`` and autograd (``autograd_grads``, the locked cell before exercise 4).
Exercise 3 is a Triton kernel: its launcher cell (``ex3_launcher``) runs after it, and the cells
run with the kernel device as torch's default device (Triton's interpreter on a CPU; the shapes of
its test cells are small). The whole notebook (memory measurements, widgets, the model, the
benchmark) is executed by the course-wide notebook tests.
"""

from __future__ import annotations

import llmu  # noqa: F401  (Triton mode first: the exercise kernel is defined below)
from llmu import course

NOTEBOOK = course.repo_root() / "solutions" / "08_flash_attention" / "08_flash_attention.ipynb"


EXERCISES = {
    "ex1": course.Exercise.numbered(1),
    "ex2": course.Exercise.numbered(2),
    "ex3": course.Exercise("ex3_kernel", ("test_ex3_visible", "test_ex3_hidden"), after=("ex3_launcher",)),
    "ex4": course.Exercise.numbered(4, before=["ex4_reference"]),
}


def test_setup_cell_loads_no_model(notebook):
    """The exercises run without the model: the setup cell only imports."""
    assert "load_model(" not in notebook.cells["setup"]


WRONG = {
    # case: (exercise, replaced text, replacement, the test cell that must catch it)
    "ex1: sum not rescaled": ("ex1", "l = l * torch.exp(m - ref) + ", "l = l + ", "test_ex1_visible"),
    "ex1: last short block dropped": ("ex1", "range(0, x.shape[1], block)", "range(0, x.shape[1] - block + 1, block)",
                                      "test_ex1_visible"),
    "ex1: block one column short": ("ex1", "x[:, start:start + block]", "x[:, start:start + block - 1]",
                                    "test_ex1_visible"),
    "ex1: no max-subtraction": ("ex1", "        ref = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)"
                                "   # all -inf so far\n"
                                "        l = l * torch.exp(m - ref) + torch.exp(xb - ref[:, None]).sum(dim=1)\n"
                                "        m = m_new\n"
                                "    return torch.exp(x - m[:, None]) / l[:, None]",
                                "        l = l + torch.exp(xb).sum(dim=1)\n"
                                "        m = m_new\n"
                                "    return torch.exp(x) / l[:, None]", "test_ex1_hidden"),
    "ex1: an all -inf first block": ("ex1", "ref = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)",
                                     "ref = m_new", "test_ex1_hidden"),
    "ex2: no scale": ("ex2", "s = qb @ k[k0:k0 + block].T * scale", "s = qb @ k[k0:k0 + block].T", "test_ex2_visible"),
    "ex2: output not rescaled": ("ex2", "acc = acc * alpha[:, None] + ", "acc = acc + ", "test_ex2_visible"),
    "ex2: lse without the max": ("ex2", "lse[q0:q0 + block] = m + torch.log(l)", "lse[q0:q0 + block] = torch.log(l)",
                                 "test_ex2_visible"),
    "ex2: causal mask off by one": ("ex2", "cols[None, :] > rows[:, None] + tk - tq",
                                    "cols[None, :] >= rows[:, None] + tk - tq", "test_ex2_hidden"),
    "ex2: causal mask top-left": ("ex2", "cols[None, :] > rows[:, None] + tk - tq", "cols[None, :] > rows[:, None]",
                                  "test_ex2_hidden"),
    "ex3: sum not rescaled": ("ex3", "l = l * alpha + tl.sum(p, axis=1)", "l = l + tl.sum(p, axis=1)",
                              "test_ex3_visible"),
    "ex3: no scale": ("ex3", "s = tl.dot(q, tl.trans(k)) * scale", "s = tl.dot(q, tl.trans(k))", "test_ex3_visible"),
    "ex3: keys past Tk not masked": ("ex3", "visible = col_ok[None, :]", "visible = offs_n[None, :] >= 0",
                                     "test_ex3_hidden"),
    "ex3: causal mask top-left": ("ex3", "offs_n[None, :] <= offs_m[:, None] + tk - tq",
                                  "offs_n[None, :] <= offs_m[:, None]", "test_ex3_hidden"),
    "ex4: no softmax correction": ("ex4", "ds = p * (dp - delta)", "ds = p * dp", "test_ex4_visible"),
    "ex4: dq not scaled": ("ex4", "return ds @ k * scale, ", "return ds @ k, ", "test_ex4_visible"),
    "ex4: causal mask top-left": ("ex4", "torch.arange(tq)[:, None] + tk - tq", "torch.arange(tq)[:, None]",
                                  "test_ex4_hidden"),
}


# The exercise file's tests: every solution passes its test cells; every wrong answer is caught
# by the test cell named for it; llmu's own answer fails every test cell of its exercise (cell
# metadata is checked in tests/course/test_notebooks.py).
(notebook, test_solutions_pass_all_tests, test_wrong_answers_fail,
 test_library_answers_fail) = course.exercise_tests(
    NOTEBOOK, EXERCISES, WRONG, on_kernel_device=True)


def test_hidden_tests_are_not_in_the_visible_part(notebook):
    """Each hidden test cell runs a visible check first, then the hidden block (after the hidden
    own-work check that opens every test cell)."""
    for name in ("test_ex1_hidden", "test_ex2_hidden", "test_ex3_hidden", "test_ex4_hidden"):
        own, _, rest = notebook.cells[name].partition(course.END_HIDDEN)
        assert "check_own_work(" in own, f"{name} does not open with the own-work check"
        before, _, after = rest.partition(course.BEGIN_HIDDEN)
        assert after, f"{name} has no hidden block"
        assert "check" in before, f"{name}: the learner should see at least one check before the hidden block"


def test_kernel_tests_choose_their_own_device_and_tolerance(notebook):
    """The Triton exercise's test cells read no name a demo or helper cell sets for the notebook's
    own use: each picks the kernel device and the tolerance (TF32 on a GPU) itself."""
    for name in ("test_ex3_visible", "test_ex3_hidden"):
        _, _, body = notebook.cells[name].partition(course.END_HIDDEN)
        assert "dev = llmu.runtime.kernel_device()" in body and "tol = 1e-5 if llmu.runtime.interpreting() else 1e-2" in body
    assert not any("TOL3" in source for source in notebook.cells.values())


def test_the_benchmark_times_your_kernel_beside_llmus(notebook, tmp_path):
    """The benchmark cell passes exercise 3's kernel (through my_flash_triton, one head at a time)
    as llmu's kernel of the entry is called: with the solution in place, it gives llmu's output on
    the entry's inputs, here two batches of two heads, causal, with T = 40 (a ragged last tile of
    queries and of keys)."""
    size = {"B": 2, "H": 2, "Hkv": 2, "T": 40, "D": 16, "causal": True}
    assert notebook.check_bench_yours(tmp_path, {"flash_attention_fwd": "ex3"},
                                      sizes={"flash_attention_fwd": size}) == {"flash_attention_fwd": "ok"}


def test_the_self_check_intensities_follow_section_1s_traffic_count():
    """Self-check 1: the traffic of section 1's table, per head, in bf16, for a long sequence.
    Naive attention moves 4Td + 4T^2 elements, the tiled forward 2Td + 2Td*ceil(T/B_r) + T; both do
    4T^2 d operations. At B_r = 128, d = 64 that is about 32 and about 128 FLOP per byte, both
    under an H200's ridge (989 TFLOP/s over 4.8 TB/s): FlashAttention is faster by moving less,
    not by turning compute-bound."""
    import math

    from llmu.roofline import gpu_roofs

    T, d, block_rows, elem = 65_536, 64, 128, 2
    flops = 4 * T * T * d
    naive = flops / ((4 * T * d + 4 * T * T) * elem)
    tiled = flops / ((2 * T * d + 2 * T * d * math.ceil(T / block_rows) + T) * elem)
    assert round(naive) == 32 and round(tiled) == 128 and round(tiled / naive) == 4
    ridge = next(r for r in gpu_roofs() if "H200" in r.name).ridge
    assert 195 < ridge < 215 and tiled < ridge
    text = " ".join(course.cells_by_grade_id(NOTEBOOK)["self_check"].split())
    assert "from about $d/2 = 32$ to about $B_r = 128$ FLOP per byte in bf16" in text
    assert "compute-bound" not in text
