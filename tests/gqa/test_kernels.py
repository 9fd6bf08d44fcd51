"""The grouped decode kernel against the references, for MHA, GQA and MQA groups; bad inputs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llmu.attention import reference as attn_ref
from llmu.runtime import interpreting
from llmu.gqa.kernels import gqa_decode, gqa_decode_partials
from llmu.kvcache.reference import attend_cached

# float32 in and out: the kernel accumulates in float32 in a different order than torch, so
# results agree to a few ulps of the O(1) outputs; 1e-5 leaves room for long rows.
TOL = dict(rtol=1e-5, atol=1e-5)


def _inputs(b, h, hkv, t, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, d, generator=g).to(dtype), torch.randn(b, hkv, t, d, generator=g).to(dtype),
            torch.randn(b, hkv, t, d, generator=g).to(dtype))


@pytest.mark.parametrize("h, hkv", [(4, 4), (9, 3), (16, 2), (8, 1), (9, 1)], ids=["MHA", "G3", "G8", "MQA8", "MQA9"])
@pytest.mark.parametrize("grouped", [True, False])
def test_matches_reference_ragged(h, hkv, grouped):
    q, k, v = _inputs(3, h, hkv, 150, 64)
    lengths = torch.tensor([150, 1, 77])                      # full, a single position, ragged (not /64)
    out = gqa_decode(q, k, v, lengths, grouped=grouped, num_splits=3)
    torch.testing.assert_close(out, attend_cached(q, k, v, lengths), **TOL)


def test_matches_causal_attention_last_row_batch_one():
    q, k, v = _inputs(1, 9, 3, 100, 64, seed=1)
    # the new token's query against all 100 keys == the last row of causal attention
    ref = attn_ref.attention(q[:, :, None], k, v, causal=True)[:, :, 0]
    torch.testing.assert_close(gqa_decode(q, k, v), ref, **TOL)


@pytest.mark.parametrize("splits", [1, 2, 5, 8])
def test_split_count_does_not_change_result(splits):
    q, k, v = _inputs(2, 6, 2, 130, 32, seed=2)
    lengths = torch.tensor([130, 65])
    torch.testing.assert_close(gqa_decode(q, k, v, lengths, num_splits=splits), attend_cached(q, k, v, lengths), **TOL)


def test_padding_past_length_is_ignored():
    q, k, v = _inputs(1, 4, 2, 80, 16, seed=3)
    k[:, :, 50:], v[:, :, 50:] = float("nan"), float("inf")
    out = gqa_decode(q, k, v, torch.tensor([50]), num_splits=2)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, attend_cached(q[:, :, :], k[:, :, :50], v[:, :, :50], torch.tensor([50])), **TOL)


def test_partials_format():
    q, k, v = _inputs(1, 4, 1, 10, 16)
    po, lse = gqa_decode_partials(q, k, v, torch.tensor([10]), num_splits=3)
    assert po.shape == (1, 4, 3, 16) and lse.shape == (1, 4, 3) and po.dtype == lse.dtype == torch.float32
    # 10 positions in blocks of 64: split 0 has them all, the others are empty (-inf)
    assert torch.isfinite(lse[..., 0]).all() and torch.isinf(lse[..., 1:]).all()


@pytest.mark.parametrize("dtype, tol", [
    (torch.float16, 2e-3),
    # Triton's interpreter runs tl.dot through numpy, which has no bfloat16: GPU only
    pytest.param(torch.bfloat16, 2e-2, marks=pytest.mark.skipif(interpreting(), reason="no bf16 tl.dot in the interpreter")),
])
def test_half_precision(dtype, tol):
    # half inputs: scores are accumulated in fp32 but p is rounded to the input dtype before p @ v,
    # an error of about one ulp of the dtype (fp16 ~1e-3, bf16 ~8e-3) on outputs of size O(1)
    q, k, v = _inputs(2, 8, 2, 70, 64, dtype=dtype)
    out = gqa_decode(q, k, v)
    assert out.dtype == dtype
    ref = attend_cached(q.float(), k.float(), v.float(), torch.tensor([70, 70]))
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


@settings(max_examples=6, deadline=None)
@given(b=st.integers(1, 2), hkv=st.integers(1, 3), group=st.integers(1, 5), t=st.integers(1, 140),
       d=st.sampled_from([16, 32]), grouped=st.booleans())
def test_random_shapes(b, hkv, group, t, d, grouped):
    q, k, v = _inputs(b, hkv * group, hkv, t, d)
    lengths = torch.randint(1, t + 1, (b,))
    torch.testing.assert_close(gqa_decode(q, k, v, lengths, grouped=grouped), attend_cached(q, k, v, lengths), **TOL)


def test_bad_inputs():
    q, k, v = _inputs(1, 9, 3, 8, 16)
    with pytest.raises(ValueError, match="multiple of the KV-head count"):
        gqa_decode(q[:, :8], k, v)
    with pytest.raises(TypeError, match="k_cache"):
        gqa_decode(q, k.double(), v)
    with pytest.raises(TypeError, match="dtype"):
        gqa_decode(q, k.half(), v.half())
    with pytest.raises(ValueError, match="head_dim"):
        gqa_decode(q, k[..., :8], v[..., :8])
    with pytest.raises(ValueError, match="head_dim must be one of"):
        gqa_decode(q[..., :8], k[..., :8].contiguous(), v[..., :8].contiguous())
    with pytest.raises(ValueError, match="v_cache"):
        gqa_decode(q, k, v[:, :, :4])
    with pytest.raises(ValueError, match="lengths must lie"):
        gqa_decode(q, k, v, torch.tensor([9]))
    with pytest.raises(ValueError, match="lengths must lie"):
        gqa_decode(q, k, v, torch.tensor([0]))
    with pytest.raises(ValueError, match="one entry per sequence"):
        gqa_decode(q, k, v, torch.tensor([3, 3]))
    with pytest.raises(ValueError, match="batch"):
        gqa_decode(q.expand(2, 9, 16).contiguous(), k, v)
    if interpreting():
        with pytest.raises(TypeError, match="bfloat16"):
            gqa_decode(q.bfloat16(), k.bfloat16(), v.bfloat16())
    with pytest.raises(ValueError, match="num_splits"):
        gqa_decode(q, k, v, num_splits=0)
    with pytest.raises(ValueError, match="ndim|dimensions"):
        gqa_decode(q[0], k, v)
