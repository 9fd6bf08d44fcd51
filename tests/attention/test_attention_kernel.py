"""The naive Triton attention kernel against llmu's torch reference and PyTorch's SDPA.

Tolerances. In float32 the kernel multiplies with exact fp32 products (no TF32) but sums in a
different order than the references: outputs (weighted means of values ~N(0, 1)) agree to a few
1e-7, and ``atol=rtol=1e-5`` leaves margin. In fp16/bf16 the inputs are the same for both sides
(the reference upcasts them), but the kernel rounds the probabilities to the input dtype before
P·V (as on the GPU) and rounds the output: a few units of the dtype's eps remain (fp16 eps 1e-3,
bf16 eps 8e-3, on outputs of magnitude up to ~3). Compiled on a GPU, fp32 tiles still multiply in
IEEE fp32 (``input_precision="ieee"``) and fp16/bf16 tiles on tensor cores with fp32 accumulation,
so the same bounds apply.

Inputs are drawn on the CPU from seeded generators and moved to ``kernel_device()`` (cpu in
Triton's interpreter, cuda when compiled); the references run on the same tensors.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import llmu  # noqa: F401
from llmu.attention import kernels, reference
from llmu.runtime import interpreting, kernel_device

pytestmark = pytest.mark.kernels

KDEV = kernel_device()

F32 = dict(atol=1e-5, rtol=1e-5)
LOW = {torch.float16: dict(atol=5e-3, rtol=5e-3), torch.bfloat16: dict(atol=4e-2, rtol=2e-2)}


def _qkv(b, h, hkv, tq, tk, d, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(b, h, tq, d, generator=g, device="cpu") * scale
    k = torch.randn(b, hkv, tk, d, generator=g, device="cpu") * scale
    v = torch.randn(b, hkv, tk, d, generator=g, device="cpu")
    return q.to(KDEV, dtype), k.to(KDEV, dtype), v.to(KDEV, dtype)


def _sdpa(q, k, v, causal):
    # SDPA's own is_causal aligns the mask top-left (query i sees keys <= i), which differs from
    # the decoding convention when q_len < kv_len: pass the bottom-right mask explicitly.
    mask = reference.causal_mask(q.shape[2], k.shape[2], device=q.device) if causal else None
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


CASES = [
    # (B, H, Hkv, Tq, Tk, D)
    (1, 1, 1, 1, 1, 16),       # the smallest problem
    (2, 4, 4, 17, 17, 64),     # multi-head, ragged length (not a multiple of the 64 block)
    (1, 9, 3, 13, 13, 64),     # SmolLM2's grouped-query layout: 9 query heads share 3 KV heads
    (2, 8, 1, 33, 33, 32),     # multi-query: one KV head for all
    (1, 2, 1, 5, 70, 64),      # fewer queries than keys (a chunk after a cached prefix)
    (2, 9, 3, 1, 130, 64),     # decoding: one query against 130 keys (3 key blocks, 2 ragged)
    (1, 3, 3, 70, 70, 80),     # head_dim 80, padded to 128 inside the kernel
    (1, 1, 1, 200, 300, 64),   # several query and key blocks
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("causal", [False, True])
def test_matches_reference_and_sdpa(case, causal):
    q, k, v = _qkv(*case)
    out, w = kernels.attention(q, k, v, causal=causal, return_weights=True)
    ref_out, ref_w = reference.attention(q, k, v, causal=causal, return_weights=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert w.shape == (case[0], case[1], case[3], case[4]) and w.dtype == torch.float32
    torch.testing.assert_close(out, ref_out, **F32)
    torch.testing.assert_close(w, ref_w, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out, _sdpa(q, k, v, causal), **F32)
    torch.testing.assert_close(w.sum(-1), torch.ones(w.shape[:-1], device=KDEV), atol=1e-5, rtol=0)


def test_causal_offset_when_queries_are_the_last_positions():
    # 3 queries at positions 5, 6, 7 of 8 keys: query 0 sees keys 0..5, never keys 6 and 7.
    q, k, v = _qkv(1, 2, 1, 3, 8, 16, seed=1)
    _, w = kernels.attention(q, k, v, causal=True, return_weights=True)
    assert (w[..., 0, 6:] == 0).all() and (w[..., 1, 7:] == 0).all()
    assert (w[..., 0, :6] > 0).all() and (w[..., 2, :] > 0).all()
    # ... which is not what SDPA's is_causal=True computes (top-left alignment).
    top_left = F.scaled_dot_product_attention(q, k.expand(1, 2, 8, 16), v.expand(1, 2, 8, 16), is_causal=True)
    assert not torch.allclose(kernels.attention(q, k, v, causal=True), top_left, atol=1e-3)


def test_causal_rows_are_lower_triangular():
    q, k, v = _qkv(1, 1, 1, 70, 70, 16, seed=2)
    _, w = kernels.attention(q, k, v, causal=True, return_weights=True)
    assert (w[0, 0].triu(1) == 0).all()
    assert w[0, 0, 0, 0] == 1.0  # the first token can only attend to itself


def test_gqa_equals_repeated_kv_heads():
    # GQA is MHA with each KV head copied for its group of query heads.
    q, k, v = _qkv(2, 9, 3, 20, 20, 64, seed=3)
    gqa = kernels.attention(q, k, v, causal=True)
    mha = kernels.attention(q, reference.repeat_kv(k, 3), reference.repeat_kv(v, 3), causal=True)
    torch.testing.assert_close(gqa, mha, atol=0, rtol=0)


def test_strided_inputs():
    # q, k, v as views of a (B, T, H, D) projection output: non-contiguous, strides passed on.
    g = torch.Generator(device="cpu").manual_seed(4)
    q = torch.randn(2, 19, 4, 32, generator=g, device="cpu").to(KDEV).transpose(1, 2)
    k = torch.randn(2, 19, 2, 32, generator=g, device="cpu").to(KDEV).transpose(1, 2)
    v = torch.randn(2, 19, 2, 32, generator=g, device="cpu").to(KDEV).transpose(1, 2)
    assert not q.is_contiguous()
    torch.testing.assert_close(kernels.attention(q, k, v, causal=True), reference.attention(q, k, v, causal=True), **F32)


def test_custom_scale():
    q, k, v = _qkv(1, 2, 2, 9, 9, 16, seed=5)
    for scale in (0.01, 1.0, 3.0):
        torch.testing.assert_close(
            kernels.attention(q, k, v, scale=scale), reference.attention(q, k, v, scale=scale), **F32
        )


def test_large_scores_stay_finite():
    # q, k ~ N(0, 30^2): scaled scores of order 900 * 8 / 8; exp() of them would overflow.
    q, k, v = _qkv(1, 2, 1, 40, 40, 64, seed=6, scale=30.0)
    out, w = kernels.attention(q, k, v, causal=True, return_weights=True)
    assert torch.isfinite(out).all() and torch.isfinite(w).all()
    torch.testing.assert_close(out, reference.attention(q, k, v, causal=True), **F32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_low_precision(dtype, causal):
    q, k, v = _qkv(1, 9, 3, 45, 45, 64, dtype=dtype, seed=7)
    out = kernels.attention(q, k, v, causal=causal)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), reference.attention(q.float(), k.float(), v.float(), causal=causal), **LOW[dtype])


@pytest.mark.skipif(
    interpreting(),
    reason="compiled only: 1024 x 1024 scores per head take minutes in Triton's CPU interpreter "
    "(test_low_precision covers fp16/bf16 there on 45 tokens)",
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_low_precision_long_sequences_when_compiled(dtype, causal):
    # 16 key blocks per query block, fp16/bf16 tiles on tensor cores: the error stays a few eps of
    # the dtype (outputs are weighted means), so the LOW bounds hold at this length too.
    q, k, v = _qkv(2, 9, 3, 1024, 1024, 64, dtype=dtype, seed=8)
    out = kernels.attention(q, k, v, causal=causal)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), reference.attention(q.float(), k.float(), v.float(), causal=causal), **LOW[dtype])


@settings(max_examples=12, deadline=None)
@given(
    b=st.integers(1, 2),
    hkv=st.integers(1, 3),
    group=st.integers(1, 3),
    tq=st.integers(1, 80),
    extra=st.integers(0, 80),
    d=st.sampled_from([16, 24, 64]),
    causal=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_shapes(b, hkv, group, tq, extra, d, causal, seed):
    q, k, v = _qkv(b, hkv * group, hkv, tq, tq + extra, d, seed=seed)
    torch.testing.assert_close(
        kernels.attention(q, k, v, causal=causal), reference.attention(q, k, v, causal=causal), **F32
    )


# ---- bad inputs ---------------------------------------------------------------------------------


def _good():
    return _qkv(1, 4, 2, 8, 8, 16)


def test_rejects_wrong_rank():
    q, k, v = _good()
    with pytest.raises(ValueError, match="q must have 4 dimensions"):
        kernels.attention(q[0], k, v)


def test_rejects_mixed_dtypes():
    q, k, v = _good()
    with pytest.raises(TypeError, match="k has dtype"):
        kernels.attention(q, k.half(), v)


def test_rejects_integer_dtype():
    q, k, v = _good()
    with pytest.raises(TypeError, match="q must have dtype"):
        kernels.attention(q.long(), k.long(), v.long())


def test_rejects_heads_not_divisible():
    q, k, v = _qkv(1, 4, 3, 8, 8, 16)
    with pytest.raises(ValueError, match="multiple of the number of KV heads"):
        kernels.attention(q, k, v)


def test_rejects_head_dim_mismatch():
    q, k, v = _good()
    with pytest.raises(ValueError, match="head_dim"):
        kernels.attention(q, k[..., :8], v[..., :8])


def test_rejects_k_v_shape_mismatch():
    q, k, v = _good()
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        kernels.attention(q, k, v[:, :, :4])


def test_rejects_batch_mismatch():
    q, k, v = _good()
    with pytest.raises(ValueError, match="batch"):
        kernels.attention(q.expand(2, -1, -1, -1), k, v)


def test_rejects_causal_with_more_queries_than_keys():
    q, k, v = _qkv(1, 2, 2, 9, 8, 16)
    with pytest.raises(ValueError, match="q_len <= kv_len"):
        kernels.attention(q, k, v, causal=True)
    kernels.attention(q, k, v, causal=False)  # fine without a mask


@pytest.mark.parametrize("scale", [0.0, -1.0])
def test_rejects_non_positive_scale(scale):
    q, k, v = _good()
    with pytest.raises(ValueError, match="scale must be positive"):
        kernels.attention(q, k, v, scale=scale)


def test_rejects_huge_head_dim():
    q, k, v = _qkv(1, 1, 1, 2, 2, 512)
    with pytest.raises(ValueError, match="head_dim must be at most 256"):
        kernels.attention(q, k, v)


def test_rejects_empty_keys():
    q, k, v = _qkv(1, 1, 1, 2, 0, 16)
    with pytest.raises(ValueError, match="kv_len must be positive"):
        kernels.attention(q, k, v)


def test_rejects_non_bool_causal():
    q, k, v = _good()
    with pytest.raises(TypeError, match="causal must be a bool"):
        kernels.attention(q, k, v, causal=1)


def test_rejects_wrong_device(kdev, off_device):
    # The wrong device is the one the kernels do not run on: meta in the interpreter, cpu on a GPU.
    q, k, v = _good()
    with pytest.raises(ValueError, match=f"v must be on {kdev.type}, got {off_device.type}"):
        kernels.attention(q, k, v.to(off_device))


def test_rejects_score_matrix_beyond_32_bit_offsets():
    # 46341^2 > 2^31 scores per head: refused before anything is allocated or launched.
    q = torch.zeros(1, 1, 46341, 16, device=KDEV)
    with pytest.raises(ValueError, match="do not fit 32-bit offsets"):
        kernels.attention(q, q, q)
