"""The instructor scripts of autograder/, end to end on a temporary checkout.

release -> collect (from a folder of downloads, with a zip in it) -> autograde -> feedback ->
export, on the fixture assignment (tests/course/fixtures/99_fixture: 2 + 3 points), each script
run as an instructor runs it from a fresh clone: the temporary checkout has the repository's
layout (autograder/ with the scripts, solutions/, course/ made by release, the .venv that
`make setup` builds, the repository's .gitignore), and every script runs there as
`autograder/NAME ...`, without --root (its default root is the checkout it is in), with a PATH
whose `python3` has no nbgrader (the scripts must find the checkout's .venv themselves).
Three students:

* ``ada`` hands in the instructor's answers (``ada_99_fixture.ipynb``) -> 5;
* ``bob_lee`` a reciprocal without the zero check (``bob_lee_99_fixture (1).ipynb``, and an older
  stub ``bob_lee_99_fixture.ipynb`` that collect must not keep) -> 2: the hidden test fails;
* ``cy`` the untouched stub, in a zip with a folder per student -> 0.

Every notebook also ends with a cell of the student's own that shows a plotly figure (as a
benchmark cell does). A second assignment, ``98_unsubmitted``, is released with the first but
nobody hands it in.

The CSV must hold those scores, and no row of the assignment nobody handed in; no line of a
hidden test may appear anywhere in the feedback HTML, although bob's failing hidden test raised
inside it, and each page says where the figure is instead of dropping it with a warning. The
autograde summary gives the first line of each failed test's message. Nothing the round writes
may be left for git to pick up, and no output folder may collide with a script
(autograder/feedback is one).
"""

from __future__ import annotations

import copy
import csv
import os
import re
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
#: Released with AID, handed in by nobody.
UNSUBMITTED = "98_unsubmitted"
#: A cell a student adds: a plotly figure, which a kernel without a browser shows as plotly's JSON only.
FIGURE_CELL = ('import plotly.graph_objects as go\n'
               'go.Figure(go.Bar(x=[1, 2], y=[3, 4]), layout={"title": {"text": "my bars<br><sup>per call</sup>"}}).show()')
FIGURE_NOTE = 'Interactive figure "my bars - per call": not drawn on this page; open the notebook in JupyterLab to see it.'
NAMES = ("release", "collect", "autograde", "feedback", "export", "written")
#: What a clone's autograder/ holds (git-tracked), copied into the temporary checkout.
TRACKED = (*NAMES, "_common.py", "nbgrader_config.py", "README.md")
IN_VENV = sys.prefix != sys.base_prefix

sys.path.insert(0, str(SCRIPTS))
import _common  # noqa: E402


def _python_without_nbgrader() -> str | None:
    """A Python 3 interpreter of this machine that cannot import nbgrader (the system's, or the
    one this virtual environment was made from), or None."""
    seen = set()
    for cand in ("/usr/bin/python3", str(Path(sys.base_prefix) / "bin" / "python3"), shutil.which("python3")):
        if not cand or cand in seen or not Path(cand).is_file():
            continue
        seen.add(cand)
        probe = subprocess.run([cand, "-c", "import sys, nbgrader"], capture_output=True, timeout=60)
        if probe.returncode != 0 and b"No module named 'nbgrader'" in probe.stderr:
            return cand
    return None


FOREIGN_PYTHON = _python_without_nbgrader()


def make_checkout(where: Path, *, venv: bool = True) -> Path:
    """A checkout with the repository's layout: autograder/ (its tracked files), the repository's
    .gitignore, solutions/99_fixture/ and, with ``venv``, a .venv that is this test's virtual
    environment (what `make setup` builds)."""
    checkout = where / "llmu"
    (checkout / "autograder").mkdir(parents=True)
    for name in TRACKED:
        shutil.copy2(SCRIPTS / name, checkout / "autograder" / name)  # copy2 keeps the executable bit
    shutil.copy(REPO / ".gitignore", checkout / ".gitignore")
    shutil.copytree(FIXTURE, checkout / "solutions" / AID)
    if venv and IN_VENV:
        (checkout / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)
    return checkout


def shell_env(where: Path) -> dict:
    """The environment of an instructor's shell without an activated virtual environment: the
    first ``python3`` on PATH has no nbgrader (when this machine has such a Python; else it is
    this test's interpreter)."""
    bin_dir = where / "bin"
    bin_dir.mkdir(exist_ok=True)
    python3 = bin_dir / "python3"
    if not python3.exists():
        python3.symlink_to(FOREIGN_PYTHON if FOREIGN_PYTHON and IN_VENV else sys.executable)
    env = {k: v for k, v in os.environ.items() if k not in ("LLMU_COURSE_ROOT", "VIRTUAL_ENV", _common._SWITCHED)}
    env["PATH"] = os.pathsep.join([str(bin_dir), "/usr/bin", "/bin"])
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run(checkout: Path, name: str, *args, ok: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    """``autograder/NAME ARGS`` typed in the checkout, as the README shows it: no --root."""
    proc = subprocess.run([str(checkout / "autograder" / name), *map(str, args)], cwd=checkout,
                          capture_output=True, text=True, timeout=600, env=env or shell_env(checkout.parent))
    if ok:
        assert proc.returncode == 0, f"autograder/{name} {args} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


def _git_untracked(checkout: Path) -> set[str]:
    proc = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=checkout,
                          capture_output=True, text=True, timeout=60, check=True)
    return {line[3:] for line in proc.stdout.splitlines()}


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
    root = make_checkout(tmp_path_factory.mktemp("clone"))
    other = root / "solutions" / UNSUBMITTED
    other.mkdir()
    shutil.copy(root / "solutions" / AID / f"{AID}.ipynb", other / f"{UNSUBMITTED}.ipynb")
    git = shutil.which("git") is not None
    if git:
        subprocess.run(["git", "init", "-q"], cwd=root, check=True, timeout=60)
    before = _git_untracked(root) if git else None
    t0 = time.perf_counter()
    out = {"root": root, "release": _run(root, "release")}  # every assignment, as at the start of a term

    stub = nbformat.read(str(root / "course" / AID / f"{AID}.ipynb"), as_version=4)
    stub.cells.append(nbformat.v4.new_code_cell(FIGURE_CELL))
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

    # --root, from another folder, with the repository's own scripts: only a dry run.
    out["dry_run"] = subprocess.run([sys.executable, str(SCRIPTS / "collect"), AID, str(downloads), "--dry-run",
                                     "--root", str(root)], capture_output=True, text=True, timeout=600,
                                    cwd=downloads, env=shell_env(root.parent))
    out["collect"] = _run(root, "collect", AID, downloads)
    # A terminal 200 columns wide (pytest-xdist's workers have COLUMNS=80), so that the summary's
    # messages are not trimmed.
    out["autograde"] = _run(root, "autograde", AID, "--timeout", 20, env={**shell_env(root.parent), "COLUMNS": "200"})
    out["feedback"] = _run(root, "feedback", AID)
    out["export"] = _run(root, "export", "--to", "grades.csv")
    out["seconds"] = time.perf_counter() - t0
    shutil.rmtree(downloads)  # the test's own input, not something the scripts wrote
    out["new_for_git"] = sorted(_git_untracked(root) - before) if git else None
    print(f"release -> export: {out['seconds']:.0f} s")
    return out


@pytest.mark.slow
@pytest.mark.notebooks
def test_collect_files_each_student_once(course_round):
    assert course_round["dry_run"].returncode == 0, course_round["dry_run"].stderr
    assert "3 student(s) would be filed" in course_round["dry_run"].stdout
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
    root = course_round["root"]
    assert not (root / "grades.csv").exists(), "`--to grades.csv` wrote into the checkout's top folder"
    assert f"to {root / 'autograder' / 'grades.csv'}" in course_round["export"].stdout
    with open(root / "autograder" / "grades.csv", newline="") as f:
        rows = {r["student_id"]: r for r in csv.DictReader(f)}
    scores = {s: (float(r["score"]), float(r["max_score"])) for s, r in rows.items() if r["assignment"] == AID}
    assert scores == {"ada": (5.0, 5.0), "bob_lee": (2.0, 5.0), "cy": (0.0, 5.0)}, rows
    table = course_round["autograde"].stdout
    assert next(ln for ln in table.splitlines() if ln.startswith("bob_lee")).split()[1:3] == ["2", "5"]


@pytest.mark.slow
@pytest.mark.notebooks
def test_export_leaves_out_what_nobody_handed_in(course_round):
    root = course_round["root"]
    with open(root / "autograder" / "grades.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["assignment"], r["student_id"], r["submitted"]) for r in rows] == [
        (AID, "ada", "yes"), (AID, "bob_lee", "yes"), (AID, "cy", "yes")], rows
    assert f"left out 1 assignment(s) nobody has handed in ({UNSUBMITTED})" in course_round["export"].stdout
    _run(root, "export", "--to", "every.csv", "--all-assignments")
    with open(root / "autograder" / "every.csv", newline="") as f:
        every = list(csv.DictReader(f))
    assert sorted((r["student_id"], r["score"], r["submitted"]) for r in every if r["assignment"] == UNSUBMITTED) == [
        ("ada", "0.0", "no"), ("bob_lee", "0.0", "no"), ("cy", "0.0", "no")], every
    assert [r for r in every if r["assignment"] == AID] == rows


@pytest.mark.slow
@pytest.mark.notebooks
def test_feedback_never_shows_hidden_tests(course_round):
    root = course_round["root"]
    hidden = _common.hidden_test_lines(root, AID)
    assert hidden and any("secret-line" in h for h in hidden)
    pages = sorted((root / "autograder" / "feedback_html").glob(f"*/{AID}/*.html"))
    assert [p.parts[-3] for p in pages] == ["ada", "bob_lee", "cy"], course_round["feedback"].stderr
    for page in pages:
        raw = page.read_text(encoding="utf-8")
        assert "secret-line" not in raw and "HIDDEN TESTS" not in raw, page
        assert not _common.leaked_lines(raw, hidden), page
    bob = (root / "autograder" / "feedback_html" / "bob_lee" / AID / f"{AID}.html").read_text(encoding="utf-8")
    assert "reciprocal(0) raises" in _common.visible_text(bob), "the failed hidden check's message is missing"


@pytest.mark.slow
@pytest.mark.notebooks
def test_feedback_says_where_a_figure_is(course_round):
    """A plotly figure reaches the autograded notebook as plotly's JSON alone, which nbconvert
    cannot put on a page: the page says where the figure is, and nothing warns."""
    root = course_round["root"]
    graded = nbformat.read(str(root / "autograder" / "autograded" / "ada" / AID / f"{AID}.ipynb"), as_version=4)
    figure = [o for o in graded.cells[-1].outputs if o.get("output_type") == "display_data"]
    assert [sorted(o.data) for o in figure] == [["application/vnd.plotly.v1+json"]], graded.cells[-1].outputs
    assert "not able to be represented" not in course_round["feedback"].stderr, course_round["feedback"].stderr
    for student in ("ada", "bob_lee", "cy"):
        page = (root / "autograder" / "feedback_html" / student / AID / f"{AID}.html").read_text(encoding="utf-8")
        assert FIGURE_NOTE in " ".join(_common.visible_text(page).split()), student


@pytest.mark.slow
@pytest.mark.notebooks
def test_autograde_shows_progress_and_a_summary(course_round):
    err, out = course_round["autograde"].stderr, course_round["autograde"].stdout
    for student, score in (("ada", "5 / 5"), ("bob_lee", "2 / 5"), ("cy", "0 / 5")):
        assert f"{student}: autograding {AID}" in err and f"{student}: {score} in " in err, err
    # One line per code cell and submission; reciprocal's test passes for ada only.
    cells = re.findall(r"^\[\s*\d+/(\d+)\] (\w*)\s+[\d.]+ s  (\w+(?: \w+)?)$", err, flags=re.M)
    assert len(cells) == 3 * int(cells[0][0]), err
    assert sorted(st for _, gid, st in cells if gid == "test_reciprocal") == ["failed", "failed", "passed"], err
    assert "running over TCP" not in err, "the kernel's start-up warning is back"
    assert re.search(r"Graded 3 submission\(s\) in (\d+ min )?\d+ s: 3 completed, 0 failed\.", out), out
    # Each test that lost points, with the first line of its message (the check's own words).
    assert "Points lost" in out, out
    lost = [ln.split(None, 5) for ln in out.split("Points lost", 1)[1].split("\n\n")[0].splitlines()[1:]]
    assert [w[:5] for w in lost] == [["bob_lee", "test_reciprocal", "0", "/", "3"], ["cy", "test_double", "0", "/", "2"],
                                     ["cy", "test_reciprocal", "0", "/", "3"]], out
    assert lost[0][5] == "reciprocal(0) raises: raised ZeroDivisionError(float division by zero) instead of ValueError", out
    assert lost[1][5] == lost[2][5] == "not answered yet (NotImplementedError)", out


@pytest.mark.slow
@pytest.mark.notebooks
def test_the_round_leaves_the_scripts_and_git_alone(course_round):
    root = course_round["root"]
    for name in TRACKED:
        assert (root / "autograder" / name).read_bytes() == (SCRIPTS / name).read_bytes(), f"autograder/{name} changed"
    assert "autograder/feedback_html/" in course_round["feedback"].stdout
    if course_round["new_for_git"] is None:
        pytest.skip("git is not installed")
    # course/ is generated but committed; everything else the round wrote must be ignored.
    assert [p for p in course_round["new_for_git"] if not p.startswith("course/")] == []


@pytest.mark.slow
@pytest.mark.notebooks
def test_export_keeps_a_file_that_differs(course_round):
    root = course_round["root"]
    grades = root / "autograder" / "grades.csv"
    exported = grades.read_text()
    proc = _run(root, "export", "--to", "grades.csv")
    assert "left as it is" in proc.stdout and grades.read_text() == exported
    grades.write_text(exported + "a row someone added by hand\n")
    proc = _run(root, "export")
    backups = sorted(grades.parent.glob("grades.csv.*.bak"))
    assert len(backups) == 1 and backups[0].read_text() == exported + "a row someone added by hand\n"
    assert f"kept the previous grades.csv as {backups[0]}" in proc.stdout
    assert grades.read_text() == exported


@pytest.mark.slow
@pytest.mark.notebooks
def test_feedback_refuses_a_page_that_leaks(course_round):
    """The last guard: a line that only a hidden test holds and that reaches a page deletes the
    page. Here the visible check of test_reciprocal turns into a hidden one after grading (in
    solutions/ and the released copy), so that ada's autograded notebook shows it in the open."""
    root = course_round["root"]
    line = 'check_close(reciprocal(4.0), 0.25, what="reciprocal(4) is 1/4", hint="1.0 / a")'
    src, released = root / "solutions" / AID / f"{AID}.ipynb", root / "course" / AID / f"{AID}.ipynb"
    saved = {p: p.read_bytes() for p in (src, released)}
    for path, hidden in ((src, f"{course.BEGIN_HIDDEN}\n{line}\n{course.END_HIDDEN}"), (released, "")):
        nb = nbformat.read(str(path), as_version=4)
        cell = next(c for c in nb.cells if course.nbgrader_meta(c).get("grade_id") == "test_reciprocal")
        assert line in cell.source
        cell.source = cell.source.replace(line, hidden)
        nbformat.write(nb, str(path))
    try:
        assert line in _common.hidden_test_lines(root, AID)
        proc = _run(root, "feedback", AID, "--student", "ada", ok=False)
    finally:
        for path, data in saved.items():
            path.write_bytes(data)
    page = root / "autograder" / "feedback_html" / "ada" / AID / f"{AID}.html"
    deleted = not page.exists()
    _run(root, "feedback", AID, "--student", "ada")  # put ada's page back for the other tests
    assert proc.returncode == 1 and "hidden-test line" in proc.stderr and "reciprocal(4) is 1/4" in proc.stderr, proc.stderr
    assert deleted, "the leaking page was kept"


def test_nbgrader_outputs_never_take_a_script_name():
    """nbgrader writes its folders into autograder/, next to the scripts: none may be named like
    a file there (autograder/feedback once was both), and git must ignore each of them."""
    cd = course.nbgrader_config(REPO).CourseDirectory
    outputs = [cd.submitted_directory, cd.autograded_directory, cd.feedback_directory, cd.solution_directory,
               cd.source_with_tests_directory]
    for folder in outputs:
        top, name = Path(folder).parts[:2]
        assert top == "autograder", folder
        assert name not in TRACKED, f"nbgrader writes into autograder/{name}/, which is a file of autograder/"
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    for folder in outputs:
        probe = subprocess.run(["git", "check-ignore", "-q", f"{folder}/ada/00_welcome/00_welcome.html"],
                               cwd=REPO, timeout=60)
        assert probe.returncode == 0, f"git does not ignore {folder}/"


@pytest.mark.skipif(FOREIGN_PYTHON is None or not IN_VENV,
                    reason="needs a virtual environment and a python3 without nbgrader")
def test_scripts_find_the_checkouts_venv(tmp_path):
    """`autograder/export` typed in a shell whose python3 has no nbgrader: it runs with the
    checkout's .venv; without one, it says to run `make setup`."""
    checkout = make_checkout(tmp_path / "with")
    proc = _run(checkout, "export", "--help")
    assert "usage: autograder/export" in proc.stdout and "autograder/grades.csv" in proc.stdout

    bare = make_checkout(tmp_path / "without", venv=False)
    proc = _run(bare, "export", "--help", ok=False, env=shell_env(tmp_path / "with"))
    assert proc.returncode == 1 and "make setup" in proc.stderr and "nbgrader" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
