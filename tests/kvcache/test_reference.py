"""Module 06's torch references: the memory formula, the cache update, cached attention, and
greedy decoding with and without a cache on SmolLM2."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmu.kvcache import reference
from llmu.models.cache import KVCache


def test_formula_reproduces_the_llama2_70b_figure():
    # LLaMA-2-70B counted as multi-head attention: 80 layers, 64 KV heads (= its 64 query heads),
    # head_dim 128, context 8192, batch 16, fp16 (2 bytes): 343.6 GB (decimal gigabytes).
    mha = reference.kv_cache_bytes(layers=80, kv_heads=64, head_dim=128, context=8192, batch=16,
                                   dtype_or_bytes=torch.float16)
    assert mha == 2 * 80 * 64 * 128 * 8192 * 16 * 2 == 343_597_383_680
    assert round(mha / 1e9, 1) == 343.6
    # Its real attention is grouped-query with 8 KV heads: 8x less, 42.9 GB (40 GiB).
    gqa = reference.kv_cache_bytes(80, 8, 128, 8192, 16, "fp16")
    assert gqa == mha / 8 and round(gqa / 1e9, 1) == 42.9 and gqa == 40 * 2**30


def test_formula_units_and_errors():
    # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64, fp32: 46,080 bytes per token.
    assert reference.kv_cache_bytes(30, 3, 64, 1, 1, torch.float32) == 46_080
    assert reference.kv_cache_bytes(30, 3, 64, 8192, 1, 2) == 8192 * 23_040
    assert reference.kv_cache_bytes(1, 1, 2, 1, 1, "int4") == 2       # half a byte per value
    with pytest.raises(ValueError, match="layers must be a non-negative int"):
        reference.kv_cache_bytes(2.5, 1, 1, 1, 1, 2)
    with pytest.raises(ValueError, match="unknown dtype name"):
        reference.kv_cache_bytes(1, 1, 1, 1, 1, "fp7")


def test_cache_update_writes_ragged_positions():
    ck, cv = torch.zeros(2, 3, 6, 4), torch.zeros(2, 3, 6, 4)
    k, v = torch.randn(2, 3, 2, 4), torch.randn(2, 3, 2, 4)
    new = reference.cache_update(ck, cv, k, v, torch.tensor([0, 3]))
    assert new.tolist() == [2, 5]
    assert torch.equal(ck[0, :, 0:2], k[0]) and torch.equal(cv[1, :, 3:5], v[1])
    assert ck[0, :, 2:].abs().sum() == 0 and ck[1, :, :3].abs().sum() == 0 and ck[1, :, 5:].abs().sum() == 0


def test_cache_update_errors():
    ck, cv = torch.zeros(2, 3, 6, 4), torch.zeros(2, 3, 6, 4)
    k = torch.randn(2, 3, 2, 4)
    with pytest.raises(ValueError, match="cache is full"):
        reference.cache_update(ck, cv, k, k, torch.tensor([0, 5]))
    assert ck.abs().sum() == 0                                   # nothing written on error
    with pytest.raises(TypeError, match="k has dtype"):
        reference.cache_update(ck, cv, k.double(), k, torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="k and v must be"):
        reference.cache_update(ck, cv, torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4), torch.tensor([0, 0]))
    with pytest.raises(TypeError, match="lengths must hold integers"):
        reference.cache_update(ck, cv, k, k, torch.tensor([0.0, 1.0]))


@pytest.mark.parametrize("h,hkv", [(4, 4), (9, 3), (8, 1)])
def test_attend_cached_matches_sdpa_per_sequence(h, hkv):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, h, 16, generator=g)
    ck = torch.randn(3, hkv, 12, 16, generator=g)
    cv = torch.randn(3, hkv, 12, 16, generator=g)
    lengths = torch.tensor([12, 1, 7])
    ck[1, :, 1:] = float("nan")                                  # padding holds garbage
    cv[1, :, 1:] = float("inf")
    out = reference.attend_cached(q, ck, cv, lengths)
    for i, n in enumerate(lengths.tolist()):
        want = F.scaled_dot_product_attention(q[i:i + 1, :, None], ck[i:i + 1, :, :n], cv[i:i + 1, :, :n],
                                              enable_gqa=True)[0, :, 0]
        torch.testing.assert_close(out[i], want, atol=1e-6, rtol=0)  # float32, same math, other order


def test_attend_cached_errors():
    q, ck = torch.randn(1, 4, 8), torch.randn(1, 3, 5, 8)
    with pytest.raises(ValueError, match="multiple of the KV-head count"):
        reference.attend_cached(q, ck, ck, torch.tensor([5]))
    with pytest.raises(TypeError, match="cache_k has dtype"):
        reference.attend_cached(torch.randn(1, 3, 8), ck.half(), ck.half(), torch.tensor([5]))


def test_split_and_combine_equal_one_softmax():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 6, 8, generator=g)
    ck, cv = torch.randn(2, 2, 20, 8, generator=g), torch.randn(2, 2, 20, 8, generator=g)
    lengths = torch.tensor([20, 3])
    want = reference.attend_cached(q, ck, cv, lengths)
    for s in (1, 2, 7, 25):                                      # 25 splits > 20 positions: many empty
        out, lse = reference.split_partials(q, ck, cv, lengths, s)
        torch.testing.assert_close(reference.combine_partials_reference(out, lse), want, atol=1e-6, rtol=0)
    assert reference.split_bounds(10, 4, 1) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert reference.split_bounds(10, 4, 8) == [(0, 8), (8, 10), (10, 10), (10, 10)]


def test_kvcache_class_errors_name_the_problem():
    cache = KVCache(2, 1, 3, 4, 8)
    with pytest.raises(ValueError, match="max_len=4"):
        cache.append(0, torch.randn(1, 3, 5, 8), torch.randn(1, 3, 5, 8))
    with pytest.raises(TypeError, match="dtype"):
        cache.append(0, torch.randn(1, 3, 1, 8).double(), torch.randn(1, 3, 1, 8).double())


@pytest.mark.slow
def test_cached_and_recomputed_greedy_tokens_are_identical(smollm2):
    model, tok = smollm2
    ids = tok.encode("The capital of France is")
    slow = reference.decode_recompute(model, ids, 6)
    fast = reference.decode_cached(model, ids, 6)
    assert fast.tokens == slow.tokens
    assert len(fast.step_s) == len(slow.step_s) == 6 and fast.ms_per_token > 0
