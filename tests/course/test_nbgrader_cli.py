"""The instructor commands of autograder/README.md, run as written, with nbgrader's command line.

A temporary course root gets the fixture assignment and a copy of autograder/nbgrader_config.py
(which computes the course root from its own location), and the commands run from its
autograder/ folder, as the README says.
"""

from __future__ import annotations

import csv
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from llmu import course

pytestmark = [pytest.mark.slow, pytest.mark.notebooks]

FIXTURE = Path(__file__).parent / "fixtures" / "99_fixture"
AID = "99_fixture"


def _nbgrader(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("nbgrader")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "nbgrader"]
    # PATH is left as it is: like `.venv/bin/nbgrader` typed without activating the environment.
    return subprocess.run(cmd + list(args), cwd=cwd, capture_output=True, text=True, timeout=300)


def test_readme_workflow_with_the_nbgrader_cli(tmp_path):
    root = tmp_path
    shutil.copytree(FIXTURE, root / "solutions" / AID)
    (root / "autograder").mkdir()
    shutil.copy(course.autograder_dir() / "nbgrader_config.py", root / "autograder" / "nbgrader_config.py")
    ag = root / "autograder"

    p = _nbgrader(ag, "generate_assignment", AID, "--force")
    assert p.returncode == 0, p.stderr
    released = root / "course" / AID / f"{AID}.ipynb"
    assert released.is_file(), f"the config did not send the release to course/: {p.stderr[-2000:]}"
    assert (ag / "gradebook.db").is_file()

    # The pitfall: validate reports failure in its output but exits 0.
    p = _nbgrader(ag, "validate", str(released))
    assert "VALIDATION FAILED ON 2 CELL(S)" in p.stdout
    assert p.returncode == 0, "nbgrader validate now exits non-zero on failure: update autograder/README.md"

    # A student with a correct double() and a reciprocal() that fails only the hidden test.
    nb = nbformat.read(str(released), as_version=4)
    for c in nb.cells:
        gid = course.nbgrader_meta(c).get("grade_id")
        if gid == "double":
            c.source = "def double(x):\n    return 2 * x"
        elif gid == "reciprocal":
            c.source = "def reciprocal(a):\n    return 1.0 / a"
    sub = ag / "submitted" / "ada" / AID
    sub.mkdir(parents=True)
    nbformat.write(nb, str(sub / f"{AID}.ipynb"))

    p = _nbgrader(ag, "autograde", AID)
    assert p.returncode == 0, p.stderr[-3000:]
    assert (ag / "autograded" / "ada" / AID / f"{AID}.ipynb").is_file()

    p = _nbgrader(ag, "generate_feedback", AID)
    assert p.returncode == 0, p.stderr[-3000:]
    html = (ag / "feedback_html" / "ada" / AID / f"{AID}.html").read_text()
    assert "reciprocal(0) raises" in html
    assert "secret-line" not in html and "HIDDEN TESTS" not in html, "hidden tests leak into the feedback"

    p = _nbgrader(ag, "export", "--to", str(tmp_path / "grades.csv"))
    assert p.returncode == 0, p.stderr[-3000:]
    rows = list(csv.DictReader((tmp_path / "grades.csv").open()))
    assert [(r["student_id"], float(r["score"]), float(r["max_score"])) for r in rows] == [("ada", 2.0, 5.0)]
