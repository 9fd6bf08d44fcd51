"""Notebook 05's graded exercises, run in-process (no kernel, no model): the instructor's solutions
pass every test cell, hidden parts included, and typical wrong answers fail them.

The whole notebook (model cells, widgets, benchmark) is executed by the course-wide notebook tests.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import llmu  # noqa: F401

NOTEBOOK = Path(__file__).resolve().parents[2] / "solutions" / "05_prefill_decode" / "05_prefill_decode.ipynb"


@pytest.fixture(scope="module")
def nb():
    return json.loads(NOTEBOOK.read_text())


@pytest.fixture(scope="module")
def cells(nb):
    return {c["metadata"]["nbgrader"]["grade_id"]: "".join(c["source"]) for c in nb["cells"]}


def test_structure(nb):
    ids = [c["metadata"]["nbgrader"]["grade_id"] for c in nb["cells"]]
    assert len(ids) == len(set(ids)), "grade_id values must be unique"
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code[0]["metadata"]["nbgrader"]["grade_id"] == "setup"
    assert "print(environment())" in "".join(code[0]["source"])
    for c in nb["cells"]:
        meta = c["metadata"]["nbgrader"]
        assert meta["schema_version"] == 3 and re.fullmatch(r"[a-zA-Z0-9_-]+", meta["grade_id"])
        assert "checksum" not in meta and "cell_type" not in meta
        if meta["grade"]:
            assert meta["points"] > 0 and meta["locked"] and not meta["solution"]
        if meta["solution"]:
            assert "### BEGIN SOLUTION" in "".join(c["source"]) and not meta["locked"]
        if c["cell_type"] == "code":
            assert c["outputs"] == [] and c["execution_count"] is None, "commit the notebook without outputs"
    graded = [c for c in nb["cells"] if c["metadata"]["nbgrader"]["grade"]]
    assert sum(c["metadata"]["nbgrader"]["points"] for c in graded) == 16
    assert sum("### BEGIN HIDDEN TESTS" in "".join(c["source"]) for c in graded) == 4


def _namespace(cells):
    ns: dict = {}
    exec(cells["setup"].replace("print(environment())", ""), ns)  # noqa: S102
    return ns


EXERCISES = {
    "ex1": ("ex1_solution", ["test_ex1_visible", "test_ex1_hidden"]),
    "ex2": ("ex2_solution", ["test_ex2_visible", "test_ex2_hidden"]),
    "ex3": ("ex3_solution", ["test_ex3_visible", "test_ex3_hidden"]),
    "ex4": ("ex4_solution", ["test_ex4_visible", "test_ex4_hidden"]),
}


@pytest.mark.parametrize("exercise", list(EXERCISES))
def test_solutions_pass_all_tests(exercise, cells):
    solution, tests = EXERCISES[exercise]
    ns = _namespace(cells)
    exec(cells[solution], ns)  # noqa: S102
    for name in tests:
        exec(cells[name], ns)  # noqa: S102  (hidden-test markers are comments: the hidden part runs too)


WRONG = {
    # exercise, replaced text, replacement, the test cell that must catch it
    "ex1: output not counted": ("ex1", "(M * K + K * N + M * N)", "(M * K + K * N)", "test_ex1_visible"),
    "ex1: FLOPs without the 2": ("ex1", "flops = 2 * M * N * K", "flops = M * N * K", "test_ex1_visible"),
    "ex1: no validation": ("ex1", "raise ValueError", "pass  #", "test_ex1_hidden"),
    "ex2: max instead of min": ("ex2", "return min(", "return max(", "test_ex2_visible"),
    "ex2: no validation": ("ex2", 'raise ValueError("peak_flops', 'print("peak_flops', "test_ex2_hidden"),
    "ex3: ridge counted as memory-bound": ("ex3", "intensity < ridge", "intensity <= ridge", "test_ex3_hidden"),
    "ex3: ridge inverted": ("ex3", "ridge = peak_flops / bandwidth", "ridge = bandwidth / peak_flops",
                            "test_ex3_visible"),
    "ex4: TPOT over n gaps": ("ex4", "/ (n - 1) if n > 1", "/ n if n > 1", "test_ex4_visible"),
    "ex4: TPOT as the last gap": ("ex4", "(timestamps[-1] - timestamps[0]) / (n - 1)",
                                  "(timestamps[-1] - timestamps[-2])", "test_ex4_hidden"),
}


@pytest.mark.parametrize("case", list(WRONG))
def test_wrong_answers_fail(case, cells):
    exercise, old, new, test_cell = WRONG[case]
    solution, _ = EXERCISES[exercise]
    assert old in cells[solution]
    ns = _namespace(cells)
    exec(cells[solution].replace(old, new), ns)  # noqa: S102
    with pytest.raises(AssertionError):
        exec(cells[test_cell], ns)  # noqa: S102
