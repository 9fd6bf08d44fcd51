"""Module 13's torch references: the parallel scan and the decode step == the sequential scan.

Tolerances (float32 everywhere). The sequential scan multiplies the state by ``Ā_t`` one step at
a time; the parallel scan forms products of up to ``L`` factors in ``ceil(log2 L)`` rounds, in
another order, and the decode step repeats the loop's operations exactly. Each float32 operation
rounds by at most ``2**-24`` relative, a state goes through ``O(log L)`` (parallel) or ``O(L)``
(sequential, but damped by ``|Ā| < 1``) of them. ``rtol = atol = 1e-5`` allows
``1e-5 (1 + |out|)``; the largest error seen over these cases is ``6.4e-7 (1 + |out|)`` (outputs
reach 40 in magnitude), a margin of about fifteen. Gradients go through the reordering twice
(forward and backward): ``1e-4``.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from llmu.mamba import reference as R

FORMS = ("ti", "var", "grp")
TOL = dict(rtol=1e-5, atol=1e-5)


# -- combine --------------------------------------------------------------------------------------


def rand_pair(g, shape=(5,)):
    return torch.rand(shape, generator=g, dtype=torch.float64), torch.randn(shape, generator=g, dtype=torch.float64)


def test_combine_is_associative_not_commutative():
    g = torch.Generator().manual_seed(0)
    e1, e2, e3 = (rand_pair(g) for _ in range(3))
    left = R.combine(R.combine(e1, e2), e3)
    right = R.combine(e1, R.combine(e2, e3))
    for x, y in zip(left, right):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
    # order in time matters
    assert not torch.allclose(R.combine(e1, e2)[1], R.combine(e2, e1)[1])
    # (1, 0) is the identity on both sides
    one, zero = torch.ones(5, dtype=torch.float64), torch.zeros(5, dtype=torch.float64)
    for x, y in zip(R.combine((one, zero), e1), e1):
        assert torch.equal(x, y)
    for x, y in zip(R.combine(e1, (one, zero)), e1):
        assert torch.equal(x, y)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.floats(-2, 2), st.floats(-5, 5)), min_size=3, max_size=3),
       st.floats(-3, 3))
def test_combine_associativity_hypothesis(elements, x0):
    """As affine maps: any bracketing applied to x0 gives the same value as applying the steps."""
    e1, e2, e3 = elements
    a, b = R.combine(R.combine(e1, e2), e3)
    a2, b2 = R.combine(e1, R.combine(e2, e3))
    x = x0
    for ai, bi in elements:
        x = ai * x + bi
    assert a * x0 + b == pytest.approx(x, rel=1e-9, abs=1e-9)
    assert a2 * x0 + b2 == pytest.approx(x, rel=1e-9, abs=1e-9)


# -- parallel == sequential ---------------------------------------------------------------------------


@pytest.mark.parametrize("method", R.METHODS)
@pytest.mark.parametrize("L", [1, 2, 7, 8, 33, 100])
@pytest.mark.parametrize("N", [1, 4, 16])
@pytest.mark.parametrize("form", FORMS)
def test_parallel_equals_sequential(make_case, L, N, form, method):
    case = make_case(2, 6, L, N, form, seed=L * 100 + N)
    out_s, last_s = R.selective_scan_sequential(**case, return_last_state=True)
    out_p, last_p = R.selective_scan_parallel(**case, return_last_state=True, method=method)
    assert out_p.shape == (2, 6, L) and last_p.shape == (2, 6, N)
    torch.testing.assert_close(out_p, out_s, **TOL)
    torch.testing.assert_close(last_p, last_s, **TOL)


@pytest.mark.parametrize("D", [False, True])
@pytest.mark.parametrize("z", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("softplus", [False, True])
@pytest.mark.parametrize("form", FORMS)
def test_parallel_equals_sequential_options(make_case, D, z, bias, softplus, form):
    case = make_case(1, 4, 33, 4, form, D=D, z=z, bias=bias, softplus=softplus, seed=7)
    want = R.selective_scan_sequential(**case)
    for method in R.METHODS:
        torch.testing.assert_close(R.selective_scan_parallel(**case, method=method), want, **TOL)


def test_sequential_matches_the_formula_by_hand():
    """One channel, one state, two steps, computed on paper: a check of the specification itself."""
    u = torch.tensor([[[1.0, 2.0]]])
    delta = torch.tensor([[[0.5, 0.25]]])
    A = torch.tensor([[-1.0]])
    B = torch.tensor([[2.0]])
    C = torch.tensor([[3.0]])
    x0 = 0.5 * 2.0 * 1.0                                    # Δ B u
    x1 = math.exp(-0.25) * x0 + 0.25 * 2.0 * 2.0
    want = torch.tensor([[[3 * x0 + 10 * 1.0, 3 * x1 + 10 * 2.0]]])
    out = R.selective_scan_sequential(u, delta, A, B, C, D=torch.tensor([10.0]))
    torch.testing.assert_close(out, want)
    z = torch.tensor([[[0.3, -1.2]]])
    out = R.selective_scan_sequential(u, delta, A, B, C, z=z)
    torch.testing.assert_close(out, torch.tensor([[[3 * x0, 3 * x1]]]) * torch.nn.functional.silu(z))


def test_output_dtype_follows_u(make_case):
    case = make_case(1, 2, 5, 3, "var")
    case["u"] = case["u"].to(torch.bfloat16)
    out, last = R.selective_scan_parallel(**case, return_last_state=True)
    assert out.dtype == torch.bfloat16 and last.dtype == torch.float32


@settings(max_examples=15, deadline=None)
@given(batch=st.integers(1, 3), dim=st.integers(1, 6), L=st.integers(1, 40), N=st.integers(1, 8),
       form=st.sampled_from(FORMS), seed=st.integers(0, 1000), method=st.sampled_from(R.METHODS))
def test_parallel_equals_sequential_hypothesis(make_case, batch, dim, L, N, form, seed, method):
    case = make_case(batch, dim, L, N, form, seed=seed)
    torch.testing.assert_close(R.selective_scan_parallel(**case, method=method),
                               R.selective_scan_sequential(**case), **TOL)


# -- gradients -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("method", R.METHODS)
def test_parallel_gradients_equal_sequential(make_case, form, method):
    names = ["u", "delta", "A", "B", "C", "D", "z", "delta_bias"]
    grads = []
    parallel = functools.partial(R.selective_scan_parallel, method=method)
    for scan in (R.selective_scan_sequential, parallel):
        case = make_case(2, 4, 21, 4, form, seed=3, requires_grad=True)
        out, last = scan(**case, return_last_state=True)
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        ((out * w).sum() + last.sum()).backward()
        grads.append([case[n].grad for n in names])
    for name, gs, gp in zip(names, *grads):
        assert gs is not None and gp is not None, name
        torch.testing.assert_close(gp, gs, rtol=1e-4, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}")


# -- the decode step -------------------------------------------------------------------------------------


def _slice_bc(X, t, batch, dim):
    """``B`` or ``C`` at step ``t`` in the form ``selective_state_step`` takes."""
    if X.ndim == 2:
        return X.expand(batch, dim, X.shape[1])           # time-invariant: G = D groups of one
    return X[..., t]                                      # (B, N) or (B, G, N)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("prefix", [0, 5])
def test_steps_equal_the_scan(make_case, form, prefix):
    batch, dim, L, N = 2, 6, 12, 4
    case = make_case(batch, dim, L, N, form, seed=11)
    out, last = R.selective_scan_sequential(**case, return_last_state=True)
    if prefix:
        head = dict(case, u=case["u"][..., :prefix], delta=case["delta"][..., :prefix],
                    z=case["z"][..., :prefix],
                    B=case["B"] if form == "ti" else case["B"][..., :prefix],
                    C=case["C"] if form == "ti" else case["C"][..., :prefix])
        out_head, state = R.selective_scan_parallel(**head, return_last_state=True)
        ys = [out_head]
    else:
        state, ys = torch.zeros(batch, dim, N), []
    for t in range(prefix, L):
        before = state.clone()
        y, state_new = R.selective_state_step(
            state, case["u"][..., t], case["delta"][..., t], case["A"],
            _slice_bc(case["B"], t, batch, dim), _slice_bc(case["C"], t, batch, dim),
            D=case["D"], z_t=case["z"][..., t], delta_bias=case["delta_bias"], delta_softplus=True)
        assert torch.equal(state, before)                 # the input state is not modified
        state = state_new
        ys.append(y[..., None])
    torch.testing.assert_close(torch.cat(ys, dim=-1), out, **TOL)
    torch.testing.assert_close(state, last, **TOL)


# -- discretisation --------------------------------------------------------------------------------------


def test_discretize_shapes_and_values(make_case):
    case = make_case(2, 3, 5, 4, "var")
    dA, dBu = R.discretize(case["delta"], case["A"], case["B"], case["u"])
    assert dA.shape == dBu.shape == (2, 3, 5, 4)
    torch.testing.assert_close(dA[1, 2, 3], torch.exp(case["delta"][1, 2, 3] * case["A"][2]))
    torch.testing.assert_close(dBu[1, 2, 3], case["delta"][1, 2, 3] * case["u"][1, 2, 3] * case["B"][1, :, 3])


@pytest.mark.parametrize("form", FORMS)
def test_zoh_approaches_delta_b_as_delta_shrinks(make_case, form):
    """``B̄ = (exp(ΔA) - 1)/A · B = Δ B (1 + Δ A / 2 + ...)``: the relative gap to ``Δ B`` is
    about ``|Δ A| / 2``, so it shrinks tenfold when ``Δ`` does."""
    case = make_case(2, 3, 5, 4, form, softplus=False)
    A, B, u = case["A"], case["B"], torch.ones_like(case["u"])
    gaps = []
    for scale in (1e-1, 1e-2, 1e-3):
        delta = case["delta"] * scale
        dA, dB = R.zoh_discretize(delta, A, B)
        dA_ref, dBu = R.discretize(delta, A, B, u)       # Δ B (u = 1)
        torch.testing.assert_close(dA, dA_ref)          # the same hold for A
        gap = ((dB - dBu).abs() / dBu.abs().clamp_min(1e-30)).max().item()
        bound = (delta[..., None] * A[None, :, None, :]).abs().max().item()   # |ΔA| >= 2 * gap
        assert gap <= 0.5 * bound * 1.01 + 1e-6
        gaps.append(gap)
    assert gaps[1] < gaps[0] / 5 and gaps[2] < gaps[1] / 5


def test_zoh_is_exact_for_a_constant_input():
    """Integrating ``x' = a x + b u`` over ``Δ`` with ``u`` constant from ``x = 0`` gives
    ``(e^{aΔ} - 1)/a · b u``; ``A = 0`` gives ``Δ b u`` (the limit, not a division by zero)."""
    delta = torch.tensor([[[0.7]]])
    A = torch.tensor([[-2.0, 0.0, 0.5]])
    B = torch.tensor([[1.5, 1.5, 1.5]])
    dA, dB = R.zoh_discretize(delta, A, B)
    a = A[0].double()
    want = torch.where(a == 0, torch.full_like(a, 0.7), torch.expm1(0.7 * a) / torch.where(a == 0, 1.0, a)) * 1.5
    torch.testing.assert_close(dB[0, 0, 0].double(), want, rtol=1e-6, atol=1e-7)
    assert torch.isfinite(dB).all()
    # a crude ODE solve agrees (RK4, 1000 steps)
    x, h = torch.zeros(3, dtype=torch.float64), 0.7 / 1000
    f = lambda x: a * x + 1.5                                   # noqa: E731
    for _ in range(1000):
        k1 = f(x); k2 = f(x + h / 2 * k1); k3 = f(x + h / 2 * k2); k4 = f(x + h * k3)   # noqa: E702
        x = x + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
    torch.testing.assert_close(dB[0, 0, 0].double(), x, rtol=1e-6, atol=1e-7)


# -- bad inputs ------------------------------------------------------------------------------------------


BAD = [
    ("u", lambda c: dict(c, u=c["u"][0])),
    ("u", lambda c: dict(c, u=c["u"][..., :0], delta=c["delta"][..., :0])),
    ("delta", lambda c: dict(c, delta=c["delta"][..., :-1])),
    ("A", lambda c: dict(c, A=c["A"][:-1])),
    ("A", lambda c: dict(c, A=c["A"][0])),
    ("B", lambda c: dict(c, B=c["B"][..., :-1])),
    ("B", lambda c: dict(c, B=c["B"][:, :-1])),
    ("C", lambda c: dict(c, C=c["C"][None, None])),
    ("C", lambda c: dict(c, C=torch.zeros(2, 4, 4, 9))),        # 4 groups do not divide D = 6
    ("D", lambda c: dict(c, D=c["D"][:-1])),
    ("z", lambda c: dict(c, z=c["z"][:1])),
    ("delta_bias", lambda c: dict(c, delta_bias=c["delta_bias"][None])),
]


@pytest.mark.parametrize("scan", [R.selective_scan_sequential, R.selective_scan_parallel])
@pytest.mark.parametrize("name,bad", BAD, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD)])
def test_bad_shapes_raise_naming_the_argument(make_case, scan, name, bad):
    case = make_case(2, 6, 9, 4, "var")
    with pytest.raises(ValueError, match=rf"^{name} "):
        scan(**bad(case))


def test_unknown_method_is_refused(make_case):
    with pytest.raises(ValueError, match="^method must be one of"):
        R.selective_scan_parallel(**make_case(1, 2, 3, 2, "var"), method="brent_kung")


def test_complex_A_is_refused(make_case):
    case = make_case(1, 2, 3, 2, "var")
    with pytest.raises(ValueError, match="^A must be real"):
        R.selective_scan_sequential(**dict(case, A=case["A"].to(torch.complex64)))


def test_step_bad_shapes():
    state = torch.zeros(2, 4, 3)
    args = dict(u_t=torch.zeros(2, 4), delta_t=torch.zeros(2, 4), A=-torch.ones(4, 3),
                B_t=torch.zeros(2, 3), C_t=torch.zeros(2, 3))
    R.selective_state_step(state, **args)
    for name, value in [("u_t", torch.zeros(2, 5)), ("delta_t", torch.zeros(4)), ("A", torch.ones(4, 2)),
                        ("B_t", torch.zeros(4, 3)), ("C_t", torch.zeros(2, 3, 3))]:
        with pytest.raises(ValueError, match=rf"^{name} "):
            R.selective_state_step(state, **dict(args, **{name: value}))
    with pytest.raises(ValueError, match="^state "):
        R.selective_state_step(state[0], **args)
    with pytest.raises(ValueError, match="^D "):
        R.selective_state_step(state, **args, D=torch.ones(3))
