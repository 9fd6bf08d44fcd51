"""What else module 12's layer accepts: precomputed router logits and a fused gate-and-up weight.

``router_logits=`` replaces ``router_weight`` and ``w_gate_up=`` ``(E, 2F, H)`` (gate rows, then
up rows) replaces ``w_gate`` and ``w_up``, in ``moe_reference``, ``moe_triton``, ``route``,
``check_moe_inputs`` and ``MoEFeedForward(fused_gate_up=True)``. What is compared, and how closely:

- logits ``x @ router_weight^T`` against the router weight: the reference's router computes that
  same float32 matmul, so the logits, the routing, the losses and ``y`` are equal to the bit, and so
  are the gradients (the same operations on the same values, in the same order);
- ``w_gate_up = cat(w_gate, w_up)`` against the two weights, in the reference: the expert MLPs read
  the two halves through views, the same numbers in the same layout: equal to the bit, forward and
  backward (``w_gate_up.grad == cat(w_gate.grad, w_up.grad)``);
- the same on the Triton path, where the fused weight is one grouped GEMM of width ``2F``: with
  ``F`` a multiple of ``block_n`` every output tile of the fused GEMM is a tile of one of the two
  separate GEMMs, so ``y`` and the weight gradients are equal to the bit; ``dx`` is one reduction
  over ``2F`` instead of two over ``F`` added together, a rounding apart: ``rtol=atol=1e-5``, as
  the other backward tests of ``moe_triton``. With a ragged ``F`` a tile holds gate and up columns
  side by side: compared with the same tolerance.

Shapes are tiny; the Triton tests run in the interpreter here (marked ``kernels``, every tensor
made on ``kdev``).
"""

from __future__ import annotations

import math

import pytest
import torch

import llmu  # noqa: F401
from llmu.moe import reference as R
from llmu.moe.layer import MoEFeedForward
from llmu.runtime import kernel_device

KDEV = kernel_device()
SMALL = {"block_m": 16, "block_n": 16, "block_k": 16}
CLOSE = {"rtol": 1e-5, "atol": 1e-5}


def _weights(E, H, F, seed=0, dtype=torch.float32, device="cpu"):
    g = torch.Generator(device="cpu").manual_seed(seed)
    rw = torch.randn(E, H, generator=g, device="cpu")
    wg = torch.randn(E, F, H, generator=g, device="cpu") / math.sqrt(H)
    wu = torch.randn(E, F, H, generator=g, device="cpu") / math.sqrt(H)
    wd = torch.randn(E, H, F, generator=g, device="cpu") / math.sqrt(F)
    return tuple(t.to(dtype=dtype, device=device) for t in (rw, wg, wu, wd))


def _randn(*shape, seed, dtype=torch.float32, device="cpu"):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(*shape, generator=g, device="cpu").to(dtype=dtype, device=device)


def _same_aux(a, b):
    for field in ("logits", "probs", "experts", "weights", "tokens_per_expert", "dropped", "lb_loss", "z_loss"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    assert a.capacity == b.capacity


def _loss(y, aux, d_y):
    return (y * d_y).sum() + aux.lb_loss + 1e-3 * aux.z_loss


# ---------------------------------------------------------------------------------------------
# the reference
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("x_shape, flat_logits", [((11,), False), ((2, 6), False), ((2, 6), True), ((1,), False)])
@pytest.mark.parametrize("cf", [None, 0.6])
def test_logits_path_equals_weight_path(x_shape, flat_logits, cf):
    E, H, F = 4, 8, 12
    rw, wg, wu, wd = _weights(E, H, F, seed=1)
    x = _randn(*x_shape, H, seed=2)
    logits = x @ rw.T
    if flat_logits:
        logits = logits.reshape(-1, E)
    y_w, aux_w = R.moe_reference(x, rw, wg, wu, wd, 2, capacity_factor=cf)
    y_l, aux_l = R.moe_reference(x, None, wg, wu, wd, 2, router_logits=logits, capacity_factor=cf)
    assert torch.equal(y_l, y_w) and y_l.shape == x.shape
    _same_aux(aux_l, aux_w)
    if cf is not None and x.shape[0] == 11:
        assert aux_l.num_dropped > 0


@pytest.mark.parametrize("cf", [None, 0.6])
def test_fused_path_equals_separate_path(cf):
    rw, wg, wu, wd = _weights(3, 8, 12, seed=3)
    x = _randn(2, 7, 8, seed=4)
    w_gate_up = torch.cat([wg, wu], dim=1)
    y_s, aux_s = R.moe_reference(x, rw, wg, wu, wd, 2, capacity_factor=cf)
    y_f, aux_f = R.moe_reference(x, rw, w_down=wd, k=2, w_gate_up=w_gate_up, capacity_factor=cf)
    assert torch.equal(y_f, y_s)
    _same_aux(aux_f, aux_s)
    # both at once, all by keyword
    y_b, _ = R.moe_reference(x, router_logits=x @ rw.T, w_gate_up=w_gate_up, w_down=wd, k=2, capacity_factor=cf)
    assert torch.equal(y_b, y_s)


def test_split_gate_up_gives_views_in_cat_order():
    _, wg, wu, _ = _weights(3, 8, 12, seed=5)
    w_gate_up = torch.cat([wg, wu], dim=1)
    gate, up = R.split_gate_up(w_gate_up)
    assert torch.equal(gate, wg) and torch.equal(up, wu)
    assert gate.data_ptr() == w_gate_up.data_ptr()                           # views: no copy
    assert up.data_ptr() == w_gate_up.data_ptr() + 12 * 8 * w_gate_up.element_size()
    assert gate[1].is_contiguous() and up[1].is_contiguous()                # each expert's half is one block


@pytest.mark.parametrize("cf", [None, 0.6])
def test_gradients_of_logits_and_fused_paths_equal_the_weight_path(cf):
    rw, wg, wu, wd = _weights(4, 8, 12, seed=6)
    x = _randn(2, 5, 8, seed=7)
    d_y = _randn(2, 5, 8, seed=8)
    # weight path, the router's logits kept for their gradient
    x0, rw0, wg0, wu0, wd0 = (t.clone().requires_grad_() for t in (x, rw, wg, wu, wd))
    y0, aux0 = R.moe_reference(x0, rw0, wg0, wu0, wd0, 2, renormalize=False, capacity_factor=cf)
    aux0.logits.retain_grad()
    _loss(y0, aux0, d_y).backward()
    # logits computed outside (chained to x and the router weight) and a fused weight
    x1, rw1, wd1 = (t.clone().requires_grad_() for t in (x, rw, wd))
    wgu1 = torch.cat([wg, wu], dim=1).requires_grad_()
    logits = x1 @ rw1.T
    logits.retain_grad()
    y1, aux1 = R.moe_reference(x1, router_logits=logits, w_gate_up=wgu1, w_down=wd1, k=2, renormalize=False,
                               capacity_factor=cf)
    _loss(y1, aux1, d_y).backward()
    assert torch.equal(logits.grad.reshape(-1, 4), aux0.logits.grad)
    assert logits.grad.abs().sum() > 0                  # the router learns through the gate weights
    assert torch.equal(wgu1.grad, torch.cat([wg0.grad, wu0.grad], dim=1))
    for name, a, b in (("x", x1, x0), ("router_weight", rw1, rw0), ("w_down", wd1, wd0)):
        assert torch.equal(a.grad, b.grad), name


def test_gradcheck_logits_and_fused_float64():
    # as test_reference.test_gradcheck_float64: all float64, gradcheck's defaults
    E, H, F = 3, 3, 2
    _, wg, wu, wd = _weights(E, H, F, seed=9, dtype=torch.float64)
    wgu = torch.cat([wg, wu], dim=1).requires_grad_()
    wd.requires_grad_()
    x = _randn(4, H, seed=10, dtype=torch.float64).requires_grad_()
    logits = _randn(4, E, seed=11, dtype=torch.float64).requires_grad_()

    def f(x, logits, wgu, wd):
        y, aux = R.moe_reference(x, router_logits=logits, w_gate_up=wgu, w_down=wd, k=2)
        return y, aux.lb_loss, aux.z_loss

    assert torch.autograd.gradcheck(f, (x, logits, wgu, wd))


def test_aux_losses_from_logits():
    E, k = 4, 2
    logits = (3 * _randn(9, E, seed=12)).requires_grad_()
    aux = R.route(router_logits=logits, k=k)
    probs = torch.softmax(logits, dim=-1)
    experts = probs.topk(k, dim=-1).indices
    assert torch.equal(aux.experts, experts)
    torch.testing.assert_close(aux.lb_loss, R.load_balancing_loss(probs, experts, E), rtol=0, atol=0)
    torch.testing.assert_close(aux.z_loss, torch.logsumexp(logits, -1).pow(2).mean(), rtol=0, atol=0)
    (g_lb,) = torch.autograd.grad(aux.lb_loss, logits, retain_graph=True)
    (g_z,) = torch.autograd.grad(aux.z_loss, logits)
    # d z / d logits = 2 lse softmax / T; the balancing loss pushes the busiest experts down
    torch.testing.assert_close(g_z, 2 * torch.logsumexp(logits, -1, keepdim=True) * probs / 9)
    assert g_lb.abs().sum() > 0
    # half-precision logits are widened: the router works in float32, as it does from a weight
    half = logits.detach().half()
    aux_h = R.route(router_logits=half, k=k)
    assert aux_h.logits.dtype == aux_h.probs.dtype == torch.float32
    _same_aux(aux_h, R.route(router_logits=half.float(), k=k))


def test_route_with_logits_equals_route_with_weight():
    rw = _weights(4, 8, 12, seed=13)[0]
    x2 = _randn(10, 8, seed=14)
    want = R.route(x2, rw, 2, capacity_factor=1.0)
    _same_aux(R.route(x2, k=2, router_logits=x2 @ rw.T, capacity_factor=1.0), want)
    _same_aux(R.route(None, None, 2, router_logits=(x2 @ rw.T).view(2, 5, 4), capacity_factor=1.0), want)


def test_check_moe_inputs_with_logits_and_fused_weight():
    rw, wg, wu, wd = _weights(4, 8, 12, seed=15)
    x = _randn(3, 5, 8, seed=16)
    wgu = torch.cat([wg, wu], dim=1)
    assert R.check_moe_inputs(x, router_logits=x @ rw.T, w_gate_up=wgu, w_down=wd, k=2) == (4, 8, 12)
    # one rank's slice of the experts (expert parallelism): E comes from the logits
    assert R.check_moe_inputs(x, router_logits=x @ rw.T, w_gate_up=wgu[:2], w_down=wd[:2], k=2,
                              world_size=2) == (4, 8, 12)
    assert R.check_moe_inputs(x, rw, wg, wu, wd, 2) == (4, 8, 12)           # positional, as before


def test_module_with_fused_gate_up():
    torch.manual_seed(0)
    sep = MoEFeedForward(8, 12, num_experts=4, k=2, capacity_factor=1.0, impl="torch")
    fused = MoEFeedForward(8, 12, num_experts=4, k=2, capacity_factor=1.0, impl="torch", fused_gate_up=True)
    names = dict(fused.named_parameters())
    assert names["w_gate_up"].shape == (4, 24, 8) and "w_gate" not in names and "w_up" not in names
    with torch.no_grad():
        fused.router.weight.copy_(sep.router.weight)
        fused.w_gate_up.copy_(torch.cat([sep.w_gate, sep.w_up], dim=1))
        fused.w_down.copy_(sep.w_down)
    gate, up = fused.gate_up()
    assert torch.equal(gate, sep.w_gate) and torch.equal(up, sep.w_up)
    x = _randn(2, 6, 8, seed=17)
    y_s, y_f = sep(x), fused(x)
    assert torch.equal(y_f, y_s)
    _same_aux(fused.last_aux, sep.last_aux)
    (y_s.pow(2).mean() + sep.last_aux.lb_loss).backward()
    (y_f.pow(2).mean() + fused.last_aux.lb_loss).backward()
    assert torch.equal(fused.w_gate_up.grad, torch.cat([sep.w_gate.grad, sep.w_up.grad], dim=1))
    assert torch.equal(fused.router.weight.grad, sep.router.weight.grad)
    assert "fused_gate_up=True" in repr(fused) and "fused_gate_up" not in repr(sep)
    bound = 1 / math.sqrt(8)
    fused.reset_parameters()                            # each half initialised like nn.Linear(H, F)
    assert fused.w_gate_up.abs().max() <= bound and fused.w_gate_up.std() > bound / 4


# ---------------------------------------------------------------------------------------------
# bad inputs (the reference's checks; moe_triton runs the same ones first)
# ---------------------------------------------------------------------------------------------


def test_bad_router_arguments():
    rw, wg, wu, wd = _weights(4, 8, 12)
    x = _randn(2, 5, 8, seed=0)
    lg = x @ rw.T
    with pytest.raises(TypeError, match="router_weight and router_logits exclude each other"):
        R.moe_reference(x, rw, wg, wu, wd, 2, router_logits=lg)
    with pytest.raises(TypeError, match="router is missing"):
        R.moe_reference(x, None, wg, wu, wd, 2)
    with pytest.raises(ValueError, match=r"router_logits must be \(\.\.\., E\) with x's leading shape \(2, 5\)"):
        R.moe_reference(x, None, wg, wu, wd, 2, router_logits=lg[:, :4])           # wrong T
    with pytest.raises(ValueError, match="router_logits must be"):
        R.moe_reference(x, None, wg, wu, wd, 2, router_logits=lg.reshape(5, 2, 4))  # same T, other shape
    with pytest.raises(ValueError, match="router_logits must be"):
        R.moe_reference(x, None, wg, wu, wd, 2, router_logits=lg.sum())            # a scalar
    with pytest.raises(ValueError, match="router_logits must have at least one expert"):
        R.moe_reference(x, None, wg[:0], wu[:0], wd[:0], 1, router_logits=lg[..., :0])
    with pytest.raises(TypeError, match="router_logits must have a floating-point dtype"):
        R.moe_reference(x, None, wg, wu, wd, 2, router_logits=lg.long())
    with pytest.raises(TypeError, match="router_logits must be a torch.Tensor"):
        R.moe_reference(x, None, wg, wu, wd, 2, router_logits=lg.tolist())
    with pytest.raises(ValueError, match="router_logits is on meta but x is on cpu"):
        R.moe_reference(x, None, wg, wu, wd, 2, router_logits=lg.to("meta"))
    with pytest.raises(ValueError, match=r"w_gate must be \(E=3"):
        R.moe_reference(x, None, wg, wu, wd, 2, router_logits=lg[..., :3])         # E from the logits
    with pytest.raises(ValueError, match="k=5.*E=4"):
        R.moe_reference(x, None, wg, wu, wd, 5, router_logits=lg)
    with pytest.raises(ValueError, match="router_logits must hold one row per token of x2"):
        R.route(x.reshape(-1, 8), k=2, router_logits=lg[:1])
    with pytest.raises(TypeError, match="x2 is missing"):
        R.route(None, rw, 2)
    with pytest.raises(TypeError, match="router_weight and router_logits"):
        R.route(x.reshape(-1, 8), rw, 2, router_logits=lg)
    with pytest.raises(TypeError, match="k is missing"):
        R.route(router_logits=lg)


def test_bad_fused_and_missing_weights():
    rw, wg, wu, wd = _weights(4, 8, 12)
    x = _randn(5, 8, seed=0)
    wgu = torch.cat([wg, wu], dim=1)
    with pytest.raises(ValueError, match=r"w_gate_up must have an even number of rows.*2F=23"):
        R.moe_reference(x, rw, w_gate_up=wgu[:, :23], w_down=wd, k=2)
    with pytest.raises(ValueError, match=r"w_gate_up must be \(E=4, 2F, H=8\)"):
        R.moe_reference(x, rw, w_gate_up=wgu[:3], w_down=wd, k=2)                  # wrong E
    with pytest.raises(ValueError, match=r"w_gate_up must be \(E=4, 2F, H=8\)"):
        R.moe_reference(x, rw, w_gate_up=wgu[..., :7], w_down=wd, k=2)             # wrong H
    with pytest.raises(ValueError, match=r"w_gate_up must be \(E=4, 2F, H=8\)"):
        R.moe_reference(x, rw, w_gate_up=wgu[0], w_down=wd, k=2)                   # 2-D
    with pytest.raises(ValueError, match=r"w_down must be \(E=4, H=8, F=10\)"):
        R.moe_reference(x, rw, w_gate_up=wgu[:, 2:22], w_down=wd, k=2)             # F = 10, not 12
    with pytest.raises(TypeError, match="w_gate_up has dtype torch.float64 but w_down has torch.float32"):
        R.moe_reference(x, rw, w_gate_up=wgu.double(), w_down=wd, k=2)
    with pytest.raises(TypeError, match="w_gate_up must have a floating-point dtype"):
        R.moe_reference(x, rw, w_gate_up=wgu.long(), w_down=wd.long(), k=2)
    with pytest.raises(TypeError, match="w_gate_up must be a torch.Tensor"):
        R.moe_reference(x, rw, w_gate_up=wgu.tolist(), w_down=wd, k=2)
    with pytest.raises(TypeError, match="w_gate_up replaces w_gate and w_up.*got w_gate_up and w_gate"):
        R.moe_reference(x, rw, wg, w_gate_up=wgu, w_down=wd, k=2)
    with pytest.raises(TypeError, match="got w_gate_up and w_gate and w_up"):
        R.moe_reference(x, rw, wg, wu, wd, 2, w_gate_up=wgu)
    with pytest.raises(TypeError, match="w_up missing"):
        R.moe_reference(x, rw, wg, w_down=wd, k=2)
    with pytest.raises(TypeError, match="w_gate and w_up missing"):
        R.moe_reference(x, rw, w_down=wd, k=2)
    with pytest.raises(TypeError, match="w_down is missing"):
        R.moe_reference(x, rw, w_gate_up=wgu, k=2)
    with pytest.raises(TypeError, match="k is missing"):
        R.moe_reference(x, rw, w_gate_up=wgu, w_down=wd)
    with pytest.raises(ValueError, match="w_gate_up must have an even number"):
        R.split_gate_up(wgu[:, 1:])
    with pytest.raises(TypeError, match="fused_gate_up must be a bool"):
        MoEFeedForward(8, 12, num_experts=4, k=2, fused_gate_up="yes")


# ---------------------------------------------------------------------------------------------
# the Triton path
# ---------------------------------------------------------------------------------------------


@pytest.mark.kernels
@pytest.mark.parametrize("F, cf", [(32, None), (32, 0.6), (24, None)])
def test_triton_logits_and_fused_paths(F, cf):
    from llmu.moe import kernels as K

    E, H, T, k = 4, 20, 13, 2
    rw, wg, wu, wd = _weights(E, H, F, seed=F, device=KDEV)
    x = _randn(T, H, seed=18, device=KDEV)
    d_y = _randn(T, H, seed=19, device=KDEV)
    exact = F % SMALL["block_n"] == 0          # every tile of the fused GEMM is one of the separate GEMMs'
    # the separate path with the router weight, the router's logits kept for their gradient
    x0, rw0, wg0, wu0, wd0 = (t.clone().requires_grad_() for t in (x, rw, wg, wu, wd))
    y0, aux0 = K.moe_triton(x0, rw0, wg0, wu0, wd0, k, renormalize=False, capacity_factor=cf, **SMALL)
    aux0.logits.retain_grad()
    _loss(y0, aux0, d_y).backward()
    # precomputed logits (a leaf) and the fused weight: one grouped GEMM of width 2F
    logits = (x.float() @ rw.float().T).requires_grad_()
    x1, wd1 = x.clone().requires_grad_(), wd.clone().requires_grad_()
    wgu1 = torch.cat([wg, wu], dim=1).requires_grad_()
    y1, aux1 = K.moe_triton(x1, router_logits=logits, w_gate_up=wgu1, w_down=wd1, k=k, renormalize=False,
                            capacity_factor=cf, **SMALL)
    _same_aux(aux1, aux0)
    if cf is not None:
        assert aux1.num_dropped > 0
    assert torch.equal(y1, y0) if exact else torch.allclose(y1, y0, **CLOSE)
    _loss(y1, aux1, d_y).backward()
    assert torch.equal(logits.grad, aux0.logits.grad) and logits.grad.abs().sum() > 0
    d_wgu = torch.cat([wg0.grad, wu0.grad], dim=1)
    if exact:
        assert torch.equal(wgu1.grad, d_wgu) and torch.equal(wd1.grad, wd0.grad)
    torch.testing.assert_close(wgu1.grad, d_wgu, **CLOSE)
    torch.testing.assert_close(wd1.grad, wd0.grad, **CLOSE)
    # x (the expert half only: the logits were computed outside), against the same logits with the
    # separate weights: one reduction over 2F against two over F added together
    x2 = x.clone().requires_grad_()
    y2, aux2 = K.moe_triton(x2, router_logits=logits.detach(), w_gate=wg, w_up=wu, w_down=wd, k=k,
                            renormalize=False, capacity_factor=cf, **SMALL)
    _loss(y2, aux2, d_y).backward()
    torch.testing.assert_close(x1.grad, x2.grad, **CLOSE)
    # and against the reference on the same inputs
    x3, wd3 = x.clone().requires_grad_(), wd.clone().requires_grad_()
    wgu3 = torch.cat([wg, wu], dim=1).requires_grad_()
    logits3 = (x.float() @ rw.float().T).requires_grad_()
    y3, aux3 = R.moe_reference(x3, router_logits=logits3, w_gate_up=wgu3, w_down=wd3, k=k, renormalize=False,
                               capacity_factor=cf)
    torch.testing.assert_close(y1, y3, **CLOSE)
    _loss(y3, aux3, d_y).backward()
    for name, a, b in (("x", x1, x3), ("router_logits", logits, logits3), ("w_gate_up", wgu1, wgu3),
                       ("w_down", wd1, wd3)):
        torch.testing.assert_close(a.grad, b.grad, **CLOSE, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.kernels
def test_triton_module_with_fused_gate_up():
    torch.manual_seed(1)
    sep = MoEFeedForward(16, 64, num_experts=4, k=2, impl="triton", device=KDEV)
    fused = MoEFeedForward(16, 64, num_experts=4, k=2, impl="triton", device=KDEV, fused_gate_up=True)
    with torch.no_grad():
        fused.router.weight.copy_(sep.router.weight)
        fused.w_gate_up.copy_(torch.cat([sep.w_gate, sep.w_up], dim=1))
        fused.w_down.copy_(sep.w_down)
    x = _randn(2, 5, 16, seed=20, device=KDEV)
    for m in (sep, fused):
        (m(x).pow(2).mean() + m.last_aux.lb_loss).backward()
    # F = 64 is a multiple of the default block_n (32 interpreted, 64 compiled): the fused GEMM's
    # tiles are the separate ones
    assert torch.equal(fused.w_gate_up.grad, torch.cat([sep.w_gate.grad, sep.w_up.grad], dim=1))
    torch.testing.assert_close(fused.router.weight.grad, sep.router.weight.grad, **CLOSE)


@pytest.mark.kernels
def test_triton_bad_inputs():
    from llmu.moe import kernels as K

    rw, wg, wu, wd = _weights(4, 8, 12, device=KDEV)
    x = _randn(5, 8, seed=0, device=KDEV)
    lg, wgu = x @ rw.T, torch.cat([wg, wu], dim=1)
    with pytest.raises(TypeError, match="router_weight and router_logits exclude each other"):
        K.moe_triton(x, rw, wg, wu, wd, 2, router_logits=lg)
    with pytest.raises(TypeError, match="router is missing"):
        K.moe_triton(x, w_gate_up=wgu, w_down=wd, k=2)
    with pytest.raises(TypeError, match="router_logits must have dtype"):
        K.moe_triton(x, router_logits=lg.double(), w_gate_up=wgu, w_down=wd, k=2)
    with pytest.raises(ValueError, match="router_logits must be"):
        K.moe_triton(x, router_logits=lg[:4], w_gate_up=wgu, w_down=wd, k=2)
    with pytest.raises(ValueError, match="w_gate_up must have an even number"):
        K.moe_triton(x, rw, w_gate_up=wgu[:, 1:], w_down=wd, k=2)
    with pytest.raises(TypeError, match="w_gate_up has dtype torch.float16 but w_down"):
        K.moe_triton(x, rw, w_gate_up=wgu.half(), w_down=wd, k=2)
    with pytest.raises(TypeError, match="w_gate_up has dtype torch.float16 but x has"):
        K.moe_triton(x, rw, w_gate_up=wgu.half(), w_down=wd.half(), k=2)
    with pytest.raises(TypeError, match="w_gate_up replaces w_gate and w_up"):
        K.moe_triton(x, rw, wg, wu, wd, 2, w_gate_up=wgu)
    with pytest.raises(TypeError, match="unexpected keyword argument.*w_gateup"):
        K.moe_triton(x, rw, w_gateup=wgu, w_down=wd, k=2)
    # logits of another dtype than x are fine: the router works in float32 anyway
    y, _ = K.moe_triton(x.half(), router_logits=lg, w_gate_up=wgu.half(), w_down=wd.half(), k=2, **SMALL)
    assert y.dtype == torch.float16
