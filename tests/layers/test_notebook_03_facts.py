"""Notebook 03's prose and cells, checked without the model: the figures of the benchmark section
recomputed from llmu's benchmark entries and peak table, the summary's claim about who saves the
inverse RMS checked against the kernels, no test cell reading a name that only a demonstration cell
defines, and every test cell ending with a ``passed(...)`` line. (The exercises themselves, which
need SmolLM2, are run by ``test_notebook_03.py``.)
"""

from __future__ import annotations

import ast
import inspect
import json
import re
from pathlib import Path

import llmu  # noqa: F401  (Triton mode first)
from llmu import course

NOTEBOOK = course.repo_root() / "solutions" / "03_rope_swiglu_rmsnorm" / "03_rope_swiglu_rmsnorm.ipynb"


def _prose(grade_id):
    return " ".join(course.cells_by_grade_id(NOTEBOOK)[grade_id].split())


def _intensities(elem):
    """FLOPs per byte of the module's five benchmark entries, at every size they are run at on a GPU."""
    import llmu.layers.bench  # noqa: F401  (registers the entries)
    from llmu.bench.registry import REGISTRY

    return {name: [REGISTRY[name].flops(s) / REGISTRY[name].bytes(s, elem) for s in REGISTRY[name].gpu_sizes]
            for name in ("rms_norm", "rms_norm_bwd", "rope", "swiglu", "swiglu_bwd")}


def test_flops_per_byte_of_the_three_ops():
    text = _prose("bench_md")
    fp32, bf16 = _intensities(4), _intensities(2)
    lowest = min(fp32, key=lambda name: min(fp32[name]))
    highest = max(fp32, key=lambda name: max(fp32[name]))
    assert (lowest, highest) == ("rope", "rms_norm_bwd")
    lo4, hi4 = min(min(v) for v in fp32.values()), max(max(v) for v in fp32.values())
    lo2, hi2 = min(min(v) for v in bf16.values()), max(max(v) for v in bf16.values())
    assert (f"That is {lo4:.2f} (RoPE) to {hi4:.2f} (RMSNorm backward) flops per byte in float32, "
            f"and {lo2:.2f} to {hi2:.2g} in bf16") in text


def test_h100_float32_ridge():
    from llmu.bench.peaks import GPU_PEAKS

    h100 = next(peak for _, peak in GPU_PEAKS if peak.name == "NVIDIA H100 SXM")
    tflops, bandwidth = h100.tflops_for("float32"), h100.bandwidth_gbs
    ridge = tflops * 1e12 / (bandwidth * 1e9)
    assert (f"far below the {ridge:.0f} flops per byte at which even an H100 SXM's float32 units "
            f"({tflops:g} TFLOP/s against {bandwidth / 1000:g} TB/s) stop waiting for memory") in _prose("bench_md")


def test_summary_says_which_kernel_saves_the_inverse_rms():
    """The learner's kernel stores y only; the library's forward kernel also stores each row's rstd."""
    from llmu.layers import rmsnorm

    library = inspect.getsource(rmsnorm._rms_norm_fwd_kernel.fn)
    assert "tl.store(RSTD" in library and "BLOCK_M" in library
    mine = course.cells_by_grade_id(NOTEBOOK)["rms_norm_kernel"]
    assert mine.count("tl.store(") == 1
    text = _prose("summary")
    assert "Your RMSNorm kernel keeps a row in one program, so it reads the row once and writes the result once" in text
    assert ("the library's forward kernel does the same for a block of rows per program, and also saves each "
            "row's inverse RMS, which its backward pass reads back") in text


# ---------------------------------------------------------------------------------------------
# Test cells read only what the learner's cells and the locked setup and helper cells define, and
# each one ends, in the learner's copy as in the graded one, with a passed(...) line.
# ---------------------------------------------------------------------------------------------

# Locked cells the tests may read: the kernel's launcher, and the cell exercises 5 and 6 take the model from.
HELPERS = ("rms_norm_launcher", "finale_model")


def _code_cells(path):
    for cell in json.loads(Path(path).read_text())["cells"]:
        if cell["cell_type"] == "code":
            meta = cell["metadata"].get("nbgrader", {})
            yield meta.get("grade_id"), meta, "".join(cell["source"])


def _stored_and_loaded(source):
    """Names a cell binds anywhere (arguments and loop variables included), and names it reads."""
    stored, loaded = set(), set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else stored).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            stored.add(node.name)
        elif isinstance(node, ast.alias):
            stored.add((node.asname or node.name).split(".")[0])
        elif isinstance(node, ast.arg):
            stored.add(node.arg)
    return stored, loaded


def _defined(source):
    """The global names a cell defines (not a function's arguments or locals)."""
    names = set()

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(child.name)
            elif isinstance(child, ast.alias):
                names.add((child.asname or child.name).split(".")[0])
            elif isinstance(child, ast.Name) and not isinstance(child.ctx, ast.Load):
                names.add(child.id)
            elif not isinstance(child, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
                visit(child)

    visit(ast.parse(source))
    return names


def test_no_test_cell_reads_a_demo_cells_names():
    """A name a test cell reads without defining it comes from the setup cell, a solution cell or a
    locked helper cell before it (HELPERS), never from a demo, widget or benchmark cell alone."""
    allowed, demo, bad = set(), set(), {}
    for gid, meta, source in _code_cells(NOTEBOOK):
        stored, loaded = _stored_and_loaded(source)
        if meta.get("grade"):
            used = (loaded - stored) & (demo - allowed)
            if used:
                bad[gid] = sorted(used)
        elif gid == "setup" or meta.get("solution") or gid in HELPERS:
            allowed |= _defined(source)
        else:
            demo |= _defined(source)
    assert not bad, f"test cells reading names only a demo cell defined: {bad}"


def test_every_test_cell_ends_with_passed():
    hidden = re.compile(r"### BEGIN HIDDEN TESTS\n.*?### END HIDDEN TESTS\n?", re.S)
    for gid, meta, source in _code_cells(NOTEBOOK):
        if meta.get("grade"):
            for version in (source, hidden.sub("", source)):   # graded, and the learner's copy
                last = [line for line in version.splitlines() if line.strip()][-1]
                assert last.startswith("passed("), f"{gid} ends with {last!r}"
