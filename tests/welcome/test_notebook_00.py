"""Notebook 00's graded exercises, run in-process (no kernel, no model): the instructor's solutions
pass every test cell, hidden parts included, and typical wrong answers fail them.

Both exercises are Triton kernels (``add_kernel``, ``softmax_kernel``) that the notebook's locked
launchers (``add_launcher``, ``softmax_launcher``) wrap; the launcher cell runs after the kernel,
as in the notebook. The cells make their tensors without naming a device; they are run with
``kernel_device()`` as torch's default device (a no-op in the interpreter, cuda when the kernels
are compiled). The wrong answers keep every access inside the tensors (a kernel that stores past
the end would write over memory this process still uses); the whole notebook (widget, library
demo, benchmark) is executed by the course-wide notebook tests. Two checks of the cells' text: no
test cell reads a name that only a demonstration cell defines, and every test cell ends with a
``passed(...)`` line, in the learner's copy as in the graded one.
"""

from __future__ import annotations

import llmu  # noqa: F401  (Triton mode first: the exercise kernels are defined below)
from llmu import course

NOTEBOOK = course.repo_root() / "solutions" / "00_welcome" / "00_welcome.ipynb"


EXERCISES = {
    "ex1": course.Exercise("add_kernel", ("test_add_visible", "test_add_hidden"), after=("add_launcher",)),
    "ex2": course.Exercise("softmax_kernel", ("test_softmax_visible", "test_softmax_hidden"),
                           after=("softmax_launcher",)),
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
}


# The exercise file's tests: every solution passes its test cells; every wrong answer is caught by
# the test cell named for it; llmu's own kernels handed back score nothing (cell metadata is
# checked in tests/course/test_notebooks.py).
(notebook, test_solutions_pass_all_tests, test_wrong_answers_fail,
 test_library_answers_fail) = course.exercise_tests(
    NOTEBOOK, EXERCISES, WRONG, on_kernel_device=True, warnings_to_ignore=["ignore::RuntimeWarning"])


def test_setup_cell_loads_no_model(notebook):
    """The exercises must run without the model: the setup cell only imports."""
    assert "load_model(" not in notebook.cells["setup"]


def test_the_benchmark_times_your_kernels_beside_llmus(notebook, tmp_path):
    """The benchmark cell passes each exercise's kernel (through its launcher) as llmu's kernel of the
    entry is called: with the solutions in place, each gives llmu's output on the entry's inputs."""
    assert notebook.check_bench_yours(tmp_path, {"vector_add": "ex1", "softmax_rows": "ex2"},
                                      sizes={"softmax_rows": {"M": 8, "N": 1000}}) == \
        {"vector_add": "ok", "softmax_rows": "ok"}
