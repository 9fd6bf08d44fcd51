"""The helpers that notebook unit tests use to run cells in-process (``llmu.course``)."""

from __future__ import annotations

import pytest

from llmu import course

CELLS = {
    "setup": "import math\nfrom llmu.runtime import environment\nprint(environment())\nN = 3",
    "ok": "assert double(2) == 4, 'double(2)'",
    "strict": "assert double(-1) == -2, 'double(-1)'",
    "broken": "raise RuntimeError('not a check')",
}


def test_setup_namespace_runs_the_setup_cell_quietly(capsys):
    ns = course.setup_namespace(CELLS)
    assert ns["N"] == 3 and ns["math"].pi > 3
    assert capsys.readouterr().out == ""


def test_exec_cell_defines_names(tmp_path):
    ns = course.exec_cell("def double(x):\n    return 2 * x\n", {}, tmp_path, "sol")
    assert ns["double"](4) == 8


def _notebook(tmp_path, cells):
    import nbformat

    nb = nbformat.v4.new_notebook()
    for grade_id, source in cells.items():
        cell = nbformat.v4.new_code_cell(source)
        cell.metadata["nbgrader"] = {"grade_id": grade_id, "locked": True, "schema_version": 3,
                                     "grade": False, "solution": False}
        nb.cells.append(cell)
    path = tmp_path / "nb.ipynb"
    nbformat.write(nb, str(path))
    return path


NOTEBOOK_CELLS = {
    **CELLS,
    "helper": "def twice(f):\n    return lambda x: f(f(x))",
    "ex1_solution": "def double(x):\n    return 2 * x",
    "after": "quadruple = twice(double)",
    "test_ex1_visible": "assert double(2) == 4, 'double(2)'",
    "test_ex1_hidden": "assert double(-1) == -2, 'double(-1) should be -2'\nassert quadruple(1) == 4, 'quadruple'",
    "test_crash": "raise RuntimeError('not a check')",
}
EXERCISES = {
    "ex1": course.Exercise("ex1_solution", ("test_ex1_visible", "test_ex1_hidden"), before=("helper",), after=("after",)),
    "crash": course.Exercise("ex1_solution", ("test_crash",)),
}


def test_notebook_exercises_run_solutions_and_catch_wrong_answers(tmp_path):
    with course.NotebookExercises(_notebook(tmp_path, NOTEBOOK_CELLS), EXERCISES) as nb:
        nb.check_solution("ex1", tmp_path)
        assert nb.namespace("ex1", tmp_path)["quadruple"](3) == 12  # before and after cells ran
        # a wrong answer right for x >= 0 only: the visible test passes, the hidden one catches it
        err = nb.check_caught("ex1", "2 * x", "2 * abs(x)", "test_ex1_hidden", tmp_path)
        assert "double(-1) should be -2" in str(err)
        with pytest.raises(AssertionError, match="does not catch"):
            nb.check_caught("ex1", "2 * x", "2 * abs(x)", "test_ex1_visible", tmp_path)
        with pytest.raises(AssertionError, match="no longer contains"):
            nb.check_caught("ex1", "3 * x", "x", "test_ex1_visible", tmp_path)
        with pytest.raises(RuntimeError):  # an error that is not a check's failure propagates
            nb.check_caught("crash", "2 * x", "x", "test_crash", tmp_path)


def test_notebook_exercises_name_missing_cells(tmp_path):
    with pytest.raises(KeyError, match="no cells"):
        course.NotebookExercises(_notebook(tmp_path, CELLS), {"ex9": course.Exercise.numbered(9)})
