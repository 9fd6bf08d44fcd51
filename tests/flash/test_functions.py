"""The two differentiable FlashAttention functions as a library user calls them:
``FlashAttentionFunction`` (Triton) and ``FlashAttentionReference`` (torch), with only q, k, v
given (the rest defaulted), with 3-D one-head input, and saving the same five tensors."""

from __future__ import annotations

import pytest
import torch

import llmu  # noqa: F401  (chooses Triton's mode before triton is imported)
from llmu.attention.reference import repeat_kv
from llmu.flash.kernels import FlashAttentionFunction
from llmu.flash.reference import FlashAttentionReference

FUNCTIONS = [FlashAttentionFunction, FlashAttentionReference]
IDS = ["triton", "torch"]


def _naive(q, k, v, causal=False):
    """softmax(q k^T / sqrt(D)) v, with autograd: the oracle for outputs and gradients."""
    kk, vv = repeat_kv(k, q.shape[1] // k.shape[1]), repeat_kv(v, q.shape[1] // k.shape[1])
    s = q @ kk.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        tq, tk = q.shape[2], k.shape[2]
        s = s.masked_fill(torch.ones(tq, tk, dtype=torch.bool).triu(tk - tq + 1), float("-inf"))
    return torch.softmax(s, dim=-1) @ vv


def _inputs(shape_q, shape_kv, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).requires_grad_() for s in (shape_q, shape_kv, shape_kv)]


# float32 throughout; the kernels accumulate in another order than the naive product: rounding only
TOL = dict(atol=2e-5, rtol=2e-4)


@pytest.mark.parametrize("fn", FUNCTIONS, ids=IDS)
@pytest.mark.parametrize("causal", [False, True])
def test_q_k_v_alone_is_enough_and_matches_naive_attention_and_its_gradients(fn, causal):
    # 37 and 53: ragged last tiles; 4 query heads over 2 KV heads (grouped-query)
    q, k, v = _inputs((2, 4, 37, 16), (2, 2, 53, 16))
    o, lse = fn.apply(q, k, v, causal) if causal else fn.apply(q, k, v)
    want = _naive(q, k, v, causal)
    torch.testing.assert_close(o, want, **TOL)
    assert lse.shape == (2, 4, 37) and not lse.requires_grad
    do = torch.randn_like(o)
    got = torch.autograd.grad(o, (q, k, v), do)
    exp = torch.autograd.grad(want, (q, k, v), do)
    for name, a, b in zip("qkv", got, exp):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m, name=name: f"d{name}: {m}")


@pytest.mark.parametrize("fn", FUNCTIONS, ids=IDS)
def test_three_d_input_is_one_head(fn):
    q, k, v = _inputs((3, 29, 16), (3, 29, 16))
    o, lse = fn.apply(q, k, v, True)
    assert o.shape == (3, 29, 16) and lse.shape == (3, 29)
    q4, k4, v4 = (t.detach().unsqueeze(1).requires_grad_() for t in (q, k, v))
    o4, _ = fn.apply(q4, k4, v4, True)
    torch.testing.assert_close(o, o4.squeeze(1), rtol=0, atol=0)   # the same computation
    do = torch.randn_like(o)
    got = torch.autograd.grad(o, (q, k, v), do)
    exp = torch.autograd.grad(o4, (q4, k4, v4), do.unsqueeze(1))
    for a, b in zip(got, exp):
        assert a.shape == (3, 29, 16)
        torch.testing.assert_close(a, b.squeeze(1), rtol=0, atol=0)


@pytest.mark.parametrize("fn", FUNCTIONS, ids=IDS)
def test_each_saves_q_k_v_o_and_lse_and_nothing_of_size_n_squared(fn):
    q, k, v = _inputs((1, 2, 64, 16), (1, 2, 64, 16))
    o, lse = fn.apply(q, k, v)
    saved = o.grad_fn.saved_tensors
    assert [tuple(t.shape) for t in saved] == [(1, 2, 64, 16)] * 4 + [(1, 2, 64)]
    assert torch.equal(saved[3], o.detach()) and torch.equal(saved[4], lse)


@pytest.mark.parametrize("fn", FUNCTIONS, ids=IDS)
def test_mixed_ranks_and_non_tensors_are_refused(fn):
    q, k, v = _inputs((1, 2, 8, 16), (1, 2, 8, 16))
    with pytest.raises(ValueError, match="all be 4-D .* or all 3-D"):
        fn.apply(q[:, 0], k, v)
    with pytest.raises(TypeError, match="k must be a torch.Tensor"):
        fn.apply(q, k.tolist(), v)
