"""Written answers: markdown cells a person grades (an experiment's analysis), from release to grade.

The fixture (tests/course/fixtures/97_written) has one exercise: ``mean_of`` with a test cell
(2 points) and a written answer ``ex1_written`` (2 points) whose solution region holds a model
answer and a rubric. These tests follow it through every path: the release keeps the question
and drops the model answer and the rubric; ``llmu grade`` (self-grading) scores only the
auto-graded part, says whether the written answer holds anything and shows the rubric; a class's
autograde leaves an answered cell waiting for a person (and gives a stub 0 at once), the summary
lists what waits, and ``autograder/written`` shows each answer with its rubric and records a
person's score.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from llmu import course, selfgrade
from llmu.course import autograding

FIXTURE = Path(__file__).parent / "fixtures" / "97_written"
AID = "97_written"
SCRIPT = Path(__file__).resolve().parents[2] / "autograder" / "written"
ANSWER = ("Undefined: there is no number of which an empty list is the mean, so returning 0 would be a "
          "silent wrong answer.")
FAST_TIMEOUT = 30


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("course")
    shutil.copytree(FIXTURE, root / course.SOURCE_DIR / AID)
    course.release(root=root, db=False)
    return root


def _released(root: Path):
    return nbformat.read(str(root / course.RELEASE_DIR / AID / f"{AID}.ipynb"), as_version=4)


def _solution():
    return nbformat.read(str(FIXTURE / f"{AID}.ipynb"), as_version=4)


def _learner(root: Path, *, code: bool = True, written: str | None = ANSWER, delete_written: bool = False):
    """The released notebook as a learner leaves it: the function answered (``code``), the
    written cell's stub replaced by ``written`` (None: left as it is), or the cell deleted."""
    nb = copy.deepcopy(_released(root))
    solution = {course.nbgrader_meta(c)["grade_id"]: c.source for c in _solution().cells if course.is_solution(c)}
    cells = []
    for c in nb.cells:
        gid = course.nbgrader_meta(c).get("grade_id")
        if gid == "mean_of" and code:
            c.source = course.answer_from_solution(solution[gid])
        if gid == "ex1_written":
            if delete_written:
                continue
            if written is not None:
                c.source = c.source.replace(course.TEXT_STUB, written)
        cells.append(c)
    nb.cells = cells
    return nb


def _self_grade(nb, tmp_path: Path, root: Path) -> selfgrade.SelfGradeReport:
    path = tmp_path / f"{AID}.ipynb"
    nbformat.write(nb, str(path))
    return selfgrade.self_grade(path, root=root, cell_timeout=FAST_TIMEOUT)


# -- the instructor notebook and the release -----------------------------------------------------


def test_the_release_keeps_the_question_and_drops_the_model_answer_and_rubric(root):
    cell = next(c for c in _released(root).cells if course.nbgrader_meta(c).get("grade_id") == "ex1_written")
    assert course.is_written(cell)
    assert cell.source.startswith("**Your analysis** (2 points, graded by a person)")
    assert cell.source.rstrip().endswith(course.TEXT_STUB)
    assert "Rubric" not in cell.source and "poison" not in cell.source


def test_the_rubric_is_read_from_the_solution_region():
    cell = next(c for c in _solution().cells if course.is_written(c))
    rubric = course.rubric_of(cell.source)
    assert rubric.startswith("**Rubric**") and "poison" not in rubric      # the model answer stays out
    assert [p for p, _ in course.rubric_points(rubric)] == [1.0, 1.0]
    assert course.rubric_points(rubric)[0][1] == "says that the mean of an empty list is undefined"
    assert course.rubric_of("no region, no rubric") == ""


def test_written_cells_belong_to_their_exercise():
    groups = course.exercise_groups(_solution().cells)
    assert [[course.nbgrader_meta(c)["grade_id"] for c in cells] for _, cells in groups] == \
        [["test_mean_of", "ex1_written"]]
    assert groups[0][0]["points"] == "2 + 2"


def test_the_skeleton_check_reads_each_rubric(tmp_path):
    """A course notebook's written answer needs its question, a rubric, and rubric points that add
    up to the cell's (the other skeleton problems of a copy outside the checkout do not matter)."""
    src = course.source_notebooks()[0]
    nb = json.loads(src.read_text(encoding="utf-8"))
    fixture_cell = next(c for c in json.loads((FIXTURE / f"{AID}.ipynb").read_text())["cells"] if course.is_written(c))

    def problems(source: str, points: int = 2) -> list[str]:
        cell = copy.deepcopy(fixture_cell)
        cell["source"] = source
        cell["metadata"]["nbgrader"]["points"] = points
        mine = copy.deepcopy(nb)
        mine["cells"].insert(5, cell)
        path = tmp_path / src.parent.name / src.name
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(mine), encoding="utf-8")
        return [p for p in course.skeleton_problems(path) if "written answer" in p]

    good = "".join(fixture_cell["source"])
    assert problems(good) == []
    assert "the rubric gives 2 points, the cell is worth 3" in problems(good, points=3)[0]
    assert "needs a '**Rubric**' line" in problems(good.replace("**Rubric**", "**What to look for**"))[0]
    assert "the question must stand before" in problems(good[good.index("### BEGIN SOLUTION"):])[0]


# -- self-grading ----------------------------------------------------------------------------------


def test_self_grading_scores_the_code_and_shows_the_rubric_for_the_written_part(root, tmp_path):
    report = _self_grade(_learner(root), tmp_path, root)
    assert (report.score, report.max_score, report.written_points) == (2, 2, 2)
    (cell,) = report.exercises[0].written
    assert cell.status == selfgrade.WRITTEN and cell.words == len(ANSWER.split()) and cell.score == 0
    assert report.exercises[0].status == selfgrade.PASSED
    text = selfgrade.format_report(report, width=100)
    assert "passed; written answer (2 points): graded by a person" in text
    assert "2 / 2  auto-graded; 2 more points for written answers, graded by a person" in text
    assert f"ex1_written (2 points): you wrote {cell.words} words." in text
    assert "- **1 point** says that the mean of an empty list is undefined" in text
    assert "poison" not in text                                            # the model answer is not shown


def test_an_unanswered_or_deleted_written_cell_is_named(root, tmp_path):
    report = _self_grade(_learner(root, code=False, written=None), tmp_path, root)
    (cell,) = report.exercises[0].written
    assert cell.status == selfgrade.UNANSWERED and report.score == 0
    assert "not answered yet (NotImplementedError)" in selfgrade.format_report(report, width=100)
    assert "not answered yet (the cell still says 'YOUR ANSWER HERE')" in selfgrade.format_report(report, width=200)
    # an answer that only repeats the question holds no words of its own
    repeat = _released(root).cells[5].source.split("\n\n")[0]
    report = _self_grade(_learner(root, written=repeat), tmp_path, root)
    assert report.exercises[0].written[0].status == selfgrade.UNANSWERED
    report = _self_grade(_learner(root, delete_written=True), tmp_path, root)
    assert report.exercises[0].written[0].status == selfgrade.MISSING
    assert "this written answer's cell is not in your notebook" in selfgrade.format_report(report, width=200)


# -- a class: autograde, then a person grades ------------------------------------------------------


@pytest.fixture(scope="module")
def graded(root, tmp_path_factory) -> dict:
    """Two submissions autograded with nbgrader: ada answered both parts, bo left the written stub."""
    work = tmp_path_factory.mktemp("class")
    subs = {"ada": _learner(root), "bo": _learner(root, written=None)}
    return course.autograde(AID, subs, source=FIXTURE, workdir=work, timeout=FAST_TIMEOUT, feedback=True)


def test_autograde_leaves_an_answer_for_a_person_and_a_stub_at_zero(graded):
    ada, bo = graded["students"]["ada"], graded["students"]["bo"]
    assert ada.success and bo.success
    assert (ada.score, ada.max_score) == (2.0, 4.0) and ada.pending == [f"{AID}/ex1_written"]
    assert (bo.score, bo.max_score) == (2.0, 4.0) and bo.pending == []
    assert bo.grades[f"{AID}/ex1_written"] == (0.0, 2.0)
    summary = autograding.format_summary(graded["students"], 12.0, width=120)
    assert "Written answers waiting for a person's grade (1; each counts 0 until graded):" in summary
    assert "  ada  ex1_written" in summary
    assert "ex1_written" not in autograding.lost_points({"ada": ada}, width=120)   # waiting is not lost
    page = ada.feedback[f"{AID}.html"]
    assert "silent wrong answer" in page and "Rubric" not in page


def _written(root: str, *args, ok: bool = True, script: Path = SCRIPT) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(script), "--root", root, *args], capture_output=True, text=True,
                          timeout=300)
    if ok:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_the_written_script_shows_answers_and_records_scores(graded):
    root = graded["root"]
    out = _written(root, AID).stdout
    assert f"== ada · {AID} · ex1_written (2 points): waits for a grade" in out
    assert "   | " + ANSWER[:40] in out and "- **1 point** says that the mean" in out
    assert "== bo" not in out and "1 answer(s) wait for a grade" in out
    export = _written(root, "--to", "before.csv", script=SCRIPT.with_name("export"))
    assert f"{AID}: written answers of ada wait for a person's grade and count 0" in export.stderr
    assert "== bo · 97_written · ex1_written (2 points): scored 0 (left as the stub)" in _written(root, AID, "--all").stdout
    # a score outside 0..points, an unknown cell and an unknown student are refused, and nothing changes
    for args, message in ((("ada", "ex1_written", "3"), "between 0 and the cell's 2 points, got 3"),
                          (("ada", "ex2_written", "1"), "no written answer 'ex2_written' of student 'ada'"),
                          (("cy", "ex1_written", "1"), "autograded students: ada, bo"),
                          (("ada", "ex1_written", "two"), "POINTS must be a number, got 'two'")):
        proc = _written(root, AID, "--score", *args, ok=False)
        assert proc.returncode != 0 and message in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    proc = _written(root, AID, "--score", "ada", "ex1_written", "1.5", "--comment", "names the cause; 0.5 off for NaN")
    assert f"ada: ex1_written scored 1.5; {AID} now 3.5 / 4" in proc.stdout
    assert "no written answer of 97_written waits for a grade" in _written(root, AID).stdout
    export = _written(root, "--to", "after.csv", script=SCRIPT.with_name("export"))
    assert "wait for a person's grade" not in export.stderr
    assert ",ada,,,,3.5,0.0,3.5,4.0,yes" in (Path(root) / "autograder" / "after.csv").read_text()
    from llmu.course.written import written_answers

    (ada,) = written_answers(AID, root=root, students=["ada"])
    assert ada.manual_score == 1.5 and not ada.pending
