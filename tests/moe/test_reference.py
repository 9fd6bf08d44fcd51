"""Module 12's torch reference (llmu.moe.reference): routing, capacity, losses, the MoE layer.

The layer is checked against two independent definitions: the dense SwiGLU MLP of module 03
(``E = 1``, ``k = 1``, and ``E`` identical experts with renormalised weights), and a per-token
double loop (``_per_token``). Tolerances, float32: the loop over experts multiplies the same
numbers in another grouping (a batched matmul over an expert's rows instead of one row at a time),
so results agree to a few ulps of the O(1) outputs: ``rtol=1e-5, atol=1e-6``. ``E = 1`` against
the dense MLP is the same computation times a weight of exactly 1.0: equal to the bit.
"""

from __future__ import annotations

import math

import pytest
import torch

import llmu  # noqa: F401
from llmu.layers.reference import swiglu
from llmu.moe import reference as R
from llmu.moe.layer import MoEFeedForward


def _weights(E, H, F, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    rw = torch.randn(E, H, generator=g, dtype=dtype)
    wg = torch.randn(E, F, H, generator=g, dtype=dtype) / math.sqrt(H)
    wu = torch.randn(E, F, H, generator=g, dtype=dtype) / math.sqrt(H)
    wd = torch.randn(E, H, F, generator=g, dtype=dtype) / math.sqrt(F)
    return rw, wg, wu, wd


def _per_token(x, rw, wg, wu, wd, aux):
    """y_t = sum over kept choices j of weight * MLP_{expert}(x_t), one token at a time."""
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(aux.experts.shape[1]):
            if aux.dropped[t, j]:
                continue
            e = int(aux.experts[t, j])
            y[t] += aux.weights[t, j] * swiglu(x[t : t + 1], wg[e], wu[e], wd[e])[0]
    return y


# ---------------------------------------------------------------------------------------------
# routing
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 3])
def test_top_k_route_picks_the_most_probable_experts(k):
    logits = torch.randn(11, 5, generator=torch.Generator().manual_seed(k))
    weights, experts, probs = R.top_k_route(logits, k, renormalize=False)
    torch.testing.assert_close(probs, torch.softmax(logits, -1))
    assert experts.dtype == torch.int64 and experts.shape == (11, k) and weights.shape == (11, k)
    # the raw weights are the chosen probabilities, largest first, and nothing left out is larger
    torch.testing.assert_close(weights, probs.gather(1, experts), rtol=0, atol=0)
    assert (weights[:, :-1] >= weights[:, 1:]).all()
    rest = probs.scatter(1, experts, -1.0)
    assert (rest.max(-1).values <= weights[:, -1]).all()


@pytest.mark.parametrize("k", [1, 2, 4])
def test_renormalised_weights_sum_to_one(k):
    logits = torch.randn(9, 4, generator=torch.Generator().manual_seed(10 + k))
    w_raw, e_raw, probs = R.top_k_route(logits, k, renormalize=False)
    w, e, _ = R.top_k_route(logits, k, renormalize=True)
    assert torch.equal(e, e_raw)
    torch.testing.assert_close(w.sum(-1), torch.ones(9))
    torch.testing.assert_close(w, w_raw / w_raw.sum(-1, keepdim=True))
    if k == 4:  # all experts: the renormalised weights are the probabilities themselves
        torch.testing.assert_close(w.sum(-1), probs.sum(-1))
    if k == 1:  # renormalising one weight gives 1.0; Switch keeps the raw probability instead
        assert torch.equal(w, torch.ones_like(w)) and (w_raw < 1).all()


def test_ties_follow_torch_topk():
    logits = torch.zeros(3, 4)
    _, experts, _ = R.top_k_route(logits, 2)
    assert torch.equal(experts, torch.softmax(logits, -1).topk(2, dim=-1).indices)


@pytest.mark.parametrize("k", [0, -1, 5])
def test_k_out_of_range_is_refused(k):
    with pytest.raises(ValueError, match=rf"k={k}.*E=4"):
        R.top_k_route(torch.zeros(3, 4), k)


# ---------------------------------------------------------------------------------------------
# capacity and dropping
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("T, E, k, cf, expected", [
    (8, 4, 2, 1.0, 4),        # exactly the balanced load
    (10, 4, 1, 1.25, 4),      # ceil(3.125)
    (10, 1, 1, 1.1, 11),      # 1.1 * 10 = 11.000000000000002 in floats: still 11
    (3, 8, 1, 1.0, 1),        # less than one token per expert: the ceiling gives one slot
    (5, 4, 2, 0.01, 1),
    (16, 8, 2, 2.0, 8),
])
def test_expert_capacity_formula(T, E, k, cf, expected):
    assert R.expert_capacity(T, E, k, cf) == expected == math.ceil(round(cf * T * k / E, 9))


@pytest.mark.parametrize("cf", [0, 0.0, -1.0])
def test_capacity_below_one_token_is_refused(cf):
    with pytest.raises(ValueError, match="capacity below one token"):
        R.expert_capacity(8, 4, 2, cf)
    with pytest.raises(ValueError, match="capacity below one token"):
        MoEFeedForward(8, 16, 4, 2, capacity_factor=cf)


def test_dropping_is_in_token_order():
    # expert 0 is wanted by tokens 0, 1, 3, 4; capacity 2 keeps tokens 0 and 1
    experts = torch.tensor([[0], [0], [1], [0], [0]])
    assert R.expert_positions(experts, 2).flatten().tolist() == [0, 1, 0, 2, 3]
    kept = R.dispatch_mask(experts, 2, capacity=2)
    assert kept.flatten().tolist() == [True, True, True, False, False]
    assert R.dispatch_mask(experts, 2, capacity=None).all()


def test_dropping_with_two_choices_shares_the_tokens_place():
    experts = torch.tensor([[0, 1], [1, 0], [0, 2], [2, 1]])
    # arrivals: e0: t0, t1, t2; e1: t0, t1, t3; e2: t2, t3
    assert R.expert_positions(experts, 3).tolist() == [[0, 0], [1, 1], [2, 0], [1, 2]]
    kept = R.dispatch_mask(experts, 3, capacity=2)
    assert kept.tolist() == [[True, True], [True, True], [False, True], [True, False]]


def test_layer_drops_the_right_assignments():
    T, H, F, E, k = 12, 8, 16, 3, 2
    rw, wg, wu, wd = _weights(E, H, F, seed=3)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(4))
    y, aux = R.moe_reference(x, rw, wg, wu, wd, k, capacity_factor=0.5)
    assert aux.capacity == R.expert_capacity(T, E, k, 0.5) == 4
    assert aux.num_dropped > 0
    kept = ~aux.dropped
    # no expert computes more than its capacity, and kept ones are the first arrivals
    for e in range(E):
        assert int(((aux.experts == e) & kept).sum()) == min(int(aux.tokens_per_expert[e]), aux.capacity)
    assert torch.equal(kept, R.expert_positions(aux.experts, E) < aux.capacity)
    torch.testing.assert_close(y, _per_token(x, rw, wg, wu, wd, aux), rtol=1e-5, atol=1e-6)
    # the router's demand is counted before dropping
    assert int(aux.tokens_per_expert.sum()) == T * k


# ---------------------------------------------------------------------------------------------
# auxiliary losses
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2])
def test_load_balancing_loss_is_alpha_at_perfect_balance(k):
    E, T = 4, 8
    probs = torch.full((T, E), 1.0 / E)
    experts = (torch.arange(T * k) % E).view(T, k)       # every expert gets T*k/E assignments
    assert R.load_balancing_loss(probs, experts, E, alpha=0.01).item() == pytest.approx(0.01, abs=1e-9)
    # balanced assignments give alpha whatever the probabilities (sum_i P_i = 1)
    probs2 = torch.softmax(torch.randn(T, E, generator=torch.Generator().manual_seed(k)), -1)
    assert R.load_balancing_loss(probs2, experts, E, alpha=0.5).item() == pytest.approx(0.5, rel=1e-6)


def test_load_balancing_loss_grows_when_routing_collapses():
    E, T, alpha = 4, 8, 0.01
    logits = torch.tensor([8.0, 0.0, 0.0, 0.0]).repeat(T, 1)
    weights, experts, probs = R.top_k_route(logits, 1)
    loss = R.load_balancing_loss(probs, experts, E, alpha)
    # f = (1, 0, 0, 0) and P_0 = softmax(8, 0, 0, 0)_0: loss = alpha * E * P_0, near alpha * E
    p0 = math.exp(8) / (math.exp(8) + 3)
    assert loss.item() == pytest.approx(alpha * E * p0, rel=1e-6)
    assert loss.item() > 3.9 * alpha
    # two choices per token, both always the same pair: f = (1/2, 1/2, 0, 0)
    logits2 = torch.tensor([5.0, 5.0, 0.0, 0.0]).repeat(T, 1)
    _, experts2, probs2 = R.top_k_route(logits2, 2)
    p = math.exp(5) / (2 * math.exp(5) + 2)
    assert R.load_balancing_loss(probs2, experts2, E, alpha).item() == pytest.approx(alpha * E * p, rel=1e-6)


def test_load_balancing_loss_gradient_lowers_the_busy_expert():
    logits = torch.tensor([[2.0, 0.0, 0.0], [2.0, 0.5, 0.0], [0.0, 2.0, 0.0]], requires_grad=True)
    _, experts, probs = R.top_k_route(logits, 1)
    R.load_balancing_loss(probs, experts, 3).backward()
    # expert 0 takes 2 of 3 tokens: the gradient pushes its logits down (positive gradient)
    assert (logits.grad[:, 0] > 0).all()


def test_router_z_loss_on_a_hand_example():
    logits = torch.tensor([[0.0, 0.0], [0.0, math.log(3.0)]])
    # logsumexp: log 2 and log 4 = 2 log 2; mean of squares = (1 + 4) / 2 * log(2)^2
    expected = 2.5 * math.log(2.0) ** 2
    assert R.router_z_loss(logits).item() == pytest.approx(expected, rel=1e-6)
    assert R.router_z_loss(logits + 10).item() > R.router_z_loss(logits).item()


# ---------------------------------------------------------------------------------------------
# the layer
# ---------------------------------------------------------------------------------------------


def test_one_expert_is_the_dense_swiglu_mlp():
    H, F = 12, 20
    rw, wg, wu, wd = _weights(1, H, F, seed=5)
    x = torch.randn(2, 7, H, generator=torch.Generator().manual_seed(6))
    for renormalize in (True, False):
        y, aux = R.moe_reference(x, rw, wg, wu, wd, 1, renormalize=renormalize)
        assert torch.equal(y, swiglu(x, wg[0], wu[0], wd[0]))   # a weight of exactly 1.0
        assert aux.lb_loss.item() == pytest.approx(0.01)


def test_identical_experts_with_renormalised_weights_are_the_dense_mlp():
    H, F, E = 12, 20, 4
    rw, wg, wu, wd = _weights(E, H, F, seed=7)
    rep = lambda w: w[:1].expand_as(w).contiguous()  # noqa: E731
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(8))
    y, _ = R.moe_reference(x, rw, rep(wg), rep(wu), rep(wd), 2)
    torch.testing.assert_close(y, swiglu(x, wg[0], wu[0], wd[0]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("T, E, k, renormalize", [(1, 4, 1, False), (1, 4, 2, True), (10, 4, 2, True),
                                                    (10, 8, 1, False), (7, 3, 3, True)])
def test_loop_over_experts_equals_per_token_loop(T, E, k, renormalize):
    H, F = 16, 24
    rw, wg, wu, wd = _weights(E, H, F, seed=T + E + k)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(T))
    y, aux = R.moe_reference(x, rw, wg, wu, wd, k, renormalize=renormalize)
    assert not aux.dropped.any() and aux.capacity is None
    torch.testing.assert_close(y, _per_token(x, rw, wg, wu, wd, aux), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(aux.z_loss, R.router_z_loss(x @ rw.T))


def test_gradients_flow_to_router_and_experts():
    torch.manual_seed(0)
    moe = MoEFeedForward(16, 24, num_experts=4, k=2, capacity_factor=1.5)
    x = torch.randn(2, 5, 16, requires_grad=True)
    y = moe(x)
    assert y.shape == x.shape and moe.resolved_impl(x) == "torch"
    aux = moe.last_aux
    assert aux.experts.shape == (10, 2) and aux.probs.shape == (10, 4)
    (y.pow(2).mean() + aux.lb_loss + 1e-3 * aux.z_loss).backward()
    for name, p in moe.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert x.grad.abs().sum() > 0


def test_router_gradient_through_the_gate_weights_only():
    # without the auxiliary losses the router learns only through the weights g_{t,e} that scale
    # the experts' outputs: raw Switch weights (k=1) carry a gradient, renormalised k=1 (always 1.0) do not
    torch.manual_seed(1)
    x = torch.randn(6, 8)
    for renormalize, has_grad in ((False, True), (True, False)):
        moe = MoEFeedForward(8, 12, num_experts=3, k=1, renormalize=renormalize)
        moe(x).sum().backward()
        # w / w.sum() with one w: 1.0 up to rounding, so a gradient of rounding size (~1e-8) is left
        assert (moe.router.weight.grad.abs().max() > 1e-4) == has_grad


def test_moe_reference_keeps_float64():
    """float64 stays float64 through the experts (module 03's swiglu widens to float32 at least, never
    narrows): the layer equals a float64 per-token loop to float64 rounding, about 1e-16 of O(1)
    outputs."""
    E, H, F, k = 4, 8, 12, 2
    rw, wg, wu, wd = _weights(E, H, F, seed=6, dtype=torch.float64)
    x = torch.randn(19, H, dtype=torch.float64, generator=torch.Generator().manual_seed(6))

    def mlp64(rows, e):
        return (torch.nn.functional.silu(rows @ wg[e].T) * (rows @ wu[e].T)) @ wd[e].T

    out = swiglu(x, wg[0], wu[0], wd[0])
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, mlp64(x, 0), rtol=0, atol=1e-13)
    y, aux = R.moe_reference(x, rw, wg, wu, wd, k, capacity_factor=1.0)
    expected = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(k):
            if not aux.dropped[t, j]:
                e = int(aux.experts[t, j])
                expected[t] += aux.weights[t, j] * mlp64(x[t:t + 1], e)[0]
    assert aux.num_dropped > 0 and y.dtype == torch.float64
    torch.testing.assert_close(y, expected, rtol=0, atol=1e-13)


def test_gradcheck_float64():
    # Everything stays float64, the experts' SwiGLU included (module 03's silu_mul widens
    # half precision to float32 and keeps float64), so gradcheck runs with its float64 defaults: eps=1e-6, atol=1e-5, rtol=1e-3.
    H, F, E = 4, 6, 3
    rw, wg, wu, wd = (t.requires_grad_() for t in _weights(E, H, F, seed=9, dtype=torch.float64))
    x = torch.randn(5, H, dtype=torch.float64, generator=torch.Generator().manual_seed(9), requires_grad=True)

    def f(x, rw, wg, wu, wd):
        y, aux = R.moe_reference(x, rw, wg, wu, wd, 2, renormalize=True)
        return y, aux.lb_loss, aux.z_loss

    assert torch.autograd.gradcheck(f, (x, rw, wg, wu, wd))


def test_module_forward_matches_function_and_keeps_shape():
    moe = MoEFeedForward(8, 12, num_experts=4, k=2, renormalize=False, impl="torch")
    x = torch.randn(3, 1, 8)
    y = moe(x)
    y_ref, aux = R.moe_reference(x, moe.router.weight, moe.w_gate, moe.w_up, moe.w_down, 2, renormalize=False)
    assert torch.equal(y, y_ref) and torch.equal(moe.last_aux.experts, aux.experts)
    assert moe.w_gate.shape == (4, 12, 8) and moe.w_down.shape == (4, 8, 12)
    assert "num_experts=4" in repr(moe)


# ---------------------------------------------------------------------------------------------
# bad inputs
# ---------------------------------------------------------------------------------------------


def test_bad_shapes_are_refused_naming_the_argument():
    rw, wg, wu, wd = _weights(4, 8, 12)
    x = torch.randn(5, 8)
    with pytest.raises(ValueError, match="router_weight"):
        R.moe_reference(x, rw[:, :7], wg, wu, wd, 2)
    with pytest.raises(ValueError, match="w_gate"):
        R.moe_reference(x, rw, wg[:3], wu, wd, 2)
    with pytest.raises(ValueError, match="w_up"):
        R.moe_reference(x, rw, wg, wu[:, :11], wd, 2)
    with pytest.raises(ValueError, match="w_down"):
        R.moe_reference(x, rw, wg, wu, wd.transpose(1, 2), 2)
    with pytest.raises(ValueError, match="k=5.*E=4"):
        R.moe_reference(x, rw, wg, wu, wd, 5)
    with pytest.raises(ValueError, match="capacity below one token"):
        R.moe_reference(x, rw, wg, wu, wd, 2, capacity_factor=0.0)
    with pytest.raises(ValueError, match="probs"):
        R.load_balancing_loss(torch.rand(5, 3), torch.zeros(5, 1, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="experts"):
        R.load_balancing_loss(torch.rand(5, 4), torch.zeros(4, 1, dtype=torch.long), 4)


def test_bad_module_arguments():
    with pytest.raises(ValueError, match="k=3.*E=2"):
        MoEFeedForward(8, 12, num_experts=2, k=3)
    with pytest.raises(ValueError, match="impl"):
        MoEFeedForward(8, 12, num_experts=2, k=1, impl="cuda")
