"""Module 12's Triton kernels (llmu.moe.kernels) against torch indexing and the reference layer.

- ``permute``/``unpermute``: pure data movement, compared *exactly* with torch indexing
  (``x[order // k]``, ``index_add``). The combine sums ``k`` float32 products per token in the
  same order as the torch oracle below, so it is bit-exact for ``k <= 2``; for ``k = 3`` the
  oracle's ``index_add`` may add in another order: ``rtol=1e-6``.
- ``grouped_gemm``: one float32 matmul per group against ``x_e @ w[e].T``. The kernel
  accumulates ``BLOCK_K``-wide partial dot products in float32 (``"ieee"``: no TF32), torch in
  its own blocking; the difference is summation order, a few ulps times ``sqrt(K)``: ``rtol=1e-5,
  atol=1e-5`` for O(1) entries with ``K <= 100``. float16 inputs: both sides accumulate in float32
  and round the output once to float16 (2**-11 relative); the rounding may fall on either side:
  ``rtol=2e-3, atol=2e-3``.
- ``moe_triton`` against ``moe_reference``: the routing is the same function (``route``), so the
  decisions are identical; the expert outputs differ as above, then are scaled and summed:
  ``rtol=1e-5, atol=1e-5`` in float32. Gradients (every input, through the weighted combine into
  the router): the same bound, explained above the backward tests.

Sizes are small (every program runs in Triton's interpreter here) but ragged: ``T`` not a multiple
of the row tile, experts with no tokens, ``H``/``F`` not multiples of the column and reduction
tiles, batch 1, ``k`` in {1, 2}. Every tensor is made on ``kdev``.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import llmu  # noqa: F401
from llmu.moe import kernels as K, reference as R
from llmu.moe.layer import MoEFeedForward
from llmu.runtime import kernel_device

pytestmark = pytest.mark.kernels

KDEV = kernel_device()
SMALL = dict(block_m=16, block_n=16, block_k=16)   # several tiles even at test sizes


def _gen(seed):
    return torch.Generator(device="cpu").manual_seed(seed)


def _weights(E, H, F, seed=0, dtype=torch.float32):
    g = _gen(seed)
    rw = torch.randn(E, H, generator=g, device="cpu")
    wg = torch.randn(E, F, H, generator=g, device="cpu") / math.sqrt(H)
    wu = torch.randn(E, F, H, generator=g, device="cpu") / math.sqrt(H)
    wd = torch.randn(E, H, F, generator=g, device="cpu") / math.sqrt(F)
    return tuple(t.to(dtype=dtype, device=KDEV) for t in (rw, wg, wu, wd))


def _experts(T, E, k, seed, skip=()):
    """(T, k) distinct experts per token, never one of ``skip``."""
    g = _gen(seed)
    allowed = torch.tensor([e for e in range(E) if e not in skip], device="cpu")
    picks = torch.stack([allowed[torch.randperm(len(allowed), generator=g, device="cpu")[:k]] for _ in range(T)])
    return picks.reshape(T, k).to(KDEV)


# ---------------------------------------------------------------------------------------------
# permute / unpermute
# ---------------------------------------------------------------------------------------------

PERMUTE_CASES = [  # (T, H, E, k, experts never used)
    (1, 8, 4, 1, ()),            # batch 1
    (1, 8, 4, 2, ()),
    (17, 40, 4, 2, (2,)),        # T not a multiple of the 16-row block; expert 2 empty
    (33, 130, 5, 1, (0, 4)),     # H wider than one 128-column block, ragged; first and last empty
    (20, 16, 8, 3, ()),
]


@pytest.mark.parametrize("T, H, E, k, skip", PERMUTE_CASES)
def test_permute_matches_torch_indexing(T, H, E, k, skip):
    x = torch.randn(T, H, generator=_gen(T + H), device="cpu").to(KDEV)
    experts = _experts(T, E, k, seed=T, skip=skip)
    x_sorted, order, counts, offsets = K.permute(x, experts, E)
    flat = experts.reshape(-1)
    assert order.shape == (T * k,) and x_sorted.shape == (T * k, H)
    assert torch.equal(counts, torch.bincount(flat, minlength=E))
    assert offsets.tolist() == [0] + counts.cumsum(0).tolist()
    for e in skip:
        assert counts[e] == 0
    # grouped by expert, token order inside an expert (stable), every assignment exactly once
    assert torch.equal(flat[order], torch.sort(flat).values)
    for e in range(E):
        seg = order[offsets[e]:offsets[e + 1]]
        assert (flat[seg] == e).all() and (seg[1:] > seg[:-1]).all()
    assert torch.equal(torch.sort(order).values, torch.arange(T * k, device=KDEV))
    assert torch.equal(x_sorted, x[order // k])


@pytest.mark.parametrize("T, H, E, k, skip", PERMUTE_CASES)
def test_unpermute_is_the_weighted_combine(T, H, E, k, skip):
    x = torch.randn(T, H, generator=_gen(T + H), device="cpu").to(KDEV)
    experts = _experts(T, E, k, seed=T, skip=skip)
    weights = torch.rand(T, k, generator=_gen(k), device="cpu").to(KDEV)
    _, order, _, _ = K.permute(x, experts, E)
    y_sorted = torch.randn(T * k, H, generator=_gen(3), device="cpu").to(KDEV)
    out = K.unpermute(y_sorted, order, weights, T)
    # oracle: row i of y_sorted belongs to token order[i] // k, choice order[i] % k
    tok, slot = order // k, order % k
    ref = torch.zeros(T, H, device=KDEV).index_add(0, tok, y_sorted * weights[tok, slot, None])
    tol = dict(rtol=0, atol=0) if k <= 2 else dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out, ref, **tol)
    # permute then unpermute with weights: each token's weighted copies add back up
    x_sorted, order, _, _ = K.permute(x, experts, E)
    torch.testing.assert_close(K.unpermute(x_sorted, order, weights, T), x * weights.sum(-1, keepdim=True),
                               rtol=1e-6, atol=1e-6)


def test_dropped_assignments_get_no_row_and_add_nothing():
    T, H, E = 6, 24, 3
    x = torch.randn(T, H, generator=_gen(0), device="cpu").to(KDEV)
    experts = torch.tensor([[0, 1], [-1, 2], [0, -1], [1, 2], [-1, -1], [2, 0]], device=KDEV)
    x_sorted, order, counts, offsets = K.permute(x, experts, E)
    kept = (experts.reshape(-1) >= 0).nonzero().flatten()
    assert x_sorted.shape == (len(kept), H) and counts.tolist() == [3, 2, 3]
    assert torch.equal(torch.sort(order).values, kept)
    weights = torch.ones(T, 2, device=KDEV)
    out = K.unpermute(x_sorted, order, weights, T)
    torch.testing.assert_close(out, x * (experts >= 0).sum(-1, keepdim=True).float(), rtol=1e-6, atol=1e-6)
    assert (out[4] == 0).all()


# ---------------------------------------------------------------------------------------------
# grouped GEMM
# ---------------------------------------------------------------------------------------------

GEMM_CASES = [  # (group sizes, N, K)
    ([5], 20, 12),                       # one expert, one ragged tile
    ([1, 0, 3], 16, 16),                 # an empty expert in the middle, exact tiles in N and K
    ([0, 17, 40, 0], 33, 50),            # empty first and last, groups spanning several 16-row tiles
    ([16, 16, 1], 70, 100),              # a group ending exactly on a tile edge, then one row
    ([0, 0], 8, 8),                      # nothing at all
]


def _loop_gemm(x, w, sizes):
    outs, start = [], 0
    for e, n in enumerate(sizes):
        outs.append(x[start:start + n].double() @ w[e].double().T)
        start += n
    return torch.cat(outs).to(x.dtype)


@pytest.mark.parametrize("sizes, N, Kd", GEMM_CASES)
def test_grouped_gemm_matches_a_loop_over_experts(sizes, N, Kd):
    E, M = len(sizes), sum(sizes)
    x = torch.randn(M, Kd, generator=_gen(M), device="cpu").to(KDEV)
    w = (torch.randn(E, N, Kd, generator=_gen(N), device="cpu") / math.sqrt(Kd)).to(KDEV)
    offsets = torch.tensor([0] + sizes, device=KDEV).cumsum(0)
    out = K.grouped_gemm(x, w, offsets, **SMALL)
    assert out.shape == (M, N) and out.dtype == torch.float32
    torch.testing.assert_close(out, _loop_gemm(x, w, sizes), rtol=1e-5, atol=1e-5)
    # default tiles, int32 offsets, and the weights as a transposed view (E, K, N) memory
    w_t = w.transpose(1, 2).contiguous().transpose(1, 2)
    out2 = K.grouped_gemm(x, w_t, offsets.to(torch.int32))
    torch.testing.assert_close(out2, _loop_gemm(x, w, sizes), rtol=1e-5, atol=1e-5)


def test_grouped_gemm_float16():
    sizes, N, Kd = [9, 0, 20], 24, 40
    x = torch.randn(sum(sizes), Kd, generator=_gen(1), device="cpu").half().to(KDEV)
    w = (torch.randn(3, N, Kd, generator=_gen(2), device="cpu") / math.sqrt(Kd)).half().to(KDEV)
    offsets = torch.tensor([0] + sizes, device=KDEV).cumsum(0)
    out = K.grouped_gemm(x, w, offsets, **SMALL)
    assert out.dtype == torch.float16
    ref = _loop_gemm(x.float(), w.float(), sizes).half()
    torch.testing.assert_close(out, ref, rtol=2e-3, atol=2e-3)


def test_tile_map():
    offsets = torch.tensor([0, 0, 17, 49, 50], device=KDEV)
    tile_expert, tile_row = K.tile_map(offsets, 16)
    assert tile_expert.tolist() == [1, 1, 2, 2, 3]
    assert tile_row.tolist() == [0, 16, 17, 33, 49]


# ---------------------------------------------------------------------------------------------
# the layer
# ---------------------------------------------------------------------------------------------

MOE_CASES = [  # (T, H, F, E, k, capacity_factor)
    (1, 16, 24, 4, 1, None),      # batch 1, decode-like
    (1, 16, 24, 4, 2, None),
    (19, 20, 36, 4, 2, None),     # T, H, F all ragged
    (3, 24, 40, 8, 1, None),      # 3 tokens over 8 experts: at least 5 experts empty
    (21, 16, 24, 3, 2, 0.6),      # capacity: some assignments dropped
    (12, 16, 24, 4, 1, 0.5),
]


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("T, H, F, E, k, cf", MOE_CASES)
def test_moe_triton_matches_reference(T, H, F, E, k, cf, renormalize):
    rw, wg, wu, wd = _weights(E, H, F, seed=T + E)
    x = torch.randn(T, H, generator=_gen(T), device="cpu").to(KDEV)
    y_ref, aux_ref = R.moe_reference(x, rw, wg, wu, wd, k, renormalize=renormalize, capacity_factor=cf)
    y, aux = K.moe_triton(x, rw, wg, wu, wd, k, renormalize=renormalize, capacity_factor=cf, **SMALL)
    assert torch.equal(aux.experts, aux_ref.experts) and torch.equal(aux.dropped, aux_ref.dropped)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    if cf is not None:
        assert aux.num_dropped > 0
    if T == 3 and E == 8:
        assert (aux.tokens_per_expert == 0).sum() >= 5


def test_no_tokens():
    rw, wg, wu, wd = _weights(4, 8, 12)
    x = torch.randn(0, 8, device=KDEV)
    for cf in (None, 1.0):
        for fn in (R.moe_reference, K.moe_triton):
            y, aux = fn(x, rw, wg, wu, wd, 2, capacity_factor=cf)
            assert y.shape == (0, 8) and aux.lb_loss.item() == 0 and aux.z_loss.item() == 0


def test_module_triton_path_matches_torch_path():
    torch.manual_seed(0)
    moe = MoEFeedForward(20, 36, num_experts=4, k=2, capacity_factor=1.0, device=KDEV)
    x = torch.randn(2, 7, 20, device=KDEV)
    with torch.no_grad():
        y_torch = moe(x)
        moe.impl = "triton"
        y_triton = moe(x)
    assert y_triton.shape == x.shape
    torch.testing.assert_close(y_triton, y_torch, rtol=1e-5, atol=1e-5)
    moe.impl = None
    assert moe.resolved_impl(x) == ("torch" if KDEV.type == "cpu" else "triton")


# ---------------------------------------------------------------------------------------------
# backward
# ---------------------------------------------------------------------------------------------
# Gradients are sums of the same products as the forward, in other orders (a weight gradient sums
# over all of an expert's rows, at most 2 * 21 here): float32 rtol=1e-5, atol=1e-5 for O(1) entries.

GRAD = dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sizes, N, Kd", GEMM_CASES[:4])
def test_grouped_gemm_backward(sizes, N, Kd):
    E, M = len(sizes), sum(sizes)
    x = torch.randn(M, Kd, generator=_gen(M), device="cpu").to(KDEV).requires_grad_()
    w = (torch.randn(E, N, Kd, generator=_gen(N), device="cpu") / math.sqrt(Kd)).to(KDEV).requires_grad_()
    offsets = torch.tensor([0] + sizes, device=KDEV).cumsum(0)
    d_out = torch.randn(M, N, generator=_gen(7), device="cpu").to(KDEV)
    K.grouped_gemm(x, w, offsets, **SMALL).backward(d_out)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = torch.cat([x2[o:o + n] @ w2[e].T for e, (o, n) in enumerate(zip(offsets[:-1].tolist(), sizes))])
    ref.backward(d_out)
    torch.testing.assert_close(x.grad, x2.grad, **GRAD)
    torch.testing.assert_close(w.grad, w2.grad, **GRAD)     # zero for the empty experts
    for e, n in enumerate(sizes):
        if n == 0:
            assert (w.grad[e] == 0).all()


@pytest.mark.parametrize("T, H, F, E, k, cf", [(1, 16, 24, 4, 2, None), (19, 20, 36, 4, 2, None),
                                               (3, 24, 40, 8, 1, None), (21, 16, 24, 3, 2, 0.6)])
def test_moe_triton_backward_matches_reference(T, H, F, E, k, cf):
    leaves = [t.requires_grad_() for t in _weights(E, H, F, seed=T + E)]
    x = torch.randn(T, H, generator=_gen(T), device="cpu").to(KDEV).requires_grad_()
    d_y = torch.randn(T, H, generator=_gen(T + 1), device="cpu").to(KDEV)
    grads = []
    for fn, kw in ((R.moe_reference, {}), (K.moe_triton, SMALL)):
        y, aux = fn(x, *leaves, k, renormalize=False, capacity_factor=cf, **kw)
        loss = (y * d_y).sum() + aux.lb_loss + 1e-3 * aux.z_loss
        grads.append(torch.autograd.grad(loss, [x, *leaves]))
    for name, g_tri, g_ref in zip(["x", "router_weight", "w_gate", "w_up", "w_down"], *grads):
        torch.testing.assert_close(g_tri, g_ref, **GRAD, msg=lambda m, name=name: f"{name}: {m}")
    assert grads[1][1].abs().sum() > 0      # the router learns through the gate weights


def test_module_trains_on_the_triton_path():
    torch.manual_seed(2)
    moe = MoEFeedForward(16, 24, num_experts=4, k=2, impl="triton", device=KDEV)
    ref = MoEFeedForward(16, 24, num_experts=4, k=2, impl="torch", device=KDEV)
    ref.load_state_dict(moe.state_dict())
    x = torch.randn(2, 5, 16, device=KDEV)
    for m in (moe, ref):
        (m(x).pow(2).mean() + m.last_aux.lb_loss).backward()
    for (name, p), q in zip(moe.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **GRAD, msg=lambda m, name=name: f"{name}: {m}")


@settings(max_examples=8, deadline=None)
@given(T=st.integers(1, 24), H=st.integers(1, 40), F=st.integers(1, 40), E=st.integers(1, 6),
       k=st.integers(1, 2), cf=st.sampled_from([None, 0.5, 1.0]), seed=st.integers(0, 1000))
def test_random_shapes(T, H, F, E, k, cf, seed):
    k = min(k, E)
    rw, wg, wu, wd = _weights(E, H, F, seed=seed)
    x = torch.randn(T, H, generator=_gen(seed), device="cpu").to(KDEV)
    y_ref, _ = R.moe_reference(x, rw, wg, wu, wd, k, capacity_factor=cf)
    y, _ = K.moe_triton(x, rw, wg, wu, wd, k, capacity_factor=cf, **SMALL)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# bad inputs
# ---------------------------------------------------------------------------------------------


def test_permute_bad_inputs(off_device):
    x = torch.randn(4, 8, device=KDEV)
    with pytest.raises(ValueError, match="experts"):
        K.permute(x, torch.tensor([[0], [1], [4], [0]], device=KDEV), 4)     # id out of range
    with pytest.raises(ValueError, match="experts"):
        K.permute(x, torch.zeros(3, 1, dtype=torch.long, device=KDEV), 4)   # wrong T
    with pytest.raises(TypeError, match="experts"):
        K.permute(x, torch.zeros(4, 1, device=KDEV), 4)                     # float ids
    with pytest.raises(ValueError, match="x must be on"):
        K.permute(x.to(off_device), torch.zeros(4, 1, dtype=torch.long, device=KDEV), 4)
    with pytest.raises(ValueError, match="num_experts"):
        K.permute(x, torch.zeros(4, 1, dtype=torch.long, device=KDEV), 0)


def test_unpermute_bad_inputs():
    y = torch.randn(4, 8, device=KDEV)
    order = torch.arange(4, device=KDEV)
    w = torch.ones(2, 2, device=KDEV)
    with pytest.raises(ValueError, match="weights"):
        K.unpermute(y, order, w, 3)
    with pytest.raises(ValueError, match="order"):
        K.unpermute(y, order[:3], w, 2)
    with pytest.raises(ValueError, match="order"):
        K.unpermute(y, order + 1, w, 2)                 # index 4 >= T*k
    with pytest.raises(ValueError, match="order"):
        K.unpermute(y, torch.tensor([0, 0, 1, 2], device=KDEV), w, 2)


def test_grouped_gemm_bad_inputs(off_device):
    x = torch.randn(5, 12, device=KDEV)
    w = torch.randn(2, 8, 12, device=KDEV)
    off = torch.tensor([0, 2, 5], device=KDEV)
    with pytest.raises(ValueError, match="w must be"):
        K.grouped_gemm(x, w[:, :, :10], off)
    with pytest.raises(ValueError, match="offsets must have"):
        K.grouped_gemm(x, w, off[:2])
    with pytest.raises(ValueError, match="offsets must start"):
        K.grouped_gemm(x, w, torch.tensor([0, 2, 4], device=KDEV))
    with pytest.raises(ValueError, match="offsets must start"):
        K.grouped_gemm(x, w, torch.tensor([0, 6, 5], device=KDEV))      # a group of -1 rows
    with pytest.raises(TypeError, match="w must have dtype"):
        K.grouped_gemm(x, w.double(), off)
    with pytest.raises(TypeError, match="w has dtype"):
        K.grouped_gemm(x, w.half(), off)                 # tl.dot needs one dtype
    with pytest.raises(TypeError, match="offsets"):
        K.grouped_gemm(x, w, off.float())
    with pytest.raises(ValueError, match="block_m"):
        K.grouped_gemm(x, w, off, block_m=8)
    with pytest.raises(ValueError, match="block_n"):
        K.grouped_gemm(x, w, off, block_n=24)
    with pytest.raises(ValueError, match="x_sorted must be on"):
        K.grouped_gemm(x.to(off_device), w, off)


def test_moe_triton_bad_inputs(off_device):
    rw, wg, wu, wd = _weights(4, 8, 12)
    x = torch.randn(5, 8, device=KDEV)
    with pytest.raises(ValueError, match="x must be on"):
        K.moe_triton(x.to(off_device), rw, wg, wu, wd, 2)
    with pytest.raises(ValueError, match="k=5.*E=4"):
        K.moe_triton(x, rw, wg, wu, wd, 5)
    with pytest.raises(ValueError, match="capacity below one token"):
        K.moe_triton(x, rw, wg, wu, wd, 2, capacity_factor=0.0)
    with pytest.raises(ValueError, match="w_down"):
        K.moe_triton(x, rw, wg, wu, wd[:, :, :11], 2)
    with pytest.raises(TypeError, match="w_gate"):
        K.moe_triton(x, rw, wg.double(), wu, wd, 2)
    with pytest.raises(TypeError, match="w_gate has dtype"):
        K.moe_triton(x, rw, wg.half(), wu, wd, 2)


def test_grouped_gemm_dw_bad_inputs():
    x = torch.randn(5, 12, device=KDEV)
    dy = torch.randn(5, 8, device=KDEV)
    off = torch.tensor([0, 2, 5], device=KDEV)
    assert K.grouped_gemm_dw(dy, x, off, 2).shape == (2, 8, 12)
    with pytest.raises(ValueError, match="dy must have"):
        K.grouped_gemm_dw(dy[:4], x, off, 2)
    with pytest.raises(ValueError, match="offsets must have"):
        K.grouped_gemm_dw(dy, x, off, 3)
    with pytest.raises(ValueError, match="num_experts"):
        K.grouped_gemm_dw(dy, x, off, 0)
