"""The torch tiled reference: online softmax == softmax, tiled forward == naive attention (any
blocks), lse == logsumexp of the scores, backward formulas == autograd.

Tolerance: everything is float32; the tiled sums add the same terms in another order and rescale
them by exp(m_old - m_new), a few ulps on values of order 1: atol 1e-5.
"""

from __future__ import annotations

import math

import pytest
import torch

from llmu.attention.reference import attention, causal_mask, repeat_kv
from llmu.flash import reference

ATOL = 1e-5


def qkv(b, h, hkv, tq, tk, d, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, tq, d, generator=g) * scale, torch.randn(b, hkv, tk, d, generator=g) * scale,
            torch.randn(b, hkv, tk, d, generator=g))


@pytest.mark.parametrize("n,block", [(1, 4), (37, 8), (100, 100), (100, 7), (300, 64)])
def test_online_softmax_equals_softmax(n, block):
    x = torch.randn(3, n) * 10
    torch.testing.assert_close(reference.online_softmax(x, block), torch.softmax(x, -1), atol=ATOL, rtol=0)
    m, l = reference.online_softmax_stats(x, block)
    torch.testing.assert_close(m, x.amax(-1))
    torch.testing.assert_close(m + l.log(), torch.logsumexp(x, -1), atol=ATOL, rtol=0)


def test_online_softmax_masked_prefix_and_huge_values():
    x = torch.tensor([[-math.inf] * 5 + [1.0, 2.0], [1e4, -1e4, 1e4 - 1, 0, 0, 0, 0]])
    torch.testing.assert_close(reference.online_softmax(x, 2), torch.softmax(x, -1), atol=ATOL, rtol=0)


CASES = [  # (B, H, Hkv, Tq, Tk, D, causal)
    (1, 2, 2, 50, 50, 16, True),
    (2, 6, 2, 33, 70, 32, True),     # chunk after a prefix: bottom-right causal
    (1, 3, 1, 70, 20, 32, False),    # more queries than keys, MQA
    (1, 2, 1, 1, 45, 64, True),      # one decoding query
]


@pytest.mark.parametrize("b,h,hkv,tq,tk,d,causal", CASES)
@pytest.mark.parametrize("bq,bk", [(16, 16), (7, 13), (64, 64)])
def test_tiled_forward_equals_naive(b, h, hkv, tq, tk, d, causal, bq, bk):
    q, k, v = qkv(b, h, hkv, tq, tk, d)
    out, lse = reference.flash_attention(q, k, v, causal=causal, block_q=bq, block_k=bk)
    torch.testing.assert_close(out, attention(q, k, v, causal=causal), atol=ATOL, rtol=0)
    s = q @ repeat_kv(k, h // hkv).transpose(-1, -2) / math.sqrt(d)
    if causal:
        s = s.masked_fill(~causal_mask(tq, tk), -math.inf)
    torch.testing.assert_close(lse, torch.logsumexp(s, -1), atol=ATOL, rtol=0)


def test_large_scores_stay_finite():
    q, k, v = qkv(1, 2, 2, 40, 40, 32, scale=30.0)   # scores of order 30*30*sqrt(32)/sqrt(32) ~ 1e3
    out, lse = reference.flash_attention(q, k, v, causal=True, block_q=16, block_k=16)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(out, attention(q, k, v, causal=True), atol=1e-4, rtol=0)


@pytest.mark.parametrize("b,h,hkv,tq,tk,d,causal", CASES)
def test_backward_formulas_equal_autograd(b, h, hkv, tq, tk, d, causal):
    q, k, v = (t.requires_grad_() for t in qkv(b, h, hkv, tq, tk, d))
    ref = attention(q, k, v, causal=causal)
    do = torch.randn_like(ref)
    want = torch.autograd.grad(ref, (q, k, v), do)
    out, lse = reference.flash_attention(q.detach(), k.detach(), v.detach(), causal=causal)
    got = reference.attention_backward(q.detach(), k.detach(), v.detach(), out, lse, do, causal=causal)
    for name, g, w in zip("qkv", got, want):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=0, msg=lambda m, name=name: f"d{name}: {m}")


def test_reference_rejects_bad_shapes():
    q, k, v = qkv(1, 4, 3, 8, 8, 16)
    with pytest.raises(ValueError, match="multiple of the KV heads"):
        reference.flash_attention(q, k, v)
    q, k, v = qkv(1, 2, 2, 9, 8, 16)
    with pytest.raises(ValueError, match="q_len <= kv_len"):
        reference.flash_attention(q, k, v, causal=True)


def test_hbm_counts():
    # naive: 4Nd + 4N^2; flash with blocks of 128 queries: 2Nd + 2Nd*ceil(N/128) + N
    assert reference.naive_hbm_elements(1024, 64) == 4 * 1024 * 64 + 4 * 1024 ** 2
    assert reference.flash_hbm_elements(1024, 64, 128) == 2 * 1024 * 64 + 2 * 1024 * 64 * 8 + 1024
    assert reference.flash_hbm_elements(4096, 64) < reference.naive_hbm_elements(4096, 64) / 3  # N² terms: 4N² vs 2N²d/128
