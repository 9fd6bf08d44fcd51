"""Autograde: grade submissions with nbgrader, in a subprocess-free API."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from .paths import (
    AUTOGRADER_DIR,
    AUTOGRADING_ENV,
    CELL_TIMEOUT,
    SOURCE_DIR,
    TIMEOUT_ERROR,
    CourseError,
    _root,
    autograder_dir,
    list_assignments,
    solutions_dir,
)
from .releasing import release
from .settings import _api, _checked, nbgrader_config


@dataclass
class StudentResult:
    student: str
    success: bool
    score: float | None
    max_score: float | None
    #: ``{"<notebook>/<grade_id>": (score, max_score)}`` for every graded cell.
    grades: dict = field(default_factory=dict)
    #: ``"<notebook>/<cell>"`` for each cell that hit the per-cell time limit.
    timed_out: list = field(default_factory=list)
    seconds: float = 0.0
    log: str = ""
    #: ``{"<notebook>.html": html}`` when feedback was generated.
    feedback: dict = field(default_factory=dict)
    #: ``{"<notebook>/<grade_id>": message}`` for each graded cell that raised: what its failed
    #: check says (:func:`failure_message`).
    messages: dict = field(default_factory=dict)
    #: ``"<notebook>/<grade_id>"`` of each written answer that waits for a person's grade (it
    #: counts 0 until then). nbgrader gives an unchanged answer 0 itself: it does not wait.
    pending: list = field(default_factory=list)


def _timed_out_cells(autograded_dir: Path) -> list[str]:
    out = []
    for nb_path in sorted(autograded_dir.glob("*.ipynb")):
        nb = json.loads(nb_path.read_text())
        for i, cell in enumerate(nb.get("cells", [])):
            for o in cell.get("outputs", []):
                if o.get("output_type") == "error" and o.get("ename") == TIMEOUT_ERROR:
                    gid = cell.get("metadata", {}).get("nbgrader", {}).get("grade_id") or f"cell{i}"
                    out.append(f"{nb_path.stem}/{gid}")
                    break
    return out


def _plain(text: str) -> str:
    """``text`` without terminal colours, blank lines at either end or trailing spaces."""
    lines = [ln.rstrip() for ln in re.sub(r"\x1b\[[0-9;]*m", "", text or "").splitlines()]
    while lines and not lines[0].strip():
        lines.pop(0)
    while lines and not lines[-1].strip():
        lines.pop()
    return "\n".join(lines).strip()


def failure_message(error: Mapping) -> str:
    """What a graded cell's error output (``ename``, ``evalue``) says to the grader: the message of
    a failed check (an ``AssertionError``: llmu.grading's checks say what failed, then where to
    look), ``not answered yet`` for the released stub's ``NotImplementedError``, else the
    exception's name and message."""
    ename, evalue = error.get("ename") or "Error", _plain(error.get("evalue", ""))
    if ename == "NotImplementedError" or evalue.startswith("NotImplementedError"):
        # the stub, raised in the answer cell (Triton's interpreter wraps it in an InterpreterError)
        return "not answered yet (NotImplementedError)"
    if ename in ("AssertionError", "CheckFailed") and evalue:
        return evalue
    return f"{ename}: {evalue}" if evalue else ename


def _failure_messages(autograded_dir: Path) -> dict[str, str]:
    """``{"<notebook>/<grade_id>": message}`` for the graded cells of the autograded notebooks in
    ``autograded_dir`` that hold an error (the first one of the cell)."""
    out = {}
    for nb_path in sorted(autograded_dir.glob("*.ipynb")):
        nb = json.loads(nb_path.read_text())
        for cell in nb.get("cells", []):
            meta = cell.get("metadata", {}).get("nbgrader", {})
            if not (meta.get("grade") and meta.get("grade_id")):
                continue
            error = next((o for o in cell.get("outputs", []) if o.get("output_type") == "error"), None)
            if error is not None:
                out[f"{nb_path.stem}/{meta['grade_id']}"] = failure_message(error)
    return out


def _collect(config, aid: str, student: str) -> StudentResult:
    from nbgrader.api import Gradebook, MissingEntry
    from nbgrader.coursedir import CourseDirectory

    coursedir = CourseDirectory(config=config)
    result = StudentResult(student=student, success=True, score=None, max_score=None)
    with Gradebook(coursedir.db_url) as gb:
        try:
            sub = gb.find_submission(aid, student)
        except MissingEntry:
            result.success = False
            return result
        result.score, result.max_score = float(sub.score), float(sub.max_score)
        for nb in sub.notebooks:
            for g in nb.grades:
                result.grades[f"{nb.name}/{g.name}"] = (g.score, g.max_score)
                if g.needs_manual_grade:
                    result.pending.append(f"{nb.name}/{g.name}")
    graded = Path(coursedir.format_path(coursedir.autograded_directory, student, aid))
    result.timed_out = _timed_out_cells(graded)
    result.messages = _failure_messages(graded)
    return result


# ---------------------------------------------------------------------------------------------
# Progress while grading
# ---------------------------------------------------------------------------------------------


def cell_line(n: int, total: int, name: str | None, seconds: float | None, status: str) -> str:
    """One line of progress for a code cell that finished: ``[  3/24] test_add_visible   0.4 s  passed``
    (the line ``llmu grade`` and ``autograder/autograde`` print per cell); without ``seconds``
    (a cell that never finished) the status follows the name."""
    if seconds is None:
        return f"[{n:>3}/{total}] {name or '':<28} {status}"
    return f"[{n:>3}/{total}] {name or '':<28} {seconds:6.1f} s  {status}"


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 59.5 else f"{int(seconds // 60)} min {seconds % 60:02.0f} s"


#: The narrowest a summary line of lost points gets trimmed to (:func:`format_summary`).
MIN_WIDTH = 60


def _trim(line: str, width: int) -> str:
    return line if len(line) <= width else line[:width - 3].rstrip() + "..."


def lost_points(results: Mapping[str, StudentResult], width: int | None = None) -> list[str]:
    """A line per test that lost points, student by student: the test, its points and the first
    line of its failed check's message, each line trimmed to ``width`` columns (default: the
    terminal's, or 120 when the output is not a terminal; at least :data:`MIN_WIDTH`)."""
    if width is None:
        width = shutil.get_terminal_size((120, 24)).columns
    width = max(int(width), MIN_WIDTH)
    rows = []
    for s, r in results.items():
        for key, (sc, mx) in r.grades.items():
            if sc is not None and mx and sc < mx and key not in r.pending:
                message = r.messages.get(key, "")
                rows.append((s, key.split("/", 1)[-1], f"{sc:g} / {mx:g}",
                             message.splitlines()[0].strip() if message else "(no error in the graded notebook)"))
    if not rows:
        return []
    w_s, w_t, w_p = (max(len(row[i]) for row in rows) for i in range(3))
    return [_trim(f"  {s:<{w_s}}  {t:<{w_t}}  {p:>{w_p}}  {m}", width) for s, t, p, m in rows]


def format_summary(results: Mapping[str, StudentResult], seconds: float, width: int | None = None) -> str:
    """The end of a batch grading: each test that lost points with the first line of its message
    (:func:`lost_points`, lines at most ``width`` wide), then a line with the submissions graded,
    how many failed and how long it took."""
    lost = lost_points(results, width)
    head = ["Points lost, with the first line of each failed test's message:", *lost, ""] if lost else []
    pending = [(s, key.split("/", 1)[-1]) for s, r in results.items() for key in r.pending]
    if pending:
        head += [f"Written answers waiting for a person's grade ({len(pending)}; each counts 0 until graded):",
                 *(f"  {s}  {cell}" for s, cell in pending),
                 "Grade them with autograder/written (the answer and its rubric, then --score), or in "
                 "nbgrader's formgrader (Manual Grading).", ""]
    failed = [s for s, r in results.items() if not r.success]
    timed_out = sum(len(r.timed_out) for r in results.values())
    line = (f"Graded {len(results)} submission(s) in {_duration(seconds)}: "
            f"{len(results) - len(failed)} completed, {len(failed)} failed")
    if failed:
        line += f" ({', '.join(failed)}: see the log above)"
    if timed_out:
        line += f"; {timed_out} cell(s) ran out of time"
    return "\n".join([*head, line + "."])


_REPORTING = []


def _reporting_execute():
    """nbgrader's ``Execute`` preprocessor, which also reports each code cell as it finishes.

    nbgrader's autograde runs a submission in one call that says nothing for as long as the
    notebook runs (minutes for the longer ones). This subclass calls its ``progress`` setting with
    a :func:`cell_line` per code cell, after nbgrader's own ``on_cell_executed`` (which records a
    timeout in the cell).
    """
    if _REPORTING:
        return _REPORTING[0]
    from nbgrader.preprocessors import Execute
    from traitlets import Any

    class ReportingExecute(Execute):
        progress = Any(None, allow_none=True, help="called with one line of text per finished code cell").tag(config=True)

        def on_notebook_start(self, notebook, **kwargs):
            self._code_cells = [i for i, c in enumerate(notebook.cells) if c.cell_type == "code" and c.source.strip()]
            name = (self.resources or {}).get("metadata", {}).get("name") or "notebook"
            if self.progress:
                self.progress(f"{name}.ipynb: {len(self._code_cells)} code cells, {self.timeout} s each at most")

        def on_cell_start(self, cell, cell_index, **kwargs):
            self._cell_t0 = time.perf_counter()

        def on_cell_executed(self, **kwargs):
            super().on_cell_executed(**kwargs)
            if not self.progress:
                return
            cell, index = kwargs["cell"], kwargs["cell_index"]
            content = (kwargs.get("execute_reply") or {}).get("content", {})
            meta = cell.get("metadata", {}).get("nbgrader", {})
            graded = bool(meta.get("grade")) and not meta.get("solution")
            if content.get("status") != "error":
                status = "passed" if graded else "ok"
            elif content.get("ename") == TIMEOUT_ERROR:
                status = "timed out"
            else:
                status = "failed" if graded else "error"
            cells = getattr(self, "_code_cells", [])
            n = cells.index(index) + 1 if index in cells else index + 1
            seconds = time.perf_counter() - getattr(self, "_cell_t0", time.perf_counter())
            self.progress(cell_line(n, len(cells), meta.get("grade_id"), seconds, status))

    ReportingExecute.__module__, ReportingExecute.__qualname__ = __name__, "ReportingExecute"
    _REPORTING.append(ReportingExecute)
    return ReportingExecute


def _report_cells(config, progress: Callable[[str], None]) -> None:
    """Make the autograde step of ``config`` run each notebook with :func:`_reporting_execute`."""
    from nbgrader.converters import Autograde
    from nbgrader.preprocessors import Execute

    steps = config.Autograde.get("autograde_preprocessors") or Autograde.class_traits()["autograde_preprocessors"].default()
    config.Autograde.autograde_preprocessors = [_reporting_execute() if p is Execute else p for p in steps]
    # A plain function: traitlets deep-copies config values, and so would copy a bound method's object.
    config.ReportingExecute.progress = lambda line: progress(line)


def _grade_students(config, aid: str, students: Iterable[str], feedback: bool = False,
                    progress: Callable[[str], None] | None = None) -> dict[str, StudentResult]:
    import warnings

    students = list(students)
    if progress is not None:
        _report_cells(config, progress)
    api = _api(config)
    out = {}
    for i, s in enumerate(students, 1):
        t0 = time.perf_counter()
        if progress is not None:
            progress(f"{s}: autograding {aid} (submission {i} of {len(students)})")
        with warnings.catch_warnings():
            # nbgrader's first autograde of a student triggers a harmless SQLAlchemy warning
            # ("Object of type <SubmittedAssignment> not in session"); the scores are right.
            warnings.filterwarnings("ignore", message=".*not in session.*")
            with autograding_environment():
                r = api.autograde(aid, s, force=True, create=True)
        res = _collect(config, aid, s) if r.get("success") else StudentResult(s, False, None, None)
        res.success = bool(r.get("success")) and res.success
        res.seconds = time.perf_counter() - t0
        res.log = (r.get("log") or "") + (r.get("error") or "")
        if feedback and res.success:
            f = _checked(api.generate_feedback(aid, s, force=True), f"generate_feedback {aid} {s}")
            res.log += f.get("log") or ""
            from nbgrader.coursedir import CourseDirectory

            cd = CourseDirectory(config=config)
            fdir = Path(cd.format_path(cd.feedback_directory, s, aid))
            res.feedback = {p.name: p.read_text(encoding="utf-8") for p in sorted(fdir.glob("*.html"))}
        out[s] = res
        if progress is not None:
            got = (f"{res.score:g} / {res.max_score:g}" if res.success and res.score is not None
                   else "autograde failed")
            progress(f"{s}: {got} in {_duration(res.seconds)}")
    return out


@contextmanager
def autograding_environment():
    """Set :data:`AUTOGRADING_ENV` for the kernels started inside the block (a kernel inherits
    this process's environment), and restore the previous value afterwards."""
    before = os.environ.get(AUTOGRADING_ENV)
    os.environ[AUTOGRADING_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(AUTOGRADING_ENV, None)
        else:
            os.environ[AUTOGRADING_ENV] = before


def submitted_students(assignment: str, root=None) -> list[str]:
    """Students with a submission of ``assignment`` in ``autograder/submitted/``."""
    sub = autograder_dir(root) / "submitted"
    if not sub.is_dir():
        return []
    return sorted(p.name for p in sub.iterdir() if (p / assignment).is_dir())


def grade(assignment: str, students: Iterable[str] | None = None, *, root=None,
          timeout: int = CELL_TIMEOUT, progress: Callable[[str], None] | None = None) -> dict[str, StudentResult]:
    """Autograde the submissions in ``autograder/submitted/<student>/<assignment>/``.

    The assignment is recorded in the gradebook again first: autograding restores the locked test
    cells from the gradebook, so the gradebook must hold the tests as they are in ``solutions/``
    now (a stale record would grade with old tests). This also fails, with an explanation, when
    graded cells were added or removed since the submissions were graded. ``course/`` is not
    touched (learners and instructors may have notebooks open there).

    ``progress(line)``, when given, is called as each submission starts and ends and as each of
    its code cells finishes (:func:`cell_line`).
    """
    root = _root(root)
    config = nbgrader_config(root, timeout=timeout)
    if assignment not in list_assignments(root):
        raise CourseError(f"no assignment {assignment!r} in {solutions_dir(root)}")
    everyone = submitted_students(assignment, root)
    chosen = list(students) if students else everyone
    unknown = [s for s in chosen if s not in everyone]
    if unknown:
        raise CourseError(f"no submission of {assignment} for: {', '.join(unknown)} "
                          f"(expected autograder/submitted/<student>/{assignment}/)")
    if not chosen:
        raise CourseError(f"no submissions of {assignment} in {autograder_dir(root) / 'submitted'}")
    if progress is not None:
        progress(f"recording the tests of {solutions_dir(root) / assignment} in the gradebook")
    release([assignment], root=root, write_course=False)
    return _grade_students(config, assignment, chosen, progress=progress)


def autograde(assignment: str, submissions: Mapping[str, object], *, source=None, workdir=None,
              timeout: int = CELL_TIMEOUT, feedback: bool = False) -> dict:
    """Autograde ``submissions`` of one assignment in a throw-away course directory.

    ``submissions`` maps a student id to a notebook (an ``nbformat`` node, or a path to an
    ``.ipynb``; it is saved under the assignment's notebook name) or to a folder holding the
    submitted notebooks. ``source`` is the assignment's instructor folder (default
    ``solutions/<assignment>``); ``workdir`` keeps the course directory (default: a temporary one,
    deleted afterwards). ``feedback=True`` also renders each student's HTML feedback (kept in
    :attr:`StudentResult.feedback`). Returns ``{"root", "release_seconds", "students": {id: StudentResult}}``.
    """
    import nbformat

    source = Path(source) if source is not None else solutions_dir() / assignment
    notebooks = sorted(source.glob("*.ipynb"))
    if not notebooks:
        raise CourseError(f"{source} holds no notebook")
    tmp = None
    if workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="llmu-autograde-")
        workdir = tmp.name
    root = Path(workdir).resolve()
    try:
        shutil.copytree(source, root / SOURCE_DIR / assignment, dirs_exist_ok=True)
        t0 = time.perf_counter()
        release([assignment], root=root)
        release_seconds = time.perf_counter() - t0
        config = nbgrader_config(root, timeout=timeout)
        for student, sub in submissions.items():
            dest = root / AUTOGRADER_DIR / "submitted" / student / assignment
            dest.mkdir(parents=True, exist_ok=True)
            if isinstance(sub, (str, os.PathLike)) and Path(sub).is_dir():
                shutil.copytree(sub, dest, dirs_exist_ok=True)
            elif isinstance(sub, (str, os.PathLike)):
                shutil.copy(sub, dest / (notebooks[0].name if len(notebooks) == 1 else Path(sub).name))
            else:
                if len(notebooks) != 1:
                    raise CourseError("pass a folder per student for an assignment with several notebooks")
                nbformat.write(sub, str(dest / notebooks[0].name))
        students = _grade_students(config, assignment, list(submissions), feedback=feedback)
        return {"root": str(root), "release_seconds": release_seconds, "students": students}
    finally:
        if tmp is not None:
            tmp.cleanup()


