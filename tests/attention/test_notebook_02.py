"""Notebook 02's graded exercises, run in-process (no kernel, no model): the instructor's solutions
pass every test cell, hidden parts included, and typical wrong answers fail them.

The whole notebook (model cells, widgets, benchmark) is executed by the course-wide notebook tests.

The cells make their tensors without naming a device; they are run with ``kernel_device()`` as
torch's default device (a no-op in the interpreter, cuda when the kernels are compiled), so the
exercise kernel gets tensors it can read.

The figures of the prose (softmax's operations per byte, how often the naive kernel reads its
scores, where the last word of the attention example falls) are recomputed from llmu's code and
the tokenizer; the temperature is written τ, never T (T is a sequence length); the test cells read
nothing that only a demonstration cell defines, and each ends with a ``passed(...)`` line.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import llmu  # noqa: F401  (Triton mode first: the exercise kernel is defined below)
from llmu import course

NOTEBOOK = Path(__file__).resolve().parents[2] / "solutions" / "02_attention" / "02_attention.ipynb"


EXERCISES = {"ex1": course.Exercise.numbered(1), "ex2": course.Exercise.numbered(2),
             "ex3": course.Exercise.numbered(3, after=["ex3_launcher"]), "ex4": course.Exercise.numbered(4),
             "ex5": course.Exercise.numbered(5)}


# Exercise 2's GQA: query head h must use KV head h // (H // Hkv); tiling the KV heads gives it h % Hkv.
_GROUPED = ("k = reference.repeat_kv(k, n_heads // n_kv_heads)\n"
            "    v = reference.repeat_kv(v, n_heads // n_kv_heads)")
_TILED = ("k = k.repeat(1, n_heads // n_kv_heads, 1, 1)\n"
          "    v = v.repeat(1, n_heads // n_kv_heads, 1, 1)")

# Exercise 5's candidates: one topk over all beams' n * V scores, or (wrong) each beam's own top
# candidates, walked beam after beam.
_GLOBAL_TOPK = "top, flat = (sums[:, None] + logp).flatten().topk(min(2 * num_beams, logp.numel()))"
_PER_BEAM_TOPK = ("per_beam = (sums[:, None] + logp).topk(min(2 * num_beams, vocab), dim=-1)\n"
                  "            top = per_beam.values.flatten()\n"
                  "            flat = (per_beam.indices + vocab * torch.arange(len(seqs), device=device)[:, None]).flatten()")

WRONG = {
    # exercise, replaced text, replacement, the test cell that must catch it
    "ex1: no max subtraction": ("ex1", "z = z - z.amax(dim=-1, keepdim=True)", "z = z", "test_ex1_hidden"),
    "ex1: logits times the temperature": ("ex1", "z = logits / temperature", "z = logits * temperature",
                                          "test_ex1_visible"),
    "ex1: bad temperature accepted": ("ex1", "if not temperature > 0:\n        raise", "if False:\n        raise",
                                      "test_ex1_hidden"),
    "ex2: top-left causal mask": ("ex2", "j > i + (tk - tq)", "j > i", "test_ex2_hidden"),
    "ex2: no 1/sqrt(D) scale": ("ex2", " / math.sqrt(q.shape[-1])", "", "test_ex2_visible"),
    "ex2: KV heads tiled, not grouped": ("ex2", _GROUPED, _TILED, "test_ex2_hidden"),
    "ex3: sum not rescaled": ("ex3", "s = s * tl.exp(m - m_safe) +", "s = s +", "test_ex3_visible"),
    "ex3: temperature left out of pass 2": ("ex3", 'mask=mask, other=-float("inf")).to(tl.float32) / temperature',
                                            'mask=mask, other=-float("inf")).to(tl.float32)', "test_ex3_visible"),
    "ex3: NaN on -inf blocks": ("ex3", 'tl.where(m_new == -float("inf"), 0.0, m_new)', "m_new", "test_ex3_hidden"),
    "ex4: greedy ignored": ("ex4", "    if temperature == 0:\n        return F.one_hot(z.argmax(dim=-1), z.shape[-1]).float()\n",
                            "    if temperature == 0:\n        temperature = 1.0\n", "test_ex4_visible"),
    "ex4: top-p drops the token that crosses p": ("ex4", "p.cumsum(dim=-1) - p >= top_p", "p.cumsum(dim=-1) >= top_p",
                                                 "test_ex4_visible"),
    "ex4: min-p against the first token, not the largest": ("ex4", "min_p * p.amax(dim=-1, keepdim=True)",
                                                            "min_p * p[..., :1]", "test_ex4_hidden"),
    "ex4: top-p before top-k": ("ex4", """    if 0 < top_k < z.shape[-1]:
        keep = torch.zeros_like(z, dtype=torch.bool).scatter(-1, z.topk(top_k, dim=-1).indices, True)
        z = z.masked_fill(~keep, float("-inf"))
    if top_p < 1:
        sorted_z, order = z.sort(dim=-1, descending=True)
        p = sorted_z.softmax(dim=-1)
        drop = torch.zeros_like(z, dtype=torch.bool).scatter(-1, order, p.cumsum(dim=-1) - p >= top_p)
        z = z.masked_fill(drop, float("-inf"))
""", """    if top_p < 1:
        sorted_z, order = z.sort(dim=-1, descending=True)
        p = sorted_z.softmax(dim=-1)
        drop = torch.zeros_like(z, dtype=torch.bool).scatter(-1, order, p.cumsum(dim=-1) - p >= top_p)
        z = z.masked_fill(drop, float("-inf"))
    if 0 < top_k < z.shape[-1]:
        keep = torch.zeros_like(z, dtype=torch.bool).scatter(-1, z.topk(top_k, dim=-1).indices, True)
        z = z.masked_fill(~keep, float("-inf"))
""", "test_ex4_hidden"),
    "ex4: top-k keeps every tie at the cut": ("ex4", "keep = torch.zeros_like(z, dtype=torch.bool).scatter(-1, z.topk(top_k, dim=-1).indices, True)",
                                              "keep = z >= z.topk(top_k, dim=-1).values[..., -1:]", "test_ex4_hidden"),
    "ex4: temperature after the filters": ("ex4", "    z = z / temperature\n", "", "test_ex4_hidden"),
    "ex4: bad top_k accepted": ("ex4", "or top_k < 0:", "and top_k < 0:", "test_ex4_hidden"),
    "ex5: top-k per beam, not over all beams": ("ex5", _GLOBAL_TOPK, _PER_BEAM_TOPK, "test_ex5_visible"),
    "ex5: num_beams candidates, not 2 * num_beams": ("ex5", "topk(min(2 * num_beams,", "topk(min(num_beams,",
                                                      "test_ex5_hidden"),
    "ex5: raw logits summed, not log-probabilities": (
        "ex5", "logp = torch.log_softmax(model(feed, cache=cache, last_only=True).logits[:, -1].float(), dim=-1)",
        "logp = model(feed, cache=cache, last_only=True).logits[:, -1].float()", "test_ex5_visible"),
    "ex5: probabilities multiplied (float32 underflow)": ("ex5", "(sums[:, None] + logp).flatten()",
                                                          "(sums[:, None].exp() * logp.exp()).log().flatten()",
                                                          "test_ex5_hidden"),
    "ex5: cache rows not reordered (row i stays row i)": (
        "ex5", "index = torch.tensor(parents, device=device)",
        "index = torch.arange(len(parents), device=device) % cache.k[0].shape[0]", "test_ex5_hidden"),
    "ex5: EOS beams kept expanding": ("ex5", "elif len(parents) < num_beams:", "if len(parents) < num_beams:",
                                      "test_ex5_hidden"),
    "ex5: EOS candidates below rank num_beams finish too": ("ex5", "if rank < num_beams:  ", "if True:  ",
                                                            "test_ex5_hidden"),
    "ex5: live beams finish without the length penalty": ("ex5", "finished += [(s / penalty, seq)",
                                                          "finished += [(s, seq)", "test_ex5_visible"),
    "ex5: the length counts the prompt": ("ex5", "penalty = logp.shape[-1], step ** length_penalty",
                                          "penalty = logp.shape[-1], (len(prompt_ids) + step) ** length_penalty",
                                          "test_ex5_hidden"),
    "ex5: the first finished beam returned, not the best": ("ex5", "score, ids = max(finished, key=lambda f: f[0])",
                                                            "score, ids = finished[0]", "test_ex5_hidden"),
    "ex5: num_beams < 1 accepted": ("ex5", "not isinstance(value, int) or value < 1:", "not isinstance(value, int):",
                                    "test_ex5_hidden"),
}


# The exercise file's tests: every solution passes its test cells; every wrong answer is caught by
# the test cell named for it; llmu's own answers handed back score nothing (cell metadata is
# checked in tests/course/test_notebooks.py).
(notebook, test_solutions_pass_all_tests, test_wrong_answers_fail,
 test_library_answers_fail) = course.exercise_tests(
    NOTEBOOK, EXERCISES, WRONG, on_kernel_device=True, warnings_to_ignore=["ignore::RuntimeWarning"])


# Exercise 5's wrong answers fail with a message that names what is wrong, not only "values differ".
EX5_MESSAGES = {
    "ex5: top-k per beam, not over all beams": "two beams find [2, EOS]",
    "ex5: raw logits summed, not log-probabilities": "the greedy tokens' summed log-probability / 8",
    "ex5: probabilities multiplied (float32 underflow)": "returned score -inf",
    "ex5: cache rows not reordered (row i stays row i)": "the whole sequence, read back from the cache",
    "ex5: EOS beams kept expanding": "before their end",
    "ex5: EOS candidates below rank num_beams finish too": "depend on the last token only",
    "ex5: the length counts the prompt": "[EOS] at step 1 against [1, 1, 1] at step 3: its score",
    "ex5: the first finished beam returned, not the best": "[EOS] at step 1 against [1, 1, 1] at step 3: the best",
    "ex5: num_beams < 1 accepted": "num_beams = -1 raises ValueError",
}


@pytest.mark.parametrize("case", list(EX5_MESSAGES))
def test_ex5_wrong_answers_name_the_property(case, notebook, tmp_path):
    message = str(notebook.check_caught(*WRONG[case], workdir=tmp_path))
    assert EX5_MESSAGES[case] in message, message


def test_ex5_solution_is_a_design_of_30_to_50_lines():
    """Beam search with a reordered cache is a real design: its solution region has 30 to 50 lines of code."""
    lines = course.solution_code_lines(course.cells_by_grade_id(NOTEBOOK)["ex5_solution"])
    assert 30 <= lines <= 50, lines


# ---------------------------------------------------------------------------------------------
# The prose: its figures recomputed from llmu's code, its notation
# ---------------------------------------------------------------------------------------------

def _prose(grade_id):
    return " ".join(course.cells_by_grade_id(NOTEBOOK)[grade_id].split())


def test_softmax_operations_per_byte():
    from llmu.attention.bench import softmax_bytes, softmax_flops

    size = {"M": 1, "N": 49152}
    fp32, bf16 = softmax_flops(size) / softmax_bytes(size, 4), softmax_flops(size) / softmax_bytes(size, 2)
    assert (fp32, bf16) == (0.75, 1.5)
    assert f"${fp32:g}$ operations per byte in float32, ${bf16:g}$ in bf16" in _prose("bench_md")


def test_naive_kernel_reads_its_scores_twice():
    from llmu.attention import kernels

    source = inspect.getsource(kernels._attention_kernel.fn)
    assert source.count("tl.store(s_base") == 1 and source.count("tl.load(s_base") == 2
    text = _prose("library_attention_md")
    assert ("writes them to memory, reads them back to find the softmax denominator, and reads them a second time"
            in text)


@pytest.mark.slow   # SmolLM2's tokenizer (not the model)
def test_last_word_comes_three_positions_after_it():
    from llmu.models import load_tokenizer

    cell = course.cells_by_grade_id(NOTEBOOK)["maps_compute"]
    sentence = re.search(r'"tired": "([^"]+)"', cell).group(1)
    tokens = [load_tokenizer().token_to_str(i) for i in load_tokenizer().encode(sentence)]
    it = tokens.index(" it")
    words = "zero one two three four five six seven eight nine ten".split()
    text = _prose("maps_md")
    assert f"the same {words[it + 1]} tokens in both sentences" in text        # "The" .. " it"
    assert f"The last word arrives {words[len(tokens) - 1 - it]} positions later" in text


TEMPERATURE_AS_T = re.compile(r"\bT\s*(=|<|>|\\to)|p_i\(T\)|p\(T\)|/\s*T\b|\bT\s*=\s*\{")


def test_temperature_is_tau_never_T():
    """T is a sequence length in this notebook (and the course); the temperature is τ in the prose
    and `temperature` in code and messages."""
    cells = course.cells_by_grade_id(NOTEBOOK)
    found = {gid: TEMPERATURE_AS_T.findall(text) for gid, text in cells.items() if TEMPERATURE_AS_T.search(text)}
    assert not found, f"temperature written T in {found}"
    assert "temperature** $\\tau > 0$" in cells["temp_md"]
    assert 'description="τ"' in cells["sampling_widget"]


def test_intro_presents_the_sampling_filters_as_a_widget():
    """Softmax with temperature is an exercise, and so are the filters (exercise 4); the widget shows
    llmu's own filters on the real model."""
    cells = course.cells_by_grade_id(NOTEBOOK)
    intro = cells["intro"]
    item = intro[intro.index("3. softmax with temperature"):intro.index("4. what SmolLM2")]
    goal = next(line for line in intro.splitlines() if line.startswith("- ") and "top-p" in line)
    assert "widget" in item and "widget" in goal
    assert "sampling.process_logits" in cells["sampling_widget"]
    assert not any(re.search(r"top_k|top_p|min_p", cells[f"ex{n}_solution"]) for n in (1, 2, 3))
    assert all(name in cells["ex4_solution"] for name in ("top_k", "top_p", "min_p"))


def test_the_benchmark_times_your_kernel_beside_llmus(notebook, tmp_path):
    """The benchmark cell passes exercise 3's kernel (through ``my_softmax_t``) as llmu's kernel of
    ``softmax_temperature`` is called, ``fn(x)`` at the entry's temperature: with the solution in
    place it gives llmu's output, here on rows of 3000 (the last of three 1024-wide blocks ragged)."""
    assert notebook.check_bench_yours(tmp_path, {"softmax_temperature": "ex3"},
                                      sizes={"softmax_temperature": {"M": 3, "N": 3000}}) == \
        {"softmax_temperature": "ok"}
