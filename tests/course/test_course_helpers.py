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


def test_expect_test_failure():
    ns = {"double": lambda x: 2 * abs(x)}  # a wrong answer: right for x >= 0 only
    err = course.expect_test_failure(CELLS, ns, ["ok", "strict"], "strict")
    assert "double(-1)" in str(err)
    ns = {"double": lambda x: 2 * x}  # the right answer: the strict cell passes
    with pytest.raises(AssertionError, match="does not catch"):
        course.expect_test_failure(CELLS, ns, ["ok", "strict"], "strict")
    with pytest.raises(RuntimeError):  # an error that is not a check's failure propagates
        course.expect_test_failure(CELLS, ns, ["broken"], "broken")
