"""Module 13's Triton kernel: ``selective_scan_triton`` == ``reference.selective_scan_sequential``.

The grid: ragged lengths (1, 7, 33, 100), state sizes (1, 4, 16: 1 is padded to itself, none of
them fills a wide tile), chunks of 1, 4, 16 and 64 steps (a chunk of 64 is longer than 1, 7 and
33 steps: one ragged chunk), ``D = 3`` channels (not a power of two) in one or two channel blocks,
batch 1 (batch 2 elsewhere); each option (``D``, ``z``, ``delta_bias``, softplus) and each form of ``B``/``C``
(time-invariant, input-dependent, grouped) on its own; non-contiguous inputs; half-precision
inputs; the last state.

Tolerance (float32). The kernel computes the same float32 operations as the reference but in
another order: within a chunk ``tl.associative_scan`` brackets the products as a tree, across
chunks the carried state is multiplied by a chunk's product ``P_t``, ``exp``/softplus come from
another library (numpy in the interpreter), and ``y`` sums over ``N`` in another order. Each step
adds a few ``2**-24`` relative errors, damped by ``|Ā| < 1``: ``rtol = atol = 1e-5`` allows
``1e-5 (1 + |out|)``, about fifteen times the largest error seen (``6.1e-7 (1 + |out|)``). Half-precision inputs: the reference
is run on the same rounded inputs, and only the output's final rounding to ``u``'s dtype differs:
one unit in the last place (at most ``eps`` relative: ``2**-7`` for bfloat16, ``2**-10`` for float16).

Every case runs in Triton's interpreter on this machine, so the sizes are small.
"""

from __future__ import annotations

import pytest
import torch

from llmu.mamba import kernels as K, reference as R

pytestmark = pytest.mark.kernels

FORMS = ("ti", "var", "grp")
TOL = {"rtol": 1e-5, "atol": 1e-5}
OPTIONS = [{"D": True, "z": True, "bias": True, "softplus": True},
           {"D": False, "z": False, "bias": False, "softplus": False},
           {"D": True, "z": False, "bias": True, "softplus": False},
           {"D": False, "z": True, "bias": False, "softplus": True}]


def check(case, **kw):
    want, want_last = R.selective_scan_sequential(**case, return_last_state=True)
    got, got_last = K.selective_scan_triton(**case, return_last_state=True, **kw)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, **TOL)
    torch.testing.assert_close(got_last, want_last, **TOL)
    return got


@pytest.mark.parametrize("chunk", [1, 4, 16, 64])
@pytest.mark.parametrize("N", [1, 4, 16])
@pytest.mark.parametrize("L", [1, 7, 33, 100])
def test_kernel_equals_reference(make_case, kdev, L, N, chunk):
    i = L + N + chunk                                   # spread forms and options over the grid
    case = make_case(1, 3, L, N, FORMS[i % 3], **OPTIONS[i % 4], seed=i, device=kdev)
    check(case, chunk=chunk)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("D", [False, True])
@pytest.mark.parametrize("z", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("softplus", [False, True])
def test_kernel_options(make_case, kdev, form, D, z, bias, softplus):
    case = make_case(2, 6, 9, 4, form, D=D, z=z, bias=bias, softplus=softplus, seed=5, device=kdev)
    check(case, chunk=4)


@pytest.mark.parametrize("block_d", [1, 2, 8])
def test_channel_blocks(make_case, kdev, block_d):
    """Channels split over programs, the last block ragged (6 channels in blocks of 1, 2 or 8)."""
    case = make_case(1, 6, 10, 4, "grp", seed=2, device=kdev)
    check(case, chunk=4, block_d=block_d)


def test_default_tiles(make_case, kdev):
    assert K.choose_tiles(1536, 16, 4096) == (2, 16, 64)
    assert K.choose_tiles(3, 1, 7) == (4, 1, 8)
    for bd, n, ch in (K.choose_tiles(d, N, L) for d in (1, 5, 1536) for N in (1, 5, 16, 64) for L in (1, 9, 4096)):
        assert bd * n * ch <= K.MAX_TILE
    case = make_case(2, 5, 20, 5, "var", seed=9, device=kdev)
    got = check(case)
    # without the last state: the same output
    torch.testing.assert_close(K.selective_scan_triton(**case), got, rtol=0, atol=0)


def test_mixed_forms_of_b_and_c(make_case, kdev):
    """``B`` time-invariant and ``C`` input-dependent (and the other way round)."""
    case = make_case(2, 4, 11, 3, "var", seed=4, device=kdev)
    ti = make_case(2, 4, 11, 3, "ti", seed=4, device=kdev)
    check(dict(case, B=ti["B"]), chunk=4)
    check(dict(case, C=ti["C"]), chunk=8)


def test_non_contiguous_inputs(make_case, kdev):
    case = make_case(2, 5, 13, 4, "var", seed=8, device=kdev)
    strided = {k: (v.transpose(-1, -2).contiguous().transpose(-1, -2) if isinstance(v, torch.Tensor) and v.ndim >= 2
                   else v) for k, v in case.items()}
    strided["u"] = torch.cat([case["u"], case["u"]], dim=1)[:, ::2]   # a strided slice
    case["u"] = strided["u"].contiguous()
    assert not strided["u"].is_contiguous() and not strided["B"].is_contiguous()
    want = R.selective_scan_sequential(**case)
    torch.testing.assert_close(K.selective_scan_triton(**strided, chunk=4), want, **TOL)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs(make_case, kdev, dtype):
    case = make_case(2, 3, 9, 4, "var", seed=6, device=kdev)
    case = {k: (v.to(dtype) if isinstance(v, torch.Tensor) and k in ("u", "delta", "B", "C", "z") else v)
            for k, v in case.items()}
    want = R.selective_scan_sequential(**case)
    got = K.selective_scan_triton(**case, chunk=4)
    assert got.dtype == dtype
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(got.float(), want.float(), rtol=eps, atol=eps)


# -- bad inputs ------------------------------------------------------------------------------------------


def test_bad_shapes_raise_naming_the_argument(make_case, kdev):
    case = make_case(2, 6, 9, 4, "var", device=kdev)
    for name, bad in [("u", {"u": case["u"][0]}), ("delta", {"delta": case["delta"][:1]}),
                      ("A", {"A": case["A"][:, None]}), ("B", {"B": case["B"][:1]}),
                      ("C", {"C": case["C"][..., :3]}), ("D", {"D": case["D"][:2]}),
                      ("z", {"z": case["z"][..., :3]}), ("delta_bias", {"delta_bias": case["D"][None]})]:
        with pytest.raises(ValueError, match=rf"^{name} "):
            K.selective_scan_triton(**dict(case, **bad))


def test_bad_types_devices_and_tiles(make_case, kdev, off_device):
    case = make_case(2, 6, 9, 4, "var", device=kdev)
    with pytest.raises(TypeError, match="^u must have dtype"):
        K.selective_scan_triton(**dict(case, u=case["u"].to(torch.int32)))
    with pytest.raises(TypeError, match="^B must be a torch.Tensor"):
        K.selective_scan_triton(**dict(case, B=case["B"].tolist()))
    with pytest.raises(ValueError, match=f"^C must be on {kdev.type}"):
        K.selective_scan_triton(**dict(case, C=case["C"].to(off_device)))
    with pytest.raises(ValueError, match="^chunk must be a power of two"):
        K.selective_scan_triton(**case, chunk=3)
    with pytest.raises(ValueError, match="^block_d must be"):
        K.selective_scan_triton(**case, block_d=0)
    with pytest.raises(TypeError, match="^delta_softplus must be a bool"):
        K.selective_scan_triton(**dict(case, delta_softplus=1))


def test_inputs_that_require_grad_join_the_graph(make_case, kdev):
    """An input that requires grad gives an output in the autograd graph (the backward is tested in
    test_scan_backward.py); under ``torch.no_grad()`` the plain launch, with the same output."""
    case = make_case(1, 2, 5, 2, "var", device=kdev)
    case["B"] = case["B"].clone().requires_grad_(True)
    out = K.selective_scan_triton(**case)
    assert out.requires_grad and out.grad_fn is not None
    with torch.no_grad():
        got = check(case)
    assert got.grad_fn is None
    torch.testing.assert_close(out.detach(), got, rtol=0, atol=0)
