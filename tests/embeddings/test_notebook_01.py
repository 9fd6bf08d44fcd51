"""Notebook 01's graded exercises, run in-process (no kernel, no model): the instructor's solutions
pass every test cell, hidden parts included, and typical wrong answers fail them.

The exercises run on random row sets; the model is loaded only by the notebook's demonstration
cells (neighbours in SmolLM2's table, PCA, hidden states), which the course-wide notebook tests
execute. Exercise 2 builds on exercise 1's ``cosine_similarity_matrix``; exercise 3 is a Triton
kernel that the locked launcher ``my_cosine`` (cell ``ex3_launcher``) wraps, run with
``kernel_device()`` as torch's default device (a no-op in the interpreter, cuda when compiled).

The figures of the prose (the cosine's FLOPs per byte, the H100's ridge point and where the cosine
turns compute-bound, TF32's digits) are recomputed from llmu's benchmark entry and peak table, and
the test cells are checked to read nothing that only a demonstration cell defines.
"""

from __future__ import annotations

import math

import llmu  # noqa: F401  (Triton mode first: the exercise kernel is defined below)
import torch
from llmu import course

NOTEBOOK = course.repo_root() / "solutions" / "01_embeddings" / "01_embeddings.ipynb"


EXERCISES = {
    "ex1": course.Exercise("ex1_solution", ("ex1_visible", "ex1_hidden")),
    "ex2": course.Exercise("ex2_solution", ("ex2_visible", "ex2_hidden"), before=("ex1_solution",)),
    "ex3": course.Exercise("ex3_solution", ("ex3_visible", "ex3_hidden"), after=("ex3_launcher",)),
}


WRONG = {
    # exercise, replaced text, replacement, the test cell that must catch it
    "ex1: norms over the wrong axis": ("ex1", "a / a.norm(dim=1, keepdim=True)", "a / a.norm(dim=0, keepdim=True)",
                                       "ex1_visible"),
    "ex1: table rows not normalised": ("ex1", "b_unit = b / b.norm(dim=1, keepdim=True).clamp_min(eps)",
                                       "b_unit = b", "ex1_visible"),
    "ex1: norms not clamped": ("ex1", ".norm(dim=1, keepdim=True).clamp_min(eps)", ".norm(dim=1, keepdim=True)",
                               "ex1_hidden"),
    "ex2: dot product instead of cosine": ("ex2", "scores = cosine_similarity_matrix(queries, table)",
                                           "scores = queries @ table.T", "ex2_visible"),
    "ex2: least similar first": ("ex2", "torch.topk(scores, k, dim=1)", "torch.topk(scores, k, dim=1, largest=False)",
                                 "ex2_visible"),
    "ex2: exclude ignored": ("ex2", "    if exclude is not None:\n        scores = scores.clone()",
                             "    if False:\n        scores = scores.clone()", "ex2_hidden"),
    "ex2: excluded row still counted for k": ("ex2", "available = table.shape[0] - (0 if exclude is None else 1)",
                                              "available = table.shape[0]", "ex2_hidden"),
    "ex3: only the first chunk of D": ("ex3", "for d0 in range(0, D, BLOCK_D):",
                                       "for d0 in range(0, BLOCK_D, BLOCK_D):", "ex3_visible"),
    "ex3: norms not clamped": ("ex3", "a_norm = tl.maximum(tl.sqrt(a_sq), eps)", "a_norm = tl.sqrt(a_sq)",
                               "ex3_hidden"),
    "ex3: row stride taken as D": ("ex3", "a_ptr + rq[:, None] * stride_a", "a_ptr + rq[:, None] * D",
                                   "ex3_hidden"),
}


# The exercise file's tests: every solution passes its test cells; every wrong answer is caught by
# the test cell named for it; llmu's own answers handed back score nothing (cell metadata is
# checked in tests/course/test_notebooks.py).
(notebook, test_solutions_pass_all_tests, test_wrong_answers_fail,
 test_library_answers_fail) = course.exercise_tests(
    NOTEBOOK, EXERCISES, WRONG, on_kernel_device=True, warnings_to_ignore=["ignore::RuntimeWarning"])


def test_setup_cell_loads_no_model(notebook):
    """The exercises must run without the model: the setup cell only imports (the model is loaded
    by the ``load_model`` cell, which no exercise needs)."""
    assert "load_model(" not in notebook.cells["setup"]


# ---------------------------------------------------------------------------------------------
# The figures in the prose, recomputed from llmu's code
# ---------------------------------------------------------------------------------------------

def _prose(grade_id):
    return " ".join(course.cells_by_grade_id(NOTEBOOK)[grade_id].split())


def _cosine_intensity(q, elem):
    from llmu.embeddings.bench import COSINE

    size = {"Q": q, "V": 49152, "D": 576}   # SmolLM2's table, as the benchmark sizes it
    return COSINE.flops(size) / COSINE.bytes(size, elem)


def test_one_query_intensity():
    """One query: 2VD FLOPs over the VD elements of the table (plus one query and V scores)."""
    fp32, bf16 = _cosine_intensity(1, 4), _cosine_intensity(1, 2)
    assert round(fp32, 2) == 0.5 and round(bf16, 2) == 1.0
    text = _prose("bench_md")
    assert f"$2VD / 4VD = {fp32:.1f}$ FLOP per byte" in text
    assert f"in bf16 (2 bytes) it is ${bf16:.0f}$" in text


def test_h100_ridge_and_where_the_cosine_turns_compute_bound():
    from llmu.bench.peaks import GPU_PEAKS

    h100 = next(peak for _, peak in GPU_PEAKS if peak.name == "NVIDIA H100 SXM")
    tflops, bandwidth = h100.tflops_for("bfloat16"), h100.bandwidth_gbs
    ridge = tflops * 1e12 / (bandwidth * 1e9)
    queries = next(q for q in range(1, 10_000) if _cosine_intensity(q, 2) >= ridge)
    text = _prose("bench_md")
    assert f"{int(tflops)} TFLOP/s in bf16 against {bandwidth / 1000:g} TB/s" in text
    assert f"about {round(ridge, -2):.0f} FLOPs per byte" in text
    assert f"from about {round(queries, -2)} queries on" in text


def test_tf32_digits():
    """TF32 keeps float32's exponent and 10 of its 23 mantissa bits (11 with the implicit one)."""
    tf32 = math.floor(11 * math.log10(2))
    fp32 = math.floor(-math.log10(torch.finfo(torch.float32).eps / 2))   # 24 bits
    assert (tf32, fp32) == (3, 7)
    assert (f"whose 10-bit mantissa keeps about {tf32} significant decimal digits instead of float32's {fp32}"
            in _prose("library_md"))


def test_the_benchmark_times_your_kernel_beside_llmus(notebook, tmp_path):
    """The benchmark cell passes exercise 3's kernel (through ``my_cosine``) as llmu's kernel of
    ``cosine_similarity`` is called, ``fn(queries, table)``: with the solution in place it gives
    llmu's output, here on tiles ragged in Q, V and D."""
    assert notebook.check_bench_yours(tmp_path, {"cosine_similarity": "ex3"},
                                      sizes={"cosine_similarity": {"Q": 5, "V": 70, "D": 100}}) == \
        {"cosine_similarity": "ok"}
