"""Module 11's Triton kernel: ``kernels.accept_reject`` == ``reference.accept_reject`` on the same ``u`` and ``r``.

Every case is run through both on the same inputs (the reference computes in float32/float64 from
the same rounded float16/bfloat16 probabilities), over ragged vocabularies (1, 7, 100, 1000, 4099
and SmolLM2's 49,152, none a multiple of the tile, several also with a 16- or 64-wide tile so that
a small ``V`` spans many tiles), ``γ = 1 .. 8``, batches of 1 and several, float32/float16/bfloat16,
int32 and int64 token ids, and inputs built to reach every branch: drafts sampled from ``q``
(the usual mix of acceptances and rejections), ``q = p`` (everything accepted: the bonus token),
``p(x_1) = 0`` (the first proposal rejected), one-hot drafts (``reference.one_hot_draft``),
one-hot ``p`` and ``q`` (greedy), probabilities with many zeros, a residual with no mass (the
fallback to ``p``), a row of zeros, ``r = 0`` and ``r`` just below 1, non-contiguous views.

What must match, and the one tolerance:

- ``accepted``: exactly, always. The accept test ``u * q(x) < p(x)`` is the same float32 product
  and comparison on the same float32 values in both.
- ``next_token``: exactly, except where the reference's ``r * total`` lies within a tiny relative
  distance of a cumulative boundary of the bucket it picked. The weights are bit-identical in
  both (float32) and both accumulate them in float64, but in another order: the reference with
  one ``cumsum`` over ``V``, the kernel with ``tl.cumsum`` in tiles of ``BLOCK_V`` plus a carry
  across tiles (numpy's sequential ``cumsum`` in the interpreter, a tree scan on a GPU). A float64
  sum of non-negative terms computed along any order in which a term goes through at most ``n``
  additions is within ``n * 2**-53`` of the exact sum (relative), so with ``n <= V`` for the
  reference, ``min(V, BLOCK_V) + tiles`` for the kernel and one more each for ``r * total``, the
  two can only disagree when ``|c_j - r * total| <= (V + min(V, BLOCK_V) + tiles + 4) * 2**-53 *
  total`` (``tolerance``; about 1e-11 at ``V = 49,152``) for a boundary ``c_j`` that a different
  positive-weight token lies behind (``ambiguous``). Those cases are excluded, and each test
  asserts they are under 1% of its cases: the chance that a uniform ``r`` lands that close to a
  boundary is about ``2 * V * tolerance`` < 1e-6, so in practice none ever is.

(Were the sums float32, as a first design had them, the same rigorous bound would be about
``BLOCK_V * 2**-24`` = 2.4e-4 of the total, wider than a typical bucket of a 49,152-token
vocabulary: most large-vocabulary cases would be ambiguous. That is why the kernel sums in float64.)

Bad inputs are refused with messages naming the argument. A hypothesis test draws random shapes,
kinds and tiles (few examples: every one runs in Triton's interpreter on this machine).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from llmu import runtime
from llmu.spec import kernels, reference

pytestmark = pytest.mark.kernels

DEV = runtime.kernel_device()
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
KINDS = ["sampled", "accept_all", "reject_first", "one_hot_draft", "greedy", "zeros"]
R_BELOW_ONE = 1.0 - 2.0 ** -24          # the largest float32 below 1


# -- building cases ------------------------------------------------------------------------------


def dist(g, *shape, sharp=2.0, zeros=0.0):
    """Random probability rows ``shape`` (last dim V), float32, CPU: softmax of ``sharp * randn``
    (peaky, like a language model's), with a fraction ``zeros`` of the entries set to 0 (never a
    whole row: its largest entry is kept) and renormalised."""
    w = torch.softmax(torch.randn(*shape, generator=g, device="cpu") * sharp, dim=-1)
    if zeros:
        drop = torch.rand(*shape, generator=g, device="cpu") < zeros
        drop &= w < w.amax(dim=-1, keepdim=True)
        w = w.masked_fill(drop, 0.0)
        w = w / w.sum(dim=-1, keepdim=True)
    return w


def make(kind, b, gamma, v, *, dtype=torch.float32, id_dtype=torch.int64, seed=0):
    """``(p, q, draft, u, r)`` on the kernel device for one kind of case (see the module docstring)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    p = dist(g, b, gamma + 1, v, zeros=0.7 if kind == "zeros" else 0.0)
    q = dist(g, b, gamma, v, sharp=1.0, zeros=0.7 if kind == "zeros" else 0.0)
    if kind == "accept_all":
        q = p[:, :gamma].clone()
    if kind == "greedy":
        p = torch.nn.functional.one_hot(p.argmax(-1), v).float()
        q = torch.nn.functional.one_hot(q.argmax(-1), v).float()
        # half the sequences propose the target's argmaxes: long accepted runs, and the bonus
        q[: b // 2] = p[: b // 2, :gamma]
    p, q = p.to(dtype), q.to(dtype)
    # drafts sampled from the (rounded) draft distribution, as a draft model would
    draft = torch.multinomial(q.float().reshape(-1, v), 1, generator=g).reshape(b, gamma)
    if kind == "one_hot_draft":
        q = reference.one_hot_draft(draft, v, dtype)
    if kind == "reject_first":
        p[torch.arange(b, device="cpu"), 0, draft[:, 0]] = 0.0
    u = torch.rand(b, gamma, generator=g, device="cpu")
    r = torch.rand(b, generator=g, device="cpu")
    if b >= 3:                                 # edge values of r: 0 and just below 1
        r[0], r[1] = 0.0, R_BELOW_ONE
    return p.to(DEV), q.to(DEV), draft.to(DEV, id_dtype), u.to(DEV), r.to(DEV)


def reference_weights(p, q, accepted):
    """The float32 weights the reference samples from (its own lines, repeated): the residual at
    the first rejection (``p`` there if it has no mass), or ``p[γ]``."""
    p, q, accepted = p.float().cpu(), q.float().cpu(), accepted.cpu()
    gamma = q.shape[1]
    rows = torch.arange(p.shape[0], device="cpu")
    at = accepted.clamp(max=gamma - 1)
    residual = (p[rows, at] - q[rows, at]).clamp(min=0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p[rows, at])
    return torch.where((accepted == gamma)[:, None], p[:, gamma], residual)


def tolerance(v, block_v=None):
    """Relative distance to a boundary within which the two float64 summation orders may disagree."""
    block = kernels.choose_block_v(v) if block_v is None else block_v
    return (v + min(v, block) + math.ceil(v / block) + 4) * 2.0 ** -53


def ambiguous(p, q, accepted, r, token, tol):
    """``(B,)`` bool: the rows whose token float32 summation could flip. The reference picked ``j``
    with ``c[j-1] <= r * total < c[j]`` (float64 cumulative weights ``c``); the kernel can pick an
    earlier index only if ``r * total`` is within ``tol * total`` of ``c[j-1]`` and a positive
    weight comes before ``j``, a later one only if it is within ``tol * total`` of ``c[j]`` and a
    positive weight comes after ``j`` (else both end on the first / last positive weight)."""
    w = reference_weights(p, q, accepted).double()
    c = w.cumsum(-1)
    total = c[:, -1]
    t = r.double().cpu() * total
    j = token.cpu()[:, None]
    idx = torch.arange(w.shape[-1], device="cpu")
    first = torch.where(w > 0, idx, w.shape[-1]).amin(-1)
    last = torch.where(w > 0, idx, -1).amax(-1)
    at = c.gather(-1, j)[:, 0]
    before = c.gather(-1, (j - 1).clamp(min=0))[:, 0]
    j = j[:, 0]
    return ((j > first) & ((before - t).abs() <= tol * total)) | ((j < last) & ((at - t).abs() <= tol * total))


def check(p, q, draft, u, r, *, block_v=None):
    """Run kernel and reference, assert they agree, return ``(cases, ambiguous cases, accepted)``."""
    acc_k, tok_k = kernels.accept_reject(p, q, draft, u, r, block_v=block_v)
    acc_r, tok_r = reference.accept_reject(p, q, draft, u, r)
    assert acc_k.dtype == tok_k.dtype == torch.int64 and acc_k.device == p.device and acc_k.shape == (p.shape[0],)
    assert torch.equal(acc_k.cpu(), acc_r.cpu()), (acc_k, acc_r)
    skip = ambiguous(p, q, acc_r, r, tok_r, tolerance(p.shape[-1], block_v))
    same = tok_k.cpu() == tok_r.cpu()
    assert (same | skip).all(), f"tokens differ at {(~same & ~skip).nonzero()[:, 0].tolist()}: " \
                                f"kernel {tok_k.tolist()} reference {tok_r.tolist()}"
    # never a token of zero weight, ambiguous or not
    w = reference_weights(p, q, acc_r)
    has_mass = w.sum(-1) > 0
    assert (w.gather(-1, tok_k.cpu()[:, None])[:, 0] > 0)[has_mass].all()
    return p.shape[0], int(skip.sum()), acc_r.cpu()


def assert_rare(n, n_skip):
    assert n_skip <= 0.01 * n, f"{n_skip} of {n} cases within rounding of a boundary"


# -- the grid ------------------------------------------------------------------------------------


@pytest.mark.parametrize("v,block_v", [(1, None), (7, None), (100, None), (100, 16), (1000, None), (1000, 64),
                                       (4099, None)], ids=lambda x: str(x))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_matches_reference(v, block_v, dtype):
    # every kind once per (V, tile, dtype), each with its own γ: over the grid every γ in 1..8
    # meets every kind, batches of 1 and 5 alternate, and so do int32 and int64 ids
    n = n_skip = 0
    offset = v + (block_v or 0) + DTYPES.index(dtype)
    for kind_i, kind in enumerate(KINDS):
        gamma = 1 + (kind_i + offset) % 8
        b = 1 if (kind_i + offset) % 3 == 0 else 5
        id_dtype = torch.int32 if (kind_i + offset) % 2 else torch.int64
        p, q, draft, u, r = make(kind, b, gamma, v, dtype=dtype, id_dtype=id_dtype, seed=1000 * kind_i + offset)
        cases, skipped, acc = check(p, q, draft, u, r, block_v=block_v)
        n, n_skip = n + cases, n_skip + skipped
        if kind == "accept_all":
            assert (acc == gamma).all()
        if kind == "reject_first":
            assert (acc == 0).all()
    assert_rare(n, n_skip)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_smollm2_vocabulary(dtype):
    # V = 49,152 = 12 tiles of 4096 (the GPU tile) and 3 of 16384; sampled, bonus, rejection
    n = n_skip = 0
    for kind, gamma, block_v in [("sampled", 4, None), ("accept_all", 3, None), ("reject_first", 5, 16384)]:
        p, q, draft, u, r = make(kind, 3, gamma, 49152, dtype=dtype, seed=gamma)
        cases, skipped, _ = check(p, q, draft, u, r, block_v=block_v)
        n, n_skip = n + cases, n_skip + skipped
    assert_rare(n, n_skip)


def test_many_sampled_cases_ambiguity_is_rare():
    # 150 sequences over a 4-tile vocabulary in float16: the excluded cases are rare
    n = n_skip = 0
    for gamma in (1, 3, 6):
        p, q, draft, u, r = make("sampled", 50, gamma, 250, dtype=torch.float16, seed=gamma)
        cases, skipped, _ = check(p, q, draft, u, r, block_v=64)
        n, n_skip = n + cases, n_skip + skipped
    assert n == 150
    assert_rare(n, n_skip)


def test_greedy_is_argmax():
    # one-hot p and q: accepted = leading matches with the target's argmax, then the argmax
    p, q, draft, u, r = make("greedy", 6, 4, 300, seed=3)
    acc, tok = kernels.accept_reject(p, q, draft, u, r)
    want = reference.greedy_accept(p.argmax(-1), draft)
    assert torch.equal(acc.cpu(), want[0].cpu()) and torch.equal(tok.cpu(), want[1].cpu())
    assert acc.max() == 4 and acc.min() < 4              # a bonus and a rejection both occur


def test_residual_without_mass_falls_back_to_p():
    # a proposal with q(x) = p(x) = 0 is rejected (0 < 0 fails) and p = q leaves no residual:
    # the next token is drawn from p at that position, as in the reference
    g = torch.Generator(device="cpu").manual_seed(5)
    v, b = 50, 4
    p = dist(g, b, 3, v)
    p[:, 0, 7] = 0.0
    q = p[:, :2].clone()
    draft = torch.full((b, 2), 7, device="cpu")
    u, r = torch.rand(b, 2, generator=g, device="cpu"), torch.tensor([0.0, 0.3, 0.7, R_BELOW_ONE], device="cpu")
    p, q, draft, u, r = (t.to(DEV) for t in (p, q, draft, u, r))
    acc, tok = kernels.accept_reject(p, q, draft, u, r, block_v=16)
    assert (acc == 0).all()
    assert torch.equal(tok.cpu(), reference.inverse_cdf(p[:, 0].cpu(), r.cpu()))
    check(p, q, draft, u, r, block_v=16)


def test_row_of_zeros_exact_ties_and_extreme_r():
    # all accepted, the bonus row p[γ] is [0, .25, .25, .5] at 5..8 and zeros elsewhere (row 0: all
    # zeros -> token 0). r = 0 -> the first positive weight (6); r just below 1 -> the last one (8),
    # never a trailing zero; exact ties r * total = c[j] go past j (c[j] > r * total is strict):
    # r = .25 -> 7, r = .5 -> 8; r = 1 (out of range) -> nothing exceeds it -> the last positive (8)
    v = 40
    r = torch.tensor([0.5, R_BELOW_ONE, 0.0, 0.6, 0.25, 0.5, 1.0], device=DEV)
    b = r.shape[0]
    p = torch.zeros(b, 2, v, device=DEV)
    p[:, 0, 3] = 1.0
    p[1:, 1, 5:9] = torch.tensor([0.0, 0.25, 0.25, 0.5], device=DEV)
    q = torch.zeros(b, 1, v, device=DEV)
    q[:, 0, 3] = 1.0
    draft = torch.full((b, 1), 3, dtype=torch.int32, device=DEV)
    u = torch.full((b, 1), 0.5, device=DEV)
    want = [0, 8, 6, 8, 7, 8, 8]
    # r = 1 is refused by the checks of values; without them, the step's own fallback is what is tested
    with pytest.raises(ValueError, match=r"r must hold uniforms in \[0, 1\)"):
        kernels.accept_reject(p, q, draft, u, r)
    assert reference.accept_reject(p, q, draft, u, r, check_values=False)[1].tolist() == want
    for block_v in (None, 16):
        acc, tok = kernels.accept_reject(p, q, draft, u, r, block_v=block_v, check_values=False)
        assert acc.tolist() == [1] * b
        assert tok.tolist() == want


def test_strided_inputs_are_read_in_place():
    # slices and transposed views (V with stride 1 and not), mixed dtypes p float32 / q bfloat16
    b, gamma, v = 5, 3, 130
    p0, q0, draft0, u0, r0 = make("sampled", b, gamma, v, seed=11)
    p_big = torch.zeros(b, gamma + 3, v, device=DEV)
    p_big[:, 1:gamma + 2] = p0
    q_t = q0.transpose(0, 1).contiguous().transpose(0, 1).to(torch.bfloat16)    # (B, γ, V), batch stride V
    p_vlast = p0.transpose(1, 2).contiguous().transpose(1, 2)                     # V not the fastest dim
    draft_t = draft0.t().contiguous().t()
    u_t = u0.t().contiguous().t()
    r_s = torch.stack([r0, r0], dim=1)[:, 0]                                      # stride 2
    for p in (p_big[:, 1:gamma + 2], p_vlast):
        assert not p.is_contiguous()
        check(p, q_t, draft_t, u_t, r_s, block_v=32)
        acc, tok = kernels.accept_reject(p, q_t, draft_t, u_t, r_s, block_v=32)
        acc_c, tok_c = kernels.accept_reject(p.contiguous(), q_t.contiguous(), draft_t.contiguous(),
                                             u_t.contiguous(), r_s.contiguous(), block_v=32)
        assert torch.equal(acc, acc_c) and torch.equal(tok, tok_c)


def test_empty_batch():
    p = torch.zeros(0, 3, 10, device=DEV)
    acc, tok = kernels.accept_reject(p, p[:, :2], torch.zeros(0, 2, dtype=torch.long, device=DEV),
                                     torch.zeros(0, 2, device=DEV), torch.zeros(0, device=DEV))
    assert acc.shape == tok.shape == (0,) and acc.dtype == torch.int64


def test_speculative_sample_draws_like_the_reference():
    p, q, draft, _, _ = make("sampled", 6, 4, 300, dtype=torch.float16, seed=21)
    acc_k, tok_k = kernels.speculative_sample(p, q, draft, torch.Generator(DEV).manual_seed(7))
    acc_r, tok_r = reference.speculative_sample(p, q, draft, torch.Generator(DEV).manual_seed(7))
    assert torch.equal(acc_k, acc_r)
    g = torch.Generator(DEV).manual_seed(7)
    torch.rand(6, 4, generator=g, device=DEV)                       # u first, then r
    r = torch.rand(6, generator=g, device=DEV)
    skip = ambiguous(p, q, acc_r, r, tok_r, tolerance(300))
    assert ((tok_k == tok_r).cpu() | skip).all()


@pytest.mark.skipif(runtime.interpreting(), reason="a large batch is tested on a GPU")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_large_batch_on_gpu(dtype):
    n = n_skip = 0
    for kind_i, kind in enumerate(KINDS):
        p, q, draft, u, r = make(kind, 64, 1 + kind_i, 49152, dtype=dtype, seed=kind_i)
        cases, skipped, _ = check(p, q, draft, u, r)
        n, n_skip = n + cases, n_skip + skipped
    assert_rare(n, n_skip)


# -- random shapes -------------------------------------------------------------------------------


@settings(max_examples=8, deadline=None)
@given(b=st.integers(1, 4), gamma=st.integers(1, 8), v=st.integers(1, 300), block_v=st.sampled_from([None, 16, 64]),
       dtype=st.sampled_from(DTYPES), id_dtype=st.sampled_from([torch.int32, torch.int64]),
       kind=st.sampled_from(KINDS), seed=st.integers(0, 10_000))
def test_random_shapes(b, gamma, v, block_v, dtype, id_dtype, kind, seed):
    p, q, draft, u, r = make(kind, b, gamma, v, dtype=dtype, id_dtype=id_dtype, seed=seed)
    check(p, q, draft, u, r, block_v=block_v)


# -- bad inputs ----------------------------------------------------------------------------------


def test_bad_inputs(off_device):
    p, q, draft, u, r = make("sampled", 2, 3, 20, seed=0)
    ar = kernels.accept_reject
    cases = [
        # types and dtypes
        (lambda: ar(p.tolist(), q, draft, u, r), TypeError, "p must be a torch.Tensor"),
        (lambda: ar(p.long(), q, draft, u, r), TypeError, "p must have dtype float32, float16, bfloat16; got int64"),
        (lambda: ar(p.double(), q, draft, u, r), TypeError, "p must have dtype .*; got float64"),
        (lambda: ar(p, q.int(), draft, u, r), TypeError, "q must have dtype"),
        (lambda: ar(p, q, draft.float(), u, r), TypeError, "draft must have dtype int32, int64; got float32"),
        (lambda: ar(p, q, draft.short(), u, r), TypeError, "draft must have dtype int32, int64; got int16"),
        (lambda: ar(p, q, draft, u.double(), r), TypeError, "u must have dtype float32; got float64"),
        (lambda: ar(p, q, draft, u, r.half()), TypeError, "r must have dtype float32; got float16"),
        (lambda: ar(p, q, draft, u, None), TypeError, "r must be a torch.Tensor"),
        # shapes (the reference's messages)
        (lambda: ar(p[0], q, draft, u, r), ValueError, "p must be a 3-D float tensor"),
        (lambda: ar(p[:, :1], q[:, :0], draft[:, :0], u[:, :0], r), ValueError, r"p must hold gamma \+ 1 >= 2"),
        (lambda: ar(p, q[:, :2], draft, u, r), ValueError, r"q must be \(B, gamma, V\) = \(2, 3, 20\)"),
        (lambda: ar(p, q[..., :19], draft, u, r), ValueError, r"q must be \(B, gamma, V\)"),
        (lambda: ar(p, q, draft[:1], u, r), ValueError, r"draft must be \(B, gamma\) = \(2, 3\)"),
        (lambda: ar(p, q, draft, u[:, :2], r), ValueError, r"u must be \(2, 3\) uniforms"),
        (lambda: ar(p, q, draft, u, r[:1]), ValueError, r"r must be \(2,\) uniforms"),
        # token ids out of range
        (lambda: ar(p, q, draft + 20, u, r), ValueError, r"draft token ids must be in \[0, V\) = \[0, 20\)"),
        (lambda: ar(p, q, draft - 20, u, r), ValueError, r"draft token ids must be in \[0, V\)"),
        # the tile
        (lambda: ar(p, q, draft, u, r, block_v=48), ValueError, "block_v must be a power of two"),
        (lambda: ar(p, q, draft, u, r, block_v=0), ValueError, "block_v must be positive"),
        # devices
        (lambda: ar(p.to(off_device), q, draft, u, r), ValueError, f"p must be on {DEV.type}"),
        (lambda: ar(p, q.to(off_device), draft, u, r), ValueError, f"q must be on {DEV.type}"),
        (lambda: ar(p, q, draft.to(off_device), u, r), ValueError, f"draft must be on {DEV.type}"),
        (lambda: ar(p, q, draft, u.to(off_device), r), ValueError, f"u must be on {DEV.type}"),
        (lambda: ar(p, q, draft, u, r.to(off_device)), ValueError, f"r must be on {DEV.type}"),
        (lambda: kernels.speculative_sample(p.to(off_device), q, draft), ValueError, f"p must be on {DEV.type}"),
        (lambda: kernels.speculative_sample(p, q, draft.float()), TypeError, "draft must have dtype"),
    ]
    for call, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            call()
