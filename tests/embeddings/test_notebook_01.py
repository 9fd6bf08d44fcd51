"""Notebook 01's graded exercises, run in-process (no kernel, no model): the instructor's solutions
pass every test cell, hidden parts included, and typical wrong answers fail them.

Exercises 1 and 2 are tokenization: training byte-level BPE (``train_bpe``, compared merge for merge
with ``llmu.tokenization.train_bpe``) and a tokenizer class that encodes and decodes with the merges
(``MyTokenizer``, compared with ``llmu.tokenization.BPETokenizer``); their test cells share the locked
helper cell ``bpe_check_helpers``. The others run on random row sets; the model is loaded only by the
notebook's demonstration cells (neighbours in SmolLM2's table, PCA, hidden states), which the
course-wide notebook tests execute. Exercise 4 builds on exercise 3's ``cosine_similarity_matrix``;
exercise 5 is a Triton kernel that the locked launcher ``my_cosine`` (cell ``ex5_launcher``) wraps,
run with ``kernel_device()`` as torch's default device (a no-op in the interpreter, cuda when compiled).

The figures of the prose (the cosine's FLOPs per byte, the H100's ridge point and where the cosine
turns compute-bound, TF32's digits; the worked BPE example's counts) are recomputed from llmu's code,
and the test cells are checked to read nothing that only a demonstration cell defines.
"""

from __future__ import annotations

import math

import torch

import llmu  # noqa: F401  (Triton mode first: the exercise kernel is defined below)
from llmu import course

NOTEBOOK = course.repo_root() / "solutions" / "01_embeddings" / "01_embeddings.ipynb"


EXERCISES = {
    "ex1": course.Exercise("ex1_solution", ("ex1_visible", "ex1_hidden"), after=("bpe_check_helpers",)),
    "ex2": course.Exercise("ex2_solution", ("ex2_visible", "ex2_hidden")),
    "ex3": course.Exercise("ex3_solution", ("ex3_visible", "ex3_hidden")),
    "ex4": course.Exercise("ex4_solution", ("ex4_visible", "ex4_hidden"), before=("ex3_solution",)),
    "ex5": course.Exercise("ex5_solution", ("ex5_visible", "ex5_hidden"), after=("ex5_launcher",)),
}


WRONG = {
    # exercise, replaced text, replacement, the test cell that must catch it
    "ex1: ties to the smallest pair": ("ex1", "max(counts, key=lambda pair: (counts[pair], pair))",
                                       "min(counts, key=lambda pair: (-counts[pair], pair))", "ex1_visible"),
    "ex1: ties left to dict order": ("ex1", "max(counts, key=lambda pair: (counts[pair], pair))",
                                     "max(counts, key=lambda pair: counts[pair])", "ex1_visible"),
    "ex1: counts not weighted by word frequency": ("ex1", "counts[pair] += n", "counts[pair] += 1", "ex1_visible"),
    "ex1: special tokens counted as text": ("ex1", "split_special_tokens(text, special_tokens)",
                                            "split_special_tokens(text, [])", "ex1_visible"),
    "ex1: special tokens given no id": ("ex1", '        vocab[len(vocab)] = tok.encode("utf-8")\n',
                                        "        pass\n", "ex1_visible"),
    "ex1: no pre-tokenisation": ("ex1", "for word in pretokenize_gpt2(piece):", "for word in [piece]:",
                                 "ex1_visible"),
    "ex1: merged token not added to vocab": ("ex1", "vocab[len(vocab)] = best[0] + best[1]",
                                             "vocab[len(vocab)] = best[0]", "ex1_visible"),
    "ex1: vocab_size not checked": ("ex1", "if vocab_size < 256 + len(special_tokens):", "if False:", "ex1_hidden"),
    "ex1: overlapping merges merged twice": ("ex1", "merged.append(best[0] + best[1])\n                    i += 2",
                                             "merged.append(best[0] + best[1])\n                    i += 1",
                                             "ex1_hidden"),
    "ex2: merges applied left to right": ("ex2", "_, best = min(ranked)", "_, best = ranked[0]", "ex2_visible"),
    "ex2: latest merge first": ("ex2", "_, best = min(ranked)", "_, best = max(ranked)", "ex2_visible"),
    "ex2: special tokens not cut out": ("ex2", "split_special_tokens(text, self.special_tokens)",
                                        "split_special_tokens(text, [])", "ex2_visible"),
    "ex2: shortest special token first": ("ex2", "split_special_tokens(text, self.special_tokens)",
                                          "split_special_tokens(text, sorted(self.special_tokens, key=len)[:1])",
                                          "ex2_hidden"),
    "ex2: no pre-tokenisation": ("ex2", "for word in self.pretokenize(piece):", "for word in [piece]:",
                                 "ex2_hidden"),
    "ex2: decode without errors='replace'": ("ex2", '.decode("utf-8", errors="replace")', '.decode("utf-8")',
                                             "ex2_hidden"),
    "ex2: decode token by token": ("ex2", 'return b"".join(self.vocab[i] for i in ids).decode("utf-8", errors="replace")',
                                   'return "".join(self.vocab[i].decode("utf-8", errors="replace") for i in ids)',
                                   "ex2_hidden"),
    "ex3: norms over the wrong axis": ("ex3", "a / a.norm(dim=1, keepdim=True)", "a / a.norm(dim=0, keepdim=True)",
                                       "ex3_visible"),
    "ex3: table rows not normalised": ("ex3", "b_unit = b / b.norm(dim=1, keepdim=True).clamp_min(eps)",
                                       "b_unit = b", "ex3_visible"),
    "ex3: norms not clamped": ("ex3", ".norm(dim=1, keepdim=True).clamp_min(eps)", ".norm(dim=1, keepdim=True)",
                               "ex3_hidden"),
    "ex4: dot product instead of cosine": ("ex4", "scores = cosine_similarity_matrix(queries, table)",
                                           "scores = queries @ table.T", "ex4_visible"),
    "ex4: least similar first": ("ex4", "torch.topk(scores, k, dim=1)", "torch.topk(scores, k, dim=1, largest=False)",
                                 "ex4_visible"),
    "ex4: exclude ignored": ("ex4", "    if exclude is not None:\n        scores = scores.clone()",
                             "    if False:\n        scores = scores.clone()", "ex4_hidden"),
    "ex4: excluded row still counted for k": ("ex4", "available = table.shape[0] - (0 if exclude is None else 1)",
                                              "available = table.shape[0]", "ex4_hidden"),
    "ex5: only the first chunk of D": ("ex5", "for d0 in range(0, D, BLOCK_D):",
                                       "for d0 in range(0, BLOCK_D, BLOCK_D):", "ex5_visible"),
    "ex5: norms not clamped": ("ex5", "a_norm = tl.maximum(tl.sqrt(a_sq), eps)", "a_norm = tl.sqrt(a_sq)",
                               "ex5_hidden"),
    "ex5: row stride taken as D": ("ex5", "a_ptr + rq[:, None] * stride_a", "a_ptr + rq[:, None] * D",
                                   "ex5_hidden"),
}


# The exercise file's tests: every solution passes its test cells; every wrong answer is caught by
# the test cell named for it; llmu's own answers handed back score nothing (cell metadata is
# checked in tests/course/test_notebooks.py).
(notebook, test_solutions_pass_all_tests, test_wrong_answers_fail,
 test_library_answers_fail) = course.exercise_tests(
    NOTEBOOK, EXERCISES, WRONG, on_kernel_device=True, warnings_to_ignore=["ignore::RuntimeWarning"])


def test_setup_cell_loads_no_model(notebook):
    """The exercises must run without the model: the setup cell only imports (the model is loaded
    by the ``load_model`` cell, which no exercise needs)."""
    assert "load_model(" not in notebook.cells["setup"]


# ---------------------------------------------------------------------------------------------
# The figures in the prose, recomputed from llmu's code
# ---------------------------------------------------------------------------------------------

def _prose(grade_id):
    return " ".join(course.cells_by_grade_id(NOTEBOOK)[grade_id].split())


def _cosine_intensity(q, elem):
    from llmu.embeddings.bench import COSINE

    size = {"Q": q, "V": 49152, "D": 576}   # SmolLM2's table, as the benchmark sizes it
    return COSINE.flops(size) / COSINE.bytes(size, elem)


def test_one_query_intensity():
    """One query: 2VD FLOPs over the VD elements of the table (plus one query and V scores)."""
    fp32, bf16 = _cosine_intensity(1, 4), _cosine_intensity(1, 2)
    assert round(fp32, 2) == 0.5 and round(bf16, 2) == 1.0
    text = _prose("bench_md")
    assert f"$2VD / 4VD = {fp32:.1f}$ FLOP per byte" in text
    assert f"in bf16 (2 bytes) it is ${bf16:.0f}$" in text


def test_h100_ridge_and_where_the_cosine_turns_compute_bound():
    from llmu.bench.peaks import GPU_PEAKS

    h100 = next(peak for _, peak in GPU_PEAKS if peak.name == "NVIDIA H100 SXM")
    tflops, bandwidth = h100.tflops_for("bfloat16"), h100.bandwidth_gbs
    ridge = tflops * 1e12 / (bandwidth * 1e9)
    queries = next(q for q in range(1, 10_000) if _cosine_intensity(q, 2) >= ridge)
    text = _prose("bench_md")
    assert f"{int(tflops)} TFLOP/s in bf16 against {bandwidth / 1000:g} TB/s" in text
    assert f"about {round(ridge, -2):.0f} FLOPs per byte" in text
    assert f"from about {round(queries, -2)} queries on" in text


def test_tf32_digits():
    """TF32 keeps float32's exponent and 10 of its 23 mantissa bits (11 with the implicit one)."""
    tf32 = math.floor(11 * math.log10(2))
    fp32 = math.floor(-math.log10(torch.finfo(torch.float32).eps / 2))   # 24 bits
    assert (tf32, fp32) == (3, 7)
    assert (f"whose 10-bit mantissa keeps about {tf32} significant decimal digits instead of float32's {fp32}"
            in _prose("library_md"))


def test_the_benchmark_times_your_kernel_beside_llmus(notebook, tmp_path):
    """The benchmark cell passes exercise 5's kernel (through ``my_cosine``) as llmu's kernel of
    ``cosine_similarity`` is called, ``fn(queries, table)``: with the solution in place it gives
    llmu's output, here on tiles ragged in Q, V and D."""
    assert notebook.check_bench_yours(tmp_path, {"cosine_similarity": "ex5"},
                                      sizes={"cosine_similarity": {"Q": 5, "V": 70, "D": 100}}) == \
        {"cosine_similarity": "ok"}


# ---------------------------------------------------------------------------------------------
# Tokenization: the worked example's counts and the merges the prose quotes, from llmu's trainer
# ---------------------------------------------------------------------------------------------

def test_worked_bpe_example_counts():
    from collections import Counter

    from llmu.tokenization import count_words, train_bpe

    corpus = ("low low low low low lower lower newest newest newest newest newest newest "
              "widest widest widest")
    counts = Counter()
    for word, n in count_words(corpus).items():
        for pair in zip(word, word[1:]):
            counts[bytes([pair[0]]), bytes([pair[1]])] += n
    assert counts[b"s", b"t"] == counts[b"e", b"s"] == 9 == max(counts.values())
    merges = train_bpe(corpus, 256 + 8)[1]
    assert merges[:2] == [(b"s", b"t"), (b"e", b"st")] and merges[-1] == (b" ", b"newest")
    text = _prose("bpe_example_read")
    assert '`"s"+"t"` and `"e"+"s"` both occur 9 times (6 in *newest*, 3 in *widest*)' in text
    assert '`"e"+"st"` has count 9' in text and '`" newest"`' in text


def test_first_merges_on_the_essays():
    from llmu.data import text
    from llmu.tokenization import train_bpe

    merges = train_bpe(text("essays"), 256 + 4)[1]
    assert merges == [(b" ", b"t"), (b"h", b"e"), (b" ", b"a"), (b" t", b"he")]
    assert '`" "+"t"`, `"h"+"e"`, `" "+"a"`, then `" t"+"he"` makes `" the"`' in _prose("essay_merges_md")
    assert f"({round(len(text('essays').encode()) / 1000)} kB)" in _prose("essay_merges_md")


def test_smollm2_figures_in_the_prose():
    from llmu.tokenization import smollm2_vocab_merges

    vocab, merges, specials = smollm2_vocab_merges()
    text = _prose("smollm2_md")
    assert f"{len(vocab):,} tokens ({len(specials)} of them special" in text
    assert f"{len(merges):,} merges in rank order" in text
