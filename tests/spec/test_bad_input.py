"""Values ``accept_reject`` refuses, in the torch reference and in the Triton launcher alike.

The shapes, dtypes and devices are tested beside each implementation (test_reference.py,
test_kernels.py); here, what the values must be: uniforms ``u`` and ``r`` in ``[0, 1)``,
probabilities with no negative, NaN or infinite entry (logits passed by mistake are the usual
case), draft ids in ``[0, V)``. Rows need not sum to 1: the step normalises them itself.
"""

from __future__ import annotations

import pytest
import torch

from llmu.spec import kernels, reference

pytestmark = pytest.mark.kernels

IMPLS = {"reference": reference.accept_reject, "triton": kernels.accept_reject}


def inputs(kdev, b=2, gamma=3, v=20, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    logits = torch.randn(b, gamma + 1, v, generator=g, device="cpu")
    p = logits.softmax(-1)
    q = (logits[:, :gamma] + torch.randn(b, gamma, v, generator=g, device="cpu")).softmax(-1)
    draft = torch.multinomial(q.reshape(-1, v), 1, generator=g).reshape(b, gamma)
    u = torch.rand(b, gamma, generator=g, device="cpu")
    r = torch.rand(b, generator=g, device="cpu")
    return tuple(t.to(kdev) for t in (p, q, draft, u, r)), logits.to(kdev)


BAD = [
    # name, how to spoil the inputs, message
    ("u = 1", lambda p, q, d, u, r: (p, q, d, torch.ones_like(u), r), r"u must hold uniforms in \[0, 1\)"),
    ("u < 0", lambda p, q, d, u, r: (p, q, d, u - 1, r), r"u must hold uniforms in \[0, 1\)"),
    ("u NaN", lambda p, q, d, u, r: (p, q, d, u.masked_fill(u > 0.5, float("nan")), r),
     r"u must hold uniforms in \[0, 1\)"),
    ("r > 1", lambda p, q, d, u, r: (p, q, d, u, r + 1.5), r"r must hold uniforms in \[0, 1\)"),
    ("q negative", lambda p, q, d, u, r: (p, q - 0.01, d, u, r), "q must hold probabilities: no negative"),
    ("p infinite", lambda p, q, d, u, r: (p.index_fill(2, torch.tensor([3], device=p.device), float("inf")),
                                          q, d, u, r),
     "p must hold probabilities: no negative, NaN or infinite entry"),
    ("draft >= V", lambda p, q, d, u, r: (p, q, d + p.shape[-1], u, r),
     r"draft token ids must be in \[0, V\) = \[0, 20\)"),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_values_are_refused(kdev, impl, case):
    _, spoil, match = case
    args, _ = inputs(kdev)
    with pytest.raises(ValueError, match=match):
        IMPLS[impl](*spoil(*args))


@pytest.mark.parametrize("impl", IMPLS)
def test_logits_instead_of_probabilities_are_refused(kdev, impl):
    (p, q, draft, u, r), logits = inputs(kdev)
    with pytest.raises(ValueError, match=r"p must hold probabilities.*\(softmax the logits first\)"):
        IMPLS[impl](logits, q, draft, u, r)
    sample = reference.speculative_sample if impl == "reference" else kernels.speculative_sample
    with pytest.raises(ValueError, match="p must hold probabilities"):
        sample(logits, q, draft)


@pytest.mark.parametrize("impl", IMPLS)
def test_valid_values_pass(kdev, impl):
    """Edge values that are valid: u = 0, rows that do not sum to 1 (the draw normalises), zeros."""
    (p, q, draft, u, r), _ = inputs(kdev)
    want = reference.accept_reject(p, q, draft, u, r)
    got = IMPLS[impl](p * 3, q * 3, draft, u, r)  # the same scale on both: the same step
    assert [t.tolist() for t in got] == [t.tolist() for t in want]
    accepted, _ = IMPLS[impl](p, q, draft, torch.zeros_like(u), r)  # u = 0 accepts every token with p > 0
    assert accepted.tolist() == [3, 3]


@pytest.mark.parametrize("impl", IMPLS)
def test_check_values_false_skips_only_the_checks_of_values(kdev, impl):
    (p, q, draft, u, r), _ = inputs(kdev)
    IMPLS[impl](p, q, draft, u, r, check_values=False)
    with pytest.raises(ValueError, match=r"u must be \(2, 3\) uniforms"):  # shapes are still checked
        IMPLS[impl](p, q, draft, u[:, :2], r, check_values=False)
    with pytest.raises(TypeError, match="check_values must be a bool, got 1"):
        IMPLS[impl](p, q, draft, u, r, check_values=1)
