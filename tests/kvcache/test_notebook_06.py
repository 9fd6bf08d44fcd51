"""Notebook 06's graded exercises, run in-process (no kernel, no model): the instructor's solutions
pass every test cell, hidden parts included, typical wrong answers fail the cell named for them,
and llmu's own ``cache_update`` or ``attend_cached`` (or the flash-decoding kernel, or PyTorch's
SDPA) handed back as an answer scores nothing.

The exercises are plain tensor code checked against ``llmu.kvcache.reference``: the cache update
exactly, the cached attention step to 1e-5 in float32, and the sliding-window ring (exercise 3,
built on exercise 2's step) against attention over each sequence's last ``window`` tokens. The whole notebook (SmolLM2's decoding with
and without the cache, the calculator, the Triton kernel, the benchmark) is executed by the
course-wide notebook tests.
"""

from __future__ import annotations

import llmu  # noqa: F401
from llmu import course

NOTEBOOK = course.repo_root() / "solutions" / "06_kv_cache" / "06_kv_cache.ipynb"


EXERCISES = {f"ex{n}": course.Exercise.numbered(n) for n in (1, 2)}
# exercise 3's ring uses exercise 2's my_attend_cached
EXERCISES["ex3"] = course.Exercise.numbered(3, before=("ex2_solution",), after=("ex3_helpers",))


def test_setup_cell_loads_no_model(notebook):
    """The exercises must run without the model: the setup cell only imports."""
    assert "load_model(" not in notebook.cells["setup"]


WRONG = {
    # case: (exercise, replaced text, replacement, the test cell that must catch it)
    "ex1: every sequence written at position 0": ("ex1", "start:start + t] =", ":t] =", "test_ex1_visible"),
    "ex1: lengths not advanced": ("ex1", "return lengths + t", "return lengths", "test_ex1_visible"),
    "ex1: written one position late": ("ex1", "start:start + t] =", "start + 1:start + 1 + t] =",
                                       "test_ex1_visible"),
    "ex1: no capacity check": ("ex1", "if int((lengths + t).max()) > max_len:", "if False:", "test_ex1_hidden"),
    "ex1: a full cache counted as overflowing": ("ex1", "> max_len:", ">= max_len:", "test_ex1_hidden"),
    "ex1: checked sequence by sequence, while writing": (
        "ex1",
        "    if int((lengths + t).max()) > max_len:\n"
        "        raise ValueError(f\"the cache holds {max_len} positions per sequence\")\n"
        "    for b, start in enumerate(lengths.tolist()):\n",
        "    for b, start in enumerate(lengths.tolist()):\n"
        "        if start + t > max_len:\n"
        "            raise ValueError(f\"the cache holds {max_len} positions per sequence\")\n",
        "test_ex1_hidden"),
    "ex2: no 1/sqrt(D)": ("ex2", " / math.sqrt(d)", "", "test_ex2_visible"),
    "ex2: softmax over the heads": ("ex2", "torch.softmax(scores, dim=-1)", "torch.softmax(scores, dim=1)",
                                    "test_ex2_visible"),
    "ex2: padding scores not masked": ("ex2", '    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))\n',
                                       "", "test_ex2_hidden"),
    "ex2: position lengths[b] included": ("ex2", "< lengths[:, None]", "<= lengths[:, None]", "test_ex2_hidden"),
    "ex2: padded values not zeroed": ("ex2", "    v = v.masked_fill(~valid[:, None, :, None], 0.0)\n", "",
                                      "test_ex2_hidden"),
    "ex2: KV heads tiled, not interleaved": ("ex2", "repeat_interleave(h // hkv, dim=1)", "repeat(1, h // hkv, 1, 1)",
                                            "test_ex2_hidden"),
    "ex3: the ring never wraps (the last slot overwritten)": ("ex3", "slots = self.lengths[rows] % self.window",
                                                              "slots = self.lengths[rows].clamp(max=self.window - 1)",
                                                              "test_ex3_visible"),
    "ex3: every length advanced, active or not": ("ex3", "self.lengths[rows] += 1", "self.lengths += 1", "test_ex3_hidden"),
    "ex3: active ignored": ("ex3", "rows = torch.arange(want[0]) if active is None else torch.nonzero(active).flatten()",
                            "rows = torch.arange(want[0])", "test_ex3_hidden"),
    "ex3: attend over the whole ring from the first token": ("ex3", "self.lengths.clamp(max=self.window)",
                                                             "torch.full_like(self.lengths, self.window)", "test_ex3_visible"),
    "ex3: attend before append allowed": ("ex3", "        if bool((self.lengths == 0).any()):\n", "        if False:\n",
                                          "test_ex3_hidden"),
    "ex3: shapes not checked": ("ex3", "        if tuple(k.shape) != want or tuple(v.shape) != want:\n", "        if False:\n",
                                "test_ex3_hidden"),
}


# The exercise file's tests: every solution passes its test cells; every wrong answer is caught by
# the test cell named for it; llmu's own answer fails every test cell (cell metadata is checked in
# tests/course/test_notebooks.py).
(notebook, test_solutions_pass_all_tests, test_wrong_answers_fail,
 test_library_answers_fail) = course.exercise_tests(
    NOTEBOOK, EXERCISES, WRONG)


# The figures the notebook's prose states, recomputed from llmu's code and SmolLM2's config (no model).

def _prose(grade_id: str) -> str:
    return course.cells_by_grade_id(NOTEBOOK)[grade_id]


def _smollm2_cache_bytes(tokens: int, dtype) -> float:
    from llmu.kvcache.reference import kv_cache_bytes
    from llmu.models import LlamaConfig

    c = LlamaConfig()  # SmolLM2-135M's shape
    return kv_cache_bytes(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, tokens, 1, dtype)


def test_cache_read_next_to_the_weights():
    """Section 2: SmolLM2's float32 cache per token, at 192 and 2048 tokens, against its weights."""
    import torch

    from llmu.models import LlamaConfig

    text = _prose("speedup_read")
    per_token = _smollm2_cache_bytes(1, torch.float32)
    weights = LlamaConfig().num_parameters() * 4
    assert per_token == 46_080 and "$46\\,080$ bytes per token" in text
    assert _smollm2_cache_bytes(192, torch.float32) < 9e6 and "under 9 MB at 192 tokens" in text
    assert f"{round(weights / 1e6)} MB" == "538 MB" and "538 MB" in text
    at_2048 = _smollm2_cache_bytes(2048, torch.float32)
    assert f"{at_2048 / 1e6:.0f} MB" == "94 MB" and "at 2048 tokens it is 94 MB" in text
    assert f"{100 * at_2048 / weights:.1f} %" == "17.5 %" and "17.5 % of the weights" in text
    assert "9 MB at 2048" not in text


def test_seventy_billion_cache_next_to_its_weights():
    """The introduction: LLaMA-2-70B's real cache (8 KV heads) for 16 x 8192 tokens in fp16, against
    70 B fp16 weights."""
    import torch

    from llmu.kvcache.reference import kv_cache_bytes

    cache = kv_cache_bytes(80, 8, 128, 8192, 16, torch.float16)
    share = cache / (70e9 * 2)
    assert f"{cache / 1e9:.1f} GB" == "42.9 GB" and 0.29 < share < 1 / 3
    text = _prose("intro")
    assert "42.9 GB, close to a third of its weights" in text and "more than the\nweights" not in text


def test_kv_cache_decode_lengths():
    """Sections 2 and 6: the lengths the kv_cache_decode entry measures on a CPU and on a GPU."""
    from llmu.kvcache.bench import KV_CACHE_DECODE

    assert [s["T"] for s in KV_CACHE_DECODE.cpu_sizes] == [128, 512, 2048]
    assert [s["T"] for s in KV_CACHE_DECODE.gpu_sizes] == [128, 512, 2048, 4096]
    assert "measures 128, 512 and 2048 on a CPU" in _prose("speedup_md")
    assert "T = 128, 512 and 2048 on a CPU, and 4096 as well on a\n  GPU" in _prose("bench_md")
