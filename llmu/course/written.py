"""Written answers in a class: the ones that wait for a person's grade, and recording that grade.

A written answer is a markdown cell that a person grades (:func:`llmu.course.is_written`): an
experiment's analysis, say. nbgrader's autograde leaves it for a person (it counts 0 until then;
an answer the student left as the stub gets 0 at once and waits for nobody). This module reads
the gradebook and the autograded notebooks so that an instructor can grade from a plain shell
(``autograder/written``) what nbgrader's formgrader shows in the browser:

- :func:`written_answers`: each written answer of an assignment, with the student's text, the
  rubric from the instructor notebook, and the grade so far;
- :func:`record_written_grade`: a person's score (and an optional comment) for one answer, as the
  formgrader records it, after checking that it lies between 0 and the cell's points.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from .notebooks import is_written, nbgrader_meta, rubric_of
from .paths import CourseError, _root, autograder_dir, gradebook_url, solutions_dir


@dataclass
class WrittenAnswer:
    """One student's answer to one written cell, and where its grade stands."""

    student: str
    notebook: str
    grade_id: str
    points: float
    #: The student's cell as autograded (the question, then their answer).
    text: str
    rubric: str
    #: The person's score, or None while the answer waits for one.
    manual_score: float | None
    #: nbgrader's own score: 0 for an answer left as the stub, else None.
    auto_score: float | None

    @property
    def pending(self) -> bool:
        return self.manual_score is None and self.auto_score is None


def _rubrics(root: Path, assignment: str) -> dict[tuple[str, str], tuple[float, str]]:
    """``{(notebook, grade_id): (points, rubric)}`` of the instructor notebooks' written cells."""
    out = {}
    for path in sorted((solutions_dir(root) / assignment).glob("*.ipynb")):
        for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
            if is_written(cell):
                meta = nbgrader_meta(cell)
                out[(path.stem, meta["grade_id"])] = (float(meta.get("points") or 0), rubric_of("".join(cell["source"])))
    return out


def _autograded_text(root: Path, student: str, assignment: str, notebook: str, grade_id: str) -> str:
    path = autograder_dir(root) / "autograded" / student / assignment / f"{notebook}.ipynb"
    if not path.is_file():
        return ""
    for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
        if nbgrader_meta(cell).get("grade_id") == grade_id:
            return "".join(cell["source"])
    return ""


def written_answers(assignment: str, *, root=None, students=None, pending_only: bool = False) -> list[WrittenAnswer]:
    """Every autograded student's answers to ``assignment``'s written cells, student by student.

    ``students`` narrows them; ``pending_only`` keeps the answers that wait for a person's grade.
    An assignment without written cells gives ``[]``.
    """
    from nbgrader.api import Gradebook, MissingEntry

    root = _root(root)
    if not isinstance(assignment, str) or not (solutions_dir(root) / assignment).is_dir():
        raise CourseError(f"assignment must be the name of a folder in {solutions_dir(root)}, got {assignment!r}")
    rubrics = _rubrics(root, assignment)
    out = []
    with Gradebook(gradebook_url(root)) as gb:
        try:
            submissions = gb.assignment_submissions(assignment)
        except MissingEntry:
            return []
        for sub in sorted(submissions, key=lambda s: s.student_id):
            if students and sub.student_id not in students:
                continue
            for nb in sub.notebooks:
                for g in sorted(nb.grades, key=lambda g: g.name):
                    if (nb.name, g.name) not in rubrics:
                        continue
                    points, rubric = rubrics[(nb.name, g.name)]
                    answer = WrittenAnswer(sub.student_id, nb.name, g.name, points,
                                           _autograded_text(root, sub.student_id, assignment, nb.name, g.name),
                                           rubric, g.manual_score, g.auto_score)
                    if answer.pending or not pending_only:
                        out.append(answer)
    return out


def record_written_grade(assignment: str, student: str, grade_id: str, score, *, root=None,
                         comment: str | None = None) -> tuple[float, float]:
    """Record a person's ``score`` for ``student``'s written answer ``grade_id`` of ``assignment``
    (and ``comment``, which the student's feedback page shows). Returns the submission's new
    ``(score, max_score)``. The score must be a number from 0 to the cell's points."""
    from nbgrader.api import Gradebook, MissingEntry

    root = _root(root)
    answers = {(a.student, a.grade_id): a for a in written_answers(assignment, root=root)}
    if (student, grade_id) not in answers:
        cells = sorted({g for _, g in answers}) or ["(none)"]
        who = sorted({s for s, _ in answers}) or ["(none)"]
        raise CourseError(f"no written answer {grade_id!r} of student {student!r} in {assignment} "
                          f"(written cells: {', '.join(cells)}; autograded students: {', '.join(who)})")
    answer = answers[(student, grade_id)]
    if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
        raise TypeError(f"score must be a number of points, got {score!r}")
    if not 0 <= score <= answer.points:
        raise ValueError(f"score must lie between 0 and the cell's {answer.points:g} points, got {score:g}")
    with Gradebook(gradebook_url(root)) as gb:
        try:
            grade = gb.find_grade(grade_id, answer.notebook, assignment, student)
        except MissingEntry as exc:
            raise CourseError(f"the gradebook has no grade {grade_id!r} for {student} in {assignment}") from exc
        grade.manual_score = float(score)
        grade.needs_manual_grade = False          # as nbgrader's formgrader does on a score
        if comment is not None:
            gb.find_comment(grade_id, answer.notebook, assignment, student).manual_comment = str(comment)
        gb.db.commit()
        sub = gb.find_submission(assignment, student)
        return float(sub.score), float(sub.max_score)
