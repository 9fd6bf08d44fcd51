"""Sliding-window perplexity: exact values on models whose answer is known, windows, validation."""

from __future__ import annotations

import math

import pytest
import torch

from llmu.models.perplexity import perplexity, token_nlls, windows


class Uniform:
    """Logits all equal: every token has probability 1/V, so the perplexity is V exactly."""

    def __init__(self, vocab):
        self.vocab = vocab
        self.calls = []

    def __call__(self, ids):
        self.calls.append(tuple(ids.shape))
        return torch.zeros(*ids.shape, self.vocab)


class Bigram:
    """Logits depend only on the current token: a model whose NLL per token is computable by hand,
    and is the same whatever the window (it needs no context), so every stride must agree."""

    def __init__(self, vocab, seed=0):
        self.table = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)

    def __call__(self, ids):
        return self.table[ids]


@pytest.mark.parametrize("vocab", [2, 7, 49152])
@pytest.mark.parametrize("n, window, stride", [(10, 4, 2), (33, 8, 7), (5, 16, 3), (100, 7, 1)])
def test_uniform_model_has_perplexity_vocab_size(vocab, n, window, stride):
    ids = torch.randint(0, vocab, (n,))
    # the cross-entropy of float32 logits is log V to float32 precision (~1e-7 relative)
    assert perplexity(Uniform(vocab), ids, window=window, stride=stride) == pytest.approx(vocab, rel=1e-6)


@pytest.mark.parametrize("window, stride", [(2, 1), (4, 2), (8, 7), (16, 5), (64, 63)])
def test_context_free_model_matches_hand_computation(window, stride):
    model, vocab, n = Bigram(11), 11, 41
    ids = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(1))
    logp = torch.log_softmax(model.table, dim=-1)
    expected = -logp[ids[:-1], ids[1:]]                        # token t+1 given token t
    nll = token_nlls(model, ids, window=window, stride=stride, max_batch_tokens=10)
    torch.testing.assert_close(nll, expected, rtol=1e-12, atol=1e-12)  # float64 throughout
    assert perplexity(model, ids, window=window, stride=stride) == pytest.approx(math.exp(expected.mean().item()))


@pytest.mark.parametrize("n, window, stride", [(2, 2, 1), (3, 2, 1), (10, 4, 2), (10, 4, 3), (11, 4, 3), (3, 8, 2), (1000, 64, 17)])
def test_windows_score_every_token_once(n, window, stride):
    spans = windows(n, window, stride)
    scored = [t for _, end, first in spans for t in range(first, end)]
    assert scored == list(range(1, n))                          # each of tokens 1..n-1 exactly once
    for begin, end, first in spans:
        assert end - begin == min(window, n)                    # same length: batchable
        assert begin < first <= end
        if begin > 0:                                           # full windows keep >= window-stride context
            assert first - begin >= window - stride


def test_batching_does_not_change_the_result():
    model = Bigram(13, seed=2)
    ids = torch.randint(0, 13, (200,), generator=torch.Generator().manual_seed(3))
    one = token_nlls(model, ids, window=16, stride=8, max_batch_tokens=1)
    many = token_nlls(model, ids, window=16, stride=8, max_batch_tokens=10_000)
    assert torch.equal(one, many)


def test_windows_are_batched():
    model = Uniform(5)
    perplexity(model, torch.zeros(100, dtype=torch.long), window=10, stride=9, max_batch_tokens=40)
    assert model.calls[0] == (4, 10)                            # 4 windows of 10 tokens per batch
    assert sum(c[0] for c in model.calls) == len(windows(100, 10, 9))


def test_accepts_lists_and_a_batch_of_one():
    ids = [1, 2, 3, 4, 0]
    m = Uniform(6)
    assert perplexity(m, ids, window=4, stride=2) == pytest.approx(6)
    assert perplexity(m, torch.tensor([ids]), window=4, stride=2) == pytest.approx(6)


@pytest.mark.slow
def test_real_model_longer_context_helps(smollm2):
    from llmu.data import text

    model, tok = smollm2
    ids = tok.encode(text("essays"), add_special_tokens=False)[:192]
    ppl_short = perplexity(model, ids, window=16, stride=15)
    ppl_long = perplexity(model, ids, window=192, stride=191)
    # a real model on real prose: far better than uniform, and better with more context
    assert 1 < ppl_long < ppl_short < 1000


@pytest.mark.parametrize("kwargs, match", [
    (dict(window=1, stride=1), "window"),
    (dict(window=0, stride=1), "window"),
    (dict(window=4.0, stride=2), "window"),
    (dict(window=4, stride=0), "stride"),
    (dict(window=4, stride=4), "stride"),
    (dict(window=4, stride=True), "stride"),
    (dict(window=4, stride=2, max_batch_tokens=0), "max_batch_tokens"),
])
def test_bad_window_or_stride(kwargs, match):
    with pytest.raises(ValueError, match=match):
        perplexity(Uniform(3), torch.zeros(10, dtype=torch.long), **kwargs)


def test_bad_ids():
    with pytest.raises(ValueError, match="at least 2 tokens"):
        perplexity(Uniform(3), torch.zeros(1, dtype=torch.long), window=4, stride=2)
    with pytest.raises(ValueError, match="1-D"):
        perplexity(Uniform(3), torch.zeros(2, 5, dtype=torch.long), window=4, stride=2)
    with pytest.raises(TypeError, match="integer"):
        perplexity(Uniform(3), torch.zeros(5), window=4, stride=2)
