"""Notebook 00's graded exercises, run in-process (no kernel, no model): the instructor's solutions
pass every test cell, hidden parts included, and typical wrong answers fail them.

All four exercises are Triton kernels (``add_kernel``, ``softmax_kernel``, ``matmul_kernel``,
``online_softmax_kernel``) that the notebook's locked launchers (``add_launcher``, ``softmax_launcher``,
``ex3_launcher``, ``ex4_launcher``) wrap; the launcher cell runs after the kernel, as in the notebook. The cells make their tensors without naming a device; they are run with
``kernel_device()`` as torch's default device (a no-op in the interpreter, cuda when the kernels
are compiled). The wrong answers of exercises 1 and 2 keep every access inside the tensors (a
kernel that stores past the end would write over memory this process still uses); exercises 3 and 4's
launchers put every operand in a buffer with a tile (a block) of spare room, so their wrong answers
may stray there (and are caught by it). The whole notebook (widget, library
demo, benchmark) is executed by the course-wide notebook tests. Two checks of the cells' text: no
test cell reads a name that only a demonstration cell defines, and every test cell ends with a
``passed(...)`` line, in the learner's copy as in the graded one.
"""

from __future__ import annotations

import pytest

import llmu  # noqa: F401  (Triton mode first: the exercise kernels are defined below)
from llmu import course

NOTEBOOK = course.repo_root() / "solutions" / "00_welcome" / "00_welcome.ipynb"


EXERCISES = {
    "ex1": course.Exercise("add_kernel", ("test_add_visible", "test_add_hidden"), after=("add_launcher",)),
    "ex2": course.Exercise("softmax_kernel", ("test_softmax_visible", "test_softmax_hidden"),
                           after=("softmax_launcher",)),
    "ex3": course.Exercise("ex3_kernel", ("test_ex3_visible", "test_ex3_hidden"), after=("ex3_launcher",)),
    "ex4": course.Exercise("ex4_kernel", ("test_ex4_visible", "test_ex4_hidden"), after=("ex4_launcher",)),
}


WRONG = {
    # exercise, replaced text, replacement, the test cell that must catch it
    "ex1: every program adds block 0": ("ex1", "offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)",
                                        "offsets = tl.arange(0, BLOCK_SIZE)", "test_add_visible"),
    "ex1: block stride hard-coded to 256": ("ex1", "offsets = pid * BLOCK_SIZE +", "offsets = pid * 256 +",
                                            "test_add_hidden"),
    "ex1: last element dropped": ("ex1", "mask = offsets < n_elements", "mask = offsets < n_elements - 1",
                                  "test_add_hidden"),
    "ex2: no max subtraction": ("ex2", "z = x - tl.max(x, axis=0)", "z = x", "test_softmax_hidden"),
    "ex2: masked lanes read 0": ("ex2", 'other=-float("inf")', "other=0.0", "test_softmax_hidden"),
    "ex2: row stride taken as n_cols": ("ex2", "x_ptr + row * x_row_stride", "x_ptr + row * n_cols",
                                        "test_softmax_hidden"),
    "ex3: the accumulator overwritten at each step": ("ex3", "acc = tl.dot(a, b, acc)", "acc = tl.dot(a, b)",
                                                      "test_ex3_visible"),
    "ex3: pointers left at the first slice of K": ("ex3", "b_ptrs += BLOCK_K * stride_bk", "b_ptrs += 0",
                                                   "test_ex3_visible"),
    "ex3: program ids swapped": ("ex3", "pid_m = tl.program_id(axis=0)\n    pid_n = tl.program_id(axis=1)",
                                 "pid_m = tl.program_id(axis=1)\n    pid_n = tl.program_id(axis=0)", "test_ex3_visible"),
    "ex3: no mask on K": ("ex3", "k_ok = offs_k < K - k0", "k_ok = offs_k < BLOCK_K", "test_ex3_hidden"),
    "ex3: mask on K forgets the step": ("ex3", "k_ok = offs_k < K - k0", "k_ok = offs_k < K", "test_ex3_hidden"),
    "ex3: store not masked": ("ex3", "tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])",
                              "tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty))", "test_ex3_hidden"),
    "ex3: columns of A taken as 1 apart": ("ex3", "offs_k[None, :] * stride_ak", "offs_k[None, :]", "test_ex3_hidden"),
    "ex3: accumulator in C's dtype": ("ex3", "acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)",
                                      "acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=c_ptr.dtype.element_ty)",
                                      "test_ex3_hidden"),
    "ex4: running sum not rescaled when the maximum grows": ("ex4", "l = l * alpha + ", "l = l + ", "test_ex4_visible"),
    "ex4: each block normalised by its own maximum and sum": (
        "ex4", "y = tl.exp(x - m) / l",
        "y = tl.exp(x - tl.max(x, axis=0)) / tl.sum(tl.exp(x - tl.max(x, axis=0)), axis=0)", "test_ex4_visible"),
    "ex4: no mask on the tail": ("ex4", "mask = offs < n_cols", "mask = offs >= 0", "test_ex4_visible"),
    "ex4: store not masked": ("ex4", "tl.store(out_row + offs, y.to(out_ptr.dtype.element_ty), mask=mask)",
                              "tl.store(out_row + offs, y.to(out_ptr.dtype.element_ty))", "test_ex4_visible"),
    "ex4: row stride taken as n_cols": ("ex4", "x_ptr + row * x_row_stride", "x_ptr + row * n_cols",
                                        "test_ex4_visible"),
    "ex4: output rows at the input's stride": ("ex4", "out_ptr + row * out_row_stride",
                                               "out_ptr + row * x_row_stride", "test_ex4_visible"),
    "ex4: padded lanes read 0 in pass 1": ("ex4", 'other=-float("inf")).to(tl.float32)\n        m_new',
                                           "other=0.0).to(tl.float32)\n        m_new", "test_ex4_hidden"),
    "ex4: the maximum of the current block only": ("ex4", "m_new = tl.maximum(m, tl.max(x, axis=0))",
                                                   "m_new = tl.max(x, axis=0)", "test_ex4_hidden"),
    "ex4: a block of -inf only poisons the sum": ("ex4", 'm_safe = tl.where(m_new == -float("inf"), 0.0, m_new)',
                                                  "m_safe = m_new", "test_ex4_hidden"),
    "ex4: the running sum rounded to the input's dtype at every block": (
        "ex4", "l = l * alpha + tl.sum(tl.exp(x - m_safe), axis=0)",
        "l = (l * alpha + tl.sum(tl.exp(x - m_safe), axis=0)).to(x_ptr.dtype.element_ty).to(tl.float32)",
        "test_ex4_hidden"),
}

# What the check that catches each of exercise 4's wrong answers says (a fragment of its message).
EX4_MESSAGES = {
    "ex4: running sum not rescaled when the maximum grows": "each row of my_online_softmax on 3 x 5000 sums to 1",
    "ex4: each block normalised by its own maximum and sum": "each row of my_online_softmax on 3 x 5000 sums to 1",
    "ex4: no mask on the tail": "nothing is written after the end of a row",
    "ex4: row stride taken as n_cols": "my_online_softmax on 3 x 5000 has no NaN",
    "ex4: output rows at the input's stride": "start row r of the output at out_ptr + r * out_row_stride",
    "ex4: padded lanes read 0 in pass 1": "one row of 3 columns (a single block, mostly masked)",
    "ex4: the maximum of the current block only": "my_online_softmax on scores of +-1000 and 1e4 * N(0, 1)",
    "ex4: a block of -inf only poisons the sum": "rows with -inf: the first two blocks",
    "ex4: the running sum rounded to the input's dtype at every block": "float16, 2 rows of 100,000 nearly equal scores",
}


# The exercise file's tests: every solution passes its test cells; every wrong answer is caught by
# the test cell named for it; llmu's own kernels handed back score nothing (cell metadata is
# checked in tests/course/test_notebooks.py).
(notebook, test_solutions_pass_all_tests, test_wrong_answers_fail,
 test_library_answers_fail) = course.exercise_tests(
    NOTEBOOK, EXERCISES, WRONG, on_kernel_device=True, warnings_to_ignore=["ignore::RuntimeWarning"])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("case", list(EX4_MESSAGES))
def test_ex4_wrong_answers_name_the_property(case, notebook, tmp_path):
    message = str(notebook.check_caught(*WRONG[case], workdir=tmp_path))
    assert EX4_MESSAGES[case] in message, message


def test_ex4_solution_is_a_real_kernel_of_20_lines_or_more():
    """Exercise 4's answer is the longest of the notebook: at least 20 lines of kernel, comments and
    blank lines left out."""
    lines = course.solution_code_lines(course.cells_by_grade_id(NOTEBOOK)["ex4_kernel"])
    assert lines >= 20, lines


def test_setup_cell_loads_no_model(notebook):
    """The exercises must run without the model: the setup cell only imports."""
    assert "load_model(" not in notebook.cells["setup"]


def test_the_benchmark_times_your_kernels_beside_llmus(notebook, tmp_path):
    """The benchmark cell passes each exercise's kernel (through its launcher) as llmu's kernel of the
    entry is called: with the solutions in place, each gives llmu's output on the entry's inputs
    (gemm: x @ W^T, W^T a transposed view)."""
    assert notebook.check_bench_yours(tmp_path, {"vector_add": "ex1", "softmax_rows": "ex2", "gemm": "ex3"},
                                      sizes={"softmax_rows": {"M": 8, "N": 1000},
                                             "gemm": {"M": 40, "N": 72, "K": 100}}) == \
        {"vector_add": "ok", "softmax_rows": "ok", "gemm": "ok"}


# The figures the prose of exercise 3 states, recomputed from the formulas and llmu's tables.

def _flat(grade_id: str) -> str:
    """A cell's text with its line breaks and runs of spaces as single spaces."""
    return " ".join(course.cells_by_grade_id(NOTEBOOK)[grade_id].split())


def test_tile_figures():
    """The tiles section: a tile's FLOPs per element loaded, the accumulator of a 128 x 256 tile, and the
    loads of a 4096^3 product in bf16 on an H200 against its arithmetic (the datasheet table)."""
    from llmu.bench.peaks import peak_for

    text = _flat("tiles_md")
    intensity = lambda m, n: 2 * m * n / (m + n)  # noqa: E731
    assert (intensity(16, 16), intensity(128, 128)) == (16, 128)
    assert "A square tile of side $m$ does $m$ FLOPs per element: 16 for 16 × 16, 128 for 128 × 128" in text
    assert 128 * 256 * 4 == 128 * 1024 and "float32 accumulator of a 128 × 256 tile is 128 KB" in text
    h200 = peak_for("NVIDIA H200")
    peak, bandwidth = h200.tflops_for("bfloat16") * 1e12, h200.bandwidth_gbs * 1e9
    n = 4096
    loads_ms = lambda m, k: 2 * n**3 * (1 / m + 1 / k) / bandwidth * 1e3  # noqa: E731
    assert f"{loads_ms(16, 16):.1f}" == "3.6" and f"{loads_ms(128, 256):.2f}" == "0.34"
    assert f"{2 * n**3 / peak * 1e3:.3f}" == "0.139" and (peak / 1e12, bandwidth / 1e12) == (989.5, 4.8)
    assert ("With 16 × 16 tiles the loads alone take 3.6 ms at its 4.8 TB/s, while the arithmetic needs "
            "0.139 ms at its 989.5 TFLOP/s") in text
    assert "With 128 × 256 tiles the loads take 0.34 ms" in text


def test_tolerance_and_benchmark_figures():
    """Exercise 3's float16 bound (one rounding to float16) and the gemm entry's intensity in bf16."""
    from llmu.bench.registry import load_all
    from llmu.roofline.model import gemm_intensity

    assert f"{2**-11:.1e}" == "4.9e-04" and "$2^{-11} \\approx 4.9 \\cdot 10^{-4}$ relative per input" in _flat("ex3_md")
    entry = load_all()["gemm"]
    per_byte = sorted(gemm_intensity(s["M"], s["N"], s["K"], 2) for s in entry.gpu_sizes)
    assert (round(per_byte[0]), round(per_byte[-1])) == (228, 2731)
    assert "from 228 to 2,731 FLOPs per byte at its GPU sizes in bf16" in _flat("bench_md")


def test_self_check_answers():
    """Self-check 5 (a 64 x 64 tile, BLOCK_K = 32) and 6 (other=1.0 with K = 40, BLOCK_K = 32)."""
    m = n = 64
    k = 32
    loads, flops = (m + n) * k, 2 * m * n * k
    assert (loads, flops, flops // loads, flops // loads // 2) == (4096, 262_144, 64, 32)
    masked = 2 * k - 40                       # the second step covers k = 32..63, of which 40..63 lie past K
    assert masked == 24
    text = _flat("self_check")
    assert "$(64 + 64) \\cdot 32 = 4096$ elements and $2 \\cdot 64 \\cdot 64 \\cdot 32 = 262{,}144$ FLOPs: 64 FLOPs per element, 32 per byte in bf16" in text
    assert "24 terms $1 \\cdot 1$, so every element of $C$ comes out 24 too large" in text


def test_program_order_figures(capsys):
    """The program-order section: the panels the first wave of 132 programs reads at 8192^3, as the
    section's own cell counts them (run here), in the grid order and in grouped order."""
    exec(course.cells_by_grade_id(NOTEBOOK)["program_order"], {})  # noqa: S102 - the notebook's own cell
    out = capsys.readouterr().out
    assert "M = N = K = 8192,    grid order: the first 132 programs read 64 panels of A and  3 of B,  134 MiB" in out
    assert "M = N = K = 8192, grouped order: the first 132 programs read  8 panels of A and 17 of B,   50 MiB" in out
    assert ("at $M = N = K = 8192$, 134 MiB in the grid order, well beyond the L2, against 50 MiB in grouped "
            "order (`GROUP_M = 8`)") in _flat("program_order_md")


def test_the_tf32_tolerance():
    """Exercise 3 allows 2e-2 in float32 when compiled on a GPU, where tl.dot rounds its float32
    inputs to TF32 (10 bits of mantissa). Emulated here on the tests' shapes over 100 draws: the largest
    error is under 0.7 of what 2e-2 allows, while 1e-2 would be exceeded on some draws (1.17 times
    over 200 draws when measured; 1e-2 and 2e-2 as atol = rtol)."""
    import torch

    def tf32(x):  # round to nearest, 10 explicit mantissa bits
        bits = x.contiguous().view(torch.int32)
        return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)

    shapes = ((64, 64, 64), (17, 29, 33), (5, 130, 3), (33, 70, 17), (40, 100, 50), (37, 70, 50))
    worst = {1e-2: 0.0, 2e-2: 0.0}
    for seed in range(100):
        g = torch.Generator().manual_seed(seed)
        for m, k, n in shapes:
            a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
            exact = a.double() @ b.double()
            err = ((tf32(a).double() @ tf32(b).double()).float().double() - exact).abs()
            for tol in worst:
                worst[tol] = max(worst[tol], (err / (tol + tol * exact.abs())).max().item())
    assert worst[2e-2] < 0.7 and worst[1e-2] > 0.9, worst


def test_ex4_figures():
    """Exercise 4's prose: a 49,152-column float32 block over the 128 threads of 4 warps, float16's
    largest value against a sum of 100,000 terms of about 1, and self-check 7 (a first block of -inf,
    then the scores 0 and 1)."""
    import math

    import torch

    text = _flat("ex4_md")
    assert 49_152 // (4 * 32) == 384 and "such a block is 384 registers per thread, where a thread may use at most 255" in text
    assert torch.finfo(torch.float16).max == 65504 and "beyond float16's largest finite value, 65,504" in text
    l = math.exp(0 - 1) + math.exp(1 - 1)
    p = (math.exp(-1) / l, 1 / l)
    assert (f"{l:.3f}", f"{p[0]:.3f}", f"{p[1]:.3f}") == ("1.368", "0.269", "0.731")
    check = _flat("self_check")
    assert "e^{1 - 1} = 1.368$, and the row's last two probabilities are $0.269$ and $0.731$" in check
