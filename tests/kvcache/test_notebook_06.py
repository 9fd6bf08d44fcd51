"""Notebook 06's graded exercises, run in-process (no kernel, no model): the instructor's solutions
pass every test cell, hidden parts included, typical wrong answers fail the cell named for them,
and llmu's own ``cache_update`` or ``attend_cached`` (or the flash-decoding kernel, or PyTorch's
SDPA) handed back as an answer scores nothing.

Exercises 1 to 3 are plain tensor code checked against ``llmu.kvcache.reference``: the cache update
exactly, the cached attention step to 1e-5 in float32, and the sliding-window ring (exercise 3,
built on exercise 2's step) against attention over each sequence's last ``window`` tokens.
Exercise 4 is flash-decoding: the learner's Triton split kernel (in Triton's interpreter on a CPU,
small shapes) and PyTorch merge, run through the locked launcher ``ex4_launcher`` and checked
against the plain PyTorch ``decode_reference`` of ``ex4_reference``, output and log-sum-exp. The
launcher puts nan in the cache past each sequence's length and behind every input, and a marker
behind the partial results, so the wrong answers below that drop a mask stay inside memory the
buffers own. The whole notebook (SmolLM2's decoding with and without the cache, the calculator,
llmu's kernel, the benchmark) is executed by the course-wide notebook tests.
"""

from __future__ import annotations

import pytest

import llmu  # noqa: F401  (Triton mode first: exercise 4's kernel is defined in the notebook)
from llmu import course

NOTEBOOK = course.repo_root() / "solutions" / "06_kv_cache" / "06_kv_cache.ipynb"


EXERCISES = {f"ex{n}": course.Exercise.numbered(n) for n in (1, 2)}
# exercise 3's ring uses exercise 2's my_attend_cached
EXERCISES["ex3"] = course.Exercise.numbered(3, before=("ex2_solution",), after=("ex3_helpers",))
# exercise 4: the learner's split kernel and merge, with the reference before and the launcher after
EXERCISES["ex4"] = course.Exercise("ex4_kernel", ("test_ex4_visible", "test_ex4_hidden"), before=("ex4_reference",),
                                   after=("ex4_launcher",))


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
    "ex4: scale forgotten": ("ex4", "tl.dot(q, tl.trans(k)) * scale", "tl.dot(q, tl.trans(k))", "test_ex4_visible"),
    "ex4: accumulator not rescaled": ("ex4", "acc = acc * alpha[:, None] + ", "acc = acc + ", "test_ex4_visible"),
    "ex4: stretch end not masked (the next split's keys read)": ("ex4", "keep = offs < end", "keep = offs < length",
                                                                 "test_ex4_visible"),
    "ex4: stretch not clipped to the length": ("ex4", "end = tl.minimum(start + len_split, length)",
                                              "end = start + len_split", "test_ex4_visible"),
    "ex4: split lse without the max": ("ex4", "lse = tl.where(has, m + tl.log(l_safe)", "lse = tl.where(has, tl.log(l_safe)",
                                       "test_ex4_visible"),
    "ex4: group's query heads strided, not consecutive": ("ex4", "heads = bkv * G + g",
                                                          "heads = b * hkv * G + g * hkv + bkv % hkv", "test_ex4_visible"),
    "ex4: padding rows stored": ("ex4", "acc / l_safe[:, None],\n             mask=rows[:, None])",
                                 "acc / l_safe[:, None])", "test_ex4_visible"),
    "ex4: merged lse without the max": ("ex4", "return out, m[..., 0] + torch.log(total)", "return out, torch.log(total)",
                                        "test_ex4_visible"),
    "ex4: no running max (exp overflows)": ("ex4", "m_new = tl.maximum(m, tl.max(s, axis=1))",
                                            "m_new = tl.zeros([BLOCK_G], tl.float32)", "test_ex4_hidden"),
    "ex4: empty split's lse 0, not -inf": ("ex4", "m + tl.log(l_safe), float(\"-inf\"))", "m + tl.log(l_safe), 0.0)",
                                           "test_ex4_hidden"),
    "ex4: merge weights not relative to the max": (
        "ex4", "w = torch.exp(partial_lse - m)", "w = torch.exp(partial_lse)\n    m = torch.zeros_like(m)",
        "test_ex4_hidden"),
    "ex4: an empty split's output not dropped": ("ex4", "o = torch.where(w[..., None] > 0, partial_out, 0.0)",
                                                 "o = partial_out", "test_ex4_hidden"),
}


# What the test cells say for some of exercise 4's mistakes: the property that failed.
EX4_MESSAGES = {
    "ex4: stretch not clipped to the length": "out: 6 query heads over 2 KV heads, lengths 40 and 29, 1 split(s)",
    "ex4: padding rows stored": "the kernel writes nothing past the end of partial_out and partial_lse",
    "ex4: no running max (exp overflows)": "out: sharp queries",
    "ex4: empty split's lse 0, not -inf": "every empty split's partial lse is -inf",
    "ex4: merge weights not relative to the max": "out: sharp queries",
    "ex4: an empty split's output not dropped": "my_combine: splits with lse -inf",
}


# The exercise file's tests: every solution passes its test cells; every wrong answer is caught by
# the test cell named for it; llmu's own answer fails every test cell (cell metadata is checked in
# tests/course/test_notebooks.py).
(notebook, test_solutions_pass_all_tests, test_wrong_answers_fail,
 test_library_answers_fail) = course.exercise_tests(
    NOTEBOOK, EXERCISES, WRONG, warnings_to_ignore=("ignore::RuntimeWarning",))  # a wrong kernel's exp overflowing


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("case", list(EX4_MESSAGES))
def test_ex4_wrong_answers_name_the_property(case, notebook, tmp_path):
    message = str(notebook.check_caught(*WRONG[case], workdir=tmp_path))
    assert EX4_MESSAGES[case] in message, message


def test_ex4_solution_is_a_design_of_30_to_55_lines():
    """Exercise 4's reference answer (the split kernel and the merge) is a real design: its two
    solution regions hold 30 to 55 lines of code together."""
    cell = course.cells_by_grade_id(NOTEBOOK)["ex4_kernel"]
    assert course.solution_region(cell) is not None and cell.count("### BEGIN SOLUTION") == 2
    lines = course.solution_code_lines(cell)
    assert 30 <= lines <= 55, lines


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
