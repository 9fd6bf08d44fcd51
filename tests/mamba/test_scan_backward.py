"""Module 13's Triton backward: the gradients of ``selective_scan_triton`` == autograd through
``reference.selective_scan_sequential``.

Every gradient (``u``, ``delta``, ``A``, ``B``, ``C``, ``D``, ``z``, ``delta_bias``) is compared, for a
loss that weighs ``out`` (and the last state, whose gradient enters the backward as the adjoint
after the last step) with random weights. The grid: each form of ``B``/``C`` (time-invariant,
input-dependent, grouped, and mixed), each option on and off (``D``, ``z``, ``delta_bias``,
softplus), lengths that are not a multiple of the chunk (so the last chunk is ragged and the
reverse walk starts inside it), chunks of 1 to 16 steps, channel blocks that split a group
between programs (the atomic adds of ``dB`` and ``dC``), non-contiguous inputs, half precision.

Tolerances. float32: the kernel and autograd compute the same float32 terms in another order
(tree scans, the state before a step recomputed as ``x_t - B̄u_t`` rather than kept, sums over
``N``, time, batch and a group's channels in another order); the largest difference seen over this
file's cases is ``2.4e-6 (1 + |grad|)``, and ``rtol = atol = 1e-5`` leaves a margin of four.
Half-precision inputs: both sides compute in float32 from the same rounded inputs and round each
gradient once to its input's dtype, so they differ by one unit in the last place at most
(``rtol = eps``: ``2**-7`` for bfloat16, ``2**-10`` for float16), plus the float32 differences above
for gradients near zero (``atol = 1e-5``). The finite-difference check is in float32 (the kernel
computes in float32 and takes no float64 input): a central difference with step ``1e-2`` has a
truncation error of order ``1e-4`` and a rounding error of order ``1e-4`` here (the difference
seen is ``1.8e-4`` relative), hence ``rtol = 2e-3``. The tiny model: float32 through a few layers
around the scan; its parameters' gradients are of order ``1e-3`` and differ by at most ``1e-7``
between the scans (``rtol = 1e-4``, ``atol = 1e-6``).

Everything runs in Triton's interpreter on this machine, so the sizes are small.
"""

from __future__ import annotations

import pytest
import torch

from llmu.mamba import kernels as K, reference as R
from llmu.mamba.block import MambaLM

pytestmark = pytest.mark.kernels

TOL = {"rtol": 1e-5, "atol": 1e-5}
NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")
OPTIONS = [{"D": True, "z": True, "bias": True, "softplus": True},
           {"D": False, "z": False, "bias": False, "softplus": False},
           {"D": True, "z": False, "bias": True, "softplus": False},
           {"D": False, "z": True, "bias": False, "softplus": True}]


def leaves(case):
    """A copy of ``case`` whose tensors are fresh leaves that require grad."""
    return {k: (v.detach().clone().requires_grad_(True) if isinstance(v, torch.Tensor) else v)
            for k, v in case.items()}


def weights(case, seed=0, last=True):
    """Random weights for ``out`` (and the last state): the loss is ``Σ w·out + Σ w_last·last``."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    u, N = case["u"], case["A"].shape[1]
    w = torch.randn(*u.shape, generator=g, device="cpu").to(u.device)
    w_last = torch.randn(u.shape[0], u.shape[1], N, generator=g, device="cpu").to(u.device) if last else None
    return w, w_last


def grads(scan, case, w, w_last, **kw):
    """``(loss, {name: gradient})`` of the weighted loss through ``scan``."""
    args = leaves(case)
    out, last = scan(**args, return_last_state=True, **kw)
    loss = (out.float() * w).sum()
    if w_last is not None:
        loss = loss + (last * w_last).sum()
    loss.backward()
    return loss.detach(), {k: args[k].grad for k in NAMES if isinstance(args.get(k), torch.Tensor)}


def check_grads(case, tol=TOL, last=True, **kw):
    w, w_last = weights(case, last=last)
    _, want = grads(R.selective_scan_sequential, case, w, w_last)
    _, got = grads(K.selective_scan_triton, case, w, w_last, **kw)
    assert set(got) == set(want)
    for name in want:
        assert got[name] is not None, name
        assert got[name].shape == want[name].shape and got[name].dtype == want[name].dtype, name
        torch.testing.assert_close(got[name], want[name], **tol, msg=lambda m, name=name: f"d{name}: {m}")
    return got


@pytest.mark.parametrize("form", ["ti", "var", "grp"])
@pytest.mark.parametrize("options", range(len(OPTIONS)))
def test_gradients_equal_autograd_through_the_reference(make_case, kdev, form, options):
    """Each form of B/C with each option on and off; L = 11 in chunks of 4 (the last one ragged)."""
    case = make_case(2, 6, 11, 3, form, **OPTIONS[options], seed=options, device=kdev)
    check_grads(case, chunk=4)


@pytest.mark.parametrize(("L", "chunk"), [(1, 4), (7, 1), (33, 16), (40, 8)])
def test_lengths_and_chunks(make_case, kdev, L, chunk):
    """One step; chunks of one step; several chunks, ragged or not: the adjoint crosses every boundary."""
    case = make_case(1, 3, L, 2, ("var", "grp", "ti", "var")[L % 4], seed=L, device=kdev)
    check_grads(case, chunk=chunk)


@pytest.mark.parametrize("block_d", [1, 2, 8])
def test_channel_blocks_share_a_group(make_case, kdev, block_d):
    """6 channels in 3 groups of B (2 channels each) and one group of C, split over programs of 1, 2
    or 8 channels: a group's dB, dC are added by several programs, or twice by one."""
    case = make_case(2, 6, 9, 4, "grp", seed=7, device=kdev)
    check_grads(case, chunk=4, block_d=block_d)


def test_mixed_forms_and_non_contiguous_inputs(make_case, kdev):
    """B time-invariant, C input-dependent (and the other way round); inputs transposed and back
    (strided, still dense), and u a strided slice of a larger leaf."""
    case = make_case(2, 4, 10, 3, "var", seed=4, device=kdev)
    ti = make_case(2, 4, 10, 3, "ti", seed=4, device=kdev)
    check_grads(dict(case, B=ti["B"]), chunk=4)
    check_grads(dict(case, C=ti["C"]), chunk=8)
    w, w_last = weights(case)
    _, want = grads(R.selective_scan_sequential, case, w, w_last)
    args = leaves({k: (v.transpose(-1, -2).contiguous().transpose(-1, -2)
                       if isinstance(v, torch.Tensor) and v.ndim >= 2 else v) for k, v in case.items()})
    big = torch.stack([case["u"], torch.zeros_like(case["u"])], dim=2).flatten(1, 2).requires_grad_(True)
    args["u"] = big[:, ::2]                                      # channels 0, 2, 4, ... of big: u
    assert not args["u"].is_contiguous() and not args["B"].is_contiguous() and torch.equal(args["u"], case["u"])
    out, last = K.selective_scan_triton(**args, return_last_state=True, chunk=4)
    ((out * w).sum() + (last * w_last).sum()).backward()
    torch.testing.assert_close(big.grad[:, ::2], want["u"], **TOL)
    assert not big.grad[:, 1::2].any()
    for name in NAMES[1:]:
        torch.testing.assert_close(args[name].grad, want[name], **TOL)


def test_only_out_or_only_the_last_state(make_case, kdev):
    """A loss on ``out`` alone (the last state's gradient is None), on the last state alone (``out``'s
    is None), and a call without ``return_last_state`` (one output)."""
    case = make_case(2, 4, 10, 3, "var", seed=5, device=kdev)
    check_grads(case, last=False, chunk=4)
    w, w_last = weights(case)
    results = []
    for scan, kw in ((R.selective_scan_sequential, {}), (K.selective_scan_triton, {"chunk": 4})):
        args = leaves(case)
        _, last = scan(**args, return_last_state=True, **kw)
        (last * w_last).sum().backward()
        results.append({k: args[k].grad for k in NAMES})
    want, got = results
    for name in NAMES:
        if want[name] is None:       # z and D do not reach the state: no gradient, or zeros
            assert got[name] is None or not got[name].any(), name
        else:
            torch.testing.assert_close(got[name], want[name], **TOL)
    ours, ref = leaves(case), leaves(case)
    (K.selective_scan_triton(**ours, chunk=4) * w).sum().backward()
    (R.selective_scan_sequential(**ref) * w).sum().backward()
    for name in NAMES:
        torch.testing.assert_close(ours[name].grad, ref[name].grad, **TOL)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs(make_case, kdev, dtype):
    """u, delta, B, C, z in half precision (A, D, delta_bias float32 parameters, as Mamba keeps
    them): each gradient in its input's dtype, rounded once from float32. The reference is run in
    float32 on the same rounded inputs (autograd through the reference in half precision rounds
    every path's gradient to the input's dtype before adding them up, a less accurate answer), with
    the weights rounded as the gradient of a half-precision ``out`` is."""
    case = make_case(2, 3, 9, 4, "var", seed=6, device=kdev)
    half = {k: (v.to(dtype) if isinstance(v, torch.Tensor) and k in ("u", "delta", "B", "C", "z") else v)
            for k, v in case.items()}
    w, w_last = weights(case)
    _, want = grads(R.selective_scan_sequential, {k: (v.float() if isinstance(v, torch.Tensor) else v)
                                                  for k, v in half.items()}, w.to(dtype).float(), w_last)
    _, got = grads(K.selective_scan_triton, half, w, w_last, chunk=4)
    eps = torch.finfo(dtype).eps
    for name in NAMES:
        assert got[name].dtype == half[name].dtype, name
        torch.testing.assert_close(got[name], want[name].to(half[name].dtype), rtol=eps, atol=1e-5,
                                   msg=lambda m, name=name: f"d{name}: {m}")


def test_float64_parameters(make_case, kdev):
    """A, D and delta_bias may be float64 (read as float32): their gradients are float64."""
    case = make_case(1, 3, 6, 2, "var", seed=8, device=kdev)
    case = {k: (v.double() if k in ("A", "D", "delta_bias") else v) for k, v in case.items()}
    got = check_grads(case, chunk=4)
    assert got["A"].dtype == got["D"].dtype == got["delta_bias"].dtype == torch.float64


def test_finite_differences_in_float32(make_case, kdev):
    """The directional derivative along a random direction of every input, by central differences,
    equals the kernel's gradients dotted with that direction (no reference scan involved). In float32:
    ``torch.autograd.gradcheck`` needs float64, which the kernel does not compute in (its launcher
    refuses float64 ``u``, ``delta``, ``B``, ``C``, ``z``)."""
    case = make_case(2, 4, 10, 3, "grp", seed=10, device=kdev)
    w, w_last = weights(case, seed=1)
    _, got = grads(K.selective_scan_triton, case, w, w_last, chunk=4)
    g = torch.Generator(device="cpu").manual_seed(2)
    direction = {k: torch.randn(case[k].shape, generator=g, device="cpu").to(kdev) for k in NAMES}

    def loss_at(step):
        moved = dict(case, **{k: case[k] + step * direction[k] for k in NAMES})
        out, last = K.selective_scan_triton(**moved, return_last_state=True, chunk=4)
        return (out.double() * w.double()).sum() + (last.double() * w_last.double()).sum()

    eps = 1e-2
    numeric = (loss_at(eps) - loss_at(-eps)) / (2 * eps)
    analytic = sum((got[k].double() * direction[k].double()).sum() for k in NAMES)
    torch.testing.assert_close(numeric.cpu(), analytic.cpu(), rtol=2e-3, atol=2e-3)


def test_only_checkpoints_are_saved(make_case, kdev):
    """The forward saves its inputs and one state per chunk, ``(batch, D, ceil(L / CHUNK), N)``,
    never the ``(batch, D, L, N)`` states; without grad it saves nothing and builds no graph."""
    case = leaves(make_case(2, 4, 10, 3, "var", seed=11, device=kdev))
    out = K.selective_scan_triton(**case, chunk=4)
    saved = out.grad_fn.saved_tensors
    inputs = {id(v) for v in case.values() if isinstance(v, torch.Tensor)}
    extra = [t for t in saved if t is not None and id(t) not in inputs]
    assert [tuple(t.shape) for t in extra] == [(2, 4, 3, 3)] and extra[0].dtype == torch.float32
    with torch.no_grad():
        assert K.selective_scan_triton(**case, chunk=4).grad_fn is None


def test_bad_input_is_refused_before_autograd(make_case, kdev):
    """The forward's checks run for inputs that require grad too, and name the argument."""
    case = leaves(make_case(2, 6, 9, 4, "var", device=kdev))
    with pytest.raises(ValueError, match=r"^B must have shape \(B, N, L\)"):
        K.selective_scan_triton(**dict(case, B=case["B"][:1]))
    with pytest.raises(ValueError, match=r"^delta_bias must have shape \(D,\)"):
        K.selective_scan_triton(**dict(case, delta_bias=case["delta_bias"][:2]))
    with pytest.raises(TypeError, match="^z must have dtype"):
        K.selective_scan_triton(**dict(case, z=case["z"].detach().to(torch.int32)))
    with pytest.raises(TypeError, match="^return_last_state must be a bool"):
        K.selective_scan_triton(**case, return_last_state="yes")
    with pytest.raises(ValueError, match="^chunk must be a power of two"):
        K.selective_scan_triton(**case, chunk=6)


# -- a Mamba model that trains with the Triton scan ------------------------------------------------------


@pytest.mark.parametrize("selective", [True, False])
def test_a_mamba_model_trains_with_the_triton_scan(kdev, selective):
    """A tiny MambaLM (one block; the time-invariant ablation too: B, C of shape (E, N)): with the
    Triton scan its loss and every parameter's gradient equal those with the sequential scan, and
    a few AdamW steps on one batch bring the loss down."""
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = MambaLM(vocab_size=11, d_model=8, n_layers=1, d_state=2, selective=selective)
    model = model.to(kdev)
    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(0, 11, (2, 9), generator=g, device="cpu").to(kdev)

    def loss_of(impl):
        logits = model(ids[:, :-1], impl=impl)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 11), ids[:, 1:].reshape(-1))

    loss_seq = loss_of("sequential")
    loss_seq.backward()
    want = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    loss_tri = loss_of("triton")
    loss_tri.backward()
    torch.testing.assert_close(loss_tri, loss_seq, **TOL)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")

    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    losses = []
    for _ in range(4):
        opt.zero_grad()
        loss = loss_of("triton")
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses
