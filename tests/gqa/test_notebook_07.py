"""Notebook 07's graded exercises, run in-process (no kernel, no model): the instructor's solutions
pass every test cell, hidden parts included, typical wrong answers fail the cell named for them,
and llmu's own ``pool_kv_heads``, ``mla_absorbed_scores`` or ``kv_bytes_per_token`` handed back as
an answer scores nothing.

The exercises are ``ex1`` (mean-pooling KV heads), ``ex2`` (the absorbed MLA score, which its
test cell checks on MLA layers it builds itself: random float64 weights, no model), ``ex3``
(KV bytes per token) and ``ex4`` (MLA's decode step with the latent cache and the absorbed
matrices, checked in float32 against the unabsorbed layer over the whole sequence) and ``ex5``
(``MyMLA``, the layer as an ``nn.Module``: keys and values rebuilt over a whole sequence, a latent
cache whose numbers the tests count, and a decode step with the weights absorbed, during which no
operation may return a per-head key or value). The whole notebook (SmolLM2's perplexity after
pooling, the kernel demo, the benchmark) is executed by the course-wide notebook tests.
"""

from __future__ import annotations

import pytest

import llmu  # noqa: F401
from llmu import course

NOTEBOOK = course.repo_root() / "solutions" / "07_gqa_mqa_mla" / "07_gqa_mqa_mla.ipynb"


EXERCISES = {
    "ex1": course.Exercise.numbered(1),
    "ex2": course.Exercise("ex2_solution", ("test_ex2",)),
    "ex3": course.Exercise("ex3_solution", ("test_ex3",)),
    # the text lets the learner reuse exercise 2's absorbed_scores
    "ex4": course.Exercise.numbered(4, before=["ex2_solution"]),
    "ex5": course.Exercise.numbered(5),
}


def test_setup_cell_loads_no_model(notebook):
    """The exercises must run without the model: the setup cell only imports."""
    assert "load_model(" not in notebook.cells["setup"]


WRONG = {
    # case: (exercise, replaced text, replacement, the test cell that must catch it)
    "ex1: first head kept, not the mean": ("ex1", ".mean(dim=1)", "[:, 0]", "test_ex1_visible"),
    "ex1: heads summed": ("ex1", ".mean(dim=1)", ".sum(dim=1)", "test_ex1_visible"),
    "ex1: strided groups (heads j, j + new, ...)": (
        "ex1", "w.reshape(new_kv_heads, r, head_dim, w.shape[1]).mean(dim=1)",
        "w.reshape(r, new_kv_heads, head_dim, w.shape[1]).mean(dim=0)", "test_ex1_hidden"),
    "ex1: no divisibility check": ("ex1", "if new_kv_heads <= 0 or n_kv_heads % new_kv_heads:",
                                   "if new_kv_heads <= 0:", "test_ex1_hidden"),
    "ex2: RoPE part left out": ("ex2", "(content + rope) * scale", "content * scale", "test_ex2"),
    "ex2: no scale": ("ex2", "(content + rope) * scale", "content + rope", "test_ex2"),
    "ex2: scale on the content part only": ("ex2", "(content + rope) * scale", "content * scale + rope", "test_ex2"),
    "ex3: MLA counted twice (K and V)": ("ex3", '"MLA": latent_dim + rope_dim', '"MLA": 2 * (latent_dim + rope_dim)',
                                        "test_ex3"),
    "ex3: MLA without the RoPE key": ("ex3", '"MLA": latent_dim + rope_dim', '"MLA": latent_dim', "test_ex3"),
    "ex3: MHA without the factor 2": ("ex3", '"MHA": 2 * heads * head_dim', '"MHA": heads * head_dim', "test_ex3"),
    "ex3: GQA counted as MHA": ("ex3", '"GQA": 2 * kv_heads * head_dim', '"GQA": 2 * heads * head_dim', "test_ex3"),
    "ex3: MQA with kv_heads": ("ex3", '"MQA": 2 * head_dim', '"MQA": 2 * kv_heads * head_dim', "test_ex3"),
    "ex3: one layer": ("ex3", "return layers * per_layer * bytes_per_value", "return per_layer * bytes_per_value",
                       "test_ex3"),
    "ex4: RoPE part of the score left out": ("ex4", "scores = (content + rope) * p.scale",
                                             "scores = content * p.scale", "test_ex4_visible"),
    "ex4: scale 1/sqrt(d_h), RoPE dims not counted": ("ex4", "scores = (content + rope) * p.scale",
                                                      "scores = (content + rope) / math.sqrt(d_h)", "test_ex4_visible"),
    "ex4: new tokens rotated at positions 0..n-1": ("ex4", "positions = torch.arange(t, t + n, device=x_new.device)",
                                                    "positions = torch.arange(n, device=x_new.device)",
                                                    "test_ex4_visible"),
    "ex4: W_UK split into heads the wrong way": ("ex4", "w_uk = p.w_uk.view(d_c, h, d_h).permute(1, 0, 2)",
                                                 "w_uk = p.w_uk.view(h, d_c, d_h)", "test_ex4_visible"),
    "ex4: W_UK absorbed as W_UV (values with the key matrix)": (
        "ex4", "w_uv = p.w_uv.view(d_c, h, d_h)", "w_uv = p.w_uk.view(d_c, h, d_h)", "test_ex4_visible"),
    "ex4: no causal mask among the new tokens": ("ex4", 'scores.masked_fill(future, float("-inf"))', "scores",
                                                 "test_ex4_hidden"),
    "ex4: mask relative to the new tokens only (T forgotten)": (
        "ex4", "[None, :] > positions[:, None]", "[None, :] > torch.arange(n)[:, None]", "test_ex4_visible"),
    "ex4: caches not checked": ("ex4", "if tuple(cache_c.shape) != (b, t, p.latent_dim) or "
                                       "tuple(cache_kr.shape) != (b, t, p.rope_dim):", "if False:", "test_ex4_hidden"),
    "ex4: n = 0 accepted": ("ex4", "x_new.shape[1] == 0 or ", "", "test_ex4_hidden"),
    "ex5: prefill without the causal mask": ("ex5", 'scores.masked_fill(future, float("-inf"))', "scores",
                                             "test_ex5_visible"),
    "ex5: scale 1/sqrt(d_h), RoPE dims not counted": ("ex5", "1 / math.sqrt(self.d_h + self.d_r)",
                                                      "1 / math.sqrt(self.d_h)", "test_ex5_visible"),
    "ex5: projections kept as plain tensors, not parameters": (
        "ex5", "torch.nn.Parameter(getattr(weights, name).detach().clone())", "getattr(weights, name).detach().clone()",
        "test_ex5_visible"),
    "ex5: the cache keeps the rebuilt keys, as MHA's does": (
        "ex5", "reshape(b, t, -1) @ self.w_o, (c, k_r)", "reshape(b, t, -1) @ self.w_o, (c, k_r, k_c)",
        "test_ex5_visible"),
    "ex5: the decoded token rotated at position 0": ("ex5", "torch.arange(t, t + 1, device=x_new.device)",
                                                     "torch.arange(0, 1, device=x_new.device)", "test_ex5_visible"),
    "ex5: the decoded token does not see itself (attends to the old cache)": (
        "ex5", "o_lat = torch.softmax(scores, dim=-1) @ c[:, None]",
        "o_lat = torch.softmax(scores[..., :-1], dim=-1) @ old_c[:, None]", "test_ex5_visible"),
    "ex5: W_UK absorbed on the value side too": ("ex5", "o = o_lat @ self._heads(self.w_uv)",
                                                 "o = o_lat @ self._heads(self.w_uk)", "test_ex5_visible"),
    "ex5: decode rebuilds the keys and values from the cached latents": (
        "ex5", """        q_lat = q_c @ self._heads(self.w_uk).transpose(-1, -2)                    # (B, H, 1, d_c): W_UK absorbed
        scores = (q_lat @ c[:, None].transpose(-1, -2) + q_r @ k_r[:, None].transpose(-1, -2)) * self.scale
        o_lat = torch.softmax(scores, dim=-1) @ c[:, None]                        # (B, H, 1, d_c)
        o = o_lat @ self._heads(self.w_uv)                                        # (B, H, 1, d_h): W_UV after the sum
""", """        k_c = (c @ self.w_uk).view(b, t + 1, self.h, self.d_h).transpose(1, 2)
        v = (c @ self.w_uv).view(b, t + 1, self.h, self.d_h).transpose(1, 2)
        scores = (q_c @ k_c.transpose(-1, -2) + q_r @ k_r[:, None].transpose(-1, -2)) * self.scale
        o = torch.softmax(scores, dim=-1) @ v
""", "test_ex5_hidden"),
    "ex5: a cache of another batch not checked": ("ex5", "if x_new.shape[0] != old_c.shape[0]:", "if False:",
                                                  "test_ex5_hidden"),
    "ex5: T = 0 accepted": ("ex5", "x.shape[1] == 0 or ", "", "test_ex5_hidden"),
}


# The exercise file's tests: every solution passes its test cells; every wrong answer is caught by
# the test cell named for it; llmu's own answer fails every test cell (cell metadata is checked in
# tests/course/test_notebooks.py).
(notebook, test_solutions_pass_all_tests, test_wrong_answers_fail,
 test_library_answers_fail) = course.exercise_tests(
    NOTEBOOK, EXERCISES, WRONG)


# Exercise 4's wrong answers fail with a message that names what is wrong, not only "values differ".
EX4_MESSAGES = {
    "ex4: RoPE part of the score left out": "the score includes the RoPE part",
    "ex4: scale 1/sqrt(d_h), RoPE dims not counted": "scaled by p.scale = 1/sqrt(d_h + d_r)",
    "ex4: new tokens rotated at positions 0..n-1": "sits at position T = cache_c.shape[1], not 0",
    "ex4: W_UK split into heads the wrong way": "head h owns columns [h*d, (h+1)*d)",
    "ex4: no causal mask among the new tokens": "must not see the new tokens after it",
    "ex4: caches not checked": "raised RuntimeError",
    "ex4: n = 0 accepted": "n = 0 new tokens raises ValueError",
}


@pytest.mark.parametrize("case", list(EX4_MESSAGES))
def test_ex4_wrong_answers_name_the_property(case, notebook, tmp_path):
    message = str(notebook.check_caught(*WRONG[case], workdir=tmp_path))
    assert EX4_MESSAGES[case] in message, message


# ... and so do exercise 5's.
EX5_MESSAGES = {
    "ex5: prefill without the causal mask": "the whole-sequence forward equals the unabsorbed layer",
    "ex5: projections kept as plain tensors, not parameters": "parameters hold the seven projections' numbers",
    "ex5: the cache keeps the rebuilt keys, as MHA's does": "the cache holds B * T * (d_c + d_r) = 400 numbers",
    "ex5: the decoded token rotated at position 0": "the decode step of token 5 equals",
    "ex5: decode rebuilds the keys and values from the cached latents": "builds no per-head key or value",
    "ex5: a cache of another batch not checked": "raised RuntimeError",
    "ex5: T = 0 accepted": "x with T = 0 tokens raises ValueError",
}


@pytest.mark.parametrize("case", list(EX5_MESSAGES))
def test_ex5_wrong_answers_name_the_property(case, notebook, tmp_path):
    message = str(notebook.check_caught(*WRONG[case], workdir=tmp_path))
    assert EX5_MESSAGES[case] in message, message


def test_ex5_solution_is_a_design_of_40_to_70_lines():
    """The capstone's reference answer is a real design: its solution region has 40 to 70 lines of code."""
    lines = course.solution_code_lines(course.cells_by_grade_id(NOTEBOOK)["ex5_solution"])
    assert 40 <= lines <= 70, lines


# The prose's exercise numbers and figures, checked against the cells and recomputed from llmu's code.

def _prose(grade_id: str) -> str:
    return course.cells_by_grade_id(NOTEBOOK)[grade_id]


def test_exercise_numbers_match_grade_ids():
    """Exercise N of the prose is the solution cell exN_solution, and its test cells say so."""
    import json
    import re

    cells = json.loads(NOTEBOOK.read_text())["cells"]
    heading, seen = None, []
    for c in cells:
        text = "".join(c["source"])
        gid = course.nbgrader_meta(c).get("grade_id", "")
        found = re.findall(r"^## Exercise (\d+) ·", text, flags=re.M)
        if found:
            heading = int(found[-1])
        if gid.endswith("_solution"):
            assert gid == f"ex{heading}_solution", f"{gid} follows the heading of exercise {heading}"
            seen.append(heading)
        if course.is_test(c):
            assert gid.startswith(f"test_ex{heading}"), f"{gid} tests exercise {heading}"
            assert f"what='exercise {heading} (" in text
    assert seen == [1, 2, 3, 4, 5]


def test_mla_cache_next_to_mha_and_mqa():
    """Section 3: MLA's bytes per token against MHA's and MQA's, and one 128k-token sequence."""
    from llmu.gqa.reference import kv_cache_table

    rows = {r["scheme"]: r for r in kv_cache_table(context=128 * 1024)}
    mha, mqa, mla = (rows[s]["bytes_per_token"] for s in ("MHA", "MQA", "MLA"))
    text = _prose("bytes_read")
    assert (f"{mla / 1e3:.0f} KB", f"{mha / mla:.0f}×", f"{mha / 1e6:.1f} MB") == ("69 KB", "57×", "3.9 MB")
    assert "MLA's 69 KB per token is 57× less than MHA's 3.9 MB" in text
    assert (mla / mqa, f"{mqa / 1e3:.0f} KB") == (2.25, "31 KB") and "2.25× MQA's 31 KB" in text
    assert "a little more than MQA's" not in text
    assert f"{rows['MHA']['cache_gb']:.0f} GB" == "515 GB" and 3 * 141 < rows["MHA"]["cache_gb"] < 4 * 141
    assert f"{rows['MLA']['cache_gb']:.0f} GB" == "9 GB"
    assert "would need 515 GB of cache: more than\nthree H200s. With MLA it is 9 GB." in text


def test_sparing_layer_0():
    """Section 1: how much leaving layer 0 as GQA(3) lowers the perplexity of pooling every layer."""
    from llmu.data import json as shipped_json

    v = shipped_json("gqa_perplexity")["variants"]
    ratio = v["mqa_mean_layers_1_29"]["perplexity"] / v["mqa_mean"]["perplexity"]
    assert round(1 - ratio, 2) == 0.33
    text = _prose("convert_read")
    assert "already lowers the perplexity by a\nthird" in text and "one layer at a time" not in text


def test_mla_module_bytes_against_mha_and_gqa():
    """Exercise 5 and the summary: the bytes one token leaves in one layer's cache, at DeepSeek-V2-like
    sizes, recomputed from kv_bytes_per_token."""
    from llmu.gqa.reference import DEEPSEEK_V2_LIKE, kv_bytes_per_token

    sizes = dict(DEEPSEEK_V2_LIKE, layers=1)
    mha, gqa, mla = (kv_bytes_per_token(s, **sizes) for s in ("MHA", "GQA", "MLA"))
    figures = (f"{mla:,}", f"{mha:,}", f"{mha / mla:.0f}×", f"{gqa:,}", f"{gqa / mla:.1f}×")
    assert figures == ("1,152", "65,536", "57×", "4,096", "3.6×")
    assert ("1,152 bytes per token and layer in bfloat16, where MHA caches 65,536 bytes (57× more) and GQA with\n"
            "8 KV heads 4,096 (3.6× more)") in _prose("ex5_md")
    assert ("1,152 bytes in bfloat16 at\nDeepSeek-V2-like sizes, 57× less than MHA's 65,536 and 3.6× less than "
            "GQA's 4,096 with 8 KV heads") in _prose("summary")


def test_absorbed_against_rebuilt_arithmetic():
    """Self-check 5: a score's length in each form, and a decode step's arithmetic rebuilding the
    keys and values against attending over the latents, at DeepSeek-V2-like sizes."""
    from llmu.gqa.reference import DEEPSEEK_V2_LIKE as s

    d_c, d_r, d_h = s["latent_dim"], s["rope_dim"], s["head_dim"]
    assert (d_c + d_r, d_h + d_r, (d_c + d_r) / (d_h + d_r)) == (576, 192, 3)
    # per cached token and head: rebuilding k and v is 2 d_c d_h, attending over the latents 2 d_c + d_r
    assert round(2 * d_c * d_h / (2 * d_c + d_r)) == 120
    text = _prose("self_check")
    assert "a dot product of $d_c + d_r$\n   numbers instead of $d_h + d_r$ (576 against 192" in text
    assert "absorbing would triple the arithmetic of the scores" in text
    assert "about\n   120× the $T H (2 d_c + d_r)$" in text
