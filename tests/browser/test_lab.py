"""Every course notebook, run in a real JupyterLab in a real (headless) Chromium.

nbclient (tests/course/test_execution.py) proves that the cells run; it cannot see whether what
they display works on the page. Here each instructor notebook is opened in JupyterLab, run with
"Run All Cells", and then the page is compared with what the kernel produced:

* the run is the notebook's only run of the session: it is saved, and the checks
  tests/course/test_execution.py would make judge it (nbgrader validation of the saved outputs,
  every cell within the grading limit, 2 GB of memory, widget state stored);

* no cell raised (the model's error outputs) and no traceback is shown anywhere, the outputs of
  interactive widgets included (a warning printed to stderr is not an error);
* every widget view a cell displayed is rendered (not "Error displaying widget" nor stuck at
  "Loading widget..."), and so is every plotly figure, inside widget outputs too;
* every markdown cell with $math$ was typeset by MathJax;
* a slider that drives an output, moved with the keyboard as a person would, changes that output:
  the new value went to the kernel, which recomputed and sent the new picture back. The first
  such slider is moved one step, then to its ends; only if none of that changes anything are the
  next sliders tried (a slider that changes nothing in the widget's initial state is worth a
  look in the notebook).

A notebook without any such slider fails, by name: every notebook is meant to have one.

Screenshots go to test-artifacts/browser/: ``<notebook>.png`` is the whole notebook after the
run (split into ``.partN.png`` pieces when taller than Chromium draws at once), and
``<notebook>.slider.png`` the moved slider with the output it changed. ``<notebook>.json`` holds
the timings and what was counted.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import nbformat
import pytest

from llmu import course

pytestmark = [pytest.mark.slow, pytest.mark.notebooks, pytest.mark.browser]

ROOT = course.repo_root()
NOTEBOOKS = course.source_notebooks(ROOT)  # found at collection time: a new notebook is covered
ARTIFACTS = ROOT / "test-artifacts" / "browser"
# A whole notebook takes 30-100 s under nbclient on an idle 2-CPU machine; the same ceiling as
# test_execution.py (LLMU_NOTEBOOK_CEILING_S) bounds a run here.
RUN_CEILING_S = float(os.environ.get("LLMU_NOTEBOOK_CEILING_S", 600))
# After the kernel is idle, widget views and figures still render (and MathJax typesets) in the
# page; they get this long to settle before a missing one counts as a failure.
RENDER_S = 60
# The moved slider's output is recomputed by the kernel: the slowest demo (a simulated serving
# engine) takes a few seconds on a loaded machine; SLIDER_S bounds one key press. Once the kernel
# has handled the new value, the page gets KERNEL_QUIET_S to show the new output.
SLIDER_S = 90
KERNEL_QUIET_S = 3
SLIDERS_TRIED = 3
# Chromium draws at most 16,384 px in one screenshot: a taller notebook is shot in pieces of this.
MAX_SHOT_PX = 12_000
POLL_MS = 250


def _ids(paths):
    return [p.parent.name for p in paths]


def _settled(report: dict) -> bool:
    """True when everything the kernel produced has rendered, or an output failed for good
    ("Loading widget..." is the one failure text that may still turn into a widget)."""
    if any(not failure.startswith("Loading widget") for failure in report["renderFailures"]):
        return True
    return (report["widgets"]["rendered"] == report["widgets"]["expected"]
            and report["plots"]["rendered"] == report["plots"]["expected"]
            and report["nestedPlots"]["rendered"] == report["nestedPlots"]["total"]
            and report["math"]["rendered"] == report["math"]["cells"]
            and not report["renderFailures"])


def _inspect_until_settled(page) -> dict:
    deadline = time.monotonic() + RENDER_S
    while True:
        report = page.evaluate("window.llmuProbe.inspect()")
        if _settled(report) or time.monotonic() > deadline:
            return report
        page.wait_for_timeout(500)


def _screenshot_notebook(page, stem: str) -> list[str]:
    """The whole notebook: the viewport is made as tall as the notebook (in pieces if needed)."""
    viewport = page.viewport_size
    geometry = page.evaluate("window.llmuProbe.scrollGeometry()")
    top, height = int(geometry["top"]), int(geometry["height"])
    piece = min(height, MAX_SHOT_PX)
    page.set_viewport_size({"width": viewport["width"], "height": top + piece})
    names = []
    try:
        count = -(-height // piece)
        for i in range(count):
            page.evaluate(f"window.llmuProbe.scrollTo({i * piece})")
            page.wait_for_timeout(300)  # let plotly and MathJax redraw what came into view
            name = f"{stem}.png" if count == 1 else f"{stem}.part{i + 1}.png"
            page.screenshot(path=str(ARTIFACTS / name))
            names.append(name)
    finally:
        page.evaluate("window.llmuProbe.scrollTo(0)")
        page.set_viewport_size(viewport)
    return names


def _problems(report: dict) -> list[str]:
    problems = []
    if report["unexecuted"]:
        problems.append(f"code cells not executed (run-all stopped early): {report['unexecuted']}")
    for error in report["errors"]:
        problems.append(f"cell {error['cell']} raised {error['ename']}: {error['evalue']}")
    for shown in report["tracebacks"]:
        problems.append(f"cell {shown['cell']} shows a traceback:\n{shown['text']}")
    for failure in report["renderFailures"]:
        problems.append(f"an output did not render: {failure!r}")
    for kind in ("widgets", "plots"):
        counted = report[kind]
        if counted["rendered"] != counted["expected"]:
            problems.append(f"{counted['rendered']} of {counted['expected']} {kind} rendered; missing: {counted['missing']}")
    nested = report["nestedPlots"]
    if nested["rendered"] != nested["total"]:
        problems.append(f"{nested['rendered']} of {nested['total']} plotly figures (widget outputs included) drawn")
    if report["math"]["missing"]:
        problems.append(f"markdown cells with $math$ that MathJax did not typeset: {report['math']['missing']}")
    return problems


def _changed(before: dict, after: dict) -> bool:
    return (after["text"], after["plots"]) != (before["text"], before["plots"])


def _try_key(page, handle, key: str) -> tuple[dict, dict] | None:
    """Press ``key`` on the marked slider. None if the slider did not move (already at that end);
    otherwise (before, after): after is taken once the output changed and is drawn, or once the
    kernel has handled the new value and nothing changed for KERNEL_QUIET_S."""
    state = "window.llmuProbe.sliderState()"
    before = page.evaluate(state)
    handle.press(key)
    deadline = time.monotonic() + 2
    while page.evaluate(state)["readout"] == before["readout"]:
        if time.monotonic() > deadline:
            return None
        page.wait_for_timeout(100)
    deadline, quiet_since = time.monotonic() + SLIDER_S, None
    while True:
        after = page.evaluate(state)
        if _changed(before, after) and after["drawn"]:
            return before, after
        if after["idles"] > before["idles"] and quiet_since is None:
            quiet_since = time.monotonic()
        if time.monotonic() > deadline or (quiet_since and time.monotonic() - quiet_since > KERNEL_QUIET_S):
            return before, after
        page.wait_for_timeout(POLL_MS)


def _move_slider(page, name: str) -> dict:
    """Move a slider with the keyboard, as a person would, until the output beside it changes.

    One step right first; a value can leave the output as it was (a step past the last block
    shows the finished state again, a setting another control makes irrelevant), so then the
    slider's two ends (Home, End) are tried, and then the next slider, up to SLIDERS_TRIED."""
    candidates = page.evaluate("window.llmuProbe.sliderCandidates()")
    assert candidates, (
        f"{name} has no slider next to an output (an ipywidgets slider in a box with an Output, as "
        "llmu.viz.interactive builds): every notebook needs one that a learner can move")
    tried = []
    for index in range(min(candidates, SLIDERS_TRIED)):
        target = page.evaluate("i => window.llmuProbe.markSlider(i)", index)
        handle = page.locator('[data-llmu-probe="slider"] .noUi-handle').first
        handle.scroll_into_view_if_needed()
        handle.focus()
        for key in ("ArrowRight", "Home", "End"):
            started = time.monotonic()
            moved = _try_key(page, handle, key)
            if moved is None:
                tried.append(f"{target['description']!r} {key}: did not move")
                continue
            before, after = moved
            if _changed(before, after):
                page.locator('[data-llmu-probe="box"]').screenshot(path=str(ARTIFACTS / f"{name}.slider.png"))
                return {"cell": target["cell"], "slider": target["description"], "key": key,
                        "from": before["readout"], "to": after["readout"],
                        "seconds": round(time.monotonic() - started, 2), "tried_before": tried}
            tried.append(f"{target['description']!r} {key}: {before['readout']} -> {after['readout']}, output unchanged")
    raise AssertionError(f"{name}: no slider changed the output beside it: " + "; ".join(tried))


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_notebook_renders_and_responds_in_lab(notebook: Path, lab_page, lab, notebook_runs):
    page, name = lab_page, notebook.parent.name
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    record = {"notebook": name}
    path = notebook.relative_to(course.solutions_dir(ROOT)).as_posix()
    started = time.monotonic()
    try:
        record["cells"] = page.evaluate("path => window.llmuProbe.open(path)", path)
        record["open_s"] = round(time.monotonic() - started, 2)

        # Run > Run All Cells, then wait for the run to finish and the kernel to go idle.
        page.evaluate("window.llmuProbe.startRunAll()")
        page.wait_for_function("(() => { const s = window.llmuProbe.runState(); return s.done && s.kernel === 'idle'; })()",
                               timeout=RUN_CEILING_S * 1000, polling=500)
        run = page.evaluate("window.llmuProbe.runState()")
        record["run_s"] = round(time.monotonic() - started - record["open_s"], 2)

        report = _inspect_until_settled(page)
        record.update({k: report[k] for k in ("widgets", "plots", "nestedPlots", "math", "sliders")})
        record["screenshots"] = _screenshot_notebook(page, name)
        saved = lab.root / page.evaluate("window.llmuProbe.save()")
        problems = _problems(report)
        if not run.get("ok") and not problems:
            problems.append(f"run-all did not succeed: {run}")
        assert not problems, f"{name} in JupyterLab:\n" + "\n".join(problems) + \
            (f"\npage errors: {page.console_errors[-5:]}" if page.console_errors else "")

        # This run is the notebook's run of the session (tests/course/test_execution.py skips its
        # own): nbgrader's verdict on the saved outputs, the grading limit, memory, widget state.
        executed = nbformat.read(str(saved), as_version=4)
        notebook_runs.check_solution(name, executed, record["run_s"], course.validate_executed(saved),
                                     where="jupyterlab")

        record["slider_move"] = _move_slider(page, name)
        record["screenshots"].append(f"{name}.slider.png")
    finally:
        record["total_s"] = round(time.monotonic() - started, 2)
        (ARTIFACTS / f"{name}.json").write_text(json.dumps(record, indent=1))
        print(json.dumps(record))
        page.evaluate("window.llmuProbe.close()")


def _broken_notebook():
    """A notebook with one of each failure the checks above must catch, and one thing they must not."""
    import nbformat

    v4 = nbformat.v4
    missing_model = {"model_id": "0" * 32, "version_major": 2, "version_minor": 0}
    cells = [
        v4.new_markdown_cell("Math: $x^2$ and $$\\sum_i x_i$$"),                                # 0
        v4.new_code_cell("import sys\nprint('a warning, not an error', file=sys.stderr)"),     # 1
        v4.new_code_cell("from IPython.display import display\n"                               # 2
                         f"display({{'application/vnd.jupyter.widget-view+json': {missing_model!r}}}, raw=True)"),
        v4.new_code_cell("from llmu import viz\nviz.interactive(lambda n: 1 / 0, n=(0, 5, 1))"),  # 3
        v4.new_code_cell("raise ValueError('deliberate')"),                                     # 4
        v4.new_code_cell("print('never runs')"),                                                # 5
    ]
    nb = v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


def test_probe_reports_each_kind_of_failure(lab_page, lab):
    """The checks can fail: a notebook built to break each of them is reported exactly."""
    import nbformat

    folder = lab.root / "_probe_check"
    folder.mkdir(exist_ok=True)
    nbformat.write(_broken_notebook(), str(folder / "broken.ipynb"))
    page = lab_page
    try:
        page.evaluate("path => window.llmuProbe.open(path)", "_probe_check/broken.ipynb")
        page.evaluate("window.llmuProbe.startRunAll()")
        page.wait_for_function("(() => { const s = window.llmuProbe.runState(); return s.done && s.kernel === 'idle'; })()",
                               timeout=120_000, polling=500)
        assert page.evaluate("window.llmuProbe.runState()")["ok"] is False
        report = _inspect_until_settled(page)
    finally:
        page.evaluate("window.llmuProbe.close()")
    print(json.dumps(report))
    assert report["unexecuted"] == [5]
    assert [(e["cell"], e["ename"]) for e in report["errors"]] == [(4, "ValueError")]
    # The interactive's ZeroDivisionError is only in its Output widget; the stderr warning is not listed.
    assert sorted(t["cell"] for t in report["tracebacks"]) == [3, 4]
    assert "ZeroDivisionError" in next(t["text"] for t in report["tracebacks"] if t["cell"] == 3)
    assert report["widgets"]["expected"] == 2 and report["widgets"]["rendered"] == 1
    assert [m["cell"] for m in report["widgets"]["missing"]] == [2]
    assert any("Error displaying widget" in f for f in report["renderFailures"])
    assert report["math"] == {"cells": 1, "rendered": 1, "missing": []}
    assert len(_problems(report)) == 6
