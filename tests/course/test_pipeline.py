"""llmu.course and the course commands, on a tiny fixture assignment in a temporary course root.

The fixture (tests/course/fixtures/99_fixture) has two exercises with visible and hidden tests;
it keeps these tests fast. The real notebooks are covered by test_notebooks.py,
test_execution.py and test_autograde.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import nbformat
import pytest

from llmu import cli, course

FIXTURE = Path(__file__).parent / "fixtures" / "99_fixture"
AID = "99_fixture"


def _course_root(tmp_path: Path) -> Path:
    shutil.copytree(FIXTURE, tmp_path / course.SOURCE_DIR / AID)
    return tmp_path


def test_config_file_and_python_api_agree():
    """autograder/nbgrader_config.py (what the nbgrader CLI reads) holds llmu.course's settings."""
    from traitlets.config.loader import PyFileConfigLoader

    path = course.autograder_dir() / "nbgrader_config.py"
    loaded = PyFileConfigLoader(path.name, path=str(path.parent)).load_config()
    expected = course.nbgrader_config()
    for section in ("CourseDirectory", "Exchange", "Execute", "ClearSolutions"):
        assert dict(loaded[section]) == dict(expected[section]), section
    assert loaded.CourseDirectory.root == str(course.repo_root())
    assert loaded.CourseDirectory.source_directory == "solutions"
    assert loaded.CourseDirectory.release_directory == "course"
    assert loaded.CourseDirectory.db_url.endswith("/autograder/gradebook.db")
    assert loaded.Execute.timeout == course.CELL_TIMEOUT and loaded.Execute.interrupt_on_timeout
    assert loaded.CourseDirectory.course_id == "llmu"
    names = [p.__name__ for p in loaded.GenerateFeedback.preprocessors]
    assert names.index("HideHiddenTracebacks") < names.index("ClearHiddenTests") < names.index("CSSHTMLHeaderPreprocessor")


def test_list_assignments_and_paths(tmp_path):
    root = _course_root(tmp_path)
    (root / course.SOURCE_DIR / "empty_folder").mkdir()
    assert course.list_assignments(root) == [AID]
    assert course.source_notebooks(root) == [root / "solutions" / AID / f"{AID}.ipynb"]
    assert course.released_twin(course.source_notebooks(root)[0], root) == root / "course" / AID / f"{AID}.ipynb"


def test_release_strips_solutions_and_hidden_tests(tmp_path):
    root = _course_root(tmp_path)
    res = course.release(root=root, db=False)
    assert res.assignments == [AID]
    text = (root / "course" / AID / f"{AID}.ipynb").read_text()
    assert "secret-line" not in text and "HIDDEN" not in text and "BEGIN SOLUTION" not in text
    assert "raise NotImplementedError()" in text and "return 2 * x" not in text
    assert not (root / "autograder" / "gradebook.db").exists(), "db=False must not touch the gradebook"


def test_release_refuses_unknown_or_nothing(tmp_path):
    with pytest.raises(course.CourseError, match="nothing to release"):
        course.release(root=tmp_path)
    root = _course_root(tmp_path)
    with pytest.raises(course.CourseError, match="no such assignment.*nope"):
        course.release(["nope"], root=root)


def test_release_prunes_stale_assignments(tmp_path):
    root = _course_root(tmp_path)
    (root / "course" / "88_gone").mkdir(parents=True)
    res = course.release(root=root, db=False)
    assert res.removed == ["88_gone"] and not (root / "course" / "88_gone").exists()


@pytest.mark.notebooks
def test_validate_source_passes_release_fails(tmp_path):
    root = _course_root(tmp_path)
    course.release(root=root, db=False)
    assert course.validate(root / "solutions" / AID / f"{AID}.ipynb", root=root) == {}
    released = root / "course" / AID / f"{AID}.ipynb"
    failed = course.validate(released, root=root)["failed"]
    assert len(failed) == 2 and all("NotImplementedError" in f["raw_error"] for f in failed)
    assert course.validate(released, root=root, invert=True) == {}, "a graded cell passes on the stubs"


def test_validate_executed_judges_the_outputs_a_notebook_holds(tmp_path):
    """A notebook run elsewhere (saved from JupyterLab) is judged from its outputs, not run again:
    the verdicts equal those of running it, and an error output in a graded cell is a failure."""
    root = _course_root(tmp_path)
    course.release(root=root, db=False)
    for path, invert in [(root / "solutions" / AID / f"{AID}.ipynb", False), (root / "course" / AID / f"{AID}.ipynb", True)]:
        run = course.execute_and_validate(path, root=root, invert=invert)
        saved = tmp_path / f"saved-{path.parent.parent.name}.ipynb"
        nbformat.write(run.notebook, str(saved))
        assert course.validate_executed(saved, root=root, invert=invert) == run.results == {}
    stubs = course.execute_and_validate(root / "course" / AID / f"{AID}.ipynb", root=root)
    nbformat.write(stubs.notebook, str(tmp_path / "stubs.ipynb"))
    failed = course.validate_executed(tmp_path / "stubs.ipynb", root=root)["failed"]
    assert len(failed) == 2 and all("NotImplementedError" in f["raw_error"] for f in failed)
    # not run again: a notebook without outputs has nothing that failed
    assert course.validate_executed(root / "course" / AID / f"{AID}.ipynb", root=root) == {}


def test_the_memory_probe_and_cell_timings_are_read_back(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells.append(nbformat.v4.new_code_cell("x = 1"))
    path = tmp_path / "nb.ipynb"
    nbformat.write(nb, str(path))
    course.add_memory_probe(path)
    run = course.execute_and_validate(path, root=tmp_path)
    assert 10 < course.peak_rss_mb(run.notebook) < 4096
    assert 0 <= course.cell_seconds(run.notebook.cells[0]) < 60
    assert course.cell_seconds(nbformat.v4.new_code_cell("y = 2")) is None
    with pytest.raises(ValueError, match="printed nothing"):
        course.peak_rss_mb(nb)


@pytest.mark.slow
@pytest.mark.notebooks
def test_grade_command_and_release_rollback(tmp_path, monkeypatch, capsys):
    root = _course_root(tmp_path)
    monkeypatch.setenv("LLMU_COURSE_ROOT", str(root))
    assert cli.main(["release"]) == 0
    assert "released 99_fixture" in capsys.readouterr().out

    # A student answers exercise 1 only.
    nb = nbformat.read(str(root / "course" / AID / f"{AID}.ipynb"), as_version=4)
    for c in nb.cells:
        if course.nbgrader_meta(c).get("grade_id") == "double":
            c.source = "def double(x):\n    return x * 2"
    dest = root / "autograder" / "submitted" / "ada" / AID
    dest.mkdir(parents=True)
    nbformat.write(nb, str(dest / f"{AID}.ipynb"))

    assert cli.main(["grade", AID, "--timeout", "20"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("ada"))
    assert row.split()[1:3] == ["2", "5"], out  # 2 of 5 points: test_double passed, test_reciprocal did not
    assert "lost points: test_reciprocal" in row

    assert cli.main(["grade", AID, "--student", "nobody"]) == 1
    assert "no submission" in capsys.readouterr().err

    # The pitfall: adding a graded cell once submissions are graded. nbgrader's forced regenerate
    # deletes course/<assignment>/ and then fails; llmu puts the old release back.
    src = root / "solutions" / AID / f"{AID}.ipynb"
    snb = nbformat.read(str(src), as_version=4)
    extra = nbformat.v4.new_code_cell("assert True")
    extra.metadata["nbgrader"] = {"grade": True, "grade_id": "test_extra", "locked": True, "points": 1,
                                  "schema_version": 3, "solution": False}
    snb.cells.append(extra)
    nbformat.write(snb, str(src))
    before = (root / "course" / AID / f"{AID}.ipynb").read_bytes()
    assert cli.main(["release"]) == 1
    err = capsys.readouterr().err
    assert "Graded cells were added or removed" in err and "previous course/99_fixture was kept" in err
    assert "RuntimeError: Cannot add or remove cells" in err and "nbgrader db assignment remove" in err
    assert len(err.splitlines()) < 10, f"the message should be short, the log is in CourseError.log:\n{err}"
    assert (root / "course" / AID / f"{AID}.ipynb").read_bytes() == before


def test_released_notebook_json_is_nbformat_valid(tmp_path):
    root = _course_root(tmp_path)
    course.release(root=root, db=False)
    nb = nbformat.read(str(root / "course" / AID / f"{AID}.ipynb"), as_version=4)
    nbformat.validate(nb)
    metas = [course.nbgrader_meta(c) for c in nb.cells]
    locked_tests = [m for m in metas if m.get("grade") and not m.get("solution")]
    assert locked_tests and all("checksum" in m for m in locked_tests)
    assert json.loads((root / "course" / AID / f"{AID}.ipynb").read_text())["nbformat"] == 4


@pytest.mark.slow
@pytest.mark.notebooks
def test_feedback_hides_hidden_tests_even_in_tracebacks(tmp_path):
    """A student whose reciprocal passes the visible test but not the hidden one (no zero check).

    nbgrader's ClearHiddenTests removes the hidden source from the feedback, but IPython's
    traceback quotes the failing hidden line; llmu's feedback preprocessor cuts that traceback
    down to the check's message.
    """
    released = tmp_path / "rel"
    shutil.copytree(FIXTURE, released / course.SOURCE_DIR / AID)
    course.release(root=released, db=False)
    nb = nbformat.read(str(released / "course" / AID / f"{AID}.ipynb"), as_version=4)
    for c in nb.cells:
        gid = course.nbgrader_meta(c).get("grade_id")
        if gid == "double":
            c.source = "def double(x):\n    return x + x"
        elif gid == "reciprocal":
            c.source = "def reciprocal(a):\n    return 1.0 / a"
    out = course.autograde(AID, {"ada": nb}, source=FIXTURE, workdir=tmp_path / "grading", timeout=20, feedback=True)
    r = out["students"]["ada"]
    assert r.success and r.grades[f"{AID}/test_reciprocal"] == (0.0, 3.0) and r.score == 2.0
    html = r.feedback[f"{AID}.html"]
    assert "reciprocal(0) raises" in html, "the failed check's message (what the learner needs) is missing"
    assert "ZeroDivisionError" in html
    assert "secret-line" not in html and "HIDDEN TESTS" not in html
    # The autograded copy (instructor side) keeps the full traceback.
    autograded = Path(out["root"]) / "autograder" / "autograded" / "ada" / AID / f"{AID}.ipynb"
    assert "secret-line-2" in autograded.read_text()
