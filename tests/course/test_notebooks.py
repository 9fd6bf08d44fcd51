"""Static checks on the course notebooks: nothing here starts a kernel.

* solutions/ is not empty, and every solutions notebook has a released twin in course/ (and back);
* course/ is exactly what nbgrader generates from solutions/ today;
* no hidden test (markers or lines) and no solution marker reaches course/;
* notebooks are committed without outputs or execution counts;
* nbgrader metadata is well formed (schema 3, unique grade ids, markers where they belong).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from llmu import course

ROOT = course.repo_root()
SOURCES = course.source_notebooks(ROOT)
FIXTURES = sorted((Path(__file__).parent / "fixtures").glob("*/*.ipynb"))
RELEASED = sorted(course.course_dir(ROOT).glob("*/*.ipynb"))
GRADE_ID = re.compile(r"^[a-zA-Z0-9_-]*$")
REQUIRED_KEYS = {"schema_version", "grade", "solution", "locked"}
ALLOWED_KEYS = REQUIRED_KEYS | {"grade_id", "points", "task"}


def _ids(paths):
    return [f"{p.parent.parent.name}/{p.parent.name}/{p.name}" for p in paths]


def _load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _src(cell) -> str:
    s = cell.get("source", "")
    return "".join(s) if isinstance(s, list) else s


def _hidden_regions(source: str) -> list[str]:
    return re.findall(rf"{re.escape(course.BEGIN_HIDDEN)}[^\n]*\n(.*?){re.escape(course.END_HIDDEN)}", source, re.S)


def test_solutions_exist():
    assert SOURCES, (f"{course.solutions_dir(ROOT)} holds no assignment notebook: the course has nothing to "
                     "release (expected solutions/NN_topic/NN_topic.ipynb)")


def test_assignment_folders_are_named_like_notebooks():
    for p in SOURCES:
        assert p.stem == p.parent.name, f"{p}: the notebook should be named after its folder ({p.parent.name}.ipynb)"
        assert re.fullmatch(r"\d\d_[a-z0-9_]+", p.parent.name), f"{p.parent.name}: expected NN_topic"


@pytest.mark.parametrize("src", SOURCES, ids=_ids(SOURCES))
def test_every_solution_has_a_released_twin(src):
    twin = course.released_twin(src, ROOT)
    assert twin.is_file(), f"{src.relative_to(ROOT)} has no release at {twin.relative_to(ROOT)}: run `llmu release`"


@pytest.mark.parametrize("rel", RELEASED, ids=_ids(RELEASED))
def test_every_release_has_a_source(rel):
    src = course.solutions_dir(ROOT) / rel.parent.name / rel.name
    assert src.is_file(), f"{rel.relative_to(ROOT)} has no source {src.relative_to(ROOT)}: `llmu release` removes it"


@pytest.fixture(scope="module")
def fresh_release(tmp_path_factory) -> Path:
    """course/ as nbgrader generates it now, from a copy of solutions/ (no gradebook involved)."""
    root = tmp_path_factory.mktemp("fresh")
    shutil.copytree(course.solutions_dir(ROOT), root / course.SOURCE_DIR)
    course.release(root=root, db=False)
    return course.course_dir(root)


def _files(d: Path) -> set[str]:
    ignore = {".ipynb_checkpoints", "__pycache__"}
    return {str(p.relative_to(d)) for p in d.rglob("*") if p.is_file() and not ignore & set(p.parts)}


def test_course_equals_a_fresh_generation(fresh_release):
    committed = course.course_dir(ROOT)
    have, want = _files(committed), _files(fresh_release)
    assert have == want, (f"course/ is out of date: missing {sorted(want - have)}, unexpected {sorted(have - want)}; "
                          "run `llmu release`")
    for rel in sorted(want):
        a, b = committed / rel, fresh_release / rel
        if rel.endswith(".ipynb"):
            # generate_assignment is deterministic (same source -> byte-identical release; checked
            # by generating twice), so the notebooks are compared whole, metadata included.
            na, nb = _load(a), _load(b)
            if na != nb:
                diff = [i for i, (x, y) in enumerate(zip(na["cells"], nb["cells"])) if x != y]
                pytest.fail(f"course/{rel} differs from a fresh generation (cells {diff[:5]}, "
                            f"{len(na['cells'])} vs {len(nb['cells'])} cells): run `llmu release`")
        else:
            assert a.read_bytes() == b.read_bytes(), f"course/{rel} differs from solutions/: run `llmu release`"


def test_release_is_deterministic(fresh_release, tmp_path):
    shutil.copytree(course.solutions_dir(ROOT), tmp_path / course.SOURCE_DIR)
    course.release(root=tmp_path, db=False)
    for rel in _files(fresh_release):
        assert (fresh_release / rel).read_bytes() == (tmp_path / course.RELEASE_DIR / rel).read_bytes(), rel


@pytest.mark.parametrize("src", SOURCES, ids=_ids(SOURCES))
def test_no_hidden_tests_in_course(src):
    nb = _load(src)
    hidden_lines, other_lines = set(), set()
    for cell in nb["cells"]:
        text = _src(cell)
        regions = _hidden_regions(text)
        for region in regions:
            hidden_lines |= {ln.strip() for ln in region.splitlines() if ln.strip()}
        outside = course.without_hidden_tests(text)
        other_lines |= {ln.strip() for ln in outside.splitlines() if ln.strip()}
    # Lines that only exist inside hidden regions must not reach the student copy.
    secret = hidden_lines - other_lines
    rel_dir = course.course_dir(ROOT) / src.parent.name
    assert rel_dir.is_dir(), f"no release for {src.parent.name}"
    for f in sorted(p for p in rel_dir.rglob("*") if p.is_file()):
        text = f.read_text(encoding="utf-8", errors="replace")
        for marker in (course.BEGIN_HIDDEN, course.END_HIDDEN, course.BEGIN_SOLUTION, course.END_SOLUTION):
            assert marker not in text, f"{f.relative_to(ROOT)} contains {marker!r}"
        body = "\n".join(_src(c) for c in json.loads(text)["cells"]) if f.suffix == ".ipynb" else text
        present = {ln.strip() for ln in body.splitlines()}
        leaked = sorted(secret & present)
        assert not leaked, f"{f.relative_to(ROOT)} contains hidden test lines: {leaked[:3]}"


ALL_COMMITTED = SOURCES + RELEASED + FIXTURES


@pytest.mark.parametrize("path", ALL_COMMITTED, ids=_ids(ALL_COMMITTED))
def test_committed_without_outputs(path):
    nb = _load(path)
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        assert cell.get("outputs") == [], f"{path.relative_to(ROOT)} cell {i} has outputs: clear them before committing"
        assert cell.get("execution_count") is None, f"{path.relative_to(ROOT)} cell {i} has an execution count"
    assert "widgets" not in nb.get("metadata", {}), f"{path.relative_to(ROOT)} stores widget state: clear it"


METADATA_SUBJECTS = SOURCES + FIXTURES


@pytest.mark.parametrize("path", METADATA_SUBJECTS, ids=_ids(METADATA_SUBJECTS))
def test_nbgrader_metadata(path):
    nb = _load(path)
    name = str(path.relative_to(ROOT))
    assert nb["metadata"].get("kernelspec", {}).get("name") == "python3", f"{name}: kernelspec must be python3"
    ids, test_cells, solution_cells = [], [], []
    for i, cell in enumerate(nb["cells"]):
        where = f"{name} cell {i}"
        text = _src(cell)
        meta = cell.get("metadata", {}).get("nbgrader")
        if meta is None:
            assert cell["cell_type"] == "code", f"{where}: a markdown cell must be marked read-only (locked)"
            for marker in (course.BEGIN_SOLUTION, course.BEGIN_HIDDEN):
                assert marker not in text, f"{where}: {marker} in a cell nbgrader does not know about"
            continue
        assert REQUIRED_KEYS <= set(meta), f"{where}: nbgrader metadata lacks {REQUIRED_KEYS - set(meta)}"
        assert set(meta) <= ALLOWED_KEYS, (f"{where}: unexpected nbgrader keys {set(meta) - ALLOWED_KEYS} "
                                           "(checksum and cell_type are nbgrader's to write)")
        assert meta["schema_version"] == 3, f"{where}: schema_version must be 3"
        if meta["grade"] or meta["solution"] or meta["locked"]:
            gid = meta.get("grade_id")
            assert gid and GRADE_ID.match(gid), f"{where}: grade_id {gid!r} must match {GRADE_ID.pattern}"
            ids.append(gid)
        if meta["grade"]:
            assert isinstance(meta.get("points"), (int, float)) and meta["points"] > 0, f"{where}: graded cell needs points"
        if cell["cell_type"] == "markdown" and not meta["solution"]:
            assert meta["locked"], f"{where}: markdown cells are read-only (locked)"
        if meta["solution"] and cell["cell_type"] == "code":
            solution_cells.append(i)
            assert text.count(course.BEGIN_SOLUTION) == text.count(course.END_SOLUTION) >= 1, \
                f"{where}: a solution cell needs ### BEGIN SOLUTION / ### END SOLUTION"
            assert course.solution_region(text), f"{where}: END SOLUTION must follow BEGIN SOLUTION"
        elif course.is_written(cell):  # a written answer: the question, then the model answer and rubric
            assert text.count(course.BEGIN_SOLUTION) == text.count(course.END_SOLUTION) == 1 \
                and course.solution_region(text), f"{where}: a written answer needs one solution region"
        else:
            assert course.BEGIN_SOLUTION not in text, f"{where}: solution markers outside a solution cell"
        if course.BEGIN_HIDDEN in text or course.END_HIDDEN in text:
            assert meta["grade"] and not meta["solution"], f"{where}: hidden tests belong in an autograder test cell"
            assert text.count(course.BEGIN_HIDDEN) == text.count(course.END_HIDDEN) == len(_hidden_regions(text)), \
                f"{where}: unpaired hidden-test markers"
        if course.is_test(cell):
            test_cells.append(i)
    dupes = sorted({g for g in ids if ids.count(g) > 1})
    assert not dupes, f"{name}: duplicate grade_ids {dupes}"
    assert test_cells, f"{name}: no autograded test cell"
    assert solution_cells, f"{name}: no solution cell"
    assert min(test_cells) > min(solution_cells), f"{name}: the first test cell comes before any solution"
    first_code = next(_src(c) for c in nb["cells"] if c["cell_type"] == "code")
    assert "import llmu" in first_code and "environment()" in first_code, \
        f"{name}: the first code cell must be the setup cell (import llmu; print(environment()))"


OWN_WORK = re.compile(rf"^{re.escape(course.BEGIN_HIDDEN)}\n(?:.*\n)*?check_own_work\(\w+, .+\n(?:.*\n)*?{re.escape(course.END_HIDDEN)}\n")


@pytest.mark.parametrize("src", SOURCES, ids=_ids(SOURCES))
def test_every_test_cell_opens_with_the_own_work_check(src):
    """Every autograded test cell starts with a hidden ``check_own_work`` naming llmu's answers to its
    exercise, so that handing back the library's function scores nothing (each module's notebook
    tests hand it back and see every cell refuse it)."""
    nb = _load(src)
    missing = [course.nbgrader_meta(c).get("grade_id") for c in nb["cells"]
               if course.is_test(c) and not OWN_WORK.match(_src(c))]
    assert not missing, (f"{src.parent.name}: test cells {missing} do not open with a hidden own-work check "
                         "(### BEGIN HIDDEN TESTS / check_own_work(submission, answer, ..., what=...) / ### END HIDDEN TESTS)")


@pytest.mark.parametrize("src", SOURCES, ids=_ids(SOURCES))
def test_every_test_cell_ends_with_passed(src):
    """Each autograded test cell ends with its ``passed(...)`` line, in the graded notebook and in
    the learner's copy (hidden tests removed): a learner sees a ✓ for every cell that passed."""
    for cell in _load(src)["cells"]:
        if not course.is_test(cell):
            continue
        gid = course.nbgrader_meta(cell).get("grade_id")
        for version, which in ((_src(cell), "graded"), (course.without_hidden_tests(_src(cell)), "learner's copy")):
            last = [ln for ln in version.splitlines() if ln.strip()][-1]
            assert last.startswith("passed("), f"{src.parent.name} {gid} ({which}) ends with {last!r}"


@pytest.mark.parametrize("src", SOURCES, ids=_ids(SOURCES))
def test_no_test_cell_reads_a_demo_cells_names(src):
    """A test cell builds what it needs, or reads what the setup cell, a solution, an earlier test
    or a locked helper cell (``course.HELPER_CELL``) defined, never a name only a demo cell sets."""
    found = course.demo_names_read_by_tests(src)
    assert not found, f"{src.parent.name}: test cells reading names only a demo cell defines: {found}"


def test_solution_code_lines_counts_every_region_without_comments_or_blanks():
    source = ("def f(x):\n    ### BEGIN SOLUTION\n    # a comment\n    y = x + 1\n\n    return y\n    ### END SOLUTION\n"
              "\n\ndef g():\n    ### BEGIN SOLUTION\n    return 2\n    ### END SOLUTION\n")
    assert course.solution_code_lines(source) == 3
    assert course.solution_code_lines("x = 1\n") == 0
