"""What the instructor reads after grading, without running a notebook (a few seconds).

* Feedback pages: an output the HTML page cannot show (a plotly figure, which carries only
  plotly's JSON when a kernel without a browser runs it, as autograding does) becomes a sentence
  naming the figure, and nbconvert has nothing to warn about.
* ``autograder/export``: rows for the assignments someone handed in, a ``submitted`` column, and
  options for nbgrader's own rows (every assignment) or for submissions only.
* The autograde summary (``autograder/autograde``, ``llmu grade ASSIGNMENT``): each test that lost
  points with the first line of its message.

``tests/course/test_instructor_scripts.py`` runs the same three on a real round of the scripts.
"""

from __future__ import annotations

import csv
import importlib.util
import warnings
from importlib.machinery import SourceFileLoader
from pathlib import Path

import nbformat
import pytest

from llmu import course
from llmu.course import autograding

REPO = Path(__file__).resolve().parents[2]
PLOTLY = "application/vnd.plotly.v1+json"
UNREPRESENTABLE = "is not able to be represented"


# ---------------------------------------------------------------------------------------------
# Feedback pages
# ---------------------------------------------------------------------------------------------


def _feedback_exporter():
    """nbconvert's HTML exporter as nbgrader's GenerateFeedback builds it, with the course's
    feedback preprocessors registered on it (all but GetGrades, which reads a gradebook)."""
    import nbgrader
    from nbconvert import HTMLExporter
    from nbgrader.preprocessors import GetGrades
    from traitlets.config import Config

    base = Path(nbgrader.__file__).parent / "server_extensions" / "formgrader"
    c = Config()
    c.HTMLExporter.template_name = "feedback"
    c.HTMLExporter.extra_template_basedirs = [str(base / "templates")]
    c.HTMLExporter.extra_template_paths = [str(base / "static" / "node_modules" / "bootstrap" / "dist" / "css")]
    c.Exporter.default_preprocessors = []  # as nbgrader's converters set it
    exporter = HTMLExporter(config=c)
    for step in course.nbgrader_config().GenerateFeedback.preprocessors:
        if step is not GetGrades:
            exporter.register_preprocessor(step, enabled=True)
    return exporter


def _figure(title):
    return {"data": [{"type": "bar", "x": [1, 2], "y": [3, 4]}],
            "layout": {"title": {"text": title}, "width": 760}}


def _page_text(page: str) -> str:
    import html
    import re

    return html.unescape(re.sub(r"<[^>]+>", " ", page))


def _render(outputs):
    nb = nbformat.v4.new_notebook()
    nb.metadata["language_info"] = {"name": "python"}
    nb.cells = [nbformat.v4.new_code_cell("show()", outputs=outputs)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        page, _ = _feedback_exporter().from_notebook_node(
            nb, resources={"nbgrader": {"notebook": "nb", "score": 0, "max_score": 0, "late_penalty": 0}})
    return page, [str(w.message) for w in caught]


def test_a_plotly_figure_becomes_a_sentence_without_a_warning():
    title = "vector_add: time per call (ms, median)<br><sup>no GPU results yet</sup>"
    outputs = [nbformat.v4.new_output("display_data", data={PLOTLY: _figure(title)}),
               nbformat.v4.new_output("execute_result", data={PLOTLY: _figure(None)}, execution_count=1),
               nbformat.v4.new_output("display_data", data={"application/x-unheard-of": "?"})]
    page, caught = _render(outputs)
    assert not [w for w in caught if UNREPRESENTABLE in w], caught
    text = " ".join(_page_text(page).split())
    assert ('Interactive figure "vector_add: time per call (ms, median) - no GPU results yet": not drawn on '
            "this page; open the notebook in JupyterLab to see it.") in text, text[-2000:]
    assert "Interactive figure: not drawn on this page" in text
    assert "Output of type application/x-unheard-of: not shown on this page" in text


def test_an_output_the_page_can_show_is_left_as_it_is():
    png = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
    outputs = [nbformat.v4.new_output("display_data", data={PLOTLY: _figure("t"), "image/png": png}),
               nbformat.v4.new_output("display_data", data={"application/vnd.jupyter.widget-view+json":
                                                            {"model_id": "abc", "version_major": 2, "version_minor": 0},
                                                            "text/plain": "IntSlider(value=3)"})]
    page, caught = _render(outputs)
    assert not [w for w in caught if UNREPRESENTABLE in w], caught
    assert png in page and "IntSlider(value=3)" in page
    assert "llmu-output-note" not in page


# ---------------------------------------------------------------------------------------------
# autograder/export
# ---------------------------------------------------------------------------------------------


def _script(name: str):
    loader = SourceFileLoader(f"autograder_{name}", str(REPO / "autograder" / name))  # a script without .py
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(module)
    return module


@pytest.fixture
def gradebook_root(tmp_path):
    """A course root whose gradebook holds three assignments (5 points each) and two students;
    only ada handed in, only 00_first, and scored 3."""
    from nbgrader.api import Gradebook

    course._scripts_on_path()
    (tmp_path / "autograder").mkdir()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not in session.*")  # nbgrader's harmless SAWarning
        with Gradebook(course.gradebook_url(tmp_path), course.COURSE_ID) as gb:
            for aid in ("00_first", "01_second", "02_third"):
                gb.add_assignment(aid)
                gb.add_notebook(aid, aid)
                gb.add_grade_cell("test_x", aid, aid, max_score=5, cell_type="code")
            for student in ("ada", "bob"):
                gb.add_student(student)
            gb.add_submission("00_first", "ada")
            gb.find_grade("test_x", "00_first", "00_first", "ada").auto_score = 3
            gb.db.commit()
    return tmp_path


def _export(root: Path, *args: str, capsys=None) -> tuple[list[dict], str]:
    out = root / "autograder" / "out.csv"
    out.unlink(missing_ok=True)
    assert _script("export").main(["--root", str(root), "--to", str(out), *args]) == 0
    with open(out, newline="") as f:
        return list(csv.DictReader(f)), (capsys.readouterr().out if capsys else "")


def _table(rows):
    return [(r["assignment"], r["student_id"], r["score"], r["max_score"], r["submitted"]) for r in rows]


def test_export_leaves_out_assignments_nobody_handed_in(gradebook_root, capsys):
    rows, out = _export(gradebook_root, capsys=capsys)
    assert _table(rows) == [("00_first", "ada", "3.0", "5.0", "yes"), ("00_first", "bob", "0.0", "5.0", "no")]
    assert list(rows[0])[-1] == "submitted" and list(rows[0])[:11] == [
        "assignment", "duedate", "timestamp", "student_id", "last_name", "first_name", "email", "raw_score",
        "late_submission_penalty", "score", "max_score"]
    assert "left out 2 assignment(s) nobody has handed in (01_second, 02_third)" in out, out


def test_export_options_give_the_other_rows(gradebook_root):
    every, _ = _export(gradebook_root, "--all-assignments")
    assert len(every) == 6 and [r["submitted"] for r in every].count("yes") == 1
    assert {(r["assignment"], r["score"]) for r in every if r["submitted"] == "no"} >= {("01_second", "0.0")}
    only, _ = _export(gradebook_root, "--submitted-only")
    assert _table(only) == [("00_first", "ada", "3.0", "5.0", "yes")]
    named, _ = _export(gradebook_root, "--assignment", "02_third", "--student", "bob")
    assert _table(named) == [("02_third", "bob", "0.0", "5.0", "no")]


# ---------------------------------------------------------------------------------------------
# The autograde summary
# ---------------------------------------------------------------------------------------------


def _graded_cell(gid, outputs, points=2):
    meta = {"nbgrader": {"grade": True, "solution": False, "locked": True, "grade_id": gid, "points": points,
                         "schema_version": 3}}
    return nbformat.v4.new_code_cell("check()", metadata=meta, outputs=outputs)


def test_failure_messages_come_from_the_graded_notebook(tmp_path):
    nb = nbformat.v4.new_notebook()
    error = nbformat.v4.new_output
    nb.cells = [
        _graded_cell("test_ok", []),
        _graded_cell("test_close", [error("stream", name="stdout", text="x\n"), error(
            "error", ename="CheckFailed", evalue="\x1b[0;31mdouble(x) equals x + x\x1b[0m: 3 of 4 values differ\n"
                                                 "  Look at: multiply by 2", traceback=[])]),
        _graded_cell("test_stub", [error("error", ename="InterpreterError", evalue="NotImplementedError()",
                                         traceback=[])]),
        _graded_cell("test_name", [error("error", ename="NameError", evalue="name 'double' is not defined",
                                         traceback=[])]),
        nbformat.v4.new_code_cell("1 / 0", outputs=[error("error", ename="ZeroDivisionError", evalue="", traceback=[])]),
    ]
    nbformat.write(nb, str(tmp_path / "nb.ipynb"))
    assert autograding._failure_messages(tmp_path) == {
        "nb/test_close": "double(x) equals x + x: 3 of 4 values differ\n  Look at: multiply by 2",
        "nb/test_stub": "not answered yet (NotImplementedError)",
        "nb/test_name": "NameError: name 'double' is not defined",
    }


def test_the_summary_gives_the_first_line_of_each_lost_test():
    ada = course.StudentResult("ada", True, 5.0, 5.0, grades={"nb/test_a": (2.0, 2.0), "nb/test_b": (3.0, 3.0)})
    bob = course.StudentResult(
        "bob_lee", True, 2.0, 5.0, grades={"nb/test_a": (2.0, 2.0), "nb/test_b": (0.0, 3.0)},
        messages={"nb/test_b": "reciprocal(0) raises: it raised ZeroDivisionError, not ValueError\n  Look at: a == 0"})
    cy = course.StudentResult("cy", True, 0.0, 5.0, grades={"nb/test_a": (0.0, 2.0), "nb/test_b": (0.0, 3.0)},
                              messages={"nb/test_a": "not answered yet (NotImplementedError)",
                                        "nb/test_b": "x" * 500})
    lines = autograding.format_summary({"ada": ada, "bob_lee": bob, "cy": cy}, 61.0, width=100).splitlines()
    assert lines[0].startswith("Points lost")
    assert lines[1].split() == ["bob_lee", "test_b", "0", "/", "3", "reciprocal(0)", "raises:", "it", "raised",
                                "ZeroDivisionError,", "not", "ValueError"]
    assert lines[2].split()[:2] == ["cy", "test_a"] and lines[2].endswith("not answered yet (NotImplementedError)")
    assert lines[3].split()[:2] == ["cy", "test_b"] and len(lines[3]) == 100 and lines[3].endswith("...")
    assert "Look at" not in "\n".join(lines) and not any("ada" in ln for ln in lines[:-1])
    assert lines[-1] == "Graded 3 submission(s) in 1 min 01 s: 3 completed, 0 failed."
    assert course.format_summary({"ada": ada}, 3.0) == "Graded 1 submission(s) in 3 s: 1 completed, 0 failed."
