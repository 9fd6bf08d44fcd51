"""Every notebook runs headless, under nbgrader's own validator.

* The instructor notebook (solutions/) runs top to bottom with no error in any cell, passes
  nbgrader validation, fits the course's budget (2 minutes, 2 GB), and stores its widget state.
  It runs once per session: when tests/browser/test_lab.py runs it in JupyterLab (its test is
  selected and a browser is installed, as in CI), the same checks (``notebook_runs.check_solution``
  in tests/conftest.py) judge that run and the test here says so and skips; otherwise it runs here.
* The student notebook (course/) as released: every autograded test cell FAILS on the stubs (the
  ``--invert`` check: no graded cell passes), yet every other cell — explanations, pictures, demos,
  the benchmark — still runs, because they use llmu's reference code, not the learner's.
  A cell that is the instructor's own, reads nothing an exercise binds and is needed by no cell
  that does is not run again here: it does what it did in the instructor notebook's run of this
  session (``llmu.course.cell_deps`` says how that is decided); every answer, every test, and
  every cell that could see the learner's code runs on the stubs.

Each notebook is executed in a copy of its assignment folder in a temporary directory (so that
nothing it writes lands in the repository), with a last cell appended that reports the kernel's
peak memory. Timings are written to test-artifacts/notebooks/.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import nbformat
import pytest

from llmu import course

pytestmark = [pytest.mark.slow, pytest.mark.notebooks]

ROOT = course.repo_root()
SOURCES = course.source_notebooks(ROOT)


def _ids(paths):
    return [p.parent.name for p in paths]


def _copy_with_probe(nb_path: Path, tmp: Path, skip_as_in: Path | None = None) -> tuple[Path, dict]:
    """Copy the assignment folder of ``nb_path`` into ``tmp`` and append the memory probe cell.
    With ``skip_as_in`` (the instructor notebook), tag the cells that behave as they do there
    ``skip-execution`` (nbclient leaves them out; tags are not part of nbgrader's checksums) and
    return them."""
    dest_dir = tmp / nb_path.parent.name
    shutil.copytree(nb_path.parent, dest_dir)
    dest = dest_dir / nb_path.name
    course.add_memory_probe(dest)
    skipped = {}
    if skip_as_in is not None:
        nb = nbformat.read(str(dest), as_version=4)
        source = nbformat.read(str(skip_as_in), as_version=4)
        skipped = course.release_check_skips(nb, source, course.is_solution, course.is_test)
        for i in skipped:
            nb.cells[i].metadata.setdefault("tags", []).append("skip-execution")
        nbformat.write(nb, str(dest))
    return dest, skipped


@pytest.mark.parametrize("src", SOURCES, ids=_ids(SOURCES))
def test_solution_notebook_runs_and_validates(src, tmp_path, notebook_runs, notebooks_run_in_lab):
    if src.parent.name in notebooks_run_in_lab:
        pytest.skip("run once, in JupyterLab: tests/browser/test_lab.py makes these checks on that run")
    nb_path, _ = _copy_with_probe(src, tmp_path)
    run = course.execute_and_validate(nb_path, timeout=course.CELL_TIMEOUT)
    notebook_runs.check_solution(src.parent.name, run.notebook, run.seconds, run.results, where="nbclient")


@pytest.mark.parametrize("src", SOURCES, ids=_ids(SOURCES))
def test_released_notebook_fails_its_tests_and_runs_the_rest(src, tmp_path, notebook_runs):
    released = course.released_twin(src, ROOT)
    assert released.is_file(), f"no release of {src.parent.name}: run `llmu release`"
    nb_path, skipped = _copy_with_probe(released, tmp_path, skip_as_in=src)
    run = course.execute_and_validate(nb_path, invert=True, timeout=course.CELL_TIMEOUT)
    notebook_runs.record(src.parent.name, "course", run.notebook, run.seconds, course.peak_rss_mb(run.notebook), "nbclient",
                         skipped=[run.notebook.cells[i].metadata.get("nbgrader", {}).get("grade_id", i) for i in skipped])

    assert "changed" not in run.results, f"checksums of locked cells differ in the release: {run.results['changed']}"
    assert "type_changed" not in run.results, run.results
    passing = [p["source"][:120] for p in run.results.get("passed", [])]
    assert not passing, f"{src.parent.name}: graded cells pass on the unanswered release (free points): {passing}"
    graded = [c for c in run.notebook.cells if course.is_test(c)]
    assert graded, "no autograded test cells in the release"
    # Everything that is neither an answer nor a test must run on the stubs.
    errors = notebook_runs.errors(run.notebook, skip=lambda c: course.is_solution(c) or course.is_grade(c))
    assert not errors, (f"{src.parent.name}: cells that are not exercises fail when the exercises are "
                        "unanswered (use llmu's reference implementation there):\n" + "\n".join(errors))
