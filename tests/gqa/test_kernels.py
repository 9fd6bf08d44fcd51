"""``gqa_decode``: module 06's decode kernel under module 07's name, for MHA, GQA and MQA groups.

The kernel itself (splits, empty splits, the merge, every bad input) is tested in
``tests/kvcache/test_decode_kernel.py``; here: the wrapper IS that kernel, both ways of cutting the
work give the reference's answer for every group size, ``lengths`` defaults to full caches, and
bad inputs surface the kernel's own errors.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from llmu.attention import reference as attn_ref
from llmu.gqa import bench
from llmu.gqa.kernels import gqa_decode, gqa_decode_partials
from llmu.kvcache import kernels as kv_kernels
from llmu.kvcache.reference import attend_cached
from llmu.runtime import interpreting, kernel_device

pytestmark = pytest.mark.kernels

DEV = kernel_device()

# float32 in and out: the kernel accumulates in float32 in a different order than torch, so
# results agree to a few ulps of the O(1) outputs; 1e-5 leaves room for long rows.
TOL = dict(rtol=1e-5, atol=1e-5)


def _inputs(b, h, hkv, t, d, dtype=torch.float32, seed=0):
    """q ``(B, H, D)`` and the caches ``(B, Hkv, T, D)``, drawn on the CPU and moved to the kernel device."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    shapes = ((b, h, d), (b, hkv, t, d), (b, hkv, t, d))
    return tuple(torch.randn(shape, generator=g, device="cpu").to(DEV, dtype) for shape in shapes)


@pytest.mark.parametrize("grouped", [True, False])
def test_is_module_06s_kernel(grouped):
    # one kernel: the wrapper's output is bit for bit decode_attention's
    q, k, v = _inputs(2, 9, 3, 90, 32)
    lengths = torch.tensor([90, 41], device=DEV)
    want = kv_kernels.decode_attention(q, k, v, lengths, num_splits=2, grouped=grouped)
    assert torch.equal(gqa_decode(q, k, v, lengths, num_splits=2, grouped=grouped), want)


@pytest.mark.parametrize("h, hkv", [(4, 4), (9, 3), (16, 2), (8, 1), (9, 1)], ids=["MHA", "G3", "G8", "MQA8", "MQA9"])
@pytest.mark.parametrize("grouped", [True, False])
def test_matches_reference_ragged(h, hkv, grouped):
    q, k, v = _inputs(3, h, hkv, 150, 64)
    lengths = torch.tensor([150, 1, 77], device=DEV)          # full, a single position, ragged (not /64)
    out = gqa_decode(q, k, v, lengths, grouped=grouped, num_splits=3)
    torch.testing.assert_close(out, attend_cached(q, k, v, lengths), **TOL)


@pytest.mark.parametrize("grouped", [True, False])
def test_default_lengths_is_the_last_row_of_causal_attention_batch_one(grouped):
    q, k, v = _inputs(1, 9, 3, 100, 64, seed=1)
    # no lengths: all 100 positions; the new token's query against them == causal attention's last row
    ref = attn_ref.attention(q[:, :, None], k, v, causal=True)[:, :, 0]
    torch.testing.assert_close(gqa_decode(q, k, v, grouped=grouped), ref, **TOL)


def test_partials_format_both_ways():
    q, k, v = _inputs(1, 4, 1, 10, 16)
    for grouped in (True, False):
        po, lse = gqa_decode_partials(q, k, v, num_splits=3, grouped=grouped)
        assert po.shape == (1, 4, 3, 16) and lse.shape == (1, 4, 3) and po.dtype == lse.dtype == torch.float32
        # 10 positions in blocks of 64: split 0 has them all, the others are empty (-inf)
        assert torch.isfinite(lse[..., 0]).all() and torch.isinf(lse[..., 1:]).all()
        torch.testing.assert_close(kv_kernels.combine_partials(po, lse),
                                   attend_cached(q, k, v, torch.tensor([10], device=DEV)), **TOL)


@settings(max_examples=6, deadline=None)
@given(b=st.integers(1, 2), hkv=st.integers(1, 3), group=st.integers(1, 5), t=st.integers(1, 140),
       d=st.sampled_from([16, 32]), grouped=st.booleans())
def test_random_shapes(b, hkv, group, t, d, grouped):
    q, k, v = _inputs(b, hkv * group, hkv, t, d)
    lengths = torch.randint(1, t + 1, (b,), device=DEV)
    torch.testing.assert_close(gqa_decode(q, k, v, lengths, grouped=grouped), attend_cached(q, k, v, lengths), **TOL)


def test_bench_providers_run_the_one_kernel_both_ways():
    assert {"llmu triton grouped", "llmu triton per-head"} <= set(bench.GQA_DECODE.providers)
    size = dict(bench.GQA_DECODE.cpu_sizes[0], T=70)
    inputs = bench._setup(size, DEV, torch.float32)
    ref = attend_cached(*inputs)
    for name in ("llmu triton grouped", "llmu triton per-head", "torch"):
        torch.testing.assert_close(bench.GQA_DECODE.providers[name].fn(*inputs), ref, **TOL)
    # per head reads the cache G = H / Hkv times; q and the output are counted once either way
    size = {"B": 2, "H": 9, "Hkv": 3, "T": 100, "D": 64}
    cache = 2 * 2 * 100 * 64 * 4
    assert bench.grouped_bytes(size, 4) == 3 * cache + 2 * 2 * 9 * 64 * 4
    assert bench.per_head_bytes(size, 4) == 9 * cache + 2 * 2 * 9 * 64 * 4


def test_bad_inputs_surface_the_kernels_checks():
    q, k, v = _inputs(1, 9, 3, 8, 16)
    with pytest.raises(ValueError, match="multiple of the KV-head count"):
        gqa_decode(q[:, :8], k, v)
    with pytest.raises(TypeError, match="k_cache"):
        gqa_decode(q, k.double(), v)
    with pytest.raises(ValueError, match="cache_v must have cache_k's shape"):
        gqa_decode(q, k, v[:, :, :4])
    with pytest.raises(ValueError, match="lengths must be <= the cache's max_len"):
        gqa_decode(q, k, v, torch.tensor([9], device=DEV), grouped=False)
    with pytest.raises(ValueError, match="lengths must be >= 1"):
        gqa_decode(q, k, v, torch.tensor([0], device=DEV))
    with pytest.raises(ValueError, match="batch"):
        gqa_decode(q.expand(2, 9, 16).contiguous(), k, v)       # default lengths follow k_cache
    with pytest.raises(ValueError, match="k_cache must have 4 dimensions"):
        gqa_decode(q, k[0], v)                                  # no lengths to default: k_cache is named
    with pytest.raises(ValueError, match="num_splits"):
        gqa_decode_partials(q, k, v, num_splits=0)
    with pytest.raises(TypeError, match="grouped must be True or False"):
        gqa_decode(q, k, v, grouped=None)
    if interpreting():
        with pytest.raises(TypeError, match="bfloat16"):
            gqa_decode(q.bfloat16(), k.bfloat16(), v.bfloat16())
