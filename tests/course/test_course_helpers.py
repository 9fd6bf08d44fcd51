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


OWN = ("### BEGIN HIDDEN TESTS\nfrom llmu.grading import check_own_work\n"
       "check_own_work(my_softmax, 'llmu.attention.reference.softmax', what='ex1')\n### END HIDDEN TESTS\n")
OWN_CELLS = {
    "setup": "import torch\nfrom llmu.runtime import environment\nprint(environment())",
    "ex1_solution": "def my_softmax(x, dim=-1):\n    e = (x - x.amax(dim, keepdim=True)).exp()\n    return e / e.sum(dim, keepdim=True)",
    "test_ex1_visible": OWN + "assert torch.allclose(my_softmax(torch.ones(3)), torch.ones(3) / 3), 'uniform'",
    "test_ex1_hidden": OWN + "assert my_softmax(torch.tensor([0.0, 1e4]))[1] == 1, 'large scores'",
}


def test_a_library_answer_is_refused_by_every_test_cell(tmp_path):
    with course.NotebookExercises(_notebook(tmp_path, OWN_CELLS), {"ex1": course.Exercise.numbered(1)}) as nb:
        nb.check_solution("ex1", tmp_path)
        assert nb.own_work_calls("ex1")["test_ex1_visible"] == [("my_softmax", ("'llmu.attention.reference.softmax'",))]
        tried = nb.check_library_answer_fails("ex1", tmp_path)
        assert tried == ["my_softmax = 'llmu.attention.reference.softmax' (alias)",
                         "my_softmax = 'llmu.attention.reference.softmax' (wrapper)"]


def test_a_test_cell_without_the_own_work_check_is_named(tmp_path):
    cells = dict(OWN_CELLS, test_ex1_hidden="assert my_softmax(torch.tensor([0.0, 1e4]))[1] == 1, 'large scores'")
    with course.NotebookExercises(_notebook(tmp_path, cells), {"ex1": course.Exercise.numbered(1)}) as nb:
        with pytest.raises(AssertionError, match=r"\['test_ex1_hidden'\] never call check_own_work"):
            nb.check_library_answer_fails("ex1", tmp_path)


def test_an_own_work_check_that_comes_too_late_is_named(tmp_path):
    # the cell's visible check passes on the library's answer; a check after a failing one never runs
    late = "assert my_softmax(torch.ones(2))[0] == 0, 'wrong on purpose'\n" + OWN
    cells = dict(OWN_CELLS, test_ex1_hidden=late)
    with course.NotebookExercises(_notebook(tmp_path, cells), {"ex1": course.Exercise.numbered(1)}) as nb:
        with pytest.raises(AssertionError, match="test_ex1_hidden failed with AssertionError before its own-work check"):
            nb.check_library_answer_fails("ex1", tmp_path)
