"""The leak check of autograder/feedback, on every assignment of the course.

The check deletes a feedback page that shows a line only a hidden test holds. It must never
delete a correct page: one that shows everything a learner sees anyway (the released notebook,
the solutions, the visible tests, the text) — lines such as ``try:``, ``else:``, ``]:`` or a
``check_close(...)`` that stands in a visible test as well as in a hidden one are no secret. And
it must catch a page that shows one real hidden line.

Each page is rendered as ``autograder/feedback`` renders it: the course's feedback
preprocessors (llmu's traceback hiding, nbgrader's ClearHiddenTests) and nbgrader's feedback
template, from the instructor notebook (what the autograded copy of a perfect submission holds)
followed by the released student notebook.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import nbformat
import pytest

from llmu import course

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "autograder"))
import _common  # noqa: E402

FIXTURE = Path(__file__).parent / "fixtures" / "99_fixture"


def _exporter():
    """nbconvert's HTML exporter set up as nbgrader's GenerateFeedback sets it up."""
    import nbgrader
    from nbconvert import HTMLExporter
    from traitlets.config import Config

    base = Path(nbgrader.__file__).parent / "server_extensions" / "formgrader"
    c = Config()
    c.HTMLExporter.template_name = "feedback"
    c.HTMLExporter.extra_template_basedirs = [str(base / "templates")]
    c.HTMLExporter.extra_template_paths = [str(base / "static" / "node_modules" / "bootstrap" / "dist" / "css")]
    return HTMLExporter(config=c)


def _feedback_notebook(aid: str):
    """The instructor notebook, then the released one, through the course's feedback
    preprocessors (all but GetGrades, which reads a gradebook; the scores are filled in here)."""
    from nbconvert.preprocessors import CSSHTMLHeaderPreprocessor
    from nbgrader.preprocessors import GetGrades

    nb = nbformat.read(str(course.solutions_dir() / aid / f"{aid}.ipynb"), as_version=4)
    released = nbformat.read(str(course.course_dir() / aid / f"{aid}.ipynb"), as_version=4)
    nb.cells += released.cells
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"cell-{i}"
    steps = course.nbgrader_config().GenerateFeedback.preprocessors
    resources = {}
    for step in steps:
        if step not in (GetGrades, CSSHTMLHeaderPreprocessor):
            nb, resources = step().preprocess(nb, resources)
    for cell in nb.cells:
        meta = cell.metadata.get("nbgrader")
        if meta is not None:
            meta.setdefault("comment", None)
            if meta.get("grade"):
                meta["score"] = meta.get("points", 0)
    return nb


def _first_hidden_line(aid: str, hidden: set[str]) -> tuple[str, str]:
    """(grade_id of the cell, a line of its hidden tests that counts) for the first hidden test."""
    nb = nbformat.read(str(course.solutions_dir() / aid / f"{aid}.ipynb"), as_version=4)
    for cell in nb.cells:
        lines, _ = _common._split_hidden(cell.source)
        for line in lines:
            if line in hidden:
                return course.nbgrader_meta(cell).get("grade_id"), line
    raise AssertionError(f"{aid}: no hidden-test line counts for the leak check")


@pytest.fixture(scope="module")
def exporter():
    return _exporter()


@pytest.mark.slow
@pytest.mark.parametrize("aid", course.list_assignments())
def test_a_correct_page_passes_and_one_hidden_line_is_caught(aid, exporter):
    hidden = _common.hidden_test_lines(course.repo_root(), aid)
    gid, line = _first_hidden_line(aid, hidden)
    nb = _feedback_notebook(aid)
    cell = next(c for c in nb.cells if course.nbgrader_meta(c).get("grade_id") == gid)
    assert line not in cell.source, "ClearHiddenTests left the hidden test in the page"
    # The leak: the failing hidden line quoted in a traceback, coloured as IPython colours it.
    cell.outputs = [nbformat.v4.new_output("error", ename="AssertionError", evalue="", traceback=[
        "\x1b[0;31mAssertionError\x1b[0m                            Traceback (most recent call last)",
        f"\x1b[0;32m----> 3\x1b[0m \x1b[43m{line}\x1b[0m",
    ])]
    page, _ = exporter.from_notebook_node(nb, resources={"nbgrader": {"notebook": aid, "score": 0, "max_score": 0,
                                                                      "late_penalty": 0}})
    assert _common.leaked_lines(page, hidden) == [line]


def test_bare_syntax_and_visible_lines_are_no_secret(tmp_path):
    """A hidden region that repeats the visible check and holds bare syntax: only its own
    lines count."""
    root = tmp_path
    shutil.copytree(FIXTURE, root / "solutions" / "99_fixture")
    path = root / "solutions" / "99_fixture" / "99_fixture.ipynb"
    nb = nbformat.read(str(path), as_version=4)
    visible = 'check_close(reciprocal(4.0), 0.25, what="reciprocal(4) is 1/4", hint="1.0 / a")'
    extra = "\n".join([course.BEGIN_HIDDEN, visible, "try:", "    reciprocal(-0.0)", "except ValueError:",
                       "    pass", "else:", "    pass", "x = [", "]", "    ]:", course.END_HIDDEN])
    cell = next(c for c in nb.cells if course.nbgrader_meta(c).get("grade_id") == "test_reciprocal")
    cell.source += "\n" + extra
    nbformat.write(nb, str(path))
    hidden = _common.hidden_test_lines(root, "99_fixture")
    assert {"try:", "else:", "pass", "]", "]:", "x = [", visible} & hidden == set()
    assert {"reciprocal(-0.0)", "except ValueError:"} <= hidden
    assert any("secret-line-1" in h for h in hidden) and any("secret-line-2" in h for h in hidden)


def test_a_line_is_found_whole():
    assert _common.shows("y = max(a, b)\n", "max(a, b)")
    assert _common.shows("----> 3 check(x)", "check(x)")
    assert not _common.shows("max = 10", "x = 1")
    assert not _common.shows("n = 10000", "n = 1000")
    assert not _common.telling("else:") and not _common.telling("]:") and not _common.telling("# a comment here")
    assert _common.telling("raised = True") and not _common.telling("x = 1")


def test_what_a_learner_wrote_is_theirs(tmp_path):
    """Cells a learner writes count; the locked cells autograding restores do not."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("mine = 1", metadata={"nbgrader": {"solution": True, "grade": False, "locked": False}}),
                nbformat.v4.new_code_cell("restored = 2", metadata={"nbgrader": {"grade": True, "solution": False, "locked": True}}),
                nbformat.v4.new_code_cell("added = 3")]
    path = tmp_path / "a.ipynb"
    nbformat.write(nb, str(path))
    text = _common.notebook_text([path], learner_only=True)
    assert "mine = 1" in text and "added = 3" in text and "restored" not in text
    assert "restored = 2" in _common.notebook_text([path])
