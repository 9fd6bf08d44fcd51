"""Notebook 10's graded exercises, run in-process (no kernel): the instructor's solutions pass every
test cell, hidden parts included, and typical wrong answers fail them.

The test cells take their SmolLM2 matrices from the setup cell's model, which loads once for the
module; no demonstration cell runs here. The whole notebook (plots, perplexity table, model cells,
benchmark) is executed by the course-wide notebook tests. The int4 GEMV kernel's cells move their
tensors to ``kernel_device()`` themselves (``gemv_inputs`` in the launcher cell).
"""

from __future__ import annotations

import pytest

import llmu  # noqa: F401  (Triton mode first: the exercise kernel is defined below)
from llmu import course

# The notebook's setup cell, which every exercise here runs first, loads SmolLM2.
pytestmark = pytest.mark.slow

NOTEBOOK = course.repo_root() / "solutions" / "10_quantization" / "10_quantization.ipynb"


EXERCISES = {
    "ex1": course.Exercise.numbered(1),
    "ex2": course.Exercise.numbered(2),
    "ex3": course.Exercise.numbered(3),
    "ex4": course.Exercise("ex4_kernel", ("test_ex4_visible", "test_ex4_hidden"), after=("ex4_launcher",)),
}


WRONG = {
    # exercise, replaced text, replacement, the test cell that must catch it
    "ex1: floor instead of round": ("ex1", "torch.round(groups / scale[..., None])", "torch.floor(groups / scale[..., None])",
                                    "test_ex1_visible"),
    "ex1: range without zero": ("ex1", "lo = groups.amin(dim=2).clamp(max=0)", "lo = groups.amin(dim=2)",
                                "test_ex1_visible"),
    "ex1: zero scales kept": ("ex1", "        scale = (hi - lo) / (2**bits - 1)\n"
                                     "        scale = torch.where(scale > 0, scale, torch.ones_like(scale))\n",
                              "        scale = (hi - lo) / (2**bits - 1)\n", "test_ex1_hidden"),
    "ex1: symmetric zero point at the top": ("ex1", "zero = torch.full_like(scale, 2.0 ** (bits - 1))",
                                             "zero = torch.full_like(scale, 2.0 ** bits - 1)", "test_ex1_hidden"),
    "ex1: bad group size accepted": ("ex1", "    if k % group_size:\n        raise ValueError",
                                     "    if False:\n        raise ValueError", "test_ex1_hidden"),
    "ex1: dequantize without the zero": ("ex1", "((q - zero[..., None]) * scale[..., None])", "(q * scale[..., None])",
                                         "test_ex1_visible"),
    "ex2: nibbles swapped": ("ex2", "codes[..., 0::2] | (codes[..., 1::2] << 4)", "codes[..., 1::2] | (codes[..., 0::2] << 4)",
                             "test_ex2_visible"),
    "ex2: large codes accepted": ("ex2", "if codes.numel() and int(codes.max()) > 15:", "if False:", "test_ex2_hidden"),
    "ex3: no error feedback": ("ex3", "        W[:, j + 1:] -= err[:, None] * U[j, j + 1:][None, :]\n", "",
                               "test_ex3_visible"),
    "ex3: error not divided by U[j, j]": ("ex3", "err = (W[:, j] - (q - zero) * scale) / U[j, j]",
                                          "err = W[:, j] - (q - zero) * scale", "test_ex3_hidden"),
    "ex3: no damping": ("ex3", "H[range(k), range(k)] += percdamp * torch.diagonal(H).mean()", "pass",
                        "test_ex3_hidden"),
    "ex3: caller's weights modified": ("ex3", "W = w.detach().float().clone()", "W = w.detach().float()",
                                       "test_ex3_hidden"),
    "ex4: codes paired with the wrong inputs": ("ex4", "(lo - z) * s * x_even[None, :] + (hi - z) * s * x_odd[None, :]",
                                                "(lo - z) * s * x_odd[None, :] + (hi - z) * s * x_even[None, :]",
                                                "test_ex4_visible"),
    "ex4: group of the byte index": ("ex4", "grp = (2 * j) // G", "grp = j // G", "test_ex4_visible"),
    "ex4: zero point ignored": ("ex4", "(lo - z) * s * x_even[None, :] + (hi - z) * s * x_odd[None, :]",
                                "lo * s * x_even[None, :] + hi * s * x_odd[None, :]", "test_ex4_visible"),
    "ex4: last step not masked": ("ex4", "col_ok = j < half", "col_ok = j < 2 * half", "test_ex4_hidden"),
}


# The exercise file's two tests: every solution passes its test cells; every wrong answer is
# caught by the test cell named for it (cell metadata is checked in tests/course/test_notebooks.py).
(notebook, test_solutions_pass_all_tests, test_wrong_answers_fail,
 test_library_answers_fail) = course.exercise_tests(
    NOTEBOOK, EXERCISES, WRONG)


def test_the_benchmark_times_your_kernel_beside_llmus(notebook, tmp_path):
    """The benchmark cell hands exercise 4's GEMV (through my_int4_gemv, once per token) the int4_gemv
    entry's inputs as llmu's kernel takes them: with the solution in place, it gives llmu's output.
    Two tokens; N = 37 leaves the last block of 16 rows ragged, K / 2 = 80 bytes the last step of 32."""
    assert notebook.check_bench_yours(tmp_path, {"int4_gemv": "ex4"},
                                      sizes={"int4_gemv": {"M": 2, "N": 37, "K": 160, "G": 32}}) == {"int4_gemv": "ok"}
