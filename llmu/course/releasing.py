"""Release: ``course/<assignment>/`` generated from ``solutions/<assignment>/``.

``course/`` is where learners work: ``make lab`` opens it, and they fill the notebooks in place.
So release never overwrites a learner's work:

* nbgrader generates each assignment into a temporary folder, never into ``course/`` (its
  ``generate_assignment --force`` deletes the whole destination folder first). When nbgrader
  fails, ``course/`` has not been touched.
* Each ``course/<assignment>/`` holds a record, :data:`RECORD`: the sha256 of every file release
  wrote there. A file that no longer matches its record (and differs from what release would write
  now) was edited, and release refuses to overwrite it unless ``force=True``; then it first moves
  the edited file aside, next to where it was (:func:`backup_name`).
* Files that release did not write (a learner's own notes, ``.ipynb_checkpoints/``) are never
  touched.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from llmu.cell_module import written_by_magic

from .paths import (
    RELEASE_DIR,
    CourseError,
    _nbgrader_failure,
    _root,
    autograder_dir,
    course_dir,
    list_assignments,
    solutions_dir,
)
from .settings import _api, nbgrader_config

#: The record of the last release, in each ``course/<assignment>/`` (hidden in JupyterLab).
RECORD = ".llmu-release.json"
_RECORD_ABOUT = ("What `llmu release` wrote in this folder: the sha256 of each file. A file that no longer "
                 "matches was edited here, and release does not overwrite it (see `llmu release --help`).")
#: How to go on when release refuses; the same flag on every front end.
FORCE_HINT = "`llmu release --force` (or `make release FORCE=1`, `autograder/release --force`)"


@dataclass
class ReleaseResult:
    assignments: list[str]
    seconds: dict[str, float] = field(default_factory=dict)
    #: ``course/<x>/`` folders removed because ``solutions/<x>/`` is gone.
    removed: list[str] = field(default_factory=list)
    #: ``{edited file: its backup}`` for each edited file moved aside by ``force=True``
    #: (paths relative to the course root, e.g. ``course/00_welcome/00_welcome.ipynb``).
    backups: dict[str, str] = field(default_factory=dict)
    #: Files left in place although release no longer writes them, because they were edited or
    #: are the learner's own (paths relative to the course root).
    kept: list[str] = field(default_factory=list)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _files(folder: Path) -> dict[str, Path]:
    """Every file under ``folder``, by its path relative to it (``/``-separated)."""
    return {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*")) if p.is_file()}


def read_record(folder: str | os.PathLike) -> dict[str, str] | None:
    """``{file: sha256}`` of what the last release wrote in ``folder``; None when there is no
    readable record (a ``course/`` from before records existed, or a damaged one)."""
    try:
        files = json.loads((Path(folder) / RECORD).read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return dict(files) if isinstance(files, dict) else None


def _write_record(folder: Path, files: dict[str, str]) -> None:
    # No timestamps: course/ is committed, and a release that changes nothing must leave git clean.
    text = json.dumps({"about": _RECORD_ABOUT, "files": dict(sorted(files.items()))}, indent=1) + "\n"
    path = folder / RECORD
    if not path.is_file() or path.read_text(encoding="utf-8") != text:
        path.write_text(text, encoding="utf-8")


def backup_name(path: Path, stamp: str) -> Path:
    """Where ``force`` moves an edited file: next to it, ``NAME.learner-<stamp>.ipynb``, so a
    learner finds it beside the fresh copy in JupyterLab. Never an existing file."""
    candidate = path.with_name(f"{path.stem}.learner-{stamp}{path.suffix}")
    n = 2
    while candidate.exists():
        candidate = path.with_name(f"{path.stem}.learner-{stamp}-{n}{path.suffix}")
        n += 1
    return candidate


@dataclass
class _Plan:
    """What releasing one assignment does to ``course/<aid>/`` (file names relative to it)."""

    aid: str
    staged: dict[str, Path]       # nbgrader's output for this assignment
    hashes: dict[str, str]        # their sha256: the new record
    write: list[str] = field(default_factory=list)    # missing or unedited files that change
    edited: list[str] = field(default_factory=list)   # differ from the record and from the new release
    stale: list[str] = field(default_factory=list)    # released before, not any more, unedited: removed
    kept: list[str] = field(default_factory=list)     # released before, not any more, edited: left alone


def _plan(aid: str, stage: Path, target: Path) -> _Plan:
    staged = _files(stage)
    plan = _Plan(aid, staged, {rel: _sha256(p) for rel, p in staged.items()})
    record = read_record(target) or {}
    for rel, new in plan.hashes.items():
        dest = target / rel
        have = _sha256(dest) if dest.is_file() else None
        if not dest.exists():
            plan.write.append(rel)
        elif have == new:
            continue  # already what this release writes (also when the record is stale or missing)
        elif have is not None and have == record.get(rel):
            plan.write.append(rel)  # as the last release wrote it: safe to replace
        else:
            plan.edited.append(rel)
    for rel, old in record.items():
        dest = target / rel
        if rel in plan.hashes or rel == RECORD or not dest.is_file():
            continue
        (plan.stale if _sha256(dest) == old else plan.kept).append(rel)
    return plan


def _refusal(plans: list[_Plan]) -> CourseError:
    edited = [f"  {RELEASE_DIR}/{p.aid}/{rel}" for p in plans for rel in p.edited]
    others = [p.aid for p in plans if not p.edited]
    lines = [
        "release would overwrite files that were edited in course/ since the last release, so it changed nothing:",
        *edited,
        "Your edits are safe where they are. To get a fresh copy anyway, run " + FORCE_HINT + ":",
        "it first moves each edited file aside, next to it, as NAME.learner-<date>-<time>.ipynb, and says where.",
    ]
    if others:
        lines.append("Or release only the others: llmu release " + " ".join(others))
    return CourseError("\n".join(lines))


def _install(plan: _Plan, target: Path, root: Path, stamp: str, out: ReleaseResult) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for rel in plan.edited:  # only reached with force=True
        dest = target / rel
        backup = backup_name(dest, stamp)
        os.replace(dest, backup)  # a rename next to the file: the learner's bytes are never copied
        out.backups[dest.relative_to(root).as_posix()] = backup.relative_to(root).as_posix()
    for rel in plan.write + plan.edited:
        dest = target / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.llmu-release-tmp")
        shutil.copyfile(plan.staged[rel], tmp)
        shutil.copymode(plan.staged[rel], tmp)
        os.replace(tmp, dest)  # atomic: a reader sees the old file or the new one, never half of one
    for rel in plan.stale:
        (target / rel).unlink()
    out.kept += [(target / rel).relative_to(root).as_posix() for rel in plan.kept]
    _write_record(target, plan.hashes)


def _prune(folder: Path, root: Path, out: ReleaseResult) -> None:
    """Remove what release wrote in ``course/<x>/`` (``solutions/<x>/`` is gone), and the folder if
    nothing else is left in it. Edited files and files release did not write stay."""
    record = read_record(folder)
    if record is None:
        if not any(folder.iterdir()):
            folder.rmdir()
            out.removed.append(folder.name)
        return  # no record: release never wrote here (or an older course/): not ours to delete
    for rel, old in record.items():
        p = folder / rel
        if p.is_file() and _sha256(p) == old:
            p.unlink()
    (folder / RECORD).unlink()
    for d in sorted((p for p in folder.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        if not any(d.iterdir()):
            d.rmdir()
    if any(folder.iterdir()):
        out.kept += [p.relative_to(root).as_posix() for p in _files(folder).values()]
    else:
        folder.rmdir()
        out.removed.append(folder.name)


def release(assignments: Iterable[str] | None = None, *, root=None, db: bool = True, prune: bool = True,
            force: bool = False, write_course: bool = True) -> ReleaseResult:
    """Regenerate ``course/<assignment>/`` from ``solutions/<assignment>/`` for each assignment.

    ``db=True`` also records the assignment (its graded cells, points and test sources) in the
    gradebook, which autograding needs. ``prune`` removes what release wrote in ``course/<x>/``
    folders whose source is gone (only when all assignments are released).

    A file in ``course/`` that was edited since the last release is never overwritten: release
    raises :class:`CourseError` naming the files, before changing anything in ``course/``.
    ``force=True`` moves each edited file aside first (:func:`backup_name`; listed in
    :attr:`ReleaseResult.backups`). Files release did not write are left alone. When nbgrader
    fails, ``course/`` is left as it was. ``write_course=False`` only updates the gradebook and
    leaves ``course/`` alone (what grading needs).
    """
    if isinstance(assignments, (str, bytes)):
        raise TypeError(f"assignments: expected a list of assignment ids such as ['00_welcome'], got the string {assignments!r}")
    if not db and not write_course:
        raise ValueError("release: db=False and write_course=False would do nothing; allow at least one")
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
    out = ReleaseResult(assignments=todo)
    autograder_dir(root).mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="llmu-release-") as stage:
        # nbgrader writes here; an absolute release_directory replaces <root>/course in its paths.
        config.CourseDirectory.release_directory = stage
        api = _api(config)
        for aid in todo:
            t0 = time.perf_counter()
            result = api.generate_assignment(aid, force=True, create=True)
            out.seconds[aid] = time.perf_counter() - t0
            if not result.get("success"):
                key, log = _nbgrader_failure(result)
                hint = ""
                if "Cannot add or remove cells" in log:
                    hint = ("\nGraded cells were added or removed after submissions were graded. Revert the "
                            f"change, or drop the assignment from the gradebook (`cd autograder && nbgrader db "
                            f"assignment remove {aid} --force`, which deletes its grades), release, and regrade. "
                            "See autograder/README.md.")
                raise CourseError(f"releasing {aid} failed; the previous course/{aid} was kept "
                                  f"(nothing in course/ was changed).{hint}\nnbgrader: {key}", log)
        if not write_course:
            return out
        # A %%module cell run in solutions/<x>/ leaves its .py copy there, the solution in it:
        # nbgrader copied it with the folder's other files, and the learner's own run rewrites it.
        for aid in todo:
            for path in _files(Path(stage) / aid).values():
                if path.suffix == ".py" and written_by_magic(path):
                    path.unlink()

        # Look at every assignment before changing any: a refusal leaves all of course/ as it was.
        plans = [_plan(aid, Path(stage) / aid, course_dir(root) / aid) for aid in todo]
        if any(p.edited for p in plans) and not force:
            raise _refusal(plans)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for plan in plans:
            _install(plan, course_dir(root) / plan.aid, root, stamp, out)
    if prune and assignments is None:
        for p in sorted(course_dir(root).iterdir()):
            if p.is_dir() and not p.name.startswith(".") and p.name not in known:
                _prune(p, root, out)
    return out
