"""RoPE kernel (llmu.layers.rope): equals the torch reference, transformers' convention for
"half", rotates in place, and its backward is the rotation by the opposite angle.

Tolerances, fp32: the kernel evaluates exactly the reference's expressions (x1*cos - x2*sin and
x1*sin + x2*cos, in fp32), so results agree to an ulp or two; 1e-6 with rtol 1e-5 allows for
fused multiply-adds on a GPU. transformers writes the same rotation as q*cos + rotate_half(q)*sin,
a different association of the same products: 1e-5. bf16/fp16: one rounding at the end on both
sides; the casts may round ties differently (one bf16 ulp, 2**-8 relative): 1e-2.

Every tensor is made on ``kernel_device()`` (cpu in the interpreter, cuda when compiled). The
cos/sin tables are computed on the CPU (float64 angles, the same values on every machine) and moved.
"""

import pytest
import torch
from hypothesis import given, settings, strategies as st

import llmu  # noqa: F401
from llmu.layers import reference
from llmu.layers.rope import rope
from llmu.runtime import kernel_device

pytestmark = pytest.mark.kernels

KDEV = kernel_device()  # cpu in Triton's interpreter, cuda when the kernels are compiled

LAYOUTS = ["half", "interleaved"]
SHAPES = [  # (B, Hq, Hk, T, D)
    (1, 9, 3, 7, 64),    # SmolLM2's heads (GQA 9/3), batch 1, ragged T
    (2, 4, 4, 5, 32),
    (2, 3, 1, 3, 128),   # MQA, a large head
    (1, 1, 1, 1, 6),     # one token, head_dim not a power of two (3 pairs)
    (3, 5, 5, 33, 64),
]


def _qk(b, hq, hk, t, d, dtype=torch.float32, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)  # the same numbers on every machine
    q = torch.randn(b, hq, t, d, generator=g, device="cpu")
    k = torch.randn(b, hk, t, d, generator=g, device="cpu")
    return q.to(KDEV, dtype), k.to(KDEV, dtype)


def _angles(positions, head_dim, base=10000.0):
    """reference.rope_angles computed on the CPU, moved to the kernel device."""
    with torch.device("cpu"):
        cos, sin = reference.rope_angles(positions.cpu(), head_dim, base)
    return cos.to(KDEV), sin.to(KDEV)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_matches_reference(shape, layout):
    b, hq, hk, t, d = shape
    q, k = _qk(*shape)
    cos, sin = _angles(torch.arange(t, device=KDEV) + 5, d, 1e5)
    want_q, want_k = reference.apply_rope(q, cos, sin, layout), reference.apply_rope(k, cos, sin, layout)
    rope(q, k, cos, sin, layout)
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(k, want_k, rtol=1e-5, atol=1e-6)


def test_half_layout_matches_transformers():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    b, hq, hk, t, d = 2, 9, 3, 11, 64
    q, k = _qk(b, hq, hk, t, d)
    cos, sin = _angles(torch.arange(t, device=KDEV), d, 1e5)
    # transformers keeps cos/sin at full head_dim, the half-size table repeated twice, with a batch axis.
    cos_hf = torch.cat([cos, cos], dim=-1)[None].expand(b, t, d)
    sin_hf = torch.cat([sin, sin], dim=-1)[None].expand(b, t, d)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos_hf, sin_hf)
    rope(q, k, cos, sin, "half")
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, want_k, rtol=1e-5, atol=1e-5)


def test_layouts_are_one_rotation_on_permuted_channels():
    # Interleaved RoPE on channels (x0, x1, x2, x3, ...) equals half RoPE on the channels reordered
    # as (x0, x2, x4, ..., x1, x3, ...): the permutation GGUF files apply to Q/K weights.
    b, h, t, d = 1, 2, 6, 16
    q, k = _qk(b, h, h, t, d)
    perm = torch.cat([torch.arange(0, d, 2, device=KDEV), torch.arange(1, d, 2, device=KDEV)])
    cos, sin = _angles(torch.arange(t, device=KDEV), d)
    q_half, k_half = q[..., perm].clone(), k[..., perm].clone()
    rope(q, k, cos, sin, "interleaved")
    rope(q_half, k_half, cos, sin, "half")
    torch.testing.assert_close(q[..., perm], q_half, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k[..., perm], k_half, rtol=1e-6, atol=1e-6)


def test_in_place_semantics():
    q, k = _qk(2, 3, 1, 4, 8)
    q_before, k_before = q.clone(), k.clone()
    ptr_q, ver_q = q.data_ptr(), q._version
    cos, sin = _angles(torch.arange(4, device=KDEV), 8)
    out_q, out_k = rope(q, k, cos, sin)
    assert out_q is q and out_k is k, "rope returns its inputs, not copies"
    assert q.data_ptr() == ptr_q
    assert q._version > ver_q, "an in-place write must bump the version counter so autograd can see it"
    assert not torch.equal(q, q_before) and not torch.equal(k, k_before)
    torch.testing.assert_close(q, reference.apply_rope(q_before, cos, sin), rtol=1e-5, atol=1e-6)


def test_position_zero_is_identity_and_norms_are_kept():
    q, k = _qk(1, 2, 2, 9, 64)
    q0, k0 = q.clone(), k.clone()
    cos, sin = _angles(torch.arange(9, device=KDEV), 64)
    rope(q, k, cos, sin)
    torch.testing.assert_close(q[:, :, 0], q0[:, :, 0])  # angle 0: cos 1, sin 0
    torch.testing.assert_close(k[:, :, 0], k0[:, :, 0])
    # A rotation keeps every pair's length, so each head vector keeps its norm.
    torch.testing.assert_close(q.norm(dim=-1), q0.norm(dim=-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k.norm(dim=-1), k0.norm(dim=-1), rtol=1e-5, atol=1e-5)


def test_strided_views_are_rotated_where_they_lie():
    # A (B, T, H, D) projection output viewed as (B, H, T, D) via transpose: no copy is made.
    b, t, hq, hk, d = 2, 5, 4, 2, 32
    buf_q, buf_k = torch.randn(b, t, hq, d, device=KDEV), torch.randn(b, t, hk, d, device=KDEV)
    q, k = buf_q.transpose(1, 2), buf_k.transpose(1, 2)
    want_q = reference.apply_rope(q, *_angles(torch.arange(t, device=KDEV), d))
    cos, sin = _angles(torch.arange(t, device=KDEV), d)
    rope(q, k, cos, sin)
    torch.testing.assert_close(buf_q.transpose(1, 2), want_q, rtol=1e-5, atol=1e-6)
    # q and k can also be two slices of one fused qkv buffer.
    qkv = torch.randn(b, t, (hq + 2 * hk) * d, device=KDEV)
    q = qkv[..., : hq * d].view(b, t, hq, d).transpose(1, 2)
    k = qkv[..., hq * d : (hq + hk) * d].view(b, t, hk, d).transpose(1, 2)
    v_before = qkv[..., (hq + hk) * d :].clone()
    want_q, want_k = reference.apply_rope(q, cos, sin), reference.apply_rope(k, cos, sin)
    rope(q, k, cos, sin)
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(k, want_k, rtol=1e-5, atol=1e-6)
    assert torch.equal(qkv[..., (hq + hk) * d :], v_before), "v must not be touched"


def test_per_sequence_positions():
    # cos/sin of shape (B, T, D/2): each sequence of the batch at its own positions (decoding).
    b, hq, hk, t, d = 3, 2, 1, 4, 16
    q, k = _qk(b, hq, hk, t, d)
    starts = [0, 7, 100]
    tables = [_angles(torch.arange(s, s + t, device=KDEV), d) for s in starts]
    cos = torch.stack([c for c, _ in tables])
    sin = torch.stack([s for _, s in tables])
    want = [reference.apply_rope(q[i : i + 1], *tables[i]) for i in range(b)]
    rope(q, k, cos, sin)
    torch.testing.assert_close(q, torch.cat(want), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_backward_matches_autograd_on_reference(layout):
    b, hq, hk, t, d = 2, 6, 2, 7, 64
    q0, k0 = _qk(b, hq, hk, t, d, seed=3)
    cos, sin = _angles(torch.arange(t, device=KDEV) * 3, d, 1e5)
    gq, gk = _qk(b, hq, hk, t, d, seed=4)

    qa, ka = q0.clone().requires_grad_(), k0.clone().requires_grad_()
    q, k = rope(qa * 1.0, ka * 1.0, cos, sin, layout)  # "* 1.0": rope may not overwrite a leaf
    ((q * gq).sum() + (k * gk).sum()).backward()

    qb, kb = q0.clone().requires_grad_(), k0.clone().requires_grad_()
    qr, kr = reference.apply_rope(qb, cos, sin, layout), reference.apply_rope(kb, cos, sin, layout)
    ((qr * gq).sum() + (kr * gk).sum()).backward()
    torch.testing.assert_close(qa.grad, qb.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ka.grad, kb.grad, rtol=1e-5, atol=1e-6)


def test_backward_is_rotation_by_negative_angle():
    q, k = _qk(1, 2, 2, 5, 8)
    cos, sin = _angles(torch.arange(5, device=KDEV), 8)
    qa = q.clone().requires_grad_()
    out, _ = rope(qa * 1.0, k.clone(), cos, sin)
    gq = torch.randn_like(out)
    out.backward(gq)
    torch.testing.assert_close(qa.grad, reference.apply_rope(gq, cos, -sin), rtol=1e-5, atol=1e-6)


def test_leaf_requiring_grad_is_refused_by_autograd():
    q = torch.randn(1, 1, 2, 4, requires_grad=True, device=KDEV)
    k = torch.randn(1, 1, 2, 4, device=KDEV)
    cos, sin = _angles(torch.arange(2, device=KDEV), 4)
    with pytest.raises(RuntimeError, match="leaf"):
        rope(q, k, cos, sin)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype):
    q, k = _qk(2, 3, 1, 6, 64, dtype=dtype)
    cos, sin = _angles(torch.arange(6, device=KDEV), 64, 1e5)
    want_q = reference.apply_rope(q.float(), cos, sin)
    rope(q, k, cos, sin)
    assert q.dtype == dtype
    torch.testing.assert_close(q.float(), want_q, rtol=1e-2, atol=1e-2)


def test_dot_product_depends_only_on_offset():
    # The property that makes RoPE a *relative* position code: <R_m q, R_n k> depends on m - n only.
    # Put the same q and the same k at every position; after rotation the score matrix must then be
    # constant along each diagonal (m - n fixed).
    t, d = 48, 64
    q = torch.randn(d, device=KDEV).expand(1, 1, t, d).clone()
    k = torch.randn(d, device=KDEV).expand(1, 1, t, d).clone()
    cos, sin = _angles(torch.arange(t, device=KDEV), d, 1e5)
    rope(q, k, cos, sin)
    scores = q[0, 0] @ k[0, 0].T
    for offset in (-20, -1, 0, 5, 30):
        diag = torch.diagonal(scores, offset)
        torch.testing.assert_close(diag, diag[:1].expand_as(diag), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(torch.diagonal(scores, 0)[0], torch.diagonal(scores, 5)[0])


@settings(max_examples=8, deadline=None)
@given(
    b=st.integers(1, 3), hq=st.integers(1, 9), hk=st.integers(1, 4), t=st.integers(1, 20),
    half=st.integers(1, 70), layout=st.sampled_from(LAYOUTS), start=st.integers(0, 10_000),
)
def test_random_shapes(b, hq, hk, t, half, layout, start):
    d = 2 * half
    q, k = _qk(b, hq, hk, t, d, seed=b + hq + t + d)
    cos, sin = _angles(torch.arange(start, start + t, device=KDEV), d, 1e4)
    want_q, want_k = reference.apply_rope(q, cos, sin, layout), reference.apply_rope(k, cos, sin, layout)
    rope(q, k, cos, sin, layout)
    # Angles up to 1e4 rad: cos/sin are the same fp32 values on both sides, so no extra error.
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(k, want_k, rtol=1e-5, atol=1e-6)


_Q, _K = torch.randn(1, 2, 3, 8, device=KDEV), torch.randn(1, 1, 3, 8, device=KDEV)
_COS, _SIN = _angles(torch.arange(3, device=KDEV), 8)
BAD = {
    "q 3-d": (dict(q=_Q[0]), ValueError, "q must have 4 dimensions"),
    "q int": (dict(q=_Q.to(torch.int64)), TypeError, "q must have dtype"),
    "k fp64": (dict(k=_K.double()), TypeError, "k must have dtype"),
    "dtype mismatch": (dict(k=_K.half()), TypeError, "k has dtype"),
    "layout": (dict(layout="rotated"), ValueError, "layout must be one of"),
    "T mismatch": (dict(k=torch.randn(1, 1, 4, 8, device=KDEV)), ValueError, "q and k must agree"),
    "odd head_dim": (dict(q=torch.randn(1, 2, 3, 7, device=KDEV), k=torch.randn(1, 1, 3, 7, device=KDEV), cos=_COS[:, :3], sin=_SIN[:, :3]),
                     ValueError, "head_dim must be even"),
    "cos rows": (dict(cos=_COS[:2]), ValueError, "cos and sin must have shape"),
    "sin batch": (dict(sin=torch.randn(2, 3, 4, device=KDEV)), ValueError, "cos and sin must have shape"),
    "q strided": (dict(q=torch.randn(1, 2, 8, 3, device=KDEV).transpose(-1, -2)), ValueError, "q must be contiguous in its last"),
    "q expanded": (dict(q=torch.randn(1, 1, 3, 8, device=KDEV).expand(1, 2, 3, 8)), ValueError, "expanded view"),
    "q is k": (dict(q=_Q, k=_Q), ValueError, "same memory"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_inputs(case):
    over, exc, match = BAD[case]
    args = dict(q=_Q.clone(), k=_K.clone(), cos=_COS, sin=_SIN, layout="half") | over
    with pytest.raises(exc, match=match):
        rope(**args)


def test_bad_device(kdev, off_device):
    # The wrong device is the one the kernels do not run on: meta in the interpreter, cpu on a GPU.
    q, k = torch.randn(1, 2, 3, 8, device=off_device), torch.randn(1, 1, 3, 8, device=off_device)
    with pytest.raises(ValueError, match=f"q must be on {kdev.type}, got {off_device.type}"):
        rope(q, k, _COS, _SIN, "half")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_backward_through_views_of_a_projection(layout):
    # How a model calls rope: q and k are transposed views of projection outputs that require grad.
    b, t, hq, hk, d, dm = 2, 5, 4, 2, 16, 24
    gen = torch.Generator(device="cpu").manual_seed(9)
    x0 = torch.randn(b, t, dm, generator=gen, device="cpu").to(KDEV)
    wq = torch.randn(hq * d, dm, generator=gen, device="cpu").to(KDEV)
    wk = torch.randn(hk * d, dm, generator=gen, device="cpu").to(KDEV)
    cos, sin = _angles(torch.arange(t, device=KDEV), d)

    def run(apply):
        x = x0.clone().requires_grad_(True)
        q = (x @ wq.T).view(b, t, hq, d).transpose(1, 2)
        k = (x @ wk.T).view(b, t, hk, d).transpose(1, 2)
        q, k = apply(q, k)
        (q.pow(2).sum() * 0.5 + (q[..., :hk, :, :] * k).sum()).backward()
        return q.detach(), k.detach(), x.grad

    got = run(lambda q, k: rope(q, k, cos, sin, layout))
    want = run(lambda q, k: (reference.apply_rope(q, cos, sin, layout), reference.apply_rope(k, cos, sin, layout)))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_only_q_requires_grad():
    q0 = torch.randn(1, 2, 3, 8, requires_grad=True, device=KDEV)
    k = torch.randn(1, 1, 3, 8, device=KDEV)
    cos, sin = _angles(torch.arange(3, device=KDEV), 8)
    k_want = reference.apply_rope(k, cos, sin)
    q, k_out = rope(q0 * 2.0, k, cos, sin)
    assert k_out is k and q.requires_grad and not k.requires_grad
    torch.testing.assert_close(k, k_want, rtol=1e-5, atol=1e-6)
    q.sum().backward()
    want = 2.0 * reference.apply_rope(torch.ones(1, 2, 3, 8, device=KDEV), cos, -sin)
    torch.testing.assert_close(q0.grad, want, rtol=1e-5, atol=1e-6)
