"""The course as nbgrader sees it: where things live, and release / validate / autograde.

The instructor notebooks live in ``solutions/NN_topic/NN_topic.ipynb`` (nbgrader's *source*
directory); the student copies in ``course/`` (nbgrader's *release* directory) are generated from
them and never edited by hand. Everything nbgrader writes while grading (submissions, autograded
copies, feedback, the gradebook) goes under ``autograder/``.

All nbgrader settings are made in one place, :func:`nbgrader_config`. The file
``autograder/nbgrader_config.py`` (read by the ``nbgrader`` command line and by the formgrader)
merges the same settings, so the command line and the Python functions below always agree.

Three nbgrader habits this module guards against (see ``autograder/README.md``):

* ``nbgrader validate`` exits 0 even when validation fails: :func:`validate` returns the
  validator's result dictionary instead, and callers look at it.
* ``generate_assignment --force`` deletes the old release before it can fail (for example when
  graded cells were added after submissions exist): :func:`release` puts the old release back and
  raises :class:`CourseError`.
* The nbgrader API never raises; it returns ``{"success": False, ...}``. Every call here checks
  it and raises :class:`CourseError` with nbgrader's log.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

COURSE_ID = "llmu"
SOURCE_DIR = "solutions"
RELEASE_DIR = "course"
AUTOGRADER_DIR = "autograder"
#: nbgrader's per-cell time limit (seconds) when it executes a notebook (validate, autograde).
CELL_TIMEOUT = 60
#: What a solution region becomes in the student copy.
CODE_STUB = "# YOUR CODE HERE\nraise NotImplementedError()"
#: The error nbgrader records in a cell that ran past the per-cell time limit.
TIMEOUT_ERROR = "CellTimeoutError"

BEGIN_SOLUTION = "### BEGIN SOLUTION"
END_SOLUTION = "### END SOLUTION"
BEGIN_HIDDEN = "### BEGIN HIDDEN TESTS"
END_HIDDEN = "### END HIDDEN TESTS"


class CourseError(RuntimeError):
    """An nbgrader step failed. The message says what and names nbgrader's error; ``log`` holds
    nbgrader's full log and traceback."""

    def __init__(self, message: str, log: str = ""):
        super().__init__(message)
        self.log = log


def _nbgrader_failure(result: dict) -> tuple[str, str]:
    """(nbgrader's own error lines, its whole log) from a failed API result."""
    text = (result.get("error") or "") + "\n" + (result.get("log") or "")
    key = [ln.strip() for ln in text.splitlines()
           if re.match(r"\s*[A-Za-z_.]*(Error|Exception|MissingEntry)\b.*:", ln) and "NbGraderException" not in ln]
    key = list(dict.fromkeys(key))[-3:]
    return ("\n".join(key) or "see the log"), text


# ---------------------------------------------------------------------------------------------
# Paths
# ---------------------------------------------------------------------------------------------


def _looks_like_course_root(path: Path) -> bool:
    return (path / AUTOGRADER_DIR / "nbgrader_config.py").is_file() or (path / SOURCE_DIR).is_dir()


def repo_root() -> Path:
    """The course root: the checkout that holds ``solutions/``, ``course/`` and ``autograder/``.

    ``$LLMU_COURSE_ROOT`` wins when set; otherwise the checkout this package was imported from
    (an editable install), otherwise the first parent of the working directory that looks like one.
    """
    env = os.environ.get("LLMU_COURSE_ROOT")
    if env:
        return Path(env).resolve()
    here = Path(__file__).resolve().parent.parent
    if _looks_like_course_root(here):
        return here
    cwd = Path.cwd().resolve()
    for p in (cwd, *cwd.parents):
        if _looks_like_course_root(p):
            return p
    return here


def _root(root: str | os.PathLike | None) -> Path:
    return Path(root).resolve() if root is not None else repo_root()


def solutions_dir(root=None) -> Path:
    """``solutions/``: the instructor notebooks (nbgrader's source directory)."""
    return _root(root) / SOURCE_DIR


def course_dir(root=None) -> Path:
    """``course/``: the student notebooks (nbgrader's release directory)."""
    return _root(root) / RELEASE_DIR


def autograder_dir(root=None) -> Path:
    """``autograder/``: submissions, autograded copies, feedback and the gradebook."""
    return _root(root) / AUTOGRADER_DIR


def gradebook_url(root=None) -> str:
    return "sqlite:///" + str(autograder_dir(root) / "gradebook.db")


def list_assignments(root=None) -> list[str]:
    """The assignment ids: the folders of ``solutions/`` that hold at least one notebook."""
    src = solutions_dir(root)
    if not src.is_dir():
        return []
    return sorted(
        p.name
        for p in src.iterdir()
        if p.is_dir() and not p.name.startswith(".") and any(p.glob("*.ipynb"))
    )


def source_notebooks(root=None) -> list[Path]:
    """Every instructor notebook, ``solutions/<assignment>/*.ipynb``."""
    return sorted(p for a in list_assignments(root) for p in (solutions_dir(root) / a).glob("*.ipynb"))


def released_twin(source_notebook: str | os.PathLike, root=None) -> Path:
    """The student copy that :func:`release` makes from ``source_notebook``."""
    p = Path(source_notebook)
    return course_dir(root) / p.parent.name / p.name


# ---------------------------------------------------------------------------------------------
# Settings: the single place where nbgrader is configured
# ---------------------------------------------------------------------------------------------


def nbgrader_config(root=None, *, timeout: int = CELL_TIMEOUT):
    """nbgrader's settings for the course rooted at ``root`` (a traitlets ``Config``).

    ``autograder/nbgrader_config.py`` merges exactly this, so the ``nbgrader`` command line, the
    formgrader and this module share one configuration.
    """
    _scripts_on_path()
    from nbgrader.preprocessors import ClearHiddenTests, GetGrades
    from nbconvert.preprocessors import CSSHTMLHeaderPreprocessor
    from traitlets.config import Config

    root = _root(root)
    ag = AUTOGRADER_DIR
    c = Config()
    c.CourseDirectory.course_id = COURSE_ID
    c.CourseDirectory.root = str(root)  # must be absolute
    c.CourseDirectory.source_directory = SOURCE_DIR
    c.CourseDirectory.release_directory = RELEASE_DIR
    c.CourseDirectory.submitted_directory = f"{ag}/submitted"
    c.CourseDirectory.autograded_directory = f"{ag}/autograded"
    c.CourseDirectory.feedback_directory = f"{ag}/feedback"
    c.CourseDirectory.solution_directory = f"{ag}/solution"
    c.CourseDirectory.source_with_tests_directory = f"{ag}/source_with_tests"
    c.CourseDirectory.db_url = gradebook_url(root)
    # Without this nbgrader would use a system-wide exchange directory.
    c.Exchange.root = str(root / ag / "exchange")
    # Per CELL, for validate and autograde. A student's infinite loop costs this much per cell
    # that calls it; interrupting (rather than killing the kernel) lets grading go on.
    c.Execute.timeout = int(timeout)
    c.Execute.interrupt_on_timeout = True
    c.ClearSolutions.code_stub = {"python": CODE_STUB}
    # Feedback: nbgrader's ClearHiddenTests strips the hidden tests' source, but a failing hidden
    # test's traceback still quotes its lines; HideHiddenTracebacks (first, while the markers are
    # still there to find) cuts those tracebacks down to the check's own message.
    c.GenerateFeedback.preprocessors = [GetGrades, hide_hidden_tracebacks(), ClearHiddenTests,
                                        CSSHTMLHeaderPreprocessor]
    return c


_HIDE = []


def hide_hidden_tracebacks():
    """The feedback preprocessor class that keeps hidden tests out of error tracebacks.

    IPython's traceback quotes the source lines around the failing one, so a failed hidden test
    shows itself (and its neighbours) in the student's feedback even after ``ClearHiddenTests``.
    In a cell with hidden tests, each error keeps only its type and message: the message of an
    ``llmu.grading`` check says which property failed and what to look at, which is the feedback
    meant for the learner.
    """
    if _HIDE:
        return _HIDE[0]
    from nbgrader.preprocessors import NbGraderPreprocessor

    class HideHiddenTracebacks(NbGraderPreprocessor):
        def preprocess_cell(self, cell, resources, index):
            if cell.cell_type == "code" and BEGIN_HIDDEN in cell.source:
                for out in cell.get("outputs", []):
                    if out.get("output_type") == "error":
                        out["traceback"] = [
                            f"{out.get('ename', 'Error')}: {out.get('evalue', '')}",
                            "(traceback not shown: this cell holds tests that stay hidden after grading)",
                        ]
            return cell, resources

    HideHiddenTracebacks.__module__ = __name__
    _HIDE.append(HideHiddenTracebacks)
    return HideHiddenTracebacks


def _scripts_on_path() -> None:
    """Put this interpreter's script folder on PATH.

    nbgrader runs ``alembic`` (its database migration tool) as a subprocess when it opens a
    gradebook. In a virtual environment that was not activated (``.venv/bin/python -m ...``, as
    ``make test`` does) that script is not on PATH, and every gradebook step fails with
    ``FileNotFoundError: 'alembic'``.
    """
    import sys

    scripts = os.path.dirname(os.path.abspath(sys.executable))
    parts = os.environ.get("PATH", "").split(os.pathsep)
    if scripts not in parts:
        os.environ["PATH"] = os.pathsep.join([scripts, *parts])


def _api(config):
    from nbgrader.apps import NbGraderAPI
    from nbgrader.coursedir import CourseDirectory

    _scripts_on_path()

    # The API checks the exchange folder on start and logs a CRITICAL line when it is missing,
    # although this course does not use it.
    Path(config.Exchange.root).mkdir(parents=True, exist_ok=True)
    return NbGraderAPI(CourseDirectory(config=config), config=config)


def _checked(result: dict, step: str) -> dict:
    if not result.get("success"):
        key, log = _nbgrader_failure(result)
        raise CourseError(f"nbgrader {step} failed: {key}", log)
    return result


# ---------------------------------------------------------------------------------------------
# Release
# ---------------------------------------------------------------------------------------------


@dataclass
class ReleaseResult:
    assignments: list[str]
    seconds: dict[str, float] = field(default_factory=dict)
    removed: list[str] = field(default_factory=list)


def release(assignments: Iterable[str] | None = None, *, root=None, db: bool = True, prune: bool = True) -> ReleaseResult:
    """Regenerate ``course/<assignment>/`` from ``solutions/<assignment>/`` for each assignment.

    ``db=True`` also records the assignment (its graded cells, points and test sources) in the
    gradebook, which autograding needs. ``prune`` removes ``course/<x>/`` folders whose source is
    gone (only when all assignments are released). On failure the previous release is restored.
    """
    root = _root(root)
    known = list_assignments(root)
    todo = list(assignments) if assignments is not None else known
    missing = [a for a in todo if a not in known]
    if missing:
        raise CourseError(f"no such assignment(s) in {solutions_dir(root)}: {', '.join(missing)}; known: {known}")
    if not todo:
        raise CourseError(f"nothing to release: {solutions_dir(root)} holds no assignment folder with a notebook")

    config = nbgrader_config(root)
    if not db:  # what `nbgrader generate_assignment --no-db` sets
        config.GenerateAssignment.no_database = True
        config.SaveCells.enabled = False
    api = _api(config)
    out = ReleaseResult(assignments=todo)
    course_dir(root).mkdir(exist_ok=True)
    autograder_dir(root).mkdir(exist_ok=True)
    for aid in todo:
        target = course_dir(root) / aid
        with tempfile.TemporaryDirectory(prefix="llmu-release-") as backup_root:
            backup = Path(backup_root) / aid
            if target.exists():
                shutil.copytree(target, backup)
            t0 = time.perf_counter()
            result = api.generate_assignment(aid, force=True, create=True)
            out.seconds[aid] = time.perf_counter() - t0
            if not result.get("success"):
                # generate_assignment --force deletes the old release before it can fail.
                if backup.exists():
                    shutil.rmtree(target, ignore_errors=True)
                    shutil.copytree(backup, target)
                key, log = _nbgrader_failure(result)
                hint = ""
                if "Cannot add or remove cells" in log:
                    hint = ("\nGraded cells were added or removed after submissions were graded. Revert the "
                            f"change, or drop the assignment from the gradebook (`cd autograder && nbgrader db "
                            f"assignment remove {aid} --force`, which deletes its grades), release, and regrade. "
                            "See autograder/README.md.")
                raise CourseError(f"releasing {aid} failed; the previous course/{aid} was kept.{hint}\n"
                                  f"nbgrader: {key}", log)
    if prune and assignments is None:
        for p in sorted(course_dir(root).iterdir()):
            if p.is_dir() and not p.name.startswith(".") and p.name not in known:
                shutil.rmtree(p)
                out.removed.append(p.name)
    return out


# ---------------------------------------------------------------------------------------------
# Validate
# ---------------------------------------------------------------------------------------------


@dataclass
class ValidationRun:
    """What :func:`execute_and_validate` found: nbgrader's verdict and the executed notebook."""

    path: Path
    results: dict
    notebook: object  # nbformat.NotebookNode, executed
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.results


def _make_validator(config):
    from nbgrader.validator import Validator

    class _KeepingValidator(Validator):
        """nbgrader's Validator that also keeps the notebook it executed."""

        executed = None

        def _preprocess(self, nb):
            nb = super()._preprocess(nb)
            self.executed = nb
            return nb

    return _KeepingValidator(config=config)


def execute_and_validate(path, *, invert: bool = False, timeout: int = CELL_TIMEOUT, root=None) -> ValidationRun:
    """Run nbgrader's validator on ``path`` and keep the notebook it executed.

    The result dictionary is empty when the notebook passes. Otherwise it has ``failed`` (graded
    cells that raised), ``changed`` (locked cells whose checksum changed), ``type_changed``, or with
    ``invert=True`` ``passed`` (graded cells that passed; a released notebook should have none).
    The notebook is executed once, with nbclient under nbgrader's ``Execute`` (widget state is
    stored, each cell limited to ``timeout`` seconds).
    """
    config = nbgrader_config(root, timeout=timeout)
    config.Validator.invert = invert
    config.Execute.store_widget_state = True
    config.Execute.record_timing = True
    v = _make_validator(config)
    path = Path(path).resolve()
    t0 = time.perf_counter()
    results = v.validate(str(path))
    return ValidationRun(path=path, results=results, notebook=v.executed, seconds=time.perf_counter() - t0)


def validate(path, *, invert: bool = False, timeout: int = CELL_TIMEOUT, root=None) -> dict:
    """nbgrader validation of one notebook: ``{}`` when it passes (see :func:`execute_and_validate`).

    Use this, never the exit code of ``nbgrader validate`` (it is 0 even when validation fails).
    """
    return execute_and_validate(path, invert=invert, timeout=timeout, root=root).results


# ---------------------------------------------------------------------------------------------
# Autograde
# ---------------------------------------------------------------------------------------------


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
    result.timed_out = _timed_out_cells(Path(coursedir.format_path(coursedir.autograded_directory, student, aid)))
    return result


def _grade_students(config, aid: str, students: Iterable[str], feedback: bool = False) -> dict[str, StudentResult]:
    import warnings

    api = _api(config)
    out = {}
    for s in students:
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            # nbgrader's first autograde of a student triggers a harmless SQLAlchemy warning
            # ("Object of type <SubmittedAssignment> not in session"); the scores are right.
            warnings.filterwarnings("ignore", message=".*not in session.*")
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
    return out


def submitted_students(assignment: str, root=None) -> list[str]:
    """Students with a submission of ``assignment`` in ``autograder/submitted/``."""
    sub = autograder_dir(root) / "submitted"
    if not sub.is_dir():
        return []
    return sorted(p.name for p in sub.iterdir() if (p / assignment).is_dir())


def grade(assignment: str, students: Iterable[str] | None = None, *, root=None,
          timeout: int = CELL_TIMEOUT) -> dict[str, StudentResult]:
    """Autograde the submissions in ``autograder/submitted/<student>/<assignment>/``.

    The assignment is released again first: autograding restores the locked test cells from the
    gradebook, so the gradebook must hold the tests as they are in ``solutions/`` now (a stale
    record would grade with old tests). This also fails, with an explanation, when graded cells
    were added or removed since the submissions were graded.
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
    release([assignment], root=root)
    return _grade_students(config, assignment, chosen)


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


# ---------------------------------------------------------------------------------------------
# Notebook editing helpers (used by the tests to play students)
# ---------------------------------------------------------------------------------------------


def cells_by_grade_id(path) -> dict[str, str]:
    """The source of every nbgrader cell of a notebook, keyed by its grade_id.

    Unit tests use it to run a notebook's exercise and test cells in-process, without a kernel.
    """
    nb = json.loads(Path(path).read_text())
    return {nbgrader_meta(c)["grade_id"]: "".join(c["source"]) for c in nb["cells"] if nbgrader_meta(c).get("grade_id")}


def setup_namespace(cells: dict[str, str]) -> dict:
    """A fresh namespace holding what a notebook's ``setup`` cell defines (without its environment
    printout): where unit tests run the notebook's exercise and test cells."""
    ns: dict = {}
    exec(cells["setup"].replace("print(environment())", ""), ns)  # noqa: S102 - the course's own cell
    return ns


def exec_cell(source: str, ns: dict, workdir, name: str = "cell") -> dict:
    """Run a notebook cell's code in the namespace ``ns``, as the notebook's kernel would; return ``ns``.

    Code that defines a ``@triton.jit`` kernel is compiled from a file ``workdir/name.py``: Triton
    reads a kernel's source text back (``inspect``), which needs a file behind the function.
    """
    if "@triton.jit" in source:
        path = Path(workdir) / f"{name}.py"
        path.write_text(source, encoding="utf-8")
        code = compile(source, str(path), "exec")
    else:
        code = compile(source, f"<{name}>", "exec")
    exec(code, ns)  # noqa: S102 - the course's own notebook cells
    return ns


def expect_test_failure(cells: dict[str, str], ns: dict, test_cells, failing: str) -> AssertionError:
    """Run the ``test_cells`` before ``failing`` (each may pass or fail), then ``failing``, which must
    fail with the ``AssertionError`` of a check: how unit tests show that a test cell catches a
    wrong answer. Returns that error; raises ``AssertionError`` if the cell passes."""
    test_cells = list(test_cells)
    for name in test_cells[: test_cells.index(failing)]:
        try:
            exec(cells[name], ns)  # noqa: S102 - the course's own notebook cells
        except AssertionError:
            pass
    try:
        exec(cells[failing], ns)  # noqa: S102
    except AssertionError as exc:
        return exc
    raise AssertionError(f"test cell {failing!r} passed: it does not catch this wrong answer")


def nbgrader_meta(cell) -> dict:
    return dict(cell.get("metadata", {}).get("nbgrader", {}))


def is_solution(cell) -> bool:
    return bool(nbgrader_meta(cell).get("solution"))


def is_grade(cell) -> bool:
    return bool(nbgrader_meta(cell).get("grade"))


def is_test(cell) -> bool:
    """An autograder test cell: graded code that is not itself an answer."""
    m = nbgrader_meta(cell)
    return cell.get("cell_type") == "code" and bool(m.get("grade")) and not m.get("solution")


def solution_region(source: str) -> tuple[str, str, str] | None:
    """Split ``source`` into (before, the solution lines, after) around the solution markers."""
    m = re.search(rf"^([ \t]*){re.escape(BEGIN_SOLUTION)}[^\n]*\n(.*?)^[ \t]*{re.escape(END_SOLUTION)}[^\n]*$",
                  source, flags=re.S | re.M)
    if not m:
        return None
    return source[: m.start()], m.group(2), source[m.end():]


def answer_from_solution(source: str) -> str:
    """The solution cell's source as a student would type it: the markers removed."""
    return "\n".join(
        line for line in source.split("\n") if line.strip() not in (BEGIN_SOLUTION, END_SOLUTION)
    )
