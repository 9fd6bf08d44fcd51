"""The FlashAttention-2 Triton kernels: forward output and lse, and dq/dk/dv, equal to llmu's naive
attention and to ``F.scaled_dot_product_attention`` (``enable_gqa=True``), on ragged lengths,
causal (bottom-right) and not, GQA/MQA, head dims 16-128; block-size invariance; large scores;
hypothesis over shapes; bad inputs.

Tolerances: float32 inputs (the interpreter) agree to rounding: the tiled sums reorder and
rescale a few hundred products, a few ulps on values of order 1 (atol 2e-5 on outputs and on
gradients, whose entries are of order 1 here too). bfloat16/float16 (GPU only) are compared with a
float32 reference computed from the same rounded inputs: the kernel rounds P to the input dtype
before P @ V (and dS before dS @ K), 8 mantissa bits for bf16 (about 2e-2 on outputs, more on
gradients, which sum Tq terms), 11 for fp16.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from llmu import runtime
from llmu.attention.reference import attention, causal_mask
from llmu.flash import kernels

pytestmark = pytest.mark.kernels

DEV = runtime.kernel_device()
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}
GTOL = {torch.float32: 5e-5, torch.bfloat16: 1.5e-1, torch.float16: 2e-2}
DTYPES = [torch.float32] if runtime.interpreting() else [torch.float32, torch.bfloat16, torch.float16]


def qkv(b, h, hkv, tq, tk, d, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(b, h, tq, d, generator=g, device="cpu") * scale
    k = torch.randn(b, hkv, tk, d, generator=g, device="cpu") * scale
    v = torch.randn(b, hkv, tk, d, generator=g, device="cpu")
    return tuple(x.to(DEV, dtype).requires_grad_() for x in (q, k, v))


def sdpa(q, k, v, causal):
    """PyTorch's attention in float32; its is_causal is top-left aligned, so pass the mask."""
    tq, tk = q.shape[2], k.shape[2]
    mask = causal_mask(tq, tk, device=q.device) if causal else None
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)


def grads(out, inputs, do):
    return torch.autograd.grad(out, inputs, do)


CASES = [  # (B, H, Hkv, Tq, Tk, D, causal)
    (1, 2, 2, 64, 64, 32, True),       # whole tiles
    (2, 9, 3, 77, 77, 64, True),       # SmolLM2's heads, ragged last tile
    (1, 4, 1, 50, 130, 32, True),      # MQA, a chunk after a prefix (bottom-right causal)
    (1, 4, 2, 130, 50, 16, False),     # more queries than keys
    (1, 2, 1, 1, 100, 128, True),      # one decoding query, D=128
    (2, 2, 2, 100, 100, 128, False),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("b,h,hkv,tq,tk,d,causal", CASES)
def test_forward_and_backward_match_naive_and_sdpa(b, h, hkv, tq, tk, d, causal, dtype):
    q, k, v = qkv(b, h, hkv, tq, tk, d, dtype)
    out, lse = kernels.flash_attention(q, k, v, causal=causal, return_lse=True)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (b, h, tq) and lse.dtype == torch.float32
    ref = attention(*(x.float() for x in (q, k, v)), causal=causal)
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=0)
    torch.testing.assert_close(out.float(), sdpa(q, k, v, causal), atol=TOL[dtype], rtol=0)

    do = torch.randn(out.shape, generator=torch.Generator(device="cpu").manual_seed(1), device="cpu").to(DEV, dtype)
    got = grads(out, (q, k, v), do)
    want = grads(sdpa(q, k, v, causal), (q, k, v), do.float())
    for name, g, w in zip("qkv", got, want):
        assert g.dtype == dtype and g.shape == w.shape
        torch.testing.assert_close(g.float(), w.float(), atol=GTOL[dtype], rtol=0,
                                   msg=lambda m, name=name: f"d{name}: {m}")


def test_backward_saves_exactly_q_k_v_o_lse():
    q, k, v = qkv(1, 2, 1, 20, 20, 16)
    out, lse = kernels.FlashAttentionFunction.apply(q, k, v, True, None, None, None)
    saved = out.grad_fn.saved_tensors
    assert len(saved) == 5
    for s, t in zip(saved, (q, k, v, out, lse)):
        assert s.data_ptr() == t.data_ptr() and s.shape == t.shape


@pytest.mark.parametrize("bm,bn", [(16, 16), (16, 64), (64, 16), (128, 32)])
def test_block_size_invariance(bm, bn):
    q, k, v = qkv(1, 3, 1, 70, 90, 32, seed=3)
    base, lse0 = kernels.flash_attention(q, k, v, causal=True, return_lse=True)
    out, lse = kernels.flash_attention(q, k, v, causal=True, return_lse=True, block_m=bm, block_n=bn)
    torch.testing.assert_close(out, base, atol=2e-5, rtol=0)
    torch.testing.assert_close(lse, lse0, atol=2e-5, rtol=0)
    q2, k2, v2 = (x.detach().clone().requires_grad_() for x in (q, k, v))
    do = torch.randn_like(out)
    g0 = grads(base, (q, k, v), do)
    o2, _ = kernels.FlashAttentionFunction.apply(q2, k2, v2, True, None, bm, bn)
    g1 = kernels.flash_attention_backward(q2.detach(), k2.detach(), v2.detach(), o2.detach(), lse, do,
                                          causal=True, block_m=bm, block_n=bn)
    for a, b_ in zip(g0, g1):
        torch.testing.assert_close(a, b_, atol=5e-5, rtol=0)


def test_large_scores_are_stable():
    # scores of order 1e3: exp would overflow float32 without the running max
    q, k, v = qkv(1, 2, 2, 70, 70, 32, scale=12.0, seed=5)
    out = kernels.flash_attention(q, k, v, causal=True)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, attention(q, k, v, causal=True), atol=1e-4, rtol=0)
    g = grads(out, (q, k, v), torch.ones_like(out))
    assert all(torch.isfinite(x).all() for x in g)


def test_explicit_scale():
    q, k, v = qkv(1, 2, 2, 33, 33, 32)
    out = kernels.flash_attention(q, k, v, scale=0.3)
    torch.testing.assert_close(out, attention(q, k, v, scale=0.3), atol=2e-5, rtol=0)


@settings(max_examples=6, deadline=None)
@given(hkv=st.sampled_from([1, 2]), rep=st.sampled_from([1, 3]), tq=st.integers(1, 90),
       extra=st.integers(0, 40), d=st.sampled_from([16, 32]), causal=st.booleans())
def test_hypothesis_shapes(hkv, rep, tq, extra, d, causal):
    q, k, v = qkv(1, hkv * rep, hkv, tq, tq + extra, d, seed=tq)
    out = kernels.flash_attention(q, k, v, causal=causal)
    ref = sdpa(q, k, v, causal)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=0)
    do = torch.randn_like(out)
    for g, w in zip(grads(out, (q, k, v), do), grads(ref, (q, k, v), do)):
        torch.testing.assert_close(g, w, atol=5e-5, rtol=0)


def test_bad_inputs_are_rejected(off_device):
    q, k, v = (x.detach() for x in qkv(1, 4, 2, 8, 8, 32))
    with pytest.raises(ValueError, match="head_dim must be one of"):
        kernels.flash_attention(q[..., :24], k[..., :24], v[..., :24])
    with pytest.raises(ValueError, match=r"multiple of the number of KV heads \(3\)"):
        kernels.flash_attention(q, torch.cat([k, k[:, :1]], 1), torch.cat([v, v[:, :1]], 1))
    with pytest.raises(TypeError, match="dtype"):
        kernels.flash_attention(q, k.double(), v)
    with pytest.raises(TypeError, match="k has dtype"):
        kernels.flash_attention(q, k.half(), v.half())
    with pytest.raises(ValueError, match=f"must be on {DEV.type}"):
        kernels.flash_attention(q, k.to(off_device), v)
    with pytest.raises(ValueError, match="q_len <= kv_len"):
        kernels.flash_attention(q, k[:, :, :4], v[:, :, :4], causal=True)
    with pytest.raises(ValueError, match="same shape"):
        kernels.flash_attention(q, k, v[:, :, :4])
    with pytest.raises(ValueError, match="all be 4-D .* or all 3-D"):   # 3-D is one head; mixed is refused
        kernels.flash_attention(q[0], k, v)
    with pytest.raises(ValueError, match="block_m must be a power of two"):
        kernels.flash_attention(q, k, v, block_m=24)
    with pytest.raises(ValueError, match="scale"):
        kernels.flash_attention(q, k, v, scale=float("nan"))


def test_backend_registration():
    import llmu.flash  # noqa: F401  (registers the backends)
    from llmu.models.backends import get_attention_backend

    q, k, v = (x.detach() for x in qkv(1, 4, 2, 10, 10, 32))
    fn = get_attention_backend("flash").fn
    torch.testing.assert_close(fn(q, k, v, causal=True, scale=0.2), attention(q, k, v, causal=True, scale=0.2),
                               atol=2e-5, rtol=0)
    with pytest.raises(ValueError, match="never forms the attention weights"):
        fn(q, k, v, return_weights=True)
    torch.testing.assert_close(get_attention_backend("flash_torch").fn(q, k, v, causal=True),
                               attention(q, k, v, causal=True), atol=2e-5, rtol=0)


def test_strided_inputs_as_the_model_makes_them():
    # the decoder makes q, k, v as views (B, T, H, D) -> (B, H, T, D): not contiguous
    g = torch.Generator(device="cpu").manual_seed(7)
    qs = torch.randn(2, 40, 6, 32, generator=g, device="cpu").to(DEV).transpose(1, 2).requires_grad_()
    ks = torch.randn(2, 40, 2, 32, generator=g, device="cpu").to(DEV).transpose(1, 2).requires_grad_()
    vs = torch.randn(2, 40, 2, 32, generator=g, device="cpu").to(DEV).transpose(1, 2).requires_grad_()
    assert not qs.is_contiguous()
    out = kernels.flash_attention(qs, ks, vs, causal=True)
    ref = sdpa(qs, ks, vs, True)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=0)
    do = torch.randn_like(out).transpose(1, 2).contiguous().transpose(1, 2)   # a strided dO too
    for g_, w in zip(grads(out, (qs, ks, vs), do), grads(ref, (qs, ks, vs), do)):
        torch.testing.assert_close(g_, w, atol=5e-5, rtol=0)


def test_no_queries():
    q, k, v = qkv(1, 2, 1, 0, 5, 16)
    out, lse = kernels.flash_attention(q, k, v, causal=True, return_lse=True)
    assert out.shape == (1, 2, 0, 16) and lse.shape == (1, 2, 0)
    dq, dk, dv = grads(out, (q, k, v), torch.zeros_like(out))
    assert dq.shape == q.shape and (dk == 0).all() and (dv == 0).all()
