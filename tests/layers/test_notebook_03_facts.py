"""Notebook 03's prose and cells, checked without the model: the figures of the benchmark section
recomputed from llmu's benchmark entries and peak table, the summary's claim about who saves the
inverse RMS checked against the kernels, no test cell reading a name that only a demonstration cell
defines, and every test cell ending with a ``passed(...)`` line. (The exercises themselves, which
need SmolLM2, are run by ``test_notebook_03.py``.)
"""

from __future__ import annotations

import inspect

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
