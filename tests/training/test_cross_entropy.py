"""Module 04's cross-entropy: the fused Triton kernel == the chunked reference == ``F.cross_entropy(x @ W.T, y)``.

Checked for the loss and the gradients of ``x`` and ``W``, over ragged sizes (``N``, ``H``, ``V``
not multiples of the row, vocabulary and hidden tiles; batch 1), ignored rows (some, and all),
label smoothing 0 and 0.1, both reductions, float32 and float16, logits of order 1e4, and bad
inputs. Every kernel tensor is made on the kernel device (CPU in Triton's interpreter).

Tolerances:

- float32. All three compute the same float32 logits up to summation order (torch's GEMM
  blocking vs the kernel's ``BLOCK_H``-wide ``tl.dot`` steps, ``"ieee"``: no TF32), then sums
  over ``V <= 200`` exponentials in different orders: a few ulps times ``sqrt(H)`` and ``sqrt(V)``,
  about 1e-6 relative. ``rtol = atol = 1e-5`` for O(1) losses and gradient entries (the ``"sum"``
  loss, up to ~300, is covered by ``rtol``).
- float64 (the reference alone, against ``F.cross_entropy`` in float64): ``1e-12``, and
  ``torch.autograd.gradcheck`` on its hand-written backward.
- float16 (the kernel; the oracle is ``F.cross_entropy`` on the float32 upcast of the same
  float16 inputs). Both accumulate the logits in float32, so the loss differs only by summation
  order: ``rtol = atol = 1e-4``. The gradients go through ``dz`` rounded to float16 (2**-11
  relative) before the two matmuls, whose float32 results are rounded to float16 once more:
  ``rtol = atol = 2e-3`` (entries are at most ~0.3 here).
- bfloat16 needs a GPU (the interpreter's ``tl.dot`` is numpy, which has no bfloat16): refused
  with ``TypeError`` in the interpreter, checked against float32 with ``rtol = atol = 2e-2``
  (8 mantissa bits) on a GPU.
- Logits ~1e4 in float32: one ulp of 1e4 is 1e-3, and the loss is the difference of two such
  numbers (``lse - z_y``), so float32 paths agree with each other to ``atol = 1e-2``, and the
  float64 truth (logits of the same float32 ``x`` and ``W`` computed in float64) to the same.

The peak-memory measurement at SmolLM2's vocabulary is :func:`llmu.training.cross_entropy.measure_peak_memory`
(not a test: about 30 s of one CPU thread and 1.7 GB of RSS); here it runs at a small size, where it must show the
same ordering and agree with the formula of ``memory_bytes``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import llmu  # noqa: F401
from llmu import runtime
from llmu.runtime import kernel_device
from llmu.training import cross_entropy as R, kernels as K

pytestmark = pytest.mark.kernels

KDEV = kernel_device()
TOL32 = dict(rtol=1e-5, atol=1e-5)
SMALL = dict(block_m=16, block_v=16, block_h=16)   # several tiles in every direction at test sizes


def _inputs(n, h, v, seed=0, dtype=torch.float32, ignored=(), logit_scale=1.0, shape=None):
    """``x`` ``(n, h)`` (or ``shape + (h,)``), ``W`` ``(v, h)`` giving O(logit_scale) logits, targets (some ignored)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(n, h, generator=g, device="cpu")
    w = torch.randn(v, h, generator=g, device="cpu") * (logit_scale / h ** 0.5)
    y = torch.randint(0, v, (n,), generator=g, device="cpu")
    y[list(ignored)] = -100
    if shape is not None:
        x, y = x.reshape(*shape, h), y.reshape(shape)
    return (x.to(dtype=dtype, device=KDEV).requires_grad_(True), w.to(dtype=dtype, device=KDEV).requires_grad_(True),
            y.to(KDEV))


def _loss_and_grads(fn, x, w, y, **kwargs):
    loss = fn(x, w, y, **kwargs)
    dx, dw = torch.autograd.grad(loss, (x, w))
    return loss.detach(), dx, dw


def _builtin(x, w, y, **kwargs):
    return F.cross_entropy(x @ w.T, y, **kwargs)


CASES = [  # (N, H, V, ignored rows, row_chunk)
    (1, 24, 50, (), None),             # batch 1; V one partial tile in the interpreter's default
    (37, 19, 101, (3, 10), 8),         # nothing a multiple of 16; chunks of 8 rows leave a ragged last chunk
    (50, 40, 130, (0, 49), 16),        # first and last rows ignored
    (64, 33, 200, tuple(range(0, 64, 3)), 32),
]


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("n, h, v, ignored, row_chunk", CASES)
def test_kernel_and_reference_match_builtin(n, h, v, ignored, row_chunk, eps, reduction):
    x, w, y = _inputs(n, h, v, seed=n + v, ignored=ignored)
    want = _loss_and_grads(_builtin, x, w, y, label_smoothing=eps, reduction=reduction)
    ref = _loss_and_grads(R.chunked_cross_entropy, x, w, y, label_smoothing=eps, reduction=reduction,
                          row_chunk=row_chunk, vocab_chunk=32)
    got = _loss_and_grads(K.fused_linear_cross_entropy, x, w, y, label_smoothing=eps, reduction=reduction,
                          row_chunk=row_chunk, **SMALL)
    for name, a, b, c in zip(("loss", "dx", "dW"), want, ref, got):
        torch.testing.assert_close(b, a, **TOL32, msg=lambda m, name=name: f"reference {name}: {m}")
        torch.testing.assert_close(c, a, **TOL32, msg=lambda m, name=name: f"kernel {name}: {m}")
    # the ignored rows get no gradient at all
    if ignored:
        assert got[1][list(ignored)].abs().max() == 0


def test_default_blocks_and_leading_dims_and_int32_targets():
    x, w, y = _inputs(30, 20, 70, seed=5, shape=(3, 10), ignored=(4,))
    want = _loss_and_grads(lambda a, b, c: F.cross_entropy((a @ b.T).flatten(0, 1), c.flatten()), x, w, y)
    got = _loss_and_grads(K.fused_linear_cross_entropy, x, w, y.to(torch.int32))
    ref = _loss_and_grads(R.chunked_cross_entropy, x, w, y.to(torch.int32))
    for a, b, c in zip(want, got, ref):
        torch.testing.assert_close(b, a, **TOL32)
        torch.testing.assert_close(c, a, **TOL32)
    assert got[1].shape == x.shape


def test_reference_float64_and_gradcheck():
    x, w, y = _inputs(13, 7, 29, seed=1, dtype=torch.float64, ignored=(2,))
    for eps in (0.0, 0.1):
        for reduction in ("mean", "sum"):
            want = _loss_and_grads(_builtin, x, w, y, label_smoothing=eps, reduction=reduction)
            got = _loss_and_grads(R.chunked_cross_entropy, x, w, y, label_smoothing=eps, reduction=reduction,
                                  row_chunk=4, vocab_chunk=8)
            naive = R.naive_cross_entropy(x, w, y, label_smoothing=eps, reduction=reduction)
            for a, b in zip(want, got):
                torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(naive, want[0], rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(
        lambda a, b: R.chunked_cross_entropy(a, b, y, label_smoothing=0.1, row_chunk=5, vocab_chunk=8), (x, w))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_all_rows_ignored_give_zero_loss_and_gradients(reduction):
    x, w, y = _inputs(20, 16, 40, seed=2, ignored=range(20))
    builtin = _builtin(x, w, y, reduction=reduction)
    # F.cross_entropy's "mean" is 0 / 0 = nan here; this module defines it as 0 (module docstring)
    assert torch.isnan(builtin).item() == (reduction == "mean")
    for fn in (R.chunked_cross_entropy, K.fused_linear_cross_entropy, R.naive_cross_entropy):
        loss, dx, dw = _loss_and_grads(fn, x, w, y, reduction=reduction, label_smoothing=0.1)
        assert loss.item() == 0.0 and dx.abs().max() == 0 and dw.abs().max() == 0, fn.__name__


def test_large_logits_stay_finite_and_exact():
    # logits of order 1e4: exp would overflow float32 (max ~3.4e38 = exp(88.7)) without the running max
    x, w, y = _inputs(40, 24, 90, seed=3, logit_scale=1e4, ignored=(7,))
    logits = (x @ w.T).detach()
    assert logits.abs().max() > 1e4
    truth = F.cross_entropy(x.detach().double() @ w.detach().double().T, y, label_smoothing=0.1)
    want = _loss_and_grads(_builtin, x, w, y, label_smoothing=0.1)
    for fn, kwargs in ((R.chunked_cross_entropy, dict(vocab_chunk=16)), (K.fused_linear_cross_entropy, SMALL)):
        loss, dx, dw = _loss_and_grads(fn, x, w, y, label_smoothing=0.1, **kwargs)
        assert torch.isfinite(loss) and torch.isfinite(dx).all() and torch.isfinite(dw).all()
        torch.testing.assert_close(loss.double(), truth, rtol=0, atol=1e-2)
        torch.testing.assert_close(loss, want[0], rtol=0, atol=1e-2)
        # the gradients are softmax-minus-target times x or W: O(1) and O(1e4 / sqrt(H)) entries
        torch.testing.assert_close(dx, want[1], rtol=1e-3, atol=1e-2)
        torch.testing.assert_close(dw, want[2], rtol=1e-3, atol=1e-3)


def test_float16_kernel_against_float32_builtin():
    x, w, y = _inputs(37, 40, 150, seed=4, dtype=torch.float16, ignored=(1,))
    x32, w32 = (t.detach().float().requires_grad_(True) for t in (x, w))
    for eps in (0.0, 0.1):
        want = _loss_and_grads(_builtin, x32, w32, y, label_smoothing=eps)
        loss, dx, dw = _loss_and_grads(K.fused_linear_cross_entropy, x, w, y, label_smoothing=eps, row_chunk=16,
                                       **SMALL)
        assert loss.dtype == torch.float32 and dx.dtype == dw.dtype == torch.float16
        torch.testing.assert_close(loss, want[0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(dx.float(), want[1], rtol=2e-3, atol=2e-3)
        torch.testing.assert_close(dw.float(), want[2], rtol=2e-3, atol=2e-3)


def test_bfloat16():
    x, w, y = _inputs(33, 32, 100, seed=6, dtype=torch.bfloat16)
    if runtime.interpreting():
        with pytest.raises(TypeError, match="bfloat16"):
            K.fused_linear_cross_entropy(x, w, y)
        return
    x32, w32 = (t.detach().float().requires_grad_(True) for t in (x, w))
    want = _loss_and_grads(_builtin, x32, w32, y)
    got = _loss_and_grads(K.fused_linear_cross_entropy, x, w, y)
    for a, b in zip(want, got):
        torch.testing.assert_close(b.float(), a, rtol=2e-2, atol=2e-2)


@settings(max_examples=6, deadline=None)
@given(n=st.integers(1, 40), h=st.integers(1, 40), v=st.integers(1, 80), eps=st.sampled_from([0.0, 0.1]),
       reduction=st.sampled_from(["mean", "sum"]), seed=st.integers(0, 1000))
def test_random_shapes(n, h, v, eps, reduction, seed):
    x, w, y = _inputs(n, h, v, seed=seed, ignored=range(0, n, 5))
    want = _loss_and_grads(_builtin, x, w, y, label_smoothing=eps, reduction=reduction)
    if y.ne(-100).sum() == 0:   # all ignored: builtin mean is nan, ours 0 (tested above)
        return
    got = _loss_and_grads(K.fused_linear_cross_entropy, x, w, y, label_smoothing=eps, reduction=reduction,
                          row_chunk=max(1, n // 3), **SMALL)
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a, **TOL32)


def test_matmul_accumulates_through_transposed_views():
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(45, 20, generator=g, device="cpu").to(KDEV)
    b = torch.randn(45, 37, generator=g, device="cpu").to(KDEV)
    out = torch.ones(20, 37, device=KDEV)
    K.matmul(a.T, b, out, accumulate=True, blocks=(16, 16, 16))    # out += a^T b, a^T a strided view
    torch.testing.assert_close(out, 1 + a.T @ b, **TOL32)
    big = torch.zeros(60, 37, device=KDEV)
    K.matmul(a, b[:20], big[10:55], blocks=(16, 16, 16))           # into a slice of a larger tensor
    torch.testing.assert_close(big[10:55], a @ b[:20], **TOL32)
    assert big[:10].abs().max() == 0


# ---------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------


def test_memory_formula_at_smollm2_size():
    mem = R.memory_bytes(2048, 576, 49152)
    assert mem["logits"] == 2048 * 49152 * 4 == 402_653_184
    assert mem["naive"] == 3 * mem["logits"]                    # logits, log-softmax, their gradient
    assert mem["row_chunk"] == R.default_row_chunk(2048, 576, 49152) == 32
    assert mem["chunked"] < mem["naive"] / 10
    assert R.memory_bytes(2048, 576, 49152, elem=2)["naive"] == 2048 * 49152 * (2 + 4 + 4 + 4)


def test_measured_peak_memory_small():
    n, h, v = 64, 32, 4096
    got = R.measure_peak_memory(n, h, v, vocab_chunk=256)
    assert got["naive_loss"] == pytest.approx(got["chunked_loss"], rel=1e-5)
    formula = got["formula"]
    # naive: the logits and their log-softmax (both saved) and the gradient of the logits, the
    # formula's three (N, V) float32 tensors (the peak comes before dx and dW exist)
    assert 3 * n * v * 4 == formula["naive"] <= got["naive"] <= 1.05 * formula["naive"]
    # chunked: the gradients it returns, plus the tiles the formula counts (10 % for small temporaries)
    assert 0 < got["chunked"] - got["gradients"] <= 1.1 * formula["chunked"]
    assert got["chunked"] < got["naive"] / 3


# ---------------------------------------------------------------------------------------------
# Bad inputs
# ---------------------------------------------------------------------------------------------


BAD = [  # (change, error, the name the message must hold)
    (dict(x=lambda x: x.long()), TypeError, "x"),
    (dict(w=lambda w: w.double()), TypeError, "weight"),
    (dict(y=lambda y: y.float()), TypeError, "target"),
    (dict(y=lambda y: y[:-1]), ValueError, "target"),
    (dict(y=lambda y: torch.full_like(y, 40)), ValueError, "target"),
    (dict(y=lambda y: torch.full_like(y, -1)), ValueError, "target"),
    (dict(w=lambda w: w[:, :-1]), ValueError, "weight"),
    (dict(w=lambda w: w[:0]), ValueError, "V > 0"),
    (dict(x=lambda x: x[0]), ValueError, "x"),
    (dict(x="not a tensor"), TypeError, "x"),
    (dict(kw=dict(label_smoothing=1.5)), ValueError, "label_smoothing"),
    (dict(kw=dict(label_smoothing="0.1")), TypeError, "label_smoothing"),
    (dict(kw=dict(reduction="none")), ValueError, "reduction"),
    (dict(kw=dict(ignore_index=1.5)), TypeError, "ignore_index"),
    (dict(kw=dict(row_chunk=0)), ValueError, "row_chunk"),
]


@pytest.mark.parametrize("fn", [K.fused_linear_cross_entropy, R.chunked_cross_entropy, R.naive_cross_entropy])
@pytest.mark.parametrize("change, error, name", BAD)
def test_bad_inputs_are_refused(fn, change, error, name):
    x, w, y = (t.detach() for t in _inputs(6, 8, 40, seed=0))
    x = change["x"](x) if callable(change.get("x")) else change.get("x", x)
    w = change["w"](w) if "w" in change else w
    y = change["y"](y) if "y" in change else y
    kwargs = change.get("kw", {})
    if fn is R.naive_cross_entropy and "row_chunk" in kwargs:
        return
    with pytest.raises(error, match=name):
        fn(x, w, y, **kwargs)


@pytest.mark.parametrize("kwargs", [dict(block_v=48), dict(block_m=8), dict(block_h=0)])
def test_bad_blocks_are_refused(kwargs):
    x, w, y = _inputs(6, 8, 40)
    with pytest.raises((ValueError, TypeError), match=next(iter(kwargs))):
        K.fused_linear_cross_entropy(x, w, y, **kwargs)



# ---------------------------------------------------------------------------------------------
# The benchmark entry (llmu.training.bench; not yet in the registry's TOPICS, so imported here)
# ---------------------------------------------------------------------------------------------


def test_bench_entry_formulas_and_providers_agree():
    from llmu.bench.registry import REGISTRY
    from llmu.training import bench

    entry = bench.FUSED_LINEAR_CROSS_ENTROPY
    assert REGISTRY[entry.name] is entry and entry.module == "04_training" and entry.x_axis == "N"
    assert {name: p.kind for name, p in entry.providers.items()} == {
        "llmu triton": "triton", "llmu torch": "torch", "torch naive": "builtin"}
    assert {(s["H"], s["V"]) for s in entry.gpu_sizes} == {(576, 49152)}
    size = {"N": 10, "H": 6, "V": 100}
    assert entry.flops(size) == 6 * 10 * 6 * 100 == 36000
    assert entry.bytes(size, 2) == 2 * (10 * 6 + 100 * 6) + 8 * 10 == 1400
    with pytest.raises(ValueError, match="V"):
        entry.flops({"N": 10, "H": 6})
    # every provider returns (loss, dx, dW), equal up to the float32 tolerance of this file
    small = {"N": 40, "H": 24, "V": 150}
    outs = {name: p.fn(*entry.setup(small, KDEV, torch.float32)) for name, p in entry.providers.items()}
    for name, out in outs.items():
        for a, b in zip(out, outs["torch naive"]):
            torch.testing.assert_close(a, b, **TOL32, msg=lambda m, name=name: f"{name}: {m}")


def test_forward_bench_entry_formulas_and_providers_agree():
    """The forward entry (what the notebook's exercise 2 kernel computes): llmu's Triton provider
    returns (mean loss, lse of every row), as the notebook's launcher my_fused_ce does; the torch
    providers return the loss."""
    from llmu.bench.registry import REGISTRY
    from llmu.training import bench

    entry = bench.FUSED_LINEAR_CROSS_ENTROPY_FORWARD
    assert REGISTRY[entry.name] is entry and entry.module == "04_training" and entry.x_axis == "N"
    assert {name: p.kind for name, p in entry.providers.items()} == {
        "llmu triton": "triton", "llmu torch": "torch", "torch naive": "builtin"}
    assert entry.gpu_sizes == bench.FUSED_LINEAR_CROSS_ENTROPY.gpu_sizes
    size = {"N": 10, "H": 6, "V": 100}
    assert entry.flops(size) == 2 * 10 * 6 * 100 == 12000
    assert entry.bytes(size, 2) == 2 * (10 * 6 + 100 * 6) + 8 * 10 + 8 * 10 == 1480
    small = {"N": 40, "H": 24, "V": 150}
    x, w, y = entry.setup(small, KDEV, torch.float32)
    assert not x.requires_grad and not w.requires_grad
    loss, lse = entry.providers["llmu triton"].fn(x, w, y)
    torch.testing.assert_close(lse, torch.logsumexp(x @ w.T, dim=1), **TOL32)
    for name in ("llmu torch", "torch naive"):
        torch.testing.assert_close(entry.providers[name].fn(x, w, y), loss, **TOL32)


def test_bench_cpu_sizes_run(check_cpu_sizes_run):
    from llmu.training import bench

    rows = check_cpu_sizes_run([bench.FUSED_LINEAR_CROSS_ENTROPY, bench.FUSED_LINEAR_CROSS_ENTROPY_FORWARD])
    assert {r["provider"] for r in rows if r["status"] == "ok"} == {"llmu torch", "torch naive"}


@pytest.mark.parametrize("frozen", ["weight", "x"])
def test_a_frozen_input_gets_no_gradient_and_the_other_is_unchanged(frozen):
    """A frozen LM head (LoRA fine-tuning) needs only dx: the chunked backward skips dW (and
    vice versa); the gradient it does compute equals the full backward's bit for bit, since the
    same tiles are summed in the same order."""
    g = torch.Generator(device="cpu").manual_seed(3)
    x, w = torch.randn(37, 24, generator=g, device="cpu"), torch.randn(101, 24, generator=g, device="cpu")
    y = torch.randint(0, 101, (37,), generator=g, device="cpu")
    x_all, w_all = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    R.chunked_cross_entropy(x_all, w_all, y, row_chunk=16, vocab_chunk=32).backward()
    x_one, w_one = x.clone().requires_grad_(frozen != "x"), w.clone().requires_grad_(frozen != "weight")
    R.chunked_cross_entropy(x_one, w_one, y, row_chunk=16, vocab_chunk=32).backward()
    if frozen == "weight":
        assert w_one.grad is None and torch.equal(x_one.grad, x_all.grad)
    else:
        assert x_one.grad is None and torch.equal(w_one.grad, w_all.grad)
