"""`llmu release` never destroys a learner's work in course/.

``make lab`` opens ``course/`` and learners fill the notebooks there, while ``llmu release`` (and
``make release``, and grading, which releases first) regenerates ``course/`` with nbgrader, whose
forced ``generate_assignment`` deletes the whole ``course/<assignment>/`` folder. Each test runs
``llmu release`` as a learner or instructor would, in its own process, on a temporary copy of the
checkout (solutions/00_welcome, course/00_welcome with its release record, and
autograder/nbgrader_config.py), found through ``LLMU_COURSE_ROOT``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from llmu import course

REPO = Path(__file__).resolve().parents[2]
AID = "00_welcome"
NOTEBOOK = f"{course.RELEASE_DIR}/{AID}/{AID}.ipynb"
FIXTURE = Path(__file__).parent / "fixtures" / "99_fixture"
_LLMU = Path(sys.executable).with_name("llmu")
LLMU = [str(_LLMU)] if _LLMU.is_file() else [sys.executable, "-c", "import sys; from llmu.cli import main; sys.exit(main())"]


@pytest.fixture(scope="module")
def checkout_in_sync(tmp_path_factory) -> None:
    """These tests start from the checkout's course/00_welcome, which must be what release makes
    from its solutions/00_welcome (test_notebooks.py checks the whole course)."""
    fresh = tmp_path_factory.mktemp("fresh")
    shutil.copytree(REPO / course.SOURCE_DIR / AID, fresh / course.SOURCE_DIR / AID)
    course.release([AID], root=fresh, db=False)
    if (fresh / NOTEBOOK).read_bytes() != (REPO / NOTEBOOK).read_bytes():
        pytest.fail(f"{NOTEBOOK} is out of date in this checkout: run `llmu release {AID}` first")


@pytest.fixture
def root(tmp_path, checkout_in_sync) -> Path:
    """A copy of the checkout with one small assignment, as a fresh clone has it."""
    shutil.copytree(REPO / course.SOURCE_DIR / AID, tmp_path / course.SOURCE_DIR / AID)
    shutil.copytree(REPO / course.RELEASE_DIR / AID, tmp_path / course.RELEASE_DIR / AID)
    (tmp_path / course.AUTOGRADER_DIR).mkdir()
    shutil.copy(REPO / course.AUTOGRADER_DIR / "nbgrader_config.py", tmp_path / course.AUTOGRADER_DIR)
    return tmp_path


def llmu(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "LLMU_COURSE_ROOT": str(root), "OMP_NUM_THREADS": "1"}
    return subprocess.run([*LLMU, *args], cwd=root, env=env, capture_output=True, text=True, timeout=600)


def fill(path: Path, answer: str = "# my answer\nresult = 42") -> bytes:
    """Answer the first exercise of the notebook at ``path``, as a learner in JupyterLab; its new bytes."""
    nb = nbformat.read(str(path), as_version=4)
    next(c for c in nb.cells if course.is_solution(c)).source = answer
    nbformat.write(nb, str(path))
    return path.read_bytes()


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_committed_course_has_a_record_that_matches_it():
    """A fresh clone must release without a refusal: every course/<x>/ records what is committed."""
    for aid in course.list_assignments(REPO):
        folder = course.course_dir(REPO) / aid
        record = course.read_record(folder)
        assert record is not None, f"course/{aid}/{course.RECORD} is missing: run `llmu release {aid}`"
        for src in (course.solutions_dir(REPO) / aid).glob("*.ipynb"):
            assert src.name in record, f"course/{aid}/{course.RECORD} does not list {src.name}: run `llmu release {aid}`"
        for rel, digest in record.items():
            assert (folder / rel).is_file() and sha256(folder / rel) == digest, (
                f"course/{aid}/{rel} differs from its release record: it was edited, or `llmu release {aid}` was not run")


@pytest.mark.parametrize("record", ["with a record", "from an older course/ without a record"])
def test_a_filled_notebook_makes_release_refuse_and_stay_byte_identical(root, record):
    if record.startswith("from"):
        (root / course.RELEASE_DIR / AID / course.RECORD).unlink()
    mine = fill(root / NOTEBOOK)
    before = snapshot(root / course.RELEASE_DIR)

    p = llmu(root, "release", AID)
    assert p.returncode == 1, p.stdout + p.stderr
    assert NOTEBOOK in p.stderr and "--force" in p.stderr and "make release FORCE=1" in p.stderr, p.stderr
    assert (root / NOTEBOOK).read_bytes() == mine
    assert snapshot(root / course.RELEASE_DIR) == before, "a refused release must change nothing in course/"


def test_force_keeps_the_edited_notebook_beside_the_fresh_one_and_says_where(root):
    fresh = (root / NOTEBOOK).read_bytes()
    mine = fill(root / NOTEBOOK)

    p = llmu(root, "release", "--force", AID)
    assert p.returncode == 0, p.stdout + p.stderr
    backups = sorted((root / course.RELEASE_DIR / AID).glob(f"{AID}.learner-*.ipynb"))
    assert len(backups) == 1, sorted(os.listdir(root / course.RELEASE_DIR / AID))
    backup = backups[0].relative_to(root).as_posix()
    assert backup in p.stdout and NOTEBOOK in p.stdout, f"--force must say where the edits went:\n{p.stdout}"
    assert backups[0].read_bytes() == mine
    assert (root / NOTEBOOK).read_bytes() == fresh
    assert course.read_record(root / course.RELEASE_DIR / AID) == {f"{AID}.ipynb": sha256(root / NOTEBOOK)}

    # The backup is the learner's file now: a later release leaves it, and the fresh copy, alone.
    p = llmu(root, "release", AID)
    assert p.returncode == 0, p.stdout + p.stderr
    assert backups[0].read_bytes() == mine and (root / NOTEBOOK).read_bytes() == fresh


def test_make_release_force_passes_the_flag():
    p = subprocess.run(["make", "-n", "--no-print-directory", "-C", str(REPO), "release", "FORCE=1"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines()[-1].endswith("llmu release --force"), p.stdout
    p = subprocess.run(["make", "-n", "--no-print-directory", "-C", str(REPO), "release"], capture_output=True, text=True, timeout=60)
    assert "--force" not in p.stdout.strip().splitlines()[-1], p.stdout


def test_a_learners_own_files_survive_a_release(root):
    folder = root / course.RELEASE_DIR / AID
    (folder / "notes.md").write_text("what I learned\n")
    (folder / ".ipynb_checkpoints").mkdir()
    (folder / ".ipynb_checkpoints" / f"{AID}-checkpoint.ipynb").write_text("{}")
    (root / course.RELEASE_DIR / "my_project").mkdir()
    (root / course.RELEASE_DIR / "my_project" / "scratch.py").write_text("print('mine')\n")
    before = snapshot(root / course.RELEASE_DIR)

    p = llmu(root, "release")  # every assignment, which also prunes course/ folders without a source
    assert p.returncode == 0, p.stdout + p.stderr
    after = snapshot(root / course.RELEASE_DIR)
    for rel in (f"{AID}/notes.md", f"{AID}/.ipynb_checkpoints/{AID}-checkpoint.ipynb", "my_project/scratch.py"):
        assert after.get(rel) == before[rel], f"course/{rel} was lost"


def test_a_module_cells_file_in_solutions_is_not_released(root):
    """An instructor who ran a %%module cell in solutions/ has the solution in NAME.py there;
    nbgrader would copy it into course/ with the folder's other files."""
    from llmu.cell_module import write_module

    write_module("my_answer", "SECRET = 42\n", root / course.SOURCE_DIR / AID)
    (root / course.SOURCE_DIR / AID / "data.py").write_text("VALUES = [1, 2]\n")   # a file of the assignment
    sys.modules.pop("my_answer", None)
    p = llmu(root, "release", AID)
    assert p.returncode == 0, p.stdout + p.stderr
    assert not (root / course.RELEASE_DIR / AID / "my_answer.py").exists()
    assert (root / course.RELEASE_DIR / AID / "data.py").read_text() == "VALUES = [1, 2]\n"


def test_an_unchanged_course_releases_quietly_and_keeps_its_record(root):
    folder = root / course.RELEASE_DIR / AID
    before = snapshot(folder)
    mtime = (root / NOTEBOOK).stat().st_mtime_ns

    for _ in range(2):
        p = llmu(root, "release", AID)
        assert p.returncode == 0 and "edited" not in p.stdout + p.stderr, p.stdout + p.stderr
    assert snapshot(folder) == before, "a release that changes nothing must leave course/ (and git) as it was"
    assert (root / NOTEBOOK).stat().st_mtime_ns == mtime, "an unchanged notebook must not be rewritten"


def test_a_stale_record_is_no_reason_to_refuse(root):
    """A file equal to what release writes now is not an edit, whatever the record says."""
    record = root / course.RELEASE_DIR / AID / course.RECORD
    record.write_text(json.dumps({"files": {f"{AID}.ipynb": "0" * 64}}))
    before = (root / NOTEBOOK).read_bytes()

    p = llmu(root, "release", AID)
    assert p.returncode == 0, p.stdout + p.stderr
    assert (root / NOTEBOOK).read_bytes() == before
    assert course.read_record(record.parent) == {f"{AID}.ipynb": sha256(root / NOTEBOOK)}
    assert record.read_bytes() == (REPO / course.RELEASE_DIR / AID / course.RECORD).read_bytes()


def test_a_failed_nbgrader_release_leaves_course_as_it_was(root):
    folder = root / course.RELEASE_DIR / AID
    fill(root / NOTEBOOK)
    (folder / "notes.md").write_text("mine\n")
    # A graded cell without points: nbgrader's generate_assignment fails on it.
    src = root / course.SOURCE_DIR / AID / f"{AID}.ipynb"
    nb = nbformat.read(str(src), as_version=4)
    broken = nbformat.v4.new_code_cell("assert True")
    broken.metadata["nbgrader"] = {"grade": True, "grade_id": "broken", "locked": True, "schema_version": 3, "solution": False}
    nb.cells.append(broken)
    nbformat.write(nb, str(src))
    before = snapshot(root / course.RELEASE_DIR)

    for flags in ([], ["--force"]):
        p = llmu(root, "release", *flags, AID)
        assert p.returncode == 1, p.stdout + p.stderr
        assert f"previous course/{AID} was kept" in p.stderr and "does not have points" in p.stderr, p.stderr
        assert snapshot(root / course.RELEASE_DIR) == before


def test_pruning_a_removed_assignment_keeps_what_is_not_the_releases(tmp_path):
    """solutions/88_gone/ was deleted: release removes what it wrote in course/88_gone/, not the rest."""
    shutil.copytree(FIXTURE, tmp_path / course.SOURCE_DIR / "88_gone")
    course.release(root=tmp_path, db=False)
    shutil.rmtree(tmp_path / course.SOURCE_DIR / "88_gone")
    shutil.copytree(FIXTURE, tmp_path / course.SOURCE_DIR / "99_fixture")
    gone = tmp_path / course.RELEASE_DIR / "88_gone"
    (gone / "notes.md").write_text("mine\n")

    res = course.release(root=tmp_path, db=False)
    assert res.removed == [] and res.kept == [f"{course.RELEASE_DIR}/88_gone/notes.md"]
    assert sorted(os.listdir(gone)) == ["notes.md"]

    (gone / "notes.md").unlink()
    (gone / "88_gone.ipynb").write_text("{}")  # no record any more: release did not write this one
    assert course.release(root=tmp_path, db=False).removed == []
    assert (gone / "88_gone.ipynb").read_text() == "{}"


def test_release_without_course_only_updates_the_gradebook(root):
    """What grading does: the gradebook gets today's tests, course/ (where people work) is not touched."""
    mine = fill(root / NOTEBOOK)
    before = snapshot(root / course.RELEASE_DIR)
    course.release([AID], root=root, write_course=False)
    assert snapshot(root / course.RELEASE_DIR) == before and (root / NOTEBOOK).read_bytes() == mine
    from nbgrader.api import Gradebook

    with Gradebook(course.gradebook_url(root)) as gb:
        assert [nb.name for nb in gb.find_assignment(AID).notebooks] == [AID]


def test_release_checks_its_arguments(root):
    with pytest.raises(TypeError, match="assignments: expected a list"):
        course.release(AID, root=root)
    with pytest.raises(ValueError, match="would do nothing"):
        course.release([AID], root=root, db=False, write_course=False)


@pytest.mark.slow
@pytest.mark.notebooks
def test_grading_leaves_course_alone(tmp_path):
    """`llmu grade ASSIGNMENT` records the assignment again before grading; it must not reset the
    instructor's or a learner's open notebooks in course/."""
    shutil.copytree(FIXTURE, tmp_path / course.SOURCE_DIR / "99_fixture")
    assert llmu(tmp_path, "release").returncode == 0
    stub = tmp_path / course.RELEASE_DIR / "99_fixture" / "99_fixture.ipynb"
    mine = fill(stub, "def double(x):\n    return x * 2")
    dest = tmp_path / course.AUTOGRADER_DIR / "submitted" / "ada" / "99_fixture"
    dest.mkdir(parents=True)
    shutil.copy(stub, dest)

    p = llmu(tmp_path, "grade", "99_fixture", "--timeout", "20")
    assert p.returncode == 0, p.stdout + p.stderr
    assert next(ln for ln in p.stdout.splitlines() if ln.startswith("ada")).split()[1:3] == ["2", "5"], p.stdout
    assert stub.read_bytes() == mine
