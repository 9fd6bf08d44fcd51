"""Logits processors, sampling, and the generation loop (stop strings, seeds, streaming)."""

from __future__ import annotations

import pytest
import torch

import llmu  # noqa: F401
from llmu.models import SamplingParams, generate, stream_generate
from llmu.models.generate import generate_ids
from llmu.models.sampling import (
    apply_temperature,
    min_p_filter,
    next_token,
    process_logits,
    repetition_penalty,
    top_k_filter,
    top_p_filter,
)


def rand_logits(rows=4, vocab=50, seed=0):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


# -- processors ---------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 5, 49, 50, 80])
def test_top_k_keeps_k(k):
    logits = rand_logits()
    out = top_k_filter(logits, k)
    kept = torch.isfinite(out)
    assert (kept.sum(-1) == min(k, 50)).all()
    # the kept ones are the largest, unchanged
    smallest_kept = torch.where(kept, logits, torch.inf).amin(-1)
    largest_dropped = torch.where(kept, -torch.inf, logits).amax(-1)
    assert (smallest_kept > largest_dropped).all()
    assert torch.equal(out[kept], logits[kept])


def test_top_k_ties_keep_exactly_k():
    out = top_k_filter(torch.zeros(1, 10), 3)
    assert torch.isfinite(out).sum() == 3


@pytest.mark.parametrize("p", [0.05, 0.3, 0.5, 0.9, 0.999])
def test_top_p_keeps_the_minimal_nucleus(p):
    logits = rand_logits(rows=6, seed=1)
    out = top_p_filter(logits, p)
    probs = logits.softmax(-1)
    for row in range(logits.shape[0]):
        kept = torch.isfinite(out[row])
        mass = probs[row][kept].sum()
        assert mass >= p - 1e-6  # enough mass
        # minimal: dropping the least likely kept token falls below p
        smallest = probs[row][kept].min()
        assert mass - smallest < p
        # and the kept tokens are the most likely ones
        dropped = probs[row][~kept]
        assert dropped.numel() == 0 or probs[row][kept].min() >= dropped.max()


def test_top_p_matches_transformers():
    tf = pytest.importorskip("transformers")
    logits = rand_logits(rows=5, seed=2)
    for p in (0.2, 0.7, 0.95):
        theirs = tf.TopPLogitsWarper(top_p=p)(None, logits.clone())
        assert torch.equal(torch.isfinite(top_p_filter(logits, p)), torch.isfinite(theirs))


def test_min_p():
    logits = torch.log(torch.tensor([[0.5, 0.26, 0.12, 0.08, 0.04]]))
    out = min_p_filter(logits, 0.2)  # threshold 0.2 * 0.5 = 0.1: 0.12 stays, 0.08 goes
    assert torch.isfinite(out).tolist() == [[True, True, True, False, False]]
    assert torch.equal(min_p_filter(logits, 0.0), logits)


def test_min_p_matches_transformers():
    tf = pytest.importorskip("transformers")
    logits = rand_logits(rows=5, seed=3)
    for mp in (0.05, 0.2, 0.5):
        theirs = tf.MinPLogitsWarper(min_p=mp)(None, logits.clone())
        assert torch.equal(torch.isfinite(min_p_filter(logits, mp)), torch.isfinite(theirs))


def test_repetition_penalty_semantics():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5]])
    context = torch.tensor([[0, 1, 1, 4]])  # token 1 twice: penalised once
    out = repetition_penalty(logits, context, 2.0)
    assert out.tolist() == [[1.0, -4.0, 1.0, -1.0, 0.25]]
    tf = pytest.importorskip("transformers")
    logits = rand_logits(rows=2, seed=4)
    context = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(0))
    theirs = tf.RepetitionPenaltyLogitsProcessor(1.3)(context, logits.clone())
    assert torch.equal(repetition_penalty(logits, context, 1.3), theirs)


def test_temperature():
    logits = rand_logits()
    assert torch.equal(apply_temperature(logits, 2.0), logits / 2)
    sharp, flat = apply_temperature(logits, 0.5).softmax(-1), apply_temperature(logits, 2.0).softmax(-1)
    assert (sharp.amax(-1) > flat.amax(-1)).all()


def test_greedy_ignores_filters_but_not_the_penalty():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    assert next_token(logits, None, SamplingParams()).item() == 1
    # the penalty divides 3.0 by 2: token 2 (2.0) now wins
    assert next_token(logits, torch.tensor([[1]]), SamplingParams(repetition_penalty=2.0)).item() == 2


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([next_token(probs.log()[None], None, SamplingParams(temperature=1.0), g)
                         for _ in range(3000)]).flatten()
    freq = torch.bincount(draws, minlength=3).float() / 3000
    # 3000 draws: a standard error of at most ~0.009; 0.04 is over 4 of them
    assert torch.allclose(freq, probs, atol=0.04)
    filtered = process_logits(probs.log()[None], None, SamplingParams(temperature=1.0, top_k=1))
    assert torch.isfinite(filtered).sum() == 1


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-1), "temperature must be a number >= 0"),
    (dict(top_k=-3), "top_k must be an int >= 0"),
    (dict(top_k=2.5), "top_k must be an int >= 0"),
    (dict(top_p=0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(min_p=-0.1), r"min_p must be in \[0, 1\]"),
    (dict(repetition_penalty=0), "repetition_penalty must be a positive number"),
    (dict(seed="x"), "seed must be an int or None"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_processor_argument_checks():
    logits = rand_logits()
    with pytest.raises(ValueError, match="top_k must be a positive int"):
        top_k_filter(logits, 0)
    with pytest.raises(ValueError, match="temperature must be a positive number"):
        apply_temperature(logits, 0)
    with pytest.raises(ValueError, match=r"logits must be \(vocab,\) or \(batch, vocab\)"):
        top_p_filter(torch.zeros(1, 2, 3), 0.5)


# -- generation on the real model ---------------------------------------------------------------

@pytest.mark.slow
def test_chat_answer(smollm2):
    model, tok = smollm2
    out = generate(model, tok, [{"role": "user", "content": "What is the capital of France?"}], 32)
    assert out == "The capital of France is Paris."
    assert out.finish_reason == "eos" and out.ids[-1] != tok.eos_token_id
    assert out.stats.new_tokens == len(out.ids) + 1  # the EOS token was generated, not returned


@pytest.mark.slow
def test_seeded_sampling_is_reproducible(smollm2):
    model, tok = smollm2
    kw = dict(temperature=0.9, top_k=50, top_p=0.95, min_p=0.02, repetition_penalty=1.1)
    a = generate(model, tok, "Once upon a time", 8, seed=7, **kw)
    b = generate(model, tok, "Once upon a time", 8, seed=7, **kw)
    c = generate(model, tok, "Once upon a time", 8, seed=8, **kw)
    assert a.ids == b.ids
    assert a.ids != c.ids  # 8 sampled tokens at temperature 0.9: a collision is vanishingly unlikely


@pytest.mark.slow
def test_stop_strings_and_streaming(smollm2):
    model, tok = smollm2
    pieces = []
    out = generate(model, tok, "Count: 1, 2, 3,", 24, stop=[" 7", "zzz"], stream=pieces.append)
    assert out.finish_reason == "stop"
    assert out == " 4, 5, 6,"
    assert "".join(pieces) == out  # the stream never shows the stop string
    streamed = list(stream_generate(model, tok, "Count: 1, 2, 3,", 6))
    assert "".join(streamed) == generate(model, tok, "Count: 1, 2, 3,", 6)
    assert len(streamed) > 1


@pytest.mark.slow
def test_length_limit_and_ids_prompt(smollm2):
    model, tok = smollm2
    ids = tok.encode("The capital of France is")
    out = generate(model, tok, ids, 5, stop_on_eos=False)
    assert out.finish_reason == "length" and len(out.ids) == 5 and out.prompt_ids == ids
    assert out.ids == list(generate_ids(model, ids, 5))
    assert generate(model, tok, torch.tensor([ids]), 5, stop_on_eos=False).ids == out.ids


@pytest.mark.slow
def test_streamed_unicode_is_whole(smollm2):
    model, tok = smollm2
    pieces = list(stream_generate(model, tok, "Le mot japonais pour chat est 猫. Le mot pour chien est", 12))
    assert not any("\ufffd" in p for p in pieces[:-1])


@pytest.mark.slow
def test_generate_bad_arguments(smollm2):
    model, tok = smollm2
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 0"):
        generate(model, tok, "hi", -1)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        generate(model, tok, "hi", 10_000)
    with pytest.raises(ValueError, match="prompt is empty"):
        generate(model, tok, "", 3)
    with pytest.raises(ValueError, match="stop must be a str or a list of str"):
        generate(model, tok, "hi", 3, stop=[1])
    with pytest.raises(ValueError, match="stop strings must not be empty"):
        generate(model, tok, "hi", 3, stop="")
    with pytest.raises(ValueError, match="stream must be a callable"):
        generate(model, tok, "hi", 3, stream="yes")
    with pytest.raises(ValueError, match="temperature must be a number >= 0"):
        generate(model, tok, "hi", 3, temperature=-1)
    with pytest.raises(TypeError, match="prompt must be a str"):
        generate(model, tok, 3.5, 3)


def test_probabilities_are_what_sampling_draws_from():
    from llmu.models.sampling import SamplingParams, probabilities, process_logits

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    params = SamplingParams(temperature=0.5, top_k=2)
    p = probabilities(logits, params)
    torch.testing.assert_close(p, process_logits(logits, None, params).softmax(-1))
    assert p.dtype == torch.float32 and p[0, 2:].eq(0).all() and p.sum().item() == pytest.approx(1.0)
