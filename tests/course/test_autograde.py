"""An nbgrader round trip on the real 00_welcome, in a temporary course directory.

Four students hand in the released notebook:

* ``correct``: every exercise answered with the instructor's solution -> full marks;
* ``wrong``: the first exercise's body replaced by a wrong one -> partial marks;
* ``tampered``: like ``wrong``, and the locked test cells of that exercise replaced by a
  ``print`` so they "pass" -> no gain: autograde restores the tests from the gradebook;
* ``loop``: the first exercise's body replaced by ``while True: pass`` -> the cells that call it
  hit the per-cell time limit, the timeout is recorded, and grading completes;
* ``library``: every exercise answered, and the first one then replaced by llmu's own kernel (the
  answer its hidden own-work check names) -> nothing for that exercise, with the reason in the
  graded notebook, full marks for the others.

The whole round trip is bounded by an overall deadline, since a per-cell limit alone does not
bound a notebook.
"""

from __future__ import annotations

import copy
import os
import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import nbformat
import pytest

from llmu import course

pytestmark = [pytest.mark.slow, pytest.mark.notebooks]

ASSIGNMENT = "00_welcome"
# Per-cell limit for this test: the slowest 00_welcome cell (the benchmark) takes about 4-8 s on
# 2 busy cores; 20 s leaves room for that and still makes the infinite loop cheap (it costs this
# much once per test cell that calls the looping function).
CELL_TIMEOUT = int(os.environ.get("LLMU_ROUNDTRIP_CELL_TIMEOUT", 20))
DEADLINE_S = 600


@contextmanager
def deadline(seconds: int):
    """Fail (instead of hanging CI) when the block runs longer than ``seconds``."""

    def _expired(signum, frame):
        raise TimeoutError(f"the autograde round trip took longer than {seconds} s")

    if threading.current_thread() is not threading.main_thread():  # signals only work there
        yield
        return
    old = signal.signal(signal.SIGALRM, _expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _solution_cells(nb):
    return [c for c in nb.cells if course.is_solution(c) and c.cell_type == "code"]


def _replace_body(source: str, new_body: list[str]) -> str:
    """The instructor solution with its solution region replaced by ``new_body`` (indented)."""
    before, body, after = course.solution_region(source)
    first = next(ln for ln in body.splitlines() if ln.strip())
    indent = first[: len(first) - len(first.lstrip())]
    return course.answer_from_solution(before + "".join(f"{indent}{ln}\n" for ln in new_body) + after)


def _make_students(solution_nb, released_nb):
    answers = {course.nbgrader_meta(c)["grade_id"]: c.source for c in _solution_cells(solution_nb)}
    correct = copy.deepcopy(released_nb)
    for c in _solution_cells(correct):
        c.source = course.answer_from_solution(answers[course.nbgrader_meta(c)["grade_id"]])

    target = course.nbgrader_meta(_solution_cells(released_nb)[0])["grade_id"]
    inside_def = "def " in course.solution_region(answers[target])[0]

    def broken(body: list[str]):
        nb = copy.deepcopy(correct)
        cell = next(c for c in _solution_cells(nb) if course.nbgrader_meta(c)["grade_id"] == target)
        cell.source = _replace_body(answers[target], body)
        return nb

    # Inside a function (or a @triton.jit kernel) a bare return is a wrong answer that runs: the
    # result is never computed. At module level, `pass` leaves the expected names undefined.
    wrong = broken(["return None" if inside_def else "pass"])
    loop = broken(["while True:", "    pass"])
    tampered = copy.deepcopy(wrong)
    for c in tampered.cells:
        if course.is_test(c):
            c.source = "print('all tests passed')"
    # the answer the first test cell after the target names in its own-work check
    cells = solution_nb.cells
    at = next(i for i, c in enumerate(cells) if course.nbgrader_meta(c).get("grade_id") == target)
    first_test = next(c for c in cells[at:] if course.is_test(c))
    name, answers = course.own_work_calls_in(first_test.source)[0]
    library = copy.deepcopy(correct)
    cell = next(c for c in _solution_cells(library) if course.nbgrader_meta(c)["grade_id"] == target)
    cell.source += "\n" + course.library_answer_cheat(name, answers[0])
    return {"correct": correct, "wrong": wrong, "tampered": tampered, "loop": loop, "library": library}, target


def _round_trip(tmp_path_factory):
    src_dir = course.solutions_dir() / ASSIGNMENT
    assert (src_dir / f"{ASSIGNMENT}.ipynb").is_file(), f"{src_dir} is missing: the round trip runs on the real {ASSIGNMENT}"
    released = course.released_twin(src_dir / f"{ASSIGNMENT}.ipynb")
    assert released.is_file(), f"{released} is missing: run `llmu release`"
    solution_nb = nbformat.read(str(src_dir / f"{ASSIGNMENT}.ipynb"), as_version=4)
    released_nb = nbformat.read(str(released), as_version=4)
    students, target = _make_students(solution_nb, released_nb)
    workdir = tmp_path_factory.mktemp("roundtrip")
    t0 = time.perf_counter()
    with deadline(DEADLINE_S):
        out = course.autograde(ASSIGNMENT, students, source=src_dir, workdir=workdir, timeout=CELL_TIMEOUT)
    out["seconds"] = time.perf_counter() - t0
    out["target"] = target
    print({s: (r.score, r.max_score, r.timed_out, round(r.seconds, 1)) for s, r in out["students"].items()},
          f"release {out['release_seconds']:.1f} s, total {out['seconds']:.0f} s")
    return out


def grading_completes_for_everyone(round_trip):
    for s, r in round_trip["students"].items():
        assert r.success, f"autograde failed for {s}:\n{r.log[-3000:]}"
        assert r.max_score and r.max_score > 0, f"{s}: no points to earn"


def correct_gets_full_marks(round_trip):
    r = round_trip["students"]["correct"]
    lost = {k: v for k, v in r.grades.items() if v[0] != v[1]}
    assert r.score == r.max_score, f"the instructor's answers lost points: {lost}\n{r.log[-2000:]}"
    assert not r.timed_out


def wrong_gets_partial_marks(round_trip):
    r, full = round_trip["students"]["wrong"], round_trip["students"]["correct"]
    assert r.score < full.score, f"a wrong {round_trip['target']} still got {r.score}/{r.max_score}"
    if len([k for k in r.grades]) > 2:  # more than one exercise: the others still count
        assert r.score > 0, f"a wrong {round_trip['target']} lost every point: {r.grades}"
    assert not r.timed_out


def tampering_gains_nothing(round_trip):
    tampered, wrong = round_trip["students"]["tampered"], round_trip["students"]["wrong"]
    assert tampered.grades == wrong.grades, "editing the locked test cells changed the grades"
    assert tampered.score == wrong.score
    assert "checksum" in tampered.log and "has changed" in tampered.log, "nbgrader did not notice the edited tests"


def infinite_loop_times_out_and_grading_completes(round_trip):
    r, full = round_trip["students"]["loop"], round_trip["students"]["correct"]
    assert r.success
    assert r.timed_out, f"no cell recorded a {course.TIMEOUT_ERROR}: {r.grades}"
    assert r.score < full.score
    # Only the looping exercise's tests are lost; the rest of the notebook was graded normally.
    assert r.score >= round_trip["students"]["wrong"].score, (r.grades, round_trip["students"]["wrong"].grades)


def library_answer_scores_nothing_and_says_why(round_trip):
    r, full = round_trip["students"]["library"], round_trip["students"]["correct"]
    lost = {k: v for k, v in r.grades.items() if v[0] != v[1]}
    assert lost and all(v[0] == 0 for v in lost.values()), f"llmu's own kernel was not refused: {r.grades}"
    assert r.score == full.score - sum(v[1] for v in lost.values()) > 0, r.grades
    graded = Path(round_trip["root"]) / "autograder" / "autograded" / "library" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb"
    outputs = " ".join(o.get("evalue", "") for c in nbformat.read(str(graded), as_version=4).cells
                       if course.is_test(c) for o in c.get("outputs", []))
    assert "a ready-made answer to this exercise" in outputs, "the graded notebook does not say why"


def round_trip_fits_ci(round_trip):
    assert round_trip["seconds"] < DEADLINE_S
    ag = Path(round_trip["root"])  # the temporary course directory was kept (workdir given)
    for s in round_trip["students"]:
        assert (ag / "autograder" / "autograded" / s / ASSIGNMENT / f"{ASSIGNMENT}.ipynb").is_file()


PROPERTIES = (grading_completes_for_everyone, correct_gets_full_marks, wrong_gets_partial_marks,
              tampering_gains_nothing, infinite_loop_times_out_and_grading_completes,
              library_answer_scores_nothing_and_says_why, round_trip_fits_ci)


def test_autograde_round_trip(tmp_path_factory):
    """One test for the round trip (it takes a minute of CPU; as several tests sharing a fixture it
    ran once on each pytest-xdist worker that drew one of them). Every property is checked, and each
    that fails is reported by name."""
    round_trip = _round_trip(tmp_path_factory)
    failures = []
    for prop in PROPERTIES:
        try:
            prop(round_trip)
        except AssertionError as exc:
            failures.append(f"{prop.__name__.replace('_', ' ')}: {exc}")
    assert not failures, "\n\n".join(failures)
