"""Notebook 10's graded exercises, run in-process (no kernel): the instructor's solutions pass every
test cell, hidden parts included, and typical wrong answers fail them.

The exercise cells read the setup cell's model and the ``weights`` dictionary of the number-line
cell, so both run once for the module. The whole notebook (plots, perplexity table, model cells,
benchmark) is executed by the course-wide notebook tests. The int4 GEMV kernel's cells move their
tensors to ``kernel_device()`` themselves (``gemv_inputs`` in the launcher cell).
"""

from __future__ import annotations


import pytest

import llmu  # noqa: F401  (Triton mode first: the exercise kernel is defined below)
from llmu import course

NOTEBOOK = course.repo_root() / "solutions" / "10_quantization" / "10_quantization.ipynb"


@pytest.fixture(scope="module")
def cells():
    # Cell metadata (unique grade_ids, points, markers, no outputs) is checked for every notebook
    # in tests/course/test_notebooks.py; this file runs the exercises.
    return course.cells_by_grade_id(NOTEBOOK)


@pytest.fixture(scope="module")
def base(cells):
    ns = course.setup_namespace(cells)
    exec(cells["numberline"], ns)  # noqa: S102  (the weights dictionary the exercises' tests read)
    return ns


EXERCISES = {
    "ex1": ("ex1_solution", [], ["test_ex1_visible", "test_ex1_hidden"]),
    "ex2": ("ex2_solution", [], ["test_ex2_visible", "test_ex2_hidden"]),
    "ex3": ("ex3_solution", [], ["test_ex3_visible", "test_ex3_hidden"]),
    "ex4": ("ex4_kernel", ["ex4_launcher"], ["test_ex4_visible", "test_ex4_hidden"]),
}


def _prepare(base, cells, exercise, source, tmp_path, name):
    _, extra, _ = EXERCISES[exercise]
    ns = dict(base)
    course.exec_cell(source, ns, tmp_path, name)
    for cell in extra:
        exec(cells[cell], ns)  # noqa: S102
    return ns


@pytest.mark.parametrize("exercise", list(EXERCISES))
def test_solutions_pass_all_tests(exercise, base, cells, tmp_path):
    solution, _, tests = EXERCISES[exercise]
    ns = _prepare(base, cells, exercise, cells[solution], tmp_path, f"sol_{exercise}")
    for name in tests:
        exec(cells[name], ns)  # noqa: S102  (hidden-test markers are comments: the hidden part runs too)


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


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # nan and inf in the interpreter's numpy
@pytest.mark.parametrize("case", list(WRONG))
def test_wrong_answers_fail(case, base, cells, tmp_path):
    exercise, old, new, test_cell = WRONG[case]
    solution, _, tests = EXERCISES[exercise]
    assert old in cells[solution], f"{case}: the solution no longer contains {old!r}"
    ns = _prepare(base, cells, exercise, cells[solution].replace(old, new), tmp_path,
                  f"wrong_{exercise}_{abs(hash(case))}")
    course.expect_test_failure(cells, ns, tests, test_cell)
