"""Every notebook runs headless, once per test, under nbgrader's own validator.

* The instructor notebook (solutions/) runs top to bottom with no error in any cell, passes
  nbgrader validation, fits the course's budget (2 minutes, 2 GB), and stores its widget state.
* The student notebook (course/) as released: every autograded test cell FAILS on the stubs (the
  ``--invert`` check: no graded cell passes), yet every other cell — explanations, pictures, demos,
  the benchmark — still runs, because they use llmu's reference code, not the learner's.

Each notebook is executed in a copy of its assignment folder in a temporary directory (so that
nothing it writes lands in the repository), with a last cell appended that reports the kernel's
peak memory. Timings are written to test-artifacts/notebooks/.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from datetime import datetime
from pathlib import Path

import nbformat
import pytest

from llmu import course

pytestmark = [pytest.mark.slow, pytest.mark.notebooks]

ROOT = course.repo_root()
SOURCES = course.source_notebooks(ROOT)
# The course's budget per notebook on 2 CPUs (DESIGN.md) is 2 minutes and 2 GB. Memory is a
# property of the notebook and is asserted; wall time depends on what else the machine runs, so
# it is recorded in test-artifacts/notebooks/ (and summarised by `llmu`'s closing figures) and
# only a hard ceiling far above the budget fails the test (LLMU_NOTEBOOK_CEILING_S).
BUDGET_S = 120
CEILING_S = float(os.environ.get("LLMU_NOTEBOOK_CEILING_S", 600))
BUDGET_RSS_MB = 2048
ARTIFACTS = ROOT / "test-artifacts" / "notebooks"

# The kernel's own peak resident memory. On Linux that is VmHWM, the high-water mark of the kernel's
# address space, which starts at zero when the kernel process is exec'd. getrusage's ru_maxrss is not:
# Linux carries it over from the process that started the kernel (the test worker, which may hold
# several models), so every notebook would report the worker's size. Elsewhere, ru_maxrss.
_PROBE = (
    "import re as _re, resource as _r, sys as _s\n"
    "try:\n"
    "    _peak = int(_re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read()).group(1)) / 1024\n"
    "except (OSError, AttributeError):\n"
    "    _peak = _r.getrusage(_r.RUSAGE_SELF).ru_maxrss / (1024 * 1024 if _s.platform == 'darwin' else 1024)\n"
    "print('LLMU_PEAK_RSS_MB', _peak)"
)


def _ids(paths):
    return [p.parent.name for p in paths]


def _copy_with_probe(nb_path: Path, tmp: Path) -> Path:
    """Copy the assignment folder of ``nb_path`` into ``tmp`` and append the memory probe cell."""
    dest_dir = tmp / nb_path.parent.name
    shutil.copytree(nb_path.parent, dest_dir)
    dest = dest_dir / nb_path.name
    nb = nbformat.read(str(dest), as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(_PROBE))
    nbformat.write(nb, str(dest))
    return dest


def _cell_seconds(cell) -> float | None:
    ex = cell.get("metadata", {}).get("execution", {})
    try:
        start = datetime.fromisoformat(ex["iopub.execute_input"].replace("Z", "+00:00"))
        end = datetime.fromisoformat(ex["shell.execute_reply"].replace("Z", "+00:00"))
    except (KeyError, ValueError):
        return None
    return (end - start).total_seconds()


def _peak_rss_mb(nb) -> float:
    # The kernel may deliver one print() as several stream chunks: join them before reading.
    text = "".join(o.get("text", "") for o in nb.cells[-1].get("outputs", []) if o.get("output_type") == "stream")
    found = re.search(r"LLMU_PEAK_RSS_MB\s+([0-9.]+)", text)
    if found:
        return float(found.group(1))
    raise AssertionError(f"the memory probe printed nothing: {nb.cells[-1].get('outputs')}")


def _errors(nb, skip=lambda cell: False) -> list[str]:
    out = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or skip(cell):
            continue
        for o in cell.get("outputs", []):
            if o.get("output_type") == "error":
                gid = course.nbgrader_meta(cell).get("grade_id", "")
                out.append(f"cell {i} {gid}: {o.get('ename')}: {o.get('evalue')}\n  {cell.source[:200]!r}")
    return out


def _record(name: str, kind: str, run: course.ValidationRun, rss: float) -> dict:
    cells = []
    for i, cell in enumerate(run.notebook.cells[:-1]):
        s = _cell_seconds(cell)
        if s is not None:
            cells.append({"cell": i, "grade_id": course.nbgrader_meta(cell).get("grade_id"), "seconds": round(s, 3)})
    rec = {"notebook": name, "kind": kind, "seconds": round(run.seconds, 2), "peak_rss_mb": round(rss),
           "slowest_cells": sorted(cells, key=lambda c: -c["seconds"])[:5]}
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / f"{name}.{kind}.json").write_text(json.dumps(rec, indent=1))
    print(json.dumps(rec))
    return rec


@pytest.mark.parametrize("src", SOURCES, ids=_ids(SOURCES))
def test_solution_notebook_runs_and_validates(src, tmp_path):
    nb_path = _copy_with_probe(src, tmp_path)
    run = course.execute_and_validate(nb_path, timeout=course.CELL_TIMEOUT)
    rss = _peak_rss_mb(run.notebook)
    rec = _record(src.parent.name, "solutions", run, rss)

    errors = _errors(run.notebook)
    assert not errors, f"{src.parent.name}: cells raised:\n" + "\n".join(errors)
    assert run.results == {}, f"{src.parent.name} fails nbgrader validation: {json.dumps(run.results)[:3000]}"
    if run.seconds > BUDGET_S:
        warnings.warn(f"{src.parent.name} took {run.seconds:.0f} s here (budget {BUDGET_S} s on an idle 2-CPU "
                      f"machine); slowest cells: {rec['slowest_cells']}")
    assert run.seconds < CEILING_S, f"{src.parent.name} took {run.seconds:.0f} s (ceiling {CEILING_S:.0f} s): {rec['slowest_cells']}"
    assert rss < BUDGET_RSS_MB, f"{src.parent.name} peaked at {rss:.0f} MB (budget {BUDGET_RSS_MB} MB)"
    # Interactive pictures must leave their widget state in the notebook (store_widget_state):
    # without it, a static rendering shows no widget at all.
    has_widgets = any("application/vnd.jupyter.widget-view+json" in o.get("data", {})
                      for c in run.notebook.cells if c.cell_type == "code" for o in c.get("outputs", []))
    if has_widgets:
        assert run.notebook.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json"), \
            "widgets were displayed but no widget state was stored"


@pytest.mark.parametrize("src", SOURCES, ids=_ids(SOURCES))
def test_released_notebook_fails_its_tests_and_runs_the_rest(src, tmp_path):
    released = course.released_twin(src, ROOT)
    assert released.is_file(), f"no release of {src.parent.name}: run `llmu release`"
    nb_path = _copy_with_probe(released, tmp_path)
    run = course.execute_and_validate(nb_path, invert=True, timeout=course.CELL_TIMEOUT)
    _record(src.parent.name, "course", run, _peak_rss_mb(run.notebook))

    assert "changed" not in run.results, f"checksums of locked cells differ in the release: {run.results['changed']}"
    assert "type_changed" not in run.results, run.results
    passing = [p["source"][:120] for p in run.results.get("passed", [])]
    assert not passing, f"{src.parent.name}: graded cells pass on the unanswered release (free points): {passing}"
    graded = [c for c in run.notebook.cells if course.is_test(c)]
    assert graded, "no autograded test cells in the release"
    # Everything that is neither an answer nor a test must run on the stubs.
    errors = _errors(run.notebook, skip=lambda c: course.is_solution(c) or course.is_grade(c))
    assert not errors, (f"{src.parent.name}: cells that are not exercises fail when the exercises are "
                        "unanswered (use llmu's reference implementation there):\n" + "\n".join(errors))
