"""General attention: a boolean ``mask`` (True = attend) beside ``causal``, and ``d_v != d_k``.

The oracle is PyTorch's ``scaled_dot_product_attention`` with a boolean ``attn_mask`` (the same
convention), given every query head its keys with ``repeat_interleave`` (independent of llmu's
``repeat_kv``) and an explicitly built bottom-right causal mask. Rows with no visible key are a
rule of llmu's (zeros), checked on their own.

Tolerances. float32: the reference and torch do the same products in another order (and torch
may fuse them): 1e-5 absolute and relative on outputs of size O(1). float16 / bfloat16: the
reference computes in float32 from the same low-precision inputs and rounds once at the end; the
oracle runs in float32 on those inputs and is rounded the same way, so the two differ by at most
one unit in the last place of the output: 2**-10 (fp16) and 2**-7 (bf16) relative, taken as
2e-3 / 1.6e-2. The "sdpa" backend run in fp16/bf16 itself rounds intermediate values (the
probabilities) to the input dtype in some of torch's kernels: a few ulps, 1e-2 / 5e-2.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import llmu  # noqa: F401
import llmu.flash  # noqa: F401  (registers the "flash" and "flash_torch" backends)
from llmu.attention.reference import attention, causal_mask, check_attention_mask
from llmu.models.backends import attention_backends, get_attention_backend, sdpa_attention

F32 = dict(atol=1e-5, rtol=1e-5)
ROUNDED = {torch.float16: dict(atol=2e-3, rtol=2e-3), torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}
SDPA_LOW = {torch.float16: dict(atol=1e-2, rtol=1e-2), torch.bfloat16: dict(atol=5e-2, rtol=5e-2)}


def qkv(b, h, hkv, tq, tk, d, dv=None, *, dtype=torch.float32, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(b, h, tq, d, generator=g, device="cpu")
    k = torch.randn(b, hkv, tk, d, generator=g, device="cpu")
    v = torch.randn(b, hkv, tk, dv or d, generator=g, device="cpu")
    return q.to(dtype), k.to(dtype), v.to(dtype)


def random_mask(shape, *, seed=0, p=0.6):
    """A random bool mask of ``shape`` in which every row (last axis) keeps key 0: no empty rows,
    with or without a causal mask (every causal query sees key 0)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    m = torch.rand(shape, generator=g, device="cpu") < p
    m[..., 0] = True
    return m


def oracle(q, k, v, *, mask=None, causal=False, scale=None):
    """torch's SDPA in float32, each query head given its KV head by repeat_interleave."""
    h, hkv, tq, tk = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    kf = k.float().repeat_interleave(h // hkv, dim=1)
    vf = v.float().repeat_interleave(h // hkv, dim=1)
    allowed = torch.ones(tq, tk, dtype=torch.bool)
    if causal:
        allowed = torch.ones(tq, tk, dtype=torch.bool).tril(tk - tq)  # query i sees keys <= tk - tq + i
    if mask is not None:
        allowed = allowed & mask
    return F.scaled_dot_product_attention(q.float(), kf, vf, attn_mask=allowed, scale=scale)


MASK_SHAPES = {  # how a mask of the scores (B, H, Tq, Tk) may be given
    "(Tq, Tk)": lambda b, h, tq, tk: (tq, tk),
    "(Tk,)": lambda b, h, tq, tk: (tk,),
    "(B, 1, 1, Tk) padding": lambda b, h, tq, tk: (b, 1, 1, tk),
    "(B, 1, Tq, Tk)": lambda b, h, tq, tk: (b, 1, tq, tk),
    "(1, H, Tq, Tk)": lambda b, h, tq, tk: (1, h, tq, tk),
    "(B, H, Tq, Tk)": lambda b, h, tq, tk: (b, h, tq, tk),
}
SHAPES = [  # (B, H, Hkv, Tq, Tk, D)
    (1, 1, 1, 1, 1, 8),       # the smallest: one query, one key
    (2, 4, 4, 5, 5, 16),      # multi-head, square
    (1, 9, 3, 7, 13, 64),     # SmolLM2's GQA (9 query heads on 3 KV heads), Tq < Tk, batch 1
    (3, 6, 2, 1, 17, 32),     # a decode step: one query, ragged key count
    (2, 4, 1, 11, 11, 24),    # MQA, head_dim not a power of two
]


@pytest.mark.parametrize("kind", list(MASK_SHAPES))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_reference_matches_torch(shape, kind, causal):
    b, h, hkv, tq, tk, d = shape
    q, k, v = qkv(*shape, seed=sum(shape))
    mask = random_mask(MASK_SHAPES[kind](b, h, tq, tk), seed=tq + tk)
    out = attention(q, k, v, mask=mask, causal=causal)
    torch.testing.assert_close(out, oracle(q, k, v, mask=mask, causal=causal), **F32)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_sdpa_backend_matches_reference(shape, causal):
    b, h, hkv, tq, tk, d = shape
    q, k, v = qkv(*shape, seed=7)
    for kind, make in MASK_SHAPES.items():
        mask = random_mask(make(b, h, tq, tk), seed=len(kind))
        torch.testing.assert_close(sdpa_attention(q, k, v, mask=mask, causal=causal),
                                   attention(q, k, v, mask=mask, causal=causal), **F32, msg=kind)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_low_precision(dtype, causal):
    b, h, hkv, tq, tk, d = 2, 6, 2, 9, 14, 32
    q, k, v = qkv(b, h, hkv, tq, tk, d, dtype=dtype, seed=3)
    mask = random_mask((b, 1, tq, tk), seed=4)
    out = attention(q, k, v, mask=mask, causal=causal)
    assert out.dtype == dtype
    want = oracle(q, k, v, mask=mask, causal=causal).to(dtype)
    torch.testing.assert_close(out.float(), want.float(), **ROUNDED[dtype])
    got = sdpa_attention(q, k, v, mask=mask, causal=causal)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), **SDPA_LOW[dtype])


def test_mask_and_causal_are_combined():
    # with both, a key must be allowed by both: the same as passing their AND as the mask alone
    q, k, v = qkv(2, 4, 2, 6, 10, 16, seed=5)
    mask = random_mask((2, 1, 6, 10), seed=6)
    both = mask & torch.ones(6, 10, dtype=torch.bool).tril(4)
    torch.testing.assert_close(attention(q, k, v, mask=mask, causal=True), attention(q, k, v, mask=both), **F32)
    # and a mask of all True changes nothing; the causal pattern as a mask is causal=True
    everything = torch.ones(6, 10, dtype=torch.bool)
    torch.testing.assert_close(attention(q, k, v, mask=everything), attention(q, k, v), rtol=0, atol=0)
    torch.testing.assert_close(attention(q, k, v, mask=causal_mask(6, 10)), attention(q, k, v, causal=True),
                               rtol=0, atol=0)


def test_weights_respect_the_mask():
    q, k, v = qkv(2, 6, 3, 5, 8, 16, seed=8)
    mask = random_mask((2, 6, 5, 8), seed=9)
    out, w = attention(q, k, v, mask=mask, causal=True, return_weights=True)
    allowed = mask & causal_mask(5, 8)
    assert w.shape == (2, 6, 5, 8)
    assert torch.all(w[~allowed.expand_as(w)] == 0), "a masked key must get weight exactly 0"
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 6, 5), **F32)
    # the output is those weights applied to the values (each query head reading its KV head)
    torch.testing.assert_close(out, w @ v.repeat_interleave(2, dim=1), **F32)


@pytest.mark.parametrize("backend", ["naive", "sdpa"])
def test_rows_without_any_key_give_zeros(backend):
    # A query allowed no key at all (a padding token in a padded batch) has no softmax (0/0): llmu
    # defines its output as zeros, like FlashAttention; the other rows are unaffected.
    fn = get_attention_backend(backend).fn
    q, k, v = qkv(2, 4, 2, 5, 7, 16, seed=10)
    mask = random_mask((2, 1, 5, 7), seed=11)
    mask[0, :, 1] = False   # row 1 of sequence 0 sees nothing
    mask[1, :, 4] = False
    out = fn(q, k, v, mask=mask)
    assert torch.isfinite(out).all(), "an empty row must not give NaN (it would spread to every later layer)"
    assert torch.all(out[0, :, 1] == 0) and torch.all(out[1, :, 4] == 0)
    keep = mask.any(-1).expand(2, 4, 5)
    torch.testing.assert_close(out[keep], oracle(q, k, v, mask=mask)[keep], **F32)
    # with causal: the first query of a square causal mask sees only key 0; hide key 0 and it sees none
    q2, k2, v2 = qkv(1, 2, 2, 4, 4, 8, seed=12)
    no_first = torch.ones(4, dtype=torch.bool)
    no_first[0] = False
    out = fn(q2, k2, v2, mask=no_first, causal=True)
    assert torch.all(out[:, :, 0] == 0) and torch.isfinite(out).all()
    torch.testing.assert_close(out[:, :, 1:], oracle(q2, k2, v2, mask=no_first, causal=True)[:, :, 1:], **F32)


def test_empty_rows_have_zero_weights_and_finite_gradients():
    q, k, v = qkv(1, 2, 2, 3, 4, 8, seed=13)
    mask = torch.tensor([[True, False, True, False], [False] * 4, [True] * 4])
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, w = attention(q, k, v, mask=mask, return_weights=True)
    assert torch.all(w[:, :, 1] == 0) and torch.all(out[:, :, 1] == 0)
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert torch.all(q.grad[:, :, 1] == 0), "a query that attends to nothing has no gradient"


@pytest.mark.parametrize("backend", ["naive", "sdpa"])
@pytest.mark.parametrize("shape", [(1, 4, 4, 6, 6, 16, 24), (2, 9, 3, 5, 12, 64, 32), (3, 4, 2, 1, 9, 8, 5)], ids=str)
def test_value_head_dim_may_differ(backend, shape):
    # v of head size Dv != D (MLA's values, for instance): the output has Dv channels
    b, h, hkv, tq, tk, d, dv = shape
    q, k, v = qkv(b, h, hkv, tq, tk, d, dv, seed=dv)
    fn = get_attention_backend(backend).fn
    for mask in (None, random_mask((b, 1, tq, tk), seed=d)):
        out = fn(q, k, v, mask=mask, causal=True)
        assert out.shape == (b, h, tq, dv)
        torch.testing.assert_close(out, oracle(q, k, v, mask=mask, causal=True), **F32)


def test_explicit_scale_with_mask():
    q, k, v = qkv(2, 2, 1, 4, 6, 16, seed=14)
    mask = random_mask((4, 6), seed=15)
    for scale in (0.05, 1.0):
        torch.testing.assert_close(attention(q, k, v, mask=mask, scale=scale), oracle(q, k, v, mask=mask, scale=scale),
                                   **F32)
        torch.testing.assert_close(sdpa_attention(q, k, v, mask=mask, scale=scale),
                                   oracle(q, k, v, mask=mask, scale=scale), **F32)


@settings(max_examples=15, deadline=None)
@given(b=st.integers(1, 3), hkv=st.integers(1, 3), rep=st.integers(1, 3), tq=st.integers(1, 12),
       extra=st.integers(0, 12), d=st.integers(1, 40), dv=st.integers(1, 40), causal=st.booleans(),
       kind=st.sampled_from(list(MASK_SHAPES)), seed=st.integers(0, 1000))
def test_random_shapes(b, hkv, rep, tq, extra, d, dv, causal, kind, seed):
    h, tk = hkv * rep, tq + extra
    q, k, v = qkv(b, h, hkv, tq, tk, d, dv, seed=seed)
    mask = random_mask(MASK_SHAPES[kind](b, h, tq, tk), seed=seed)
    want = oracle(q, k, v, mask=mask, causal=causal)
    torch.testing.assert_close(attention(q, k, v, mask=mask, causal=causal), want, **F32)
    torch.testing.assert_close(sdpa_attention(q, k, v, mask=mask, causal=causal), want, **F32)


# -- every registered backend: the reference's answer, or a clear refusal ------------------------

def llmu_backends() -> list[str]:
    """The backends llmu itself registers (tests elsewhere may register throwaway ones)."""
    return [n for n in attention_backends() if get_attention_backend(n).fn.__module__.startswith("llmu.")]


def test_the_known_backends_are_registered():
    assert {"naive", "sdpa", "flash", "flash_torch"} <= set(llmu_backends())


@pytest.mark.parametrize("name", llmu_backends())
def test_backend_masks_correctly_or_refuses(name):
    fn = get_attention_backend(name).fn
    q, k, v = qkv(2, 4, 2, 8, 8, 16, seed=16)
    mask = random_mask((2, 1, 8, 8), seed=17)
    try:
        out = fn(q, k, v, mask=mask, causal=True)
    except ValueError as e:
        assert name in str(e) and "'naive' or 'sdpa'" in str(e), f"{name}: unclear refusal: {e}"
    else:
        torch.testing.assert_close(out, attention(q, k, v, mask=mask, causal=True), **F32)
        assert not torch.allclose(out, attention(q, k, v, causal=True)), "the mask must change this answer"


@pytest.mark.parametrize("name", llmu_backends())
def test_backend_handles_value_head_dim_or_refuses(name):
    fn = get_attention_backend(name).fn
    q, k, v = qkv(1, 2, 2, 4, 4, 16, 32, seed=18)
    try:
        out = fn(q, k, v, causal=True)
    except ValueError as e:
        assert name in str(e) and "'naive' or 'sdpa'" in str(e), f"{name}: unclear refusal: {e}"
    else:
        assert out.shape == (1, 2, 4, 32)
        torch.testing.assert_close(out, attention(q, k, v, causal=True), **F32)


# -- bad input ------------------------------------------------------------------------------------

_Q, _K, _V = qkv(2, 4, 2, 3, 5, 8, seed=19)
BAD = {
    "float mask": (dict(mask=torch.zeros(3, 5)), TypeError, "mask must have dtype torch.bool"),
    "int mask": (dict(mask=torch.ones(3, 5, dtype=torch.int64)), TypeError, "mask must have dtype torch.bool"),
    "list mask": (dict(mask=[[True] * 5] * 3), TypeError, "mask must be a bool torch.Tensor"),
    "mask Tq/Tk swapped": (dict(mask=torch.ones(5, 3, dtype=torch.bool)), ValueError,
                           r"mask of shape \(5, 3\) does not broadcast to .* \(2, 4, 3, 5\)"),
    "mask wrong batch": (dict(mask=torch.ones(3, 1, 3, 5, dtype=torch.bool)), ValueError, "does not broadcast"),
    "mask KV heads": (dict(mask=torch.ones(2, 2, 3, 5, dtype=torch.bool)), ValueError, "does not broadcast"),
    "mask 5-D": (dict(mask=torch.ones(1, 2, 4, 3, 5, dtype=torch.bool)), ValueError, "at most 4 dimensions"),
    "mask device": (dict(mask=torch.ones(3, 5, dtype=torch.bool, device="meta")), ValueError, "mask must be on"),
    "v length": (dict(v=_V[:, :, :4]), ValueError, "k and v must agree in batch, heads and length"),
    "v heads": (dict(v=torch.randn(2, 1, 5, 8)), ValueError, "k and v must agree"),
    "k head_dim": (dict(k=torch.randn(2, 2, 5, 6), v=torch.randn(2, 2, 5, 6)), ValueError, "head_dim=8"),
    "heads not a multiple": (dict(k=torch.randn(2, 3, 5, 8), v=torch.randn(2, 3, 5, 8)), ValueError, "multiple"),
    "causal not bool": (dict(causal=1), TypeError, "causal must be a bool"),
    "scale string": (dict(scale="0.5"), TypeError, "scale must be a number"),
    "q not a tensor": (dict(q=_Q.tolist()), TypeError, "q must be a torch.Tensor"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input(case):
    over, exc, match = BAD[case]
    args = dict(q=_Q, k=_K, v=_V) | over
    with pytest.raises(exc, match=match):
        attention(**args)


@pytest.mark.parametrize("case", [c for c in BAD if c.startswith("mask") or c.endswith("mask")])
def test_sdpa_backend_refuses_bad_masks_too(case):
    over, exc, match = BAD[case]
    with pytest.raises(exc, match=match):
        sdpa_attention(_Q, _K, _V, **over)


def test_check_attention_mask_returns_the_mask_unexpanded():
    m = torch.ones(3, 5, dtype=torch.bool)
    assert check_attention_mask(m, (2, 4, 3, 5)) is m
