"""The torch tiled backward (``reference.tiled_attention_backward``, FlashAttention-2's loop order):
the same gradients as autograd through naive attention and as the whole-matrix formulas, whatever
the blocks; tiles only in memory; the causal mask's empty tiles skipped; bad input refused.

Tolerance: float32 throughout. The tiled sums add the same products as the whole-matrix formulas
in another order (per tile, then across tiles, then over a group's query heads): a few ulps on
gradients of order 1, well inside atol 1e-5 (the largest difference measured on these cases is
about 2e-6).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from llmu.attention.reference import attention
from llmu.flash import reference
from llmu.flash.memory import peak_bytes

ATOL = 1e-5


def case(b, h, hkv, tq, tk, d, causal, seed=0):
    """Random inputs of one case and what the backward receives: (q, k, v, o, lse, do)."""
    g = torch.Generator().manual_seed(seed)
    q, do = torch.randn(b, h, tq, d, generator=g), torch.randn(b, h, tq, d, generator=g)
    k, v = torch.randn(b, hkv, tk, d, generator=g), torch.randn(b, hkv, tk, d, generator=g)
    o, lse = reference.flash_attention(q, k, v, causal=causal)
    return q, k, v, o, lse, do


def autograd_grads(q, k, v, do, causal):
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    return torch.autograd.grad(attention(q, k, v, causal=causal), (q, k, v), do)


CASES = [  # (B, H, Hkv, Tq, Tk, D, causal)
    (1, 2, 2, 50, 50, 16, True),
    (2, 6, 2, 33, 70, 32, True),     # a chunk after a prefix: bottom-right causal
    (1, 3, 1, 70, 20, 32, False),    # more queries than keys, MQA
    (1, 2, 1, 1, 45, 64, True),      # one decoding query
    (1, 4, 2, 37, 37, 8, False),
]


@pytest.mark.parametrize("b,h,hkv,tq,tk,d,causal", CASES)
@pytest.mark.parametrize("bq,bk", [(16, 16), (7, 13), (64, 64), (1, 5)])
def test_tiled_backward_equals_autograd(b, h, hkv, tq, tk, d, causal, bq, bk):
    q, k, v, o, lse, do = case(b, h, hkv, tq, tk, d, causal)
    got = reference.tiled_attention_backward(q, k, v, o, lse, do, causal=causal, block_q=bq, block_k=bk)
    dense = reference.attention_backward(q, k, v, o, lse, do, causal=causal)
    for name, g, w, x in zip("qkv", got, autograd_grads(q, k, v, do, causal), dense):
        assert g.shape == w.shape and g.dtype == torch.float32
        torch.testing.assert_close(g, w, atol=ATOL, rtol=0, msg=lambda m, name=name: f"d{name} vs autograd: {m}")
        torch.testing.assert_close(g, x, atol=ATOL, rtol=0, msg=lambda m, name=name: f"d{name} vs dense: {m}")


def test_explicit_scale_and_non_contiguous_inputs():
    q, k, v, o, lse, do = case(1, 4, 2, 23, 30, 16, True, seed=1)
    o, lse = reference.flash_attention(q, k, v, causal=True, scale=0.3)
    want = reference.attention_backward(q, k, v, o, lse, do, causal=True, scale=0.3)
    # the same values in a (B, T, H, D) memory layout, viewed as (B, H, T, D)
    qt, kt, vt, ot, dot = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v, o, do))
    got = reference.tiled_attention_backward(qt, kt, vt, ot, lse, dot, causal=True, scale=0.3, block_q=8, block_k=8)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=ATOL, rtol=0)


def test_bfloat16_inputs_give_bfloat16_gradients():
    q, k, v, o, lse, do = (x.bfloat16() if x.ndim == 4 else x for x in case(1, 2, 1, 20, 20, 16, True, seed=2))
    got = reference.tiled_attention_backward(q, k, v, o, lse, do, causal=True, block_q=8, block_k=8)
    want = reference.attention_backward(q, k, v, o, lse, do, causal=True)
    for g, w in zip(got, want):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g.float(), w.float(), atol=2e-2, rtol=2e-2)   # bf16's 8-bit mantissa


def test_memory_is_tiles_not_the_score_matrix():
    """Counted tensor by tensor (peak_bytes): at Tq=1500, Tk=2000 the tiled backward holds its
    gradients (0.43 MiB) and a few tiles, 0.64 MiB in all, where one head's score matrix alone is
    11.4 MiB and the whole-matrix formulas hold about ten of them."""
    args = case(1, 2, 1, 1500, 2000, 16, True, seed=3)
    _, tiled = peak_bytes(reference.tiled_attention_backward, *args, causal=True, block_q=64, block_k=64)
    _, dense = peak_bytes(reference.attention_backward, *args, causal=True)
    grads = sum(x.numel() for x in args[:3]) * 4
    matrix = 1500 * 2000 * 4
    assert grads < tiled < grads + 0.5 * 2**20
    assert dense > 2 * matrix


@pytest.mark.parametrize("tq,tk,block,visited", [(256, 256, 32, 36), (64, 96, 16, 18), (40, 40, 64, 1)])
def test_causal_skips_the_empty_tiles(tq, tk, block, visited):
    """The FLOPs of the matrix products, causal against full: only the tiles the bottom-right mask
    leaves something in. 256 in blocks of 32: 8 + 7 + ... + 1 = 36 of 64. Tq = 64, Tk = 96 in
    blocks of 16: query block i (queries 16i .. 16i + 15, at positions 32 later) sees key blocks
    0 .. i + 2, so 3 + 4 + 5 + 6 = 18 of the 4 x 6 tiles."""
    q, k, v, o, lse, do = case(1, 2, 1, tq, tk, 16, True, seed=4)
    flops = {}
    for causal in (False, True):
        with FlopCounterMode(display=False) as counter:
            reference.tiled_attention_backward(q, k, v, o, lse, do, causal=causal, block_q=block, block_k=block)
        flops[causal] = counter.get_total_flops()
    tiles = -(-tq // block) * -(-tk // block)
    assert flops[True] / flops[False] == pytest.approx(visited / tiles)


def test_rejects_bad_input():
    q, k, v, o, lse, do = case(1, 4, 2, 10, 12, 16, True)
    with pytest.raises(ValueError, match="block_q"):
        reference.tiled_attention_backward(q, k, v, o, lse, do, block_q=0)
    with pytest.raises(ValueError, match="block_k"):
        reference.tiled_attention_backward(q, k, v, o, lse, do, block_k=True)
    with pytest.raises(ValueError, match="lse"):
        reference.tiled_attention_backward(q, k, v, o, lse[:, :2], do)
    with pytest.raises(ValueError, match="do"):
        reference.tiled_attention_backward(q, k, v, o, lse, do[:, :, :5])
    with pytest.raises(ValueError, match="multiple"):
        reference.tiled_attention_backward(q[:, :3], k, v, o[:, :3], lse[:, :3], do[:, :3])
    with pytest.raises(ValueError, match="causal"):
        reference.tiled_attention_backward(q, k[:, :, :5], v[:, :, :5], o, lse, do, causal=True)
