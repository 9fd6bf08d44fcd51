"""A positive ``A`` is refused by every scan and by the decode step; ``A = 0`` is allowed.

In Mamba ``A = -exp(A_log)`` is negative: the state decays by ``exp(Δ A) < 1`` a step. A positive
entry makes it grow by ``exp(Δ A) > 1`` every step until it overflows, so the scans refuse it (a
NaN too). ``A = 0`` is a state that never forgets, a running sum: well defined, allowed. The
block builds its ``A`` from ``A_log``, negative by construction, and skips the check, so that its
decode loop never waits for a GPU to read ``A`` back.
"""

from __future__ import annotations

import pytest
import torch

from llmu.mamba import kernels as K, reference as R
from llmu.mamba.block import MambaLM

pytestmark = pytest.mark.kernels

SCANS = {
    "sequential": R.selective_scan_sequential,
    "parallel": R.selective_scan_parallel,
    "triton": K.selective_scan_triton,
}
MESSAGE = r"^A must have no positive or NaN entry .* A = 0 \(no decay\) is allowed"


def _step_args(case):
    u = case["u"]
    return dict(state=torch.zeros(u.shape[0], u.shape[1], case["A"].shape[1], device=u.device),
                u_t=u[..., 0], delta_t=case["delta"][..., 0], A=case["A"],
                B_t=case["B"][..., 0], C_t=case["C"][..., 0])


@pytest.mark.parametrize("scan", SCANS)
def test_positive_or_nan_A_is_refused(make_case, kdev, scan):
    case = make_case(2, 4, 7, 3, "var", device=kdev)
    one_positive = case["A"].clone()
    one_positive[1, 2] = 0.5
    for A in (-case["A"], one_positive, case["A"].masked_fill(case["A"] < -0.5, float("nan"))):
        with pytest.raises(ValueError, match=MESSAGE):
            SCANS[scan](**dict(case, A=A))


@pytest.mark.parametrize("scan", SCANS)
def test_zero_A_is_a_running_sum(make_case, kdev, scan):
    """Ā = 1: x_t = x_{t-1} + Δ_t B_t u_t, so the state is the cumulative sum of Δ B u."""
    case = make_case(2, 4, 7, 3, "var", D=False, z=False, bias=False, softplus=False, device=kdev)
    A = torch.zeros_like(case["A"])
    _, last = SCANS[scan](**dict(case, A=A), return_last_state=True)
    u, delta, B = (case[k].cpu().float() for k in ("u", "delta", "B"))
    want = ((delta * u)[:, :, None, :] * B[:, None]).sum(-1)  # (batch, D, N): Σ_t Δ u B
    torch.testing.assert_close(last.cpu(), want, rtol=1e-5, atol=1e-5)


def test_decode_step_refuses_a_positive_A(make_case):
    case = make_case(2, 4, 7, 3, "var")
    R.selective_state_step(**_step_args(dict(case, A=torch.zeros_like(case["A"]))))  # zero: allowed
    with pytest.raises(ValueError, match=MESSAGE):
        R.selective_state_step(**_step_args(dict(case, A=-case["A"])))


@pytest.mark.parametrize("scan", SCANS)
def test_check_values_false_skips_only_the_check_of_A(make_case, kdev, scan):
    case = make_case(2, 4, 7, 3, "var", device=kdev)
    SCANS[scan](**dict(case, A=-case["A"]), check_values=False)
    with pytest.raises(ValueError, match=r"^A must have shape \(D, N\)"):
        SCANS[scan](**dict(case, A=case["A"][:2]), check_values=False)
    with pytest.raises(TypeError, match="check_values must be a bool, got 'yes'"):
        SCANS[scan](**case, check_values="yes")


def test_the_model_reads_no_value_back_while_it_decodes(monkeypatch):
    """MambaLM's A = -exp(A_log) is negative by construction: neither the prefill nor the decode
    steps check it (a check reads A back to the host: a wait for the GPU at every token)."""
    torch.manual_seed(0)
    with torch.device("cpu"):
        lm = MambaLM(vocab_size=11, d_model=16, n_layers=2, d_state=4).eval()
    ids = torch.tensor([[1, 2, 3]], device="cpu")
    want = lm.generate(ids, 5)

    def refuse(*checks):
        raise AssertionError("a value check ran inside the model")

    monkeypatch.setattr(R, "require_values", refuse)
    assert torch.equal(lm.generate(ids, 5), want)
