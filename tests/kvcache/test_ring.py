"""llmu.kvcache.ring: a sliding-window cache as a ring buffer, checked against the full cache."""

from __future__ import annotations

import math

import pytest
import torch

from llmu.kvcache import reference
from llmu.kvcache.ring import RingKVCache


def _stream(steps, batch=3, kv_heads=2, head_dim=8, seed=0, ragged=True):
    """``steps`` decode steps: each a new key, value and query per sequence, and which sequences take a token."""
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        active = torch.rand(batch, generator=g) < 0.7 if ragged else torch.ones(batch, dtype=torch.bool)
        if step == 0:
            active[:] = True                                 # everyone holds a token before the first attend
        yield (torch.randn(batch, kv_heads, 1, head_dim, generator=g), torch.randn(batch, kv_heads, 1, head_dim, generator=g),
               torch.randn(batch, 2 * kv_heads, head_dim, generator=g), active)


@pytest.mark.parametrize("window", [1, 4, 7])
def test_the_ring_attends_like_a_full_cache_cut_to_the_window(window):
    """After every step, attention over the ring equals attention over the last ``window`` tokens
    of an ever-growing full cache (tokens in time order): the ring's order does not matter."""
    batch, kv_heads, head_dim, steps = 3, 2, 8, 23
    ring = RingKVCache(batch, kv_heads, window, head_dim)
    full_k, full_v = torch.zeros(batch, kv_heads, steps, head_dim), torch.zeros(batch, kv_heads, steps, head_dim)
    lengths = torch.zeros(batch, dtype=torch.int64)
    for k, v, q, active in _stream(steps, batch, kv_heads, head_dim):
        ring.append(k, v, active)
        for b in torch.nonzero(active).flatten().tolist():
            full_k[b, :, lengths[b]], full_v[b, :, lengths[b]] = k[b, :, 0], v[b, :, 0]
            lengths[b] += 1
        assert torch.equal(ring.lengths, lengths)
        got = ring.attend(q)
        for b in range(batch):
            start = max(0, int(lengths[b]) - window)
            want = reference.attend_cached(q[b:b + 1], full_k[b:b + 1, :, start:lengths[b]],
                                           full_v[b:b + 1, :, start:lengths[b]], lengths[b:b + 1] - start)
            # the same sum over the same terms in another order: float32 rounding only
            torch.testing.assert_close(got[b:b + 1], want, rtol=1e-5, atol=1e-6)
    assert ring.k.shape == (batch, kv_heads, window, head_dim)    # memory: window slots, however long the text


def test_decoding_through_the_ring_is_sliding_window_attention():
    """One sequence decoded token by token through the ring gives, at every position, the causal
    attention whose mask also hides everything ``window`` or more positions back."""
    t, window, kv_heads, heads, d = 19, 5, 1, 2, 8
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, n, t, d, generator=g) for n in (heads, kv_heads, kv_heads))
    pos = torch.arange(t)
    band = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)     # (query, key)
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k.repeat_interleave(heads // kv_heads, 1)) / math.sqrt(d)
    want = torch.softmax(scores.masked_fill(~band, float("-inf")), -1) @ v.repeat_interleave(heads // kv_heads, 1)
    ring = RingKVCache(1, kv_heads, window, d)
    for i in range(t):
        ring.append(k[:, :, i:i + 1], v[:, :, i:i + 1])
        torch.testing.assert_close(ring.attend(q[:, :, i]), want[:, :, i], rtol=1e-5, atol=1e-6)


def test_inactive_sequences_are_left_alone():
    ring = RingKVCache(2, 1, 3, 4)
    ring.append(torch.ones(2, 1, 1, 4), torch.ones(2, 1, 1, 4))
    before = ring.k.clone()
    ring.append(torch.full((2, 1, 1, 4), 7.0), torch.full((2, 1, 1, 4), 7.0), torch.tensor([False, True]))
    assert ring.lengths.tolist() == [1, 2]
    assert torch.equal(ring.k[0], before[0]) and torch.equal(ring.k[1, 0, 1], torch.full((4,), 7.0))


@pytest.mark.parametrize("make, error, match", [
    (lambda: RingKVCache(2, 1, 0, 4), ValueError, "window"),
    (lambda: RingKVCache(2, 1.5, 3, 4), TypeError, "kv_heads"),
    (lambda: RingKVCache(2, 1, 3, 4).append(torch.ones(2, 1, 2, 4), torch.ones(2, 1, 2, 4)), ValueError,
     r"k must be a tensor of shape \(batch, kv_heads, 1, head_dim\) = \(2, 1, 1, 4\), got \(2, 1, 2, 4\)"),
    (lambda: RingKVCache(2, 1, 3, 4).append(torch.ones(2, 1, 1, 4), torch.ones(2, 1, 1, 4), torch.tensor([1, 0])),
     ValueError, "active must be a bool tensor"),
    (lambda: RingKVCache(2, 1, 3, 4).attend(torch.ones(2, 1, 4)), ValueError, r"sequences \[0, 1\] hold no token yet"),
])
def test_bad_input_is_named(make, error, match):
    with pytest.raises(error, match=match):
        make()
