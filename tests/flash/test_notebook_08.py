"""Notebook 08's graded exercises, run in-process (no kernel, no model): the instructor's solutions
pass every test cell, hidden parts included, and typical wrong answers fail the cell named for
them.

Exercises 1, 2 and 4 are float32 PyTorch checked against ``torch.softmax``, naive attention,
``llmu.flash.reference`` and autograd (``autograd_grads``, in the locked cell ``ex4_reference``
before exercise 4); exercise 4 (the tiled backward) is also checked for its peak memory and for
the FLOPs it skips under the causal mask. Exercises 3 and 5 are Triton kernels: their launcher
cells (``ex3_launcher``, ``ex5_launcher``) run after them, and the cells run with the kernel device
as torch's default device (Triton's interpreter on a CPU; the shapes of their test cells are
small). Exercise 5's launcher puts every tensor in a buffer with one tile of spare room behind it,
so the wrong answers below that drop a mask stay inside memory the buffers own. The whole notebook (memory measurements, widgets, the model, the
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
    "ex5": course.Exercise("ex5_kernel", ("test_ex5_visible", "test_ex5_hidden"), before=("ex4_reference",),
                           after=("ex5_launcher",)),
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
    "ex4: no softmax correction": ("ex4", "ds = p * (dob @ vb.transpose(-1, -2) - delta[:, :, :, rows, None])",
                                   "ds = p * (dob @ vb.transpose(-1, -2))", "test_ex4_visible"),
    "ex4: dk not scaled": ("ex4", "dk[:, :, k0:k0 + block] = dkb.sum(dim=2) * scale",
                           "dk[:, :, k0:k0 + block] = dkb.sum(dim=2)", "test_ex4_visible"),
    "ex4: the group's query heads not summed": ("ex4", "dv[:, :, k0:k0 + block] = dvb.sum(dim=2)",
                                                "dv[:, :, k0:k0 + block] = dvb[:, :, 0]", "test_ex4_visible"),
    "ex4: causal mask top-left": ("ex4", "cols[None, :] > r[:, None] + offset", "cols[None, :] > r[:, None]",
                                  "test_ex4_hidden"),
    "ex4: causal skip ignores the offset": ("ex4", "first = max(0, k0 - offset) // block * block if causal else 0",
                                            "first = k0 // block * block if causal else 0", "test_ex4_hidden"),
    # right gradients, wrong algorithm: one tile holding the whole (Tq, Tk) matrix; no skipped tiles
    "ex4: the whole matrix as one tile": ("ex4", "    for k0 in range(0, tk, block):",
                                          "    block = max(tq, tk)\n    for k0 in range(0, tk, block):",
                                          "test_ex4_hidden"),
    "ex4: causal tiles not skipped": ("ex4", "first = max(0, k0 - offset) // block * block if causal else 0",
                                      "first = 0", "test_ex4_hidden"),
    "ex5: no softmax correction": ("ex5", "ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])",
                                   "ds = p * tl.dot(do, tl.trans(v))", "test_ex5_visible"),
    "ex5: dk not scaled": ("ex5", "tl.store(dk_ptr + kv_offs, dk * scale,", "tl.store(dk_ptr + kv_offs, dk,",
                           "test_ex5_visible"),
    "ex5: one query head per group": ("ex5", "for g in range(group):", "for g in range(1):", "test_ex5_visible"),
    "ex5: causal mask top-left": ("ex5", "offs_n[None, :] <= offs_m[:, None] + tk - tq",
                                  "offs_n[None, :] <= offs_m[:, None]", "test_ex5_hidden"),
    "ex5: causal skip ignores the offset": ("ex5", "lo = (tl.maximum(start_n - (tk - tq), 0) // BLOCK_M) * BLOCK_M",
                                            "lo = (start_n // BLOCK_M) * BLOCK_M", "test_ex5_hidden"),
    # a forgotten mask on the ragged last tile: the launcher's spare room keeps it in bounds
    "ex5: q rows past Tq read without a mask": ("ex5", "q = tl.load(q_ptr + q_offs, mask=row_ok[:, None], other=0.0)",
                                                "q = tl.load(q_ptr + q_offs)", "test_ex5_hidden"),
    "ex5: dv stored past Tk": ("ex5", "tl.store(dv_ptr + kv_offs, dv, mask=col_ok[:, None])",
                               "tl.store(dv_ptr + kv_offs, dv)", "test_ex5_hidden"),
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
    for name in ("test_ex1_hidden", "test_ex2_hidden", "test_ex3_hidden", "test_ex4_hidden", "test_ex5_hidden"):
        own, _, rest = notebook.cells[name].partition(course.END_HIDDEN)
        assert "check_own_work(" in own, f"{name} does not open with the own-work check"
        before, _, after = rest.partition(course.BEGIN_HIDDEN)
        assert after, f"{name} has no hidden block"
        assert "check" in before, f"{name}: the learner should see at least one check before the hidden block"


def test_kernel_tests_choose_their_own_device_and_tolerance(notebook):
    """The Triton exercises' test cells read no name a demo or helper cell sets for the notebook's
    own use: each picks the kernel device and the tolerance (TF32 on a GPU) itself. Exercise 5's
    gradients sum more products than exercise 3's output: 1e-4 in the interpreter (its solution is
    within 2e-6 of autograd on the test shapes)."""
    for name, tol in (("test_ex3_visible", "1e-5"), ("test_ex3_hidden", "1e-5"),
                      ("test_ex5_visible", "1e-4"), ("test_ex5_hidden", "1e-4")):
        _, _, body = notebook.cells[name].partition(course.END_HIDDEN)
        assert "dev = llmu.runtime.kernel_device()" in body and f"tol = {tol} if llmu.runtime.interpreting() else 1e-2" in body
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


def test_the_backward_figures_in_the_text():
    """Exercise 4's text, section 5 and the summary state figures of the tiled backward: llmu's
    reference, counted by peak_bytes at the exercise's size (B=1, Hq=2, Hkv=1, Tq=1500, Tk=2000,
    D=16, causal, tiles of 64) and by FlopCounterMode at Tq = Tk = 256 in blocks of 32. Counted
    tensor by tensor, not timed: the same on any machine."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from llmu.attention.reference import attention
    from llmu.flash import reference
    from llmu.flash.memory import peak_bytes

    def case(tq, tk, seed):
        g = torch.Generator().manual_seed(seed)
        q, do = torch.randn(1, 2, tq, 16, generator=g), torch.randn(1, 2, tq, 16, generator=g)
        k, v = torch.randn(1, 1, tk, 16, generator=g), torch.randn(1, 1, tk, 16, generator=g)
        o, lse = reference.flash_attention(q, k, v, causal=True)
        return q, k, v, o, lse, do

    def tiled(q, k, v, o, lse, do, causal=True, block=64):
        return reference.tiled_attention_backward(q, k, v, o, lse, do, causal=causal, block_q=block, block_k=block)

    def autograd(q, k, v, o, lse, do):
        q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
        return torch.autograd.grad(attention(q, k, v, causal=True), (q, k, v), do)

    args = case(1500, 2000, 30)
    mib = {name: peak_bytes(fn, *args)[1] / 2**20 for name, fn in (("tiled", tiled), ("autograd", autograd))}
    grads_mib = sum(x.numel() for x in args[:3]) * 4 / 2**20
    matrix_mib = 1500 * 2000 * 4 / 2**20
    assert mib["tiled"] < 3 < matrix_mib / 2          # the threshold: well above the tiled, far below the matrix
    flops = {}
    small = case(256, 256, 31)
    for causal in (False, True):
        with FlopCounterMode(display=False) as counter:
            tiled(*small, causal=causal, block=32)
        flops[causal] = counter.get_total_flops()
    assert flops[True] / flops[False] == 36 / 64

    cells = course.cells_by_grade_id(NOTEBOOK)
    ex4 = " ".join(cells["ex4_md"].split())
    assert f"One head's `(Tq, Tk)` float32 matrix alone is {matrix_mib:.1f} MiB" in ex4
    assert f"the gradients themselves {grads_mib:.2f} MiB" in ex4
    assert f"llmu's tiled backward peaks at {mib['tiled']:.2f} MiB there" in ex4
    assert "leaves 36 of the 64 tiles, 56 %" in ex4
    summary = " ".join(cells["summary"].split())
    assert f"autograd through naive attention peaks at {mib['autograd']:.0f} MiB" in summary
    assert f"(tiles of 64) at {mib['tiled']:.2f} MiB, of which {grads_mib:.2f} MiB are the gradients" in summary
    assert "28 of 64 at $T = 256$ in blocks of 32" in summary
    assert "28 of 64 for 8 blocks each way" in " ".join(cells["bwd_md"].split())
