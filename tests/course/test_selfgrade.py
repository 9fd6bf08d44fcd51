"""Self-grading (``llmu grade NOTEBOOK``): llmu.selfgrade on the fixture assignment and on real notebooks.

The fixture (tests/course/fixtures/99_fixture: exercise 1 ``double``, 2 points; exercise 2
``reciprocal``, 3 points, each test cell with hidden tests) is released into a temporary course
root, and "learners" edit the released copy: the stubs, the instructor's answers pasted in, a
deleted test cell, an infinite loop, a memory hog. Every case checks that the learner's file was
not touched (same bytes, same modification time).
"""

from __future__ import annotations

import copy
import hashlib
import shutil
from pathlib import Path

import nbformat
import pytest

from llmu import course, selfgrade

FIXTURE = Path(__file__).parent / "fixtures" / "99_fixture"
AID = "99_fixture"
# The fixture's cells take about a second (setup: 1-2 s, importing torch); 30 s leaves room for a
# machine shared with other work and keeps the infinite loop (it costs the limit once) affordable.
FAST_TIMEOUT = 30


@pytest.fixture(scope="module")
def fixture_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("course")
    shutil.copytree(FIXTURE, root / course.SOURCE_DIR / AID)
    course.release(root=root, db=False)
    return root


def _stub(root: Path):
    return nbformat.read(str(root / course.RELEASE_DIR / AID / f"{AID}.ipynb"), as_version=4)


def _with_answers(released_nb, solution_nb, **override):
    """The released notebook with the instructor's answers typed in (``override``: grade_id -> source)."""
    answers = {course.nbgrader_meta(c)["grade_id"]: course.answer_from_solution(c.source)
               for c in solution_nb.cells if course.is_solution(c)}
    answers.update(override)
    nb = copy.deepcopy(released_nb)
    for c in nb.cells:
        gid = course.nbgrader_meta(c).get("grade_id")
        if course.is_solution(c) and gid in answers:
            c.source = answers[gid]
    return nb


def _fingerprint(path: Path) -> tuple[str, int]:
    return hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns


def _grade(nb, tmp_path: Path, root: Path, name: str = f"{AID}.ipynb", **kw) -> selfgrade.SelfGradeReport:
    """Save ``nb`` as a learner's file, self-grade it, and check that the file was left alone."""
    path = tmp_path / "my work" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, str(path))
    before = _fingerprint(path)
    kw.setdefault("cell_timeout", FAST_TIMEOUT)
    report = selfgrade.self_grade(path, root=root, **kw)
    assert _fingerprint(path) == before, "self-grading changed the learner's notebook"
    assert sorted(p.name for p in path.parent.iterdir()) == [name], "self-grading wrote next to the notebook"
    return report


def _solution(root: Path):
    return nbformat.read(str(root / course.SOURCE_DIR / AID / f"{AID}.ipynb"), as_version=4)


# ---------------------------------------------------------------------------------------------
# Without a kernel
# ---------------------------------------------------------------------------------------------


def test_find_solution_by_file_name(fixture_root, tmp_path):
    want = fixture_root / "solutions" / AID / f"{AID}.ipynb"
    assert selfgrade.find_solution(fixture_root / "course" / AID / f"{AID}.ipynb", fixture_root) == want
    assert selfgrade.find_solution(tmp_path / "Downloads" / f"ada_{AID} (1).ipynb", fixture_root) == want
    # JupyterLab's Duplicate, a second download, Colab's copy, and all of them at once.
    for copy_name in (f"{AID}-Copy1.ipynb", f"{AID} (1).ipynb", f"Copy of {AID}.ipynb", f"{AID}-Copy2 (3).ipynb"):
        assert selfgrade.find_solution(fixture_root / "course" / AID / copy_name, fixture_root) == want, copy_name
    with pytest.raises(selfgrade.SelfGradeError, match=r"(?s)'my_notes.ipynb'.*99_fixture.ipynb"):
        selfgrade.find_solution("my_notes.ipynb", fixture_root)


def test_a_notebook_that_matches_nothing_is_told_about_solution(fixture_root):
    """A new notebook (Untitled) matches no instructor notebook: the error lists the known ones and
    says how to grade against one, naming the assignment of the folder it is in."""
    untitled = fixture_root / "course" / AID / "Untitled.ipynb"
    with pytest.raises(selfgrade.SelfGradeError) as info:
        selfgrade.find_solution(untitled, fixture_root)
    message = str(info.value)
    assert "known: 99_fixture.ipynb" in message
    assert f"--solution {fixture_root / 'solutions' / AID / f'{AID}.ipynb'}" in message, message


@pytest.mark.parametrize(("name", "stem"), [
    ("00_welcome.ipynb", "00_welcome"), ("00_welcome-Copy1.ipynb", "00_welcome"),
    ("00_welcome-Copy12.ipynb", "00_welcome"), ("00_welcome (2).ipynb", "00_welcome"),
    ("Copy of 00_welcome.ipynb", "00_welcome"), ("00_welcome-Copy1 (1).ipynb", "00_welcome"),
    ("Untitled.ipynb", "Untitled"), ("(1).ipynb", "(1)"), ("my-Copywriting.ipynb", "my-Copywriting"),
])
def test_original_stem_strips_what_copying_adds(name, stem):
    assert selfgrade.original_stem(name) == stem


def test_bad_arguments_are_named(fixture_root, tmp_path):
    with pytest.raises(selfgrade.SelfGradeError, match="does not exist"):
        selfgrade.self_grade(tmp_path / f"{AID}.ipynb", root=fixture_root)
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(selfgrade.SelfGradeError, match=r"\.ipynb file, got"):
        selfgrade.self_grade(tmp_path / "notes.txt", root=fixture_root)
    stub = fixture_root / "course" / AID / f"{AID}.ipynb"
    with pytest.raises(selfgrade.SelfGradeError, match="cell_timeout"):
        selfgrade.self_grade(stub, root=fixture_root, cell_timeout=0)
    with pytest.raises(selfgrade.SelfGradeError, match="memory_mb"):
        selfgrade.self_grade(stub, root=fixture_root, memory_mb=-1)
    (tmp_path / "broken.ipynb").write_text("{not json")
    with pytest.raises(selfgrade.SelfGradeError, match="not a readable notebook"):
        selfgrade.self_grade(tmp_path / "broken.ipynb", solution=stub)


def test_exercises_follow_the_headings_of_every_course_notebook():
    """Each exercise heading's "(a + b points)" equals the points of the graded cells grouped under it
    (test cells and written answers)."""
    import re

    checked = 0
    for src in course.source_notebooks():
        nb = nbformat.read(str(src), as_version=4)
        headings = [[ln for ln in c.source.splitlines() if course.EXERCISE_HEADING.match(ln)][-1]
                    for c in nb.cells
                    if c.cell_type == "markdown" and any(map(course.EXERCISE_HEADING.match, c.source.splitlines()))]
        exercises = selfgrade._exercises_of(nb)
        assert sum(len(e.cells) for e in exercises) == sum(course.is_test(c) or course.is_written(c) for c in nb.cells), \
            src.name
        if not headings:  # grouped by test name instead
            continue
        assert len(exercises) == len(headings), (src.name, [e.title for e in exercises], headings)
        for heading, ex in zip(headings, exercises):
            stated = re.search(r"\(([\d\s+]+) points?\)", heading)
            if stated:
                assert sum(int(x) for x in stated[1].split("+")) == ex.max_score + ex.written_points, (src.name, heading)
                checked += 1
    assert checked >= 10, "fewer exercise headings than expected: did the heading format change?"


def test_graded_cells_are_grouped_by_name_without_headings():
    nb = nbformat.read(str(FIXTURE / f"{AID}.ipynb"), as_version=4)
    for c in nb.cells:
        if c.cell_type == "markdown":
            c.source = "Some text."
    assert [(e.title, e.max_score) for e in selfgrade._exercises_of(nb)] == [("double", 2.0), ("reciprocal", 3.0)]
    fixture = nbformat.read(str(FIXTURE / f"{AID}.ipynb"), as_version=4)
    assert [e.title for e in selfgrade._exercises_of(fixture)] == ["1 · scale a vector", "2 · a safe reciprocal"]


def test_format_report_lists_each_exercise_and_the_total():
    report = selfgrade.SelfGradeReport(Path("nb.ipynb"), Path("sol.ipynb"), [
        selfgrade.ExerciseResult("1 · Add", [selfgrade.CellOutcome("t1", 2, 2, selfgrade.PASSED),
                                       selfgrade.CellOutcome("t2", 3, 0, selfgrade.FAILED, "x + y: wrong sum")]),
        selfgrade.ExerciseResult("2 · Softmax", [selfgrade.CellOutcome("t3", 5, 0, selfgrade.TIMED_OUT, "ran longer")]),
    ])
    lines = selfgrade.format_report(report, width=100).splitlines()
    assert lines[0].split() == ["exercise", "points", "status"]
    assert "2 / 5" in lines[1] and lines[1].endswith("failed")
    assert lines[2] == "    x + y: wrong sum"  # the message, under its exercise
    assert "0 / 5" in lines[3] and lines[3].endswith("timed out") and lines[4] == "    ran longer"
    assert lines[5].split() == ["total", "2", "/", "10"]


def test_format_report_wraps_each_whole_message_under_its_exercise():
    """A check's message keeps all its lines (the "Look at:" hint too), wrapped to the width,
    indented under the exercise; the same message from two cells is shown once."""
    message = ("attention weights of the masked row: 3 value(s) differ, the largest by 0.42 at index "
               "(0, 2, 5) (rtol 1e-05, atol 1e-06)\n  Look at: add the causal mask before the softmax, "
               "not after it")
    report = selfgrade.SelfGradeReport(Path("nb.ipynb"), Path("sol.ipynb"), [
        selfgrade.ExerciseResult("3 · Causal attention", [
            selfgrade.CellOutcome("t1", 2, 0, selfgrade.FAILED, message),
            selfgrade.CellOutcome("t2", 3, 0, selfgrade.FAILED, message)]),
    ])
    lines = selfgrade.format_report(report, width=48).splitlines()
    body = lines[2:-1]  # between the exercise's row and the total
    assert lines[1].startswith("3 · Causal attention") and lines[1].endswith("failed")
    assert all(len(ln) <= 48 and ln.startswith("    ") for ln in body), body
    assert " ".join(" ".join(body).split()) == " ".join(message.split()), "the message is shown once, in full"
    look_at = next(i for i, ln in enumerate(body) if "Look at:" in ln)
    assert body[look_at].startswith("      Look at:"), "the message's own indent is kept"
    assert len(body) > len(message.splitlines()), "long lines are wrapped"


def test_a_failed_cell_keeps_its_whole_message():
    evalue = "\x1b[31mdouble(x) equals x + x: 4 value(s) differ\x1b[0m\n  Look at: multiply by 2\n"
    assert selfgrade._error_message({"ename": "CheckFailed", "evalue": evalue}) == \
        "double(x) equals x + x: 4 value(s) differ\n  Look at: multiply by 2"
    assert selfgrade._error_message({"ename": "ValueError", "evalue": "bad\nshape"}) == "ValueError: bad\nshape"
    assert selfgrade._error_message({"ename": "NotImplementedError", "evalue": ""}) == \
        "not answered yet (NotImplementedError)"
    long = "\n".join(f"row {i}" for i in range(selfgrade.MESSAGE_LINES + 5))
    shown = selfgrade._error_message({"ename": "AssertionError", "evalue": long}).splitlines()
    assert len(shown) == selfgrade.MESSAGE_LINES + 1 and shown[-1] == "... (5 more lines)"


def test_benchmarks_skip_themselves_while_autograding(monkeypatch):
    import llmu.bench

    monkeypatch.setenv(course.AUTOGRADING_ENV, "1")
    results = llmu.bench.run(names=["vector_add"], device="cpu", sizes="cpu")
    assert results["rows"] and all(r["status"] == "skipped" and r["reason"] == "autograding" for r in results["rows"])
    llmu.bench.figure(results, "vector_add")  # the notebooks' plotting line still works
    monkeypatch.setenv(course.AUTOGRADING_ENV, "0")
    assert not llmu.bench.runner.autograding()


# ---------------------------------------------------------------------------------------------
# With a kernel: the fixture
# ---------------------------------------------------------------------------------------------


@pytest.mark.notebooks
def test_stubs_score_zero(fixture_root, tmp_path):
    report = _grade(_stub(fixture_root), tmp_path, fixture_root)
    assert (report.score, report.max_score) == (0, 5)
    for ex in report.exercises:
        assert ex.status == "failed: not answered yet (NotImplementedError)", ex.status


@pytest.mark.notebooks
def test_solutions_pasted_in_score_full_marks(fixture_root, tmp_path):
    report = _grade(_with_answers(_stub(fixture_root), _solution(fixture_root)), tmp_path, fixture_root)
    assert (report.score, report.max_score) == (5, 5), selfgrade.format_report(report)
    assert all(e.status == "passed" for e in report.exercises) and not report.stopped


@pytest.mark.notebooks
def test_hidden_tests_count_and_stay_hidden(fixture_root, tmp_path):
    """reciprocal passes its visible test, not the hidden one; the message is the check's, not the source."""
    nb = _with_answers(_stub(fixture_root), _solution(fixture_root),
                       reciprocal="def reciprocal(a):\n    return 1.0 / a")
    report = _grade(nb, tmp_path, fixture_root)
    assert report.score == 2
    status = report.exercises[1].status
    assert status.startswith("failed: ") and "reciprocal(0) raises" in status, status
    assert "secret-line" not in selfgrade.format_report(report)


@pytest.mark.notebooks
def test_llmu_grade_of_a_copy_prints_each_failed_check_in_full(fixture_root, tmp_path, monkeypatch, capsys):
    """What a learner does: Duplicate the notebook in JupyterLab (``99_fixture-Copy1.ipynb``),
    answer, run ``llmu grade`` on the copy. The hidden check's whole message, its "Look at:"
    hint included, is printed under the exercise, wrapped to the terminal's width."""
    from llmu import cli

    nb = _with_answers(_stub(fixture_root), _solution(fixture_root),
                       reciprocal="def reciprocal(a):\n    return 1.0 / a")
    path = fixture_root / "course" / AID / f"{AID}-Copy1.ipynb"
    nbformat.write(nb, str(path))
    before = _fingerprint(path)
    monkeypatch.setenv("LLMU_COURSE_ROOT", str(fixture_root))
    monkeypatch.setenv("COLUMNS", "44")  # a narrow terminal: the message must wrap
    try:
        assert cli.main(["grade", str(path), "--timeout", str(FAST_TIMEOUT)]) == 0
    finally:
        assert _fingerprint(path) == before
        path.unlink()
    out = capsys.readouterr().out
    lines = out.splitlines()
    row = next(i for i, ln in enumerate(lines) if ln.startswith("2 · a safe reciprocal"))
    total = next(i for i, ln in enumerate(lines) if ln.startswith("total"))
    assert lines[row].endswith("failed") and lines[total].split()[1:] == ["2", "/", "5"], out
    message = lines[row + 1:total]
    want = ("reciprocal(0) raises: raised ZeroDivisionError(float division by zero) instead of ValueError "
            "Look at: test a == 0")
    assert " ".join(" ".join(message).split()) == want, out
    assert all(len(ln) <= 44 and ln.startswith("    ") for ln in message), out
    assert any(ln.startswith("      Look at: test a == 0") for ln in message), out
    assert "secret-line" not in out


@pytest.mark.notebooks
def test_tampered_and_deleted_test_cells(fixture_root, tmp_path):
    """A test cell edited to pass is restored; a deleted one scores 0 and is reported missing."""
    nb = _with_answers(_stub(fixture_root), _solution(fixture_root), double="def double(x):\n    return x")
    for c in nb.cells:
        if course.nbgrader_meta(c).get("grade_id") == "test_double":
            c.source = "print('all good')"
    nb.cells = [c for c in nb.cells if course.nbgrader_meta(c).get("grade_id") != "test_reciprocal"]
    report = _grade(nb, tmp_path, fixture_root)
    assert report.score == 0
    assert report.exercises[0].status.startswith("failed: double(x) equals x + x")
    assert report.exercises[1].status == "missing: this test cell is not in your notebook"


@pytest.mark.notebooks
def test_an_infinite_loop_times_out_per_exercise(fixture_root, tmp_path):
    nb = _with_answers(_stub(fixture_root), _solution(fixture_root),
                       reciprocal="def reciprocal(a):\n    while True:\n        pass")
    report = _grade(nb, tmp_path, fixture_root)
    assert report.exercises[0].status == "passed", "the exercise before the loop must still count"
    assert report.exercises[1].status == f"timed out: ran longer than the {FAST_TIMEOUT} s limit"
    assert report.score == 2 and not report.stopped


@pytest.mark.notebooks
def test_a_memory_hog_is_stopped_and_reported(fixture_root, tmp_path):
    # 64 MiB of touched memory per step; the kernel starts at a few hundred MiB (torch, llmu).
    hog = "import torch\nblocks = []\nwhile True:\n    blocks.append(torch.ones(2**24))\n"
    nb = _with_answers(_stub(fixture_root), _solution(fixture_root), reciprocal=hog)
    report = _grade(nb, tmp_path, fixture_root, cell_timeout=60, memory_mb=1200)
    assert report.exercises[0].status == "passed"
    assert "over the 1200 MiB limit" in report.stopped and "reciprocal" in report.stopped, report.stopped
    status = report.exercises[1].status
    assert status.startswith("not run: ") and "1200 MiB" in status, status
    assert report.score == 2


# ---------------------------------------------------------------------------------------------
# A real course notebook, through ``llmu grade`` as a learner runs it. One is enough for the
# mechanism: that every module's stubs score nothing and its answers pass every graded cell is
# checked for all 17 by tests/course/test_execution.py (the release run) and the solution run.
# ---------------------------------------------------------------------------------------------


def _real_zero_and_full(name: str, tmp_path: Path):
    released = course.course_dir() / name / f"{name}.ipynb"
    solution = course.solutions_dir() / name / f"{name}.ipynb"
    before = _fingerprint(released)
    # The released file itself, graded as a learner's; the per-cell progress is shown on failure.
    zero = selfgrade.self_grade(released, progress=print)
    assert _fingerprint(released) == before
    assert zero.max_score > 0 and zero.score == 0, selfgrade.format_report(zero)
    assert not zero.stopped
    full_nb = _with_answers(nbformat.read(str(released), as_version=4), nbformat.read(str(solution), as_version=4))
    full = _grade(full_nb, tmp_path, None, name=f"{name}.ipynb", cell_timeout=course.CELL_TIMEOUT, progress=print)
    assert full.score == full.max_score == zero.max_score, selfgrade.format_report(full)
    print(f"{name}: stubs {zero.score:g}/{zero.max_score:g} in {zero.seconds:.0f} s, "
          f"answers {full.score:g}/{full.max_score:g} in {full.seconds:.0f} s")


@pytest.mark.notebooks
def test_real_00_welcome_zero_then_full_marks(tmp_path):
    _real_zero_and_full("00_welcome", tmp_path)


@pytest.mark.slow
@pytest.mark.notebooks
@pytest.mark.parametrize("name", [p.parent.name for p in course.source_notebooks()])
def test_every_notebooks_answers_score_full_marks_with_the_cells_left_out(name, tmp_path):
    """The cells self-grading leaves out (cells_to_skip) cannot cost a right answer a point: every
    course notebook with the instructor's answers typed in scores full marks without them. (The
    release run in test_execution.py checks the same cells are not needed on the stubs.)"""
    released = course.course_dir() / name / f"{name}.ipynb"
    solution = course.solutions_dir() / name / f"{name}.ipynb"
    answered = _with_answers(nbformat.read(str(released), as_version=4), nbformat.read(str(solution), as_version=4))
    report = _grade(answered, tmp_path, None, name=f"{name}.ipynb", cell_timeout=course.CELL_TIMEOUT)
    assert report.skipped > 0, "nothing was left out: the test would prove nothing"
    assert report.score == report.max_score > 0 and not report.stopped, selfgrade.format_report(report)


def test_a_kernel_that_does_not_start_is_reported(fixture_root, tmp_path):
    with pytest.raises(selfgrade.KernelStartError, match="no_such_kernel"):
        _grade(_stub(fixture_root), tmp_path, fixture_root, kernel_name="no_such_kernel")


# ---------------------------------------------------------------------------------------------
# What runs: cells that cannot change the score are left out; one exercise alone
# ---------------------------------------------------------------------------------------------


def _prepared(root: Path):
    nb, missing = selfgrade.prepare(_stub(root), _solution(root))
    assert not missing
    return nb


def _ids_of(nb, indices):
    return sorted(course.nbgrader_meta(nb.cells[i]).get("grade_id") or f"cell {i}" for i in indices)


def test_the_instructors_demo_is_left_out_and_every_answer_and_test_runs(fixture_root):
    nb = _prepared(fixture_root)
    demo = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code" and "A demo that uses" in c.source)
    skips = selfgrade.cells_to_skip(nb, _solution(fixture_root))
    assert set(skips) == {demo}, _ids_of(nb, skips)
    assert "reading nothing your answers bind" in skips[demo]


def test_one_exercise_runs_its_answers_tests_and_what_they_need(fixture_root):
    nb, solution = _prepared(fixture_root), _solution(fixture_root)
    code = {course.nbgrader_meta(c).get("grade_id") or f"cell {i}" for i, c in enumerate(nb.cells) if c.cell_type == "code"}
    ran = {n: code - set(_ids_of(nb, selfgrade.cells_to_skip(nb, solution, exercise=n))) for n in (1, 2)}
    assert ran[1] == {"setup", "double", "test_double"}                 # setup: torch and the checks
    assert ran[2] == {"setup", "reciprocal", "test_reciprocal"}


def test_a_learners_own_cell_runs(fixture_root):
    """A cell the learner added is not the instructor's: it runs, whatever it reads."""
    nb = _stub(fixture_root)
    nb.cells.insert(3, nbformat.v4.new_code_cell("print('my scratch work')"))
    prepared, _ = selfgrade.prepare(nb, _solution(fixture_root))
    assert 3 not in selfgrade.cells_to_skip(prepared, _solution(fixture_root))


def test_an_exercise_that_does_not_exist_is_refused(fixture_root, tmp_path):
    with pytest.raises(selfgrade.SelfGradeError, match=r"exercise must be one of \[1, 2\] .*got 3"):
        _grade(_stub(fixture_root), tmp_path, fixture_root, exercise=3)
    with pytest.raises(TypeError, match="exercise must be an exercise number"):
        _grade(_stub(fixture_root), tmp_path, fixture_root, exercise="2")


@pytest.mark.notebooks
def test_grading_one_exercise_reports_that_one(fixture_root, tmp_path):
    """A wrong exercise 1 does not matter when exercise 2 is graded alone; the report says so."""
    nb = _with_answers(_stub(fixture_root), _solution(fixture_root), double="def double(x):\n    return x")
    lines = []
    report = _grade(nb, tmp_path, fixture_root, exercise=2, progress=lines.append)
    assert [e.number for e in report.exercises] == [2] and (report.score, report.max_score) == (3, 3)
    assert report.skipped == 3 and sum("left out: not needed to grade exercise 2" in line for line in lines) == 3
    text = selfgrade.format_report(report, width=100)
    assert "Exercise 2 only" in text and "3 cell(s) left out" in text and "double" not in text


@pytest.mark.notebooks
def test_all_cells_runs_every_cell(fixture_root, tmp_path):
    lines = []
    report = _grade(_with_answers(_stub(fixture_root), _solution(fixture_root)), tmp_path, fixture_root,
                    all_cells=True, progress=lines.append)
    assert report.skipped == 0 and not any("left out" in line for line in lines)
    assert report.score == report.max_score == 5
