"""``self_grade``'s limits are checked first, before any file is read, with errors naming them.

Cells are timed in whole seconds and a limit of 0 means none at all to the notebook runner, so a
timeout must be a finite number of seconds >= 1 (0.5 would otherwise let an endless loop hang the
grading). The notebook path here does not exist: the limit is what must be reported.
"""

from __future__ import annotations

import pytest

from llmu import cli, selfgrade


@pytest.mark.parametrize("timeout", ["5", True, None, [5]])
def test_cell_timeout_of_the_wrong_type(tmp_path, timeout):
    with pytest.raises(TypeError, match=r"^cell_timeout must be a number of seconds, got "):
        selfgrade.self_grade(tmp_path / "missing.ipynb", cell_timeout=timeout)


@pytest.mark.parametrize("timeout", [0, -3, 0.5, float("nan"), float("inf")])
def test_cell_timeout_out_of_range(tmp_path, timeout):
    with pytest.raises(selfgrade.SelfGradeError, match=r"^cell_timeout must be a finite number of seconds >= 1, got "):
        selfgrade.self_grade(tmp_path / "missing.ipynb", cell_timeout=timeout)


def test_memory_mb_of_the_wrong_type(tmp_path):
    with pytest.raises(TypeError, match=r"^memory_mb must be a number of megabytes or None, got '512'"):
        selfgrade.self_grade(tmp_path / "missing.ipynb", memory_mb="512")


def test_a_valid_limit_gets_to_the_notebook(tmp_path):
    with pytest.raises(selfgrade.SelfGradeError, match="does not exist"):
        selfgrade.self_grade(tmp_path / "missing.ipynb", cell_timeout=1.5)


@pytest.mark.parametrize("value, expected", [("0", "at least 1 second, got 0"), ("-5", "at least 1 second, got -5"),
                                             ("5s", "a whole number of seconds, got '5s'")])
def test_llmu_grade_timeout_must_be_a_positive_whole_number(value, expected, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:  # argparse's usage error, before anything runs
        cli.main(["grade", str(tmp_path / "missing.ipynb"), "--timeout", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --timeout: expected {expected}" in err, err
