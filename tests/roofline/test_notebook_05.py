"""Notebook 05's graded exercises, run in-process (no kernel, no model): the instructor's solutions
pass every test cell, hidden parts included, and typical wrong answers fail them.

The whole notebook (model cells, widgets, benchmark) is executed by the course-wide notebook tests.
"""

from __future__ import annotations

from pathlib import Path

import llmu  # noqa: F401
from llmu import course

NOTEBOOK = Path(__file__).resolve().parents[2] / "solutions" / "05_prefill_decode" / "05_prefill_decode.ipynb"


EXERCISES = {f"ex{n}": course.Exercise.numbered(n) for n in (1, 2, 3, 4)}


WRONG = {
    # exercise, replaced text, replacement, the test cell that must catch it
    "ex1: output not counted": ("ex1", "(M * K + K * N + M * N)", "(M * K + K * N)", "test_ex1_visible"),
    "ex1: FLOPs without the 2": ("ex1", "flops = 2 * M * N * K", "flops = M * N * K", "test_ex1_visible"),
    "ex1: no validation": ("ex1", "raise ValueError", "pass  #", "test_ex1_hidden"),
    "ex2: max instead of min": ("ex2", "return min(", "return max(", "test_ex2_visible"),
    "ex2: no validation": ("ex2", 'raise ValueError("peak_flops', 'print("peak_flops', "test_ex2_hidden"),
    "ex3: ridge counted as memory-bound": ("ex3", "intensity < ridge", "intensity <= ridge", "test_ex3_hidden"),
    "ex3: ridge inverted": ("ex3", "ridge = peak_flops / bandwidth", "ridge = bandwidth / peak_flops",
                            "test_ex3_visible"),
    "ex4: TPOT over n gaps": ("ex4", "/ (n - 1) if n > 1", "/ n if n > 1", "test_ex4_visible"),
    "ex4: TPOT as the last gap": ("ex4", "(timestamps[-1] - timestamps[0]) / (n - 1)",
                                  "(timestamps[-1] - timestamps[-2])", "test_ex4_hidden"),
}


# The exercise file's two tests: every solution passes its test cells; every wrong answer is
# caught by the test cell named for it (cell metadata is checked in tests/course/test_notebooks.py).
(notebook, test_solutions_pass_all_tests, test_wrong_answers_fail,
 test_library_answers_fail) = course.exercise_tests(
    NOTEBOOK, EXERCISES, WRONG)


# The figures the notebook's prose states, recomputed from llmu's code and SmolLM2's config (no model).

def _prose(grade_id: str) -> str:
    return course.cells_by_grade_id(NOTEBOOK)[grade_id]


def test_decode_reads_the_weights_and_a_small_cache():
    """Section 5: SmolLM2's fp32 weights, and the cache the longest prompt (256 + 8 new tokens) leaves."""
    import torch

    from llmu.kvcache.reference import kv_cache_bytes
    from llmu.models import LlamaConfig

    c = LlamaConfig()
    weights = c.num_parameters() * 4
    per_token = kv_cache_bytes(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, 1, 1, torch.float32)
    cache = per_token * (256 + 8)
    text = _prose("latency_read")
    assert f"{weights / 1e6:.0f} MB" == "538 MB" and "reads all 538 MB of fp32 weights" in text
    assert per_token == 46_080 and "46,080 bytes each in fp32" in text
    assert f"{cache / 1e6:.0f} MB" == "12 MB" and round(100 * cache / weights) == 2
    assert "12 MB, about 2 % of the weights" in text and "a few MB" not in text


def test_large_gemv_weights():
    """Section 6: the fp32 bytes of the sweep's matrices larger than a last-level cache."""
    import ast
    import re

    shapes = ast.literal_eval(re.search(r"^SHAPES = (.*)$", _prose("gemv_sweep"), re.M).group(1))
    large = sorted(n * k * 4 for n, k in shapes if n * k * 4 > 32e6)
    assert (f"{large[0] / 1e6:.0f}", f"{large[-1] / 1e6:.0f}") == ("67", "134")
    assert "the large matrices (67 to 134 MB in fp32" in _prose("gemv_read")


def test_softmax_intensity():
    """Self-check 3: softmax's intensity in bf16, as the benchmark registry counts it."""
    from llmu.bench.registry import load_all

    entry = load_all()["softmax_rows"]
    for size in entry.gpu_sizes:
        assert entry.flops(size) / entry.bytes(size, 2) == 1.25
    text = _prose("self_check")
    assert "1.25 FLOP/byte at any size" in text and "about 1.5 FLOP/byte" not in text
