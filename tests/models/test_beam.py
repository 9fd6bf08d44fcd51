"""Beam search (llmu.models.beam) and the table model notebook 02's exercise 5 is graded with.

What is checked: one beam is greedy decoding; with ``num_beams >= V ** steps`` nothing is pruned,
so the result is the best of every continuation (tried one by one); EOS ends a beam, only the top
``num_beams`` candidates finish, and ``num_beams`` finished beams stop the search; the length
penalty's convention (EOS counted, the prompt not); the cached search equals the search without a
cache (on a model that reads its past from the cache's rows, so unordered rows would show);
transformers' ``generate(num_beams=..., early_stopping=True)`` gives the same sequences and scores
on the same tiny checkpoint; bad arguments raise.
"""

from __future__ import annotations

import math

import pytest
import torch

import llmu  # noqa: F401
from llmu.grading import CheckFailed
from llmu.grading.beam import TableModel, call_beam_search, exhaustive_search
from llmu.models import KVCache, generate_ids, tiny_llama
from llmu.models.beam import BeamSearchResult, beam_search, reorder_cache

PROMPT = [3, 14, 15, 92, 65]


def table_of(vocab_size, probs, **kw):
    """A table model whose listed sequences have the given next-token probabilities."""
    return TableModel(vocab_size, probs=probs, **kw)


def score_of(model, prompt, ids, length_penalty):
    """The summed log-probability of ``ids`` after ``prompt`` / len(ids) ** length_penalty, recomputed."""
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt) + list(ids)])).logits[0, len(prompt) - 1:-1].float()
    total = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(ids)[:, None]).sum()
    return float(total) / len(ids) ** length_penalty


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(0)


# -- one beam, all beams ------------------------------------------------------------------------

@pytest.mark.parametrize("eos_at", [None, 0, 3])
@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.0])
def test_one_beam_is_greedy(tiny, eos_at, length_penalty):
    greedy = list(generate_ids(tiny, PROMPT, 10))
    eos = None if eos_at is None else greedy[eos_at]
    expected = greedy if eos is None else greedy[:greedy.index(eos) + 1]
    result = beam_search(tiny, PROMPT, 1, 10, eos, length_penalty)
    assert isinstance(result, BeamSearchResult)
    assert result.ids == expected
    assert result.score == pytest.approx(score_of(tiny, PROMPT, expected, length_penalty), abs=1e-4, rel=1e-5)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize(("eos", "length_penalty"), [(2, 0.0), (2, 1.0), (2, 2.0), (2, -0.5), (0, 1.0), (None, 1.0)])
def test_enough_beams_find_the_best_of_every_sequence(seed, eos, length_penalty):
    model = TableModel(3, seed)
    best_ids, best_score = exhaustive_search(model, [1, 0], 3, eos, length_penalty)
    result = beam_search(model, [1, 0], 27, 3, eos, length_penalty)     # 27 = 3 ** 3: nothing pruned
    assert result.ids == best_ids
    assert result.score == pytest.approx(best_score, abs=1e-6)


def test_enough_beams_on_two_tokens_and_four_steps():
    for seed in range(4):
        model = TableModel(2, seed)
        for eos in (1, None):
            assert beam_search(model, [0], 16, 4, eos, 1.0).ids == exhaustive_search(model, [0], 4, eos, 1.0)[0]


def test_beams_find_what_greedy_misses():
    # after [0]: token 1 (0.5) or 2 (0.4); after [0, 1] EOS (3) is at most 0.35, after [0, 2] it is 0.8
    model = table_of(4, {(0,): [0.05, 0.5, 0.4, 0.05], (0, 1): [0.25, 0.25, 0.15, 0.35],
                         (0, 2): [0.05, 0.05, 0.1, 0.8]})
    assert beam_search(model, [0], 1, 3, 3, 0.0) == BeamSearchResult([1, 3], pytest.approx(math.log(0.175)))
    assert beam_search(model, [0], 2, 3, 3, 0.0) == BeamSearchResult([2, 3], pytest.approx(math.log(0.32)))


# -- EOS and the length penalty -----------------------------------------------------------------

LENGTHS = {(0,): [0.05, 0.45, 0.1, 0.4], (0, 1): [0.05, 0.9, 0.03, 0.02], (0, 1, 1): [0.05, 0.9, 0.03, 0.02],
           (0, 2): [0.4, 0.3, 0.2, 0.1]}


@pytest.mark.parametrize(("length_penalty", "ids", "score"), [
    (0.0, [3], math.log(0.4)),                       # plain sums: log 0.4 > log 0.3645
    (1.0, [1, 1, 1], math.log(0.3645) / 3),          # per token: -0.336 > -0.916
    (2.0, [1, 1, 1], math.log(0.3645) / 9),
    (-1.0, [3], math.log(0.4)),                      # 3 tokens: -1.009 * 3
])
def test_length_penalty_counts_new_tokens_with_the_eos(length_penalty, ids, score):
    model = table_of(4, LENGTHS)
    assert beam_search(model, [0], 2, 3, 3, length_penalty) == BeamSearchResult(ids, pytest.approx(score, abs=1e-6))


def test_the_prompt_does_not_count_in_the_length():
    # the same table after a 4-token prompt: the same choice and score as after a 1-token one
    shifted = table_of(4, {(9, 9, 9) + k: v for k, v in LENGTHS.items()})
    result = beam_search(shifted, [9, 9, 9, 0], 2, 3, 3, 1.0)
    assert result == BeamSearchResult([1, 1, 1], pytest.approx(math.log(0.3645) / 3, abs=1e-6))


def test_an_eos_candidate_ranked_below_num_beams_does_not_finish():
    # one beam: EOS (3) is second after [0] (0.45); the greedy path continues and must win
    model = table_of(4, {(0,): [0.049, 0.5, 0.001, 0.45], (0, 1): [0.4, 0.3, 0.2, 0.1]})
    assert beam_search(model, [0], 1, 2, 3, 0.0).ids == [1, 0]
    # two beams: it ranks second, so it finishes, and it is the best
    assert beam_search(model, [0], 2, 2, 3, 0.0).ids == [3]


def test_finished_beams_are_not_expanded_and_stop_the_search():
    # two beams, both top candidates of step 2 end in EOS: two finished, the search stops there
    model = table_of(4, {(0,): [0.06, 0.5, 0.4, 0.04], (0, 1): [0.05, 0.05, 0.1, 0.8],
                         (0, 2): [0.05, 0.05, 0.1, 0.8]})
    result = beam_search(model, [0], 2, 6, 3, 1.0)
    assert result.ids == [1, 3]
    assert model.calls == 2            # the prefill and one decode step, not six
    for seed in range(8):
        t = TableModel(4, seed)
        ids = beam_search(t, [2], 3, 8, 1, 1.0).ids
        assert 1 not in ids[:-1]


def test_no_eos_runs_to_max_new_tokens(tiny):
    result = beam_search(tiny, PROMPT, 3, 7)
    assert len(result.ids) == 7
    assert result.score == pytest.approx(score_of(tiny, PROMPT, result.ids, 1.0), abs=1e-4)


def test_scores_are_summed_log_probabilities_not_products():
    # 30 steps over 100 nearly equally likely tokens: products of probabilities underflow float32
    model = TableModel(100, 3, scale=0.3)
    result = beam_search(model, [1], 2, 30)
    total = sum(float(model.log_probs_after([1] + result.ids[:i])[t]) for i, t in enumerate(result.ids))
    assert total < math.log(torch.finfo(torch.float32).tiny) - 20   # far below float32's range as a product
    assert result.score == pytest.approx(total / 30, abs=1e-5)


# -- the cache ----------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("eos", [0, None])
def test_cached_search_equals_search_without_cache_on_a_table(seed, eos):
    model = TableModel(5, seed)
    with_cache = beam_search(model, [4, 1], 3, 8, eos)
    model.tokens_fed = 0
    without = beam_search(model, [4, 1], 3, 8, eos, use_cache=False)
    assert with_cache.ids == without.ids and with_cache.score == pytest.approx(without.score, abs=1e-6)


def test_cached_search_feeds_one_token_per_beam(tiny):
    model = TableModel(5, 1)
    beam_search(model, [4, 1], 3, 8)
    assert model.tokens_fed <= 2 + 3 * 7       # the prompt, then at most 3 beams for 7 steps
    model.tokens_fed = 0
    beam_search(model, [4, 1], 3, 8, use_cache=False)
    assert model.tokens_fed > 3 * 10


@pytest.mark.parametrize(("num_beams", "eos", "length_penalty"), [(2, None, 1.0), (3, 44, 1.0), (4, 44, 2.0),
                                                                  (4, 44, 0.0)])
def test_cached_search_equals_search_without_cache_on_a_model(tiny, num_beams, eos, length_penalty):
    a = beam_search(tiny, PROMPT, num_beams, 10, eos, length_penalty)
    b = beam_search(tiny, PROMPT, num_beams, 10, eos, length_penalty, use_cache=False)
    assert a.ids == b.ids
    assert a.score == pytest.approx(b.score, abs=1e-4, rel=1e-5)


def test_reorder_cache_follows_the_index():
    cache = KVCache(2, 3, 1, 6, 2)
    for layer in range(2):
        x = torch.arange(3, dtype=torch.float32)[:, None, None, None].expand(3, 1, 4, 2) + 10 * layer
        cache.append(layer, x, -x)
    assert reorder_cache(cache, torch.tensor([2, 0, 0, 1])) is cache
    for layer in range(2):
        k, v = cache.get(layer)
        assert k.shape == (4, 1, 4, 2) and cache.k[layer].shape == (4, 1, 6, 2)
        assert k[:, 0, 0, 0].tolist() == [2 + 10 * layer, 10 * layer, 10 * layer, 1 + 10 * layer]
        assert torch.equal(v, -k)
    assert cache.length == 4
    reorder_cache(cache, [3])                  # a list works too; the cache shrinks to one row
    assert cache.get(1)[0][:, 0, 0, 0].tolist() == [11]


def test_reorder_cache_grows_one_row(tiny):
    cache = tiny.new_cache(1, 12)
    tiny(torch.tensor([PROMPT]), cache=cache, last_only=True)
    reorder_cache(cache, torch.zeros(3, dtype=torch.long))
    out = tiny(torch.tensor([[5], [6], [7]]), cache=cache, last_only=True).logits[:, -1]
    for row, token in enumerate((5, 6, 7)):
        alone = tiny(torch.tensor([PROMPT + [token]]), last_only=True).logits[0, -1]
        torch.testing.assert_close(out[row], alone, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("index", "error"), [
    (torch.tensor([0, 3]), ValueError), (torch.tensor([-1]), ValueError), (torch.tensor([], dtype=torch.long), ValueError),
    (torch.tensor([[0]]), ValueError), (torch.tensor([0.0]), ValueError), (torch.tensor([True]), ValueError)])
def test_reorder_cache_rejects_bad_indices(index, error):
    cache = KVCache(1, 3, 1, 4, 2)
    with pytest.raises(error, match="index"):
        reorder_cache(cache, index)


def test_reorder_cache_wants_a_kv_cache():
    with pytest.raises(TypeError, match="cache"):
        reorder_cache([torch.zeros(1)], [0])


# -- arguments ----------------------------------------------------------------------------------

def test_prompt_as_a_tensor_of_one_row(tiny):
    expected = beam_search(tiny, PROMPT, 3, 6, 44)
    assert beam_search(tiny, torch.tensor(PROMPT), 3, 6, 44) == expected
    assert beam_search(tiny, torch.tensor([PROMPT]), 3, 6, 44) == expected


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(num_beams=0), "num_beams"), (dict(num_beams=-1), "num_beams"), (dict(num_beams=2.5), "num_beams"),
    (dict(num_beams=True), "num_beams"), (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=1.5), "max_new_tokens"), (dict(max_new_tokens=200), "max_new_tokens"),
    (dict(eos_token_id=97), "eos_token_id"), (dict(eos_token_id=-1), "eos_token_id"),
    (dict(eos_token_id=True), "eos_token_id"), (dict(eos_token_id=2.0), "eos_token_id"),
    (dict(length_penalty=float("nan")), "length_penalty"), (dict(length_penalty=float("inf")), "length_penalty"),
    (dict(length_penalty="1"), "length_penalty"), (dict(use_cache="yes"), "use_cache"),
    (dict(prompt_ids=[]), "prompt_ids"), (dict(prompt_ids=[97]), "prompt_ids"),
])
def test_bad_arguments_raise_value_error(tiny, kwargs, match):
    args = dict(prompt_ids=PROMPT, num_beams=2, max_new_tokens=4) | kwargs
    with pytest.raises(ValueError, match=match):
        beam_search(tiny, **args)


# -- the grading helpers ------------------------------------------------------------------------

def test_table_model_reads_its_past_from_the_cache():
    model = TableModel(6, 2)
    cache = model.new_cache(1, 8)
    first = model(torch.tensor([[1, 2]]), cache=cache, last_only=True).logits
    assert first.shape == (1, 1, 6) and torch.equal(first[0, 0], model.logits_after([1, 2]))
    reorder_cache(cache, [0, 0])
    nxt = model(torch.tensor([[3], [4]]), cache=cache, last_only=True).logits[:, 0]
    assert torch.equal(nxt[0], model.logits_after([1, 2, 3])) and torch.equal(nxt[1], model.logits_after([1, 2, 4]))
    assert model.tokens_fed == 4 and model.calls == 2
    full = model(torch.tensor([[1, 2, 3]])).logits
    assert full.shape == (1, 3, 6) and torch.equal(full[0, 1], model.logits_after([1, 2]))
    markov = TableModel(6, 2, markov=True)
    assert torch.equal(markov.logits_after([5, 1, 3]), markov.logits_after([3]))
    assert not torch.equal(model.logits_after([5, 1, 3]), model.logits_after([3]))


def test_exhaustive_search_on_a_hand_made_table():
    model = table_of(4, LENGTHS)
    assert exhaustive_search(model, [0], 3, 3, 0.0) == ([3], pytest.approx(math.log(0.4)))
    assert exhaustive_search(model, [0], 3, 3, 1.0) == ([1, 1, 1], pytest.approx(math.log(0.3645) / 3))


def test_call_beam_search_checks_what_comes_back(tiny):
    def good(*args):
        return beam_search(*args).ids, beam_search(*args).score

    ids, score = call_beam_search(good, tiny, PROMPT, 2, 3, None, 1.0, what="x")
    assert len(ids) == 3 and isinstance(score, float)
    for fn, message in ((lambda *a: [1, 2], "not a tuple"), (lambda *a: ([], 0.0), "non-empty list"),
                        (lambda *a: ([1], float("-inf")), "finite float"), (lambda *a: ([5, 44, 2], -1.0), "before"),
                        (lambda *a: 1 / 0, "ZeroDivisionError")):
        with pytest.raises(CheckFailed, match=message):
            call_beam_search(fn, tiny, PROMPT, 2, 3, 44, 1.0, what="x")


# -- transformers -------------------------------------------------------------------------------

TINY_HF = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    """transformers' LlamaForCausalLM with random weights, and llmu's model loaded from its checkpoint."""
    transformers = pytest.importorskip("transformers")
    from llmu.models import load_hf_checkpoint

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_HF, tie_word_embeddings=False))
    with torch.no_grad():   # larger than the initialisation: peaked, varied next-token distributions
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    folder = tmp_path_factory.mktemp("hf_beam")
    hf.eval().save_pretrained(folder, safe_serialization=True)
    return hf, load_hf_checkpoint(folder)


@pytest.mark.parametrize("num_beams", [2, 3, 4])
@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.0, -1.0])
@pytest.mark.parametrize("eos_at", [2, 5, None])
def test_same_sequences_and_scores_as_transformers(hf_pair, num_beams, length_penalty, eos_at):
    hf, ours = hf_pair
    prompt = [5, 17, 42, 8]
    greedy = beam_search(ours, prompt, 1, 12, None).ids
    eos = None if eos_at is None else greedy[eos_at]
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, num_beams=num_beams,
                          early_stopping=True, length_penalty=length_penalty, eos_token_id=eos,
                          pad_token_id=0 if eos is None else eos, return_dict_in_generate=True, output_scores=True)
    expected = out.sequences[0, len(prompt):].tolist()
    if eos is not None and eos in expected:
        expected = expected[:expected.index(eos) + 1]      # the padding after EOS
    result = beam_search(ours, prompt, num_beams, 12, eos, length_penalty)
    assert result.ids == expected
    assert result.score == pytest.approx(out.sequences_scores[0].item(), abs=1e-4, rel=1e-5)
