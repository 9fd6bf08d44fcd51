"""Where the course lives: the folders nbgrader uses, the assignment ids, and the constants every
other part of :mod:`llmu.course` shares."""

from __future__ import annotations

import os
import re
from pathlib import Path

from llmu.runtime import AUTOGRADING_ENV  # noqa: F401  (one definition: benchmarks read it too)

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
#: What a solution region becomes in the student copy.
CODE_STUB = "# YOUR CODE HERE\nraise NotImplementedError()"
#: What a written answer's solution region becomes in the student copy (nbgrader's default text stub).
TEXT_STUB = "YOUR ANSWER HERE"
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
    here = Path(__file__).resolve().parents[2]
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


