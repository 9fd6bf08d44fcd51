"""RMSNorm kernel (llmu.layers.rmsnorm) == torch reference == torch.nn.functional.rms_norm.

Tolerances, fp32: the kernel sums squares in a different order than torch, so single values
differ by a few ulps (~1e-6 relative); 1e-5 leaves room. dw is a sum over every row, whose
rounding error grows like sqrt(rows) * ulp * |terms|: 1e-4 covers the 2000-row case.
bf16/fp16: both sides compute in fp32 and round once at the end; the interpreter's cast and torch's
may round a tie differently, one bf16 ulp (2**-8 relative), so rtol/atol are 1e-2 there (on a GPU
both round to nearest: the same bound with margin).

Every tensor is made on ``kernel_device()`` (cpu in the interpreter, cuda when compiled) and the
references run on the same tensors.
"""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import llmu  # noqa: F401  (sets Triton's mode before triton is imported)
from llmu.layers import reference
from llmu.layers.rmsnorm import RMSNormFunction, rms_norm
from llmu.runtime import kernel_device

pytestmark = pytest.mark.kernels

KDEV = kernel_device()  # cpu in Triton's interpreter, cuda when the kernels are compiled

SHAPES = [
    (1, 576),        # batch 1, SmolLM2's hidden size (not a power of two)
    (3, 7, 576),     # ragged row count
    (2, 5, 1536),    # SmolLM2's FFN width
    (4, 64),         # power of two
    (1, 1, 33),      # one row, odd width
    (17, 100),       # rows not a multiple of the row block
    (2, 5000),       # a long row: one row per program
]


def _grads(fn, x, w, dy, eps):
    x = x.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    y = fn(x, w, eps)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("shape", SHAPES)
def test_forward_matches_reference_and_builtin(shape):
    torch.manual_seed(0)
    x = torch.randn(shape, device=KDEV) * 3
    w = torch.randn(shape[-1], device=KDEV)
    y = rms_norm(x, w, 1e-5)
    torch.testing.assert_close(y, reference.rms_norm(x, w, 1e-5), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y, F.rms_norm(x, (shape[-1],), w, 1e-5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", SHAPES + [(2000, 64)])
def test_backward_matches_autograd_on_reference(shape):
    torch.manual_seed(1)
    x = torch.randn(shape, device=KDEV)
    w = torch.randn(shape[-1], device=KDEV)
    dy = torch.randn(shape, device=KDEV)
    y, dx, dw = _grads(rms_norm, x, w, dy, 1e-6)
    y_ref, dx_ref, dw_ref = _grads(reference.rms_norm, x, w, dy, 1e-6)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx, dx_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dw, dw_ref, rtol=1e-4, atol=1e-4)


def test_backward_matches_builtin():
    torch.manual_seed(2)
    x, w, dy = torch.randn(3, 9, 576, device=KDEV), torch.rand(576, device=KDEV) + 0.5, torch.randn(3, 9, 576, device=KDEV)
    _, dx, dw = _grads(rms_norm, x, w, dy, 1e-5)
    _, dx_b, dw_b = _grads(lambda a, b, e: F.rms_norm(a, (576,), b, e), x, w, dy, 1e-5)
    torch.testing.assert_close(dx, dx_b, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dw, dw_b, rtol=1e-4, atol=1e-4)


def test_backward_matches_finite_differences():
    # The kernel runs in fp32, so gradcheck (which wants fp64) is not available; instead compare the
    # analytic backward with a central finite difference of the fp32 kernel's forward, on a small case.
    torch.manual_seed(3)
    x, w = torch.randn(2, 6, device=KDEV), torch.randn(6, device=KDEV)
    dy = torch.randn(2, 6, device=KDEV)
    _, dx, dw = _grads(rms_norm, x, w, dy, 1e-5)
    h = 1e-2
    for i in range(6):
        e = torch.zeros(2, 6, device=KDEV)
        e[1, i] = h
        num = ((rms_norm(x + e, w, 1e-5) - rms_norm(x - e, w, 1e-5)) * dy).sum() / (2 * h)
        assert abs(num.item() - dx[1, i].item()) < 2e-2  # central difference error ~h^2 plus fp32 noise / h
        ew = torch.zeros(6, device=KDEV)
        ew[i] = h
        num_w = ((rms_norm(x, w + ew, 1e-5) - rms_norm(x, w - ew, 1e-5)) * dy).sum() / (2 * h)
        assert abs(num_w.item() - dw[i].item()) < 2e-2


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_forward_and_backward(dtype):
    torch.manual_seed(4)
    x = torch.randn(5, 576, device=KDEV).to(dtype)
    w = (torch.rand(576, device=KDEV) + 0.5).to(dtype)
    dy = torch.randn(5, 576, device=KDEV).to(dtype)
    y, dx, dw = _grads(rms_norm, x, w, dy, 1e-5)
    assert y.dtype == dx.dtype == dw.dtype == dtype
    # Expected values: the fp32 reference on the same (already rounded) inputs.
    y32, dx32, dw32 = _grads(reference.rms_norm, x.float(), w.float(), dy.float(), 1e-5)
    torch.testing.assert_close(y.float(), y32, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(dx.float(), dx32, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(dw.float(), dw32, rtol=1e-2, atol=1e-2)


def test_strided_rows_and_weight_dtype():
    # Rows with a stride larger than the width (a slice of a wider buffer) are read in place; a
    # weight kept in fp32 with bf16 activations is allowed, and dw comes back in the weight's dtype.
    buf = torch.randn(6, 200, device=KDEV)
    x = buf[:, :150]
    w = torch.randn(150, device=KDEV)
    torch.testing.assert_close(rms_norm(x, w), reference.rms_norm(x, w), rtol=1e-5, atol=1e-5)
    xb = torch.randn(3, 64, dtype=torch.bfloat16, requires_grad=True, device=KDEV)
    w32 = torch.randn(64, requires_grad=True, device=KDEV)
    rms_norm(xb, w32).float().sum().backward()
    assert xb.grad.dtype == torch.bfloat16 and w32.grad.dtype == torch.float32


# With eps=0 the padding rows of the last block divide 0 by 0 in numpy (masked, never stored).
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_zero_rows_and_eps_zero():
    assert rms_norm(torch.empty(0, 8, device=KDEV), torch.ones(8, device=KDEV)).shape == (0, 8)
    x = torch.randn(4, 8, device=KDEV)
    torch.testing.assert_close(rms_norm(x, torch.ones(8, device=KDEV), 0.0), reference.rms_norm(x, torch.ones(8, device=KDEV), 0.0))


def test_weight_grad_not_requested():
    x = torch.randn(3, 10, requires_grad=True, device=KDEV)
    w = torch.randn(10, device=KDEV)
    rms_norm(x, w).sum().backward()
    assert x.grad is not None and w.grad is None


def test_autograd_function_is_the_public_path():
    x = torch.randn(2, 8, requires_grad=True, device=KDEV)
    w = torch.randn(8, requires_grad=True, device=KDEV)
    assert rms_norm(x, w).grad_fn.name() == RMSNormFunction.__name__ + "Backward"


@settings(max_examples=8, deadline=None)
@given(rows=st.integers(1, 40), n=st.integers(1, 700), scale=st.floats(1e-3, 1e3))
def test_random_shapes(rows, n, scale):
    g = torch.Generator(device="cpu").manual_seed(rows * 1000 + n)  # the same numbers on every machine
    x = (torch.randn(rows, n, generator=g, device="cpu") * scale).to(KDEV)
    w = torch.randn(n, generator=g, device="cpu").to(KDEV)
    torch.testing.assert_close(rms_norm(x, w), reference.rms_norm(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "x, w, eps, exc, match",
    [
        ("not a tensor", torch.ones(4), 1e-5, TypeError, "x must be a torch.Tensor"),
        (torch.ones(2, 4, dtype=torch.int32), torch.ones(4), 1e-5, TypeError, "x must have dtype"),
        (torch.ones(2, 4), torch.ones(5), 1e-5, ValueError, "weight must have shape"),
        (torch.ones(2, 4), torch.ones(2, 4), 1e-5, ValueError, "weight must have 1 dimensions"),
        (torch.ones(4, 2).T, torch.ones(4), 1e-5, ValueError, "x must be contiguous in its last dimension"),
        (torch.ones(2, 4), torch.ones(4), -1.0, ValueError, "eps must be"),
        (torch.ones(2, 4), torch.ones(4), float("nan"), ValueError, "eps must be"),
        (torch.ones(2, 0), torch.ones(0), 1e-5, ValueError, "non-empty last dimension"),
        (torch.ones(1, 70000), torch.ones(70000), 1e-5, ValueError, "supports up to"),
    ],
)
def test_bad_inputs(x, w, eps, exc, match):
    # The table's tensors are made at import; the launcher sees them on the kernel device
    # (.to keeps the strides, so the transposed case stays non-contiguous).
    x, w = (t.to(KDEV) if isinstance(t, torch.Tensor) else t for t in (x, w))
    with pytest.raises(exc, match=match):
        rms_norm(x, w, eps)


def test_bad_device(kdev, off_device):
    # The wrong device is the one the kernels do not run on: meta in the interpreter, cpu on a GPU.
    x, w = torch.ones(2, 4, device=off_device), torch.ones(4, device=off_device)
    with pytest.raises(ValueError, match=f"x must be on {kdev.type}, got {off_device.type}"):
        rms_norm(x, w, 1e-5)


def test_backward_launcher_validates():
    from llmu.layers.rmsnorm import rms_norm_backward, rms_norm_forward

    x, w = torch.randn(3, 8, device=KDEV), torch.randn(8, device=KDEV)
    _, rstd = rms_norm_forward(x, w)
    with pytest.raises(ValueError, match="dy must have x's shape"):
        rms_norm_backward(torch.randn(3, 9, device=KDEV), x, w, rstd)
    with pytest.raises(ValueError, match="rstd must have shape"):
        rms_norm_backward(torch.randn(3, 8, device=KDEV), x, w, rstd[:2])
    with pytest.raises(TypeError, match="rstd must have dtype"):
        rms_norm_backward(torch.randn(3, 8, device=KDEV), x, w, rstd.double())
