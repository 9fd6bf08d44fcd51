"""Fixtures for module 13's tests: ``make_case``, a selective scan's arguments in each form of ``B``, ``C``.

``make_case(batch, dim, L, N, form, ...)`` draws float32 inputs with values like a trained Mamba's:
``A`` negative (S4D-real ``-(1..N)`` scaled by a random factor), ``Δ`` positive after
bias/softplus, so the state decays and stays of order one over any length. Forms: ``"ti"``
(time-invariant ``(D, N)``), ``"var"`` (input-dependent ``(B, N, L)``), ``"grp"`` (grouped
``(B, G, N, L)``, ``G`` the largest proper divisor of ``D``, and ``C`` with one group).
"""

from __future__ import annotations

import pytest
import torch

FORMS = ("ti", "var", "grp")


def groups(dim: int) -> int:
    return max([g for g in range(1, dim + 1) if dim % g == 0 and g < dim] or [1])


def make_case(batch, dim, L, N, form="var", *, D=True, z=True, bias=True, softplus=True, seed=0,
              device="cpu", requires_grad=False):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device="cpu")

    def rand(*shape):
        return torch.rand(*shape, generator=g, device="cpu")

    u = randn(batch, dim, L)
    # Δ before bias/softplus: any sign when softplus follows, else positive (a real step size)
    delta = randn(batch, dim, L) * 0.5 if softplus else rand(batch, dim, L) * 0.3 + 0.01
    A = -torch.arange(1, N + 1, dtype=torch.float32, device="cpu").repeat(dim, 1) * (0.2 + 0.3 * rand(dim, 1))
    if form == "ti":
        B, C = randn(dim, N), randn(dim, N)
    elif form == "var":
        B, C = randn(batch, N, L), randn(batch, N, L)
    elif form == "grp":
        B, C = randn(batch, groups(dim), N, L), randn(batch, 1, N, L)
    else:
        raise ValueError(form)
    args = dict(u=u, delta=delta, A=A, B=B, C=C,
                D=randn(dim) if D else None,
                z=randn(batch, dim, L) if z else None,
                delta_bias=(randn(dim) * 0.5 if softplus else rand(dim) * 0.1) if bias else None)
    out = {}
    for k, v in args.items():
        if v is not None:
            v = v.to(device)
            if requires_grad:
                v.requires_grad_(True)
        out[k] = v
    out["delta_softplus"] = softplus
    return out


@pytest.fixture(scope="session", name="make_case")
def make_case_fixture():
    """The function :func:`make_case` (test modules cannot import each other under importlib mode)."""
    return make_case
