"""The instructor scripts of autograder/, end to end on a temporary course directory.

release -> collect (from a folder of downloads, with a zip in it) -> autograde -> feedback ->
export, on the fixture assignment (tests/course/fixtures/99_fixture: 2 + 3 points), each script
run as an instructor would run it, in its own process. Three students:

* ``ada`` hands in the instructor's answers (``ada_99_fixture.ipynb``) -> 5;
* ``bob_lee`` a reciprocal without the zero check (``bob_lee_99_fixture (1).ipynb``, and an older
  stub ``bob_lee_99_fixture.ipynb`` that collect must not keep) -> 2: the hidden test fails;
* ``cy`` the untouched stub, in a zip with a folder per student -> 0.

The CSV must hold those scores, and no line of a hidden test may appear anywhere in the feedback
HTML, although bob's failing hidden test raised inside it.
"""

from __future__ import annotations

import copy
import csv
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import nbformat
import pytest

from llmu import course

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "autograder"
FIXTURE = Path(__file__).parent / "fixtures" / "99_fixture"
AID = "99_fixture"
NAMES = ("release", "collect", "autograde", "feedback", "export")

sys.path.insert(0, str(SCRIPTS))
import _common  # noqa: E402


def _run(name: str, *args, root: Path, ok: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("LLMU_COURSE_ROOT", None)
    proc = subprocess.run([sys.executable, str(SCRIPTS / name), *map(str, args), "--root", str(root)],
                          capture_output=True, text=True, timeout=600, env=env)
    if ok:
        assert proc.returncode == 0, f"autograder/{name} {args} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.mark.parametrize("name", NAMES)
def test_every_script_is_executable_and_has_help(name):
    path = SCRIPTS / name
    assert os.access(path, os.X_OK), f"{path} is not executable"
    assert path.read_text().startswith("#!/usr/bin/env python3")
    proc = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--root" in proc.stdout and "Example" in proc.stdout, proc.stderr


def test_scripts_are_documented_in_the_readme():
    readme = (SCRIPTS / "README.md").read_text()
    for name in NAMES:
        assert f"autograder/{name}" in readme, f"README.md does not show autograder/{name}"


def test_student_ids_from_file_names():
    import importlib.util
    from importlib.machinery import SourceFileLoader

    loader = SourceFileLoader("collect_script", str(SCRIPTS / "collect"))  # a script without .py
    script = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(script)
    name = script._student_from_name
    stems = ["00_welcome"]
    assert name("ada_00_welcome", stems) == "ada"
    assert name("ada_lovelace_00_welcome (1)", stems) == "ada_lovelace"
    assert name("ada_late", stems) == "ada"
    assert name("00_welcome", stems) is None and name("welcome", stems) is None


def test_leak_check_reads_rendered_html():
    page = '<pre><span class="n">check_close</span><span class="p">(</span>x &gt; 1<span>)</span></pre>'
    assert _common.leaked_lines(page, {"check_close(x > 1)", "never_there()"}) == ["check_close(x > 1)"]


@pytest.fixture(scope="module")
def course_round(tmp_path_factory):
    root = tmp_path_factory.mktemp("course")
    shutil.copytree(FIXTURE, root / "solutions" / AID)
    t0 = time.perf_counter()
    out = {"root": root, "release": _run("release", AID, root=root)}

    stub = nbformat.read(str(root / "course" / AID / f"{AID}.ipynb"), as_version=4)
    solution = nbformat.read(str(root / "solutions" / AID / f"{AID}.ipynb"), as_version=4)
    answers = {course.nbgrader_meta(c)["grade_id"]: course.answer_from_solution(c.source)
               for c in solution.cells if course.is_solution(c)}

    def answered(**override):
        nb = copy.deepcopy(stub)
        for c in nb.cells:
            gid = course.nbgrader_meta(c).get("grade_id")
            if course.is_solution(c):
                c.source = override.get(gid, answers[gid])
        return nb

    downloads = root / "downloads"
    downloads.mkdir()
    nbformat.write(answered(), str(downloads / f"ada_{AID}.ipynb"))
    nbformat.write(stub, str(downloads / f"bob_lee_{AID}.ipynb"))  # an early attempt, replaced below
    time.sleep(0.05)
    nbformat.write(answered(reciprocal="def reciprocal(a):\n    return 1.0 / a"), str(downloads / f"bob_lee_{AID} (1).ipynb"))
    os.utime(downloads / f"bob_lee_{AID}.ipynb", (time.time() - 3600, time.time() - 3600))
    with zipfile.ZipFile(downloads / "more.zip", "w") as zf:
        zf.writestr(f"cy/{AID}.ipynb", nbformat.writes(stub))
        zf.writestr(f"cy/.ipynb_checkpoints/{AID}-checkpoint.ipynb", nbformat.writes(answered()))
    (downloads / "notes.txt").write_text("not a notebook")

    out["collect"] = _run("collect", AID, downloads, root=root)
    out["autograde"] = _run("autograde", AID, "--timeout", 20, root=root)
    out["feedback"] = _run("feedback", AID, root=root)
    out["export"] = _run("export", "--to", root / "grades.csv", root=root)
    out["seconds"] = time.perf_counter() - t0
    print(f"release -> export: {out['seconds']:.0f} s")
    return out


@pytest.mark.slow
@pytest.mark.notebooks
def test_collect_files_each_student_once(course_round):
    sub = course_round["root"] / "autograder" / "submitted"
    assert sorted(p.name for p in sub.iterdir()) == ["ada", "bob_lee", "cy"], course_round["collect"].stdout
    for s in ("ada", "bob_lee", "cy"):
        assert [p.name for p in (sub / s / AID).iterdir()] == [f"{AID}.ipynb"]
    bob = nbformat.read(str(sub / "bob_lee" / AID / f"{AID}.ipynb"), as_version=4)
    assert any(c.source == "def reciprocal(a):\n    return 1.0 / a" for c in bob.cells), "the older attempt was kept"
    assert "handed in a newer" in course_round["collect"].stderr


@pytest.mark.slow
@pytest.mark.notebooks
def test_export_holds_the_scores(course_round):
    with open(course_round["root"] / "grades.csv", newline="") as f:
        rows = {r["student_id"]: r for r in csv.DictReader(f)}
    scores = {s: (float(r["score"]), float(r["max_score"])) for s, r in rows.items() if r["assignment"] == AID}
    assert scores == {"ada": (5.0, 5.0), "bob_lee": (2.0, 5.0), "cy": (0.0, 5.0)}, rows
    table = course_round["autograde"].stdout
    assert next(ln for ln in table.splitlines() if ln.startswith("bob_lee")).split()[1:3] == ["2", "5"]


@pytest.mark.slow
@pytest.mark.notebooks
def test_feedback_never_shows_hidden_tests(course_round):
    root = course_round["root"]
    hidden = _common.hidden_test_lines(root, AID)
    assert hidden and any("secret-line" in h for h in hidden)
    pages = sorted((root / "autograder" / "feedback").glob(f"*/{AID}/*.html"))
    assert [p.parts[-3] for p in pages] == ["ada", "bob_lee", "cy"]
    for page in pages:
        raw = page.read_text(encoding="utf-8")
        assert "secret-line" not in raw and "HIDDEN TESTS" not in raw, page
        assert not _common.leaked_lines(raw, hidden), page
    bob = (root / "autograder" / "feedback" / "bob_lee" / AID / f"{AID}.html").read_text(encoding="utf-8")
    assert "reciprocal(0) raises" in _common.visible_text(bob), "the failed hidden check's message is missing"


@pytest.mark.slow
@pytest.mark.notebooks
def test_feedback_refuses_a_page_that_leaks(course_round, tmp_path):
    """The last guard: a hidden line that reaches a page (here: a hidden test made visible in the
    instructor notebook after grading) deletes the page and fails."""
    root = course_round["root"]
    src = root / "solutions" / AID / f"{AID}.ipynb"
    saved = src.read_bytes()
    nb = nbformat.read(str(src), as_version=4)
    # `import torch`, which the (visible) setup cell holds, now counts as a hidden-test line.
    for c in nb.cells:
        if course.nbgrader_meta(c).get("grade_id") == "setup":
            c.source += '\n### BEGIN HIDDEN TESTS\nimport torch\n### END HIDDEN TESTS'
    nbformat.write(nb, str(src))
    try:
        proc = _run("feedback", AID, "--student", "ada", root=root, ok=False)
    finally:
        src.write_bytes(saved)
    page = root / "autograder" / "feedback" / "ada" / AID / f"{AID}.html"
    deleted = not page.exists()
    _run("feedback", AID, "--student", "ada", root=root)  # put ada's page back for the other tests
    assert proc.returncode == 1 and "hidden-test line" in proc.stderr and "import torch" in proc.stderr, proc.stderr
    assert deleted, "the leaking page was kept"
