"""The speculative decoding loop (``llmu.spec.decode``) and its drafts (``llmu.spec.drafts``).

- greedy speculative decoding gives exactly the tokens of plain greedy decoding with a KV cache
  (module 06's ``decode_cached``), for every draft and several ``gamma`` (0 is plain decoding),
  on the tiny model and on SmolLM2; a draft that *is* the target (early exit after every block) has
  every proposal accepted and emits ``gamma + 1`` tokens a step;
- sampling is exact at the sequence level: on a tiny model with a 6-token vocabulary, the first two
  tokens of 3,000 speculative generations (temperature 1, early-exit draft) fit the target's own
  joint distribution, computed by enumeration (chi-square with cells expecting fewer than 5
  samples pooled, false-alarm rate 1e-4, seeded);
- the budget, the end-of-sequence token, the rewinding of a cache, the n-gram lookup, the formula
  for the expected tokens per step, and bad inputs.
"""

from __future__ import annotations

import pytest
import torch

from llmu.kvcache.reference import decode_cached
from llmu.models import tiny_llama
from llmu.models.sampling import SamplingParams
from llmu.spec.decode import expected_tokens_per_step, speculative_generate
from llmu.spec.drafts import Draft, EarlyExitDraft, NGramDraft, rewind
from llmu.spec.stats import chi_square_pvalue

PROMPT = [5, 9, 3, 7, 5, 9, 3]


@pytest.mark.parametrize("gamma", [0, 1, 3, 5])
@pytest.mark.parametrize("kind", ["early1", "early2", "ngram"])
def test_greedy_equals_plain_decoding(kind, gamma):
    model = tiny_llama(0)
    draft = {"early1": EarlyExitDraft(model, 1), "early2": EarlyExitDraft(model, 2), "ngram": NGramDraft()}[kind]
    out = speculative_generate(model, draft, PROMPT, 25, gamma=gamma)
    assert out.tokens == decode_cached(model, PROMPT, 25).tokens
    s = out.stats
    assert sum(s.emitted) == 25 and all(1 <= e <= gamma + 1 for e in s.emitted)
    assert all(a <= p <= gamma for a, p in zip(s.accepted, s.proposed))
    if kind == "early2" and gamma:  # the draft is the whole target: every proposal is accepted
        assert s.acceptance_rate == 1.0 and s.emitted[0] == gamma + 1


@pytest.mark.slow
def test_greedy_equals_plain_decoding_on_smollm2(smollm2):
    model, tokenizer = smollm2
    prompt = tokenizer.encode("Copy this list: apples, pears, plums, apples, pears, plums, apples,")
    want = decode_cached(model, prompt, 16).tokens
    for draft in (NGramDraft(), EarlyExitDraft(model, 6)):
        out = speculative_generate(model, draft, prompt, 16, gamma=3)
        assert out.tokens == want, draft.name


def _joint_two_tokens(model, prompt):
    """The target's exact probabilities of its first two sampled tokens, (V, V)."""
    with torch.no_grad():
        p1 = model(torch.tensor([prompt])).logits[0, -1].softmax(-1)
        v = p1.shape[0]
        seqs = torch.tensor([prompt + [t] for t in range(v)])
        p2 = model(seqs).logits[:, -1].softmax(-1)
    return p1[:, None] * p2


def test_sampling_is_exact_at_the_sequence_level():
    model = tiny_llama(0, scale=0.2, vocab_size=6)  # spread out: p and the draft differ (TV 0.33)
    prompt = [1, 4, 2]
    draft = EarlyExitDraft(model, 1)
    counts = torch.zeros(6, 6)
    g = torch.Generator().manual_seed(0)
    rates = []
    for _ in range(3000):
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=g))
        out = speculative_generate(model, draft, prompt, 2, gamma=2, params=SamplingParams(temperature=1.0, seed=seed))
        counts[out.tokens[0], out.tokens[1]] += 1
        rates.append(out.stats.acceptance_rate)
    joint = _joint_two_tokens(model, prompt)
    assert chi_square_pvalue(counts, joint, pool_below=5) > 1e-4
    assert 0 < sum(rates) / len(rates) < 1  # the draft differs from the target: both outcomes occur


def test_budget_and_eos():
    model = tiny_llama(0)
    plain = decode_cached(model, PROMPT, 12).tokens
    for n in (1, 2, 7):
        assert speculative_generate(model, EarlyExitDraft(model, 2), PROMPT, n, gamma=4).tokens == plain[:n]
    eos = plain[5]
    out = speculative_generate(model, EarlyExitDraft(model, 2), PROMPT, 12, gamma=4, eos_token_id=eos)
    assert out.tokens == plain[: plain.index(eos) + 1]


def test_rewind():
    model = tiny_llama(0)
    cache = model.new_cache(max_len=32)
    model(torch.tensor([[1, 2, 3, 4, 5]]), cache=cache)
    kept, feed = rewind(cache, [1, 2, 3, 4, 5], [1, 2, 3, 9, 9, 9])
    assert (kept, feed, cache.length) == ([1, 2, 3], [9, 9, 9], 3)
    kept, feed = rewind(cache, kept, [1, 2, 3])  # the last context token is always fed again
    assert (kept, feed, cache.length) == ([1, 2], [3], 2)
    with pytest.raises(ValueError, match="holds 2 positions but 3 tokens"):
        rewind(cache, [1, 2, 3], [1, 2, 3, 4])
    with pytest.raises(ValueError, match="at least one token"):
        rewind(cache, [1, 2], [])


def test_ngram_lookup():
    d = NGramDraft(max_ngram=2)
    assert d.lookup([1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]   # "1 2" seen before: what followed it
    assert d.lookup([1, 2, 3, 1, 2, 9, 1, 2], 2) == [9, 1]  # the latest occurrence wins
    assert d.lookup([1, 2, 3, 4], 3) == []                  # nothing repeats
    assert d.lookup([5, 6, 7, 6], 2) == [7, 6]              # falls back to one token
    assert NGramDraft(3, 3).lookup([5, 6, 7, 6], 2) == []
    with pytest.raises(ValueError, match="min_ngram"):
        NGramDraft(1, 2)


def test_expected_tokens_per_step():
    assert expected_tokens_per_step(0.0, 4) == 1.0
    assert expected_tokens_per_step(1.0, 4) == 5.0
    assert expected_tokens_per_step(0.5, 2) == pytest.approx(1.75)
    with pytest.raises(ValueError):
        expected_tokens_per_step(1.5, 2)
    with pytest.raises(ValueError):
        expected_tokens_per_step(0.5, -1)


def test_bad_inputs():
    model = tiny_llama(0)
    d = NGramDraft()
    with pytest.raises(ValueError, match="prompt_ids"):
        speculative_generate(model, d, [], 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        speculative_generate(model, d, PROMPT, 0)
    with pytest.raises(ValueError, match="gamma"):
        speculative_generate(model, d, PROMPT, 4, gamma=-1)
    with pytest.raises(TypeError, match="draft"):
        speculative_generate(model, object(), PROMPT, 4)
    with pytest.raises(ValueError, match="repetition_penalty"):
        speculative_generate(model, d, PROMPT, 4, params=SamplingParams(temperature=1.0, repetition_penalty=1.2))
    with pytest.raises(ValueError, match="num_layers"):
        EarlyExitDraft(model, 3)
    with pytest.raises(RuntimeError, match="begin"):
        EarlyExitDraft(model, 1).propose(PROMPT, 2, SamplingParams())
    assert isinstance(d, Draft)
