"""The Triton softmax-with-temperature kernel against llmu's torch reference and torch.softmax.

Tolerances. In float32 the kernel and the references compute the same exp() and sum in a
different order, so probabilities (all in [0, 1]) differ by a few units in the last place:
``atol=1e-6`` with a small ``rtol`` covers that with margin. In float16/bfloat16 the output is
rounded to the dtype, so one rounding step of the largest probability (eps/2 relative: 2^-11 for
fp16, 2^-8 for bf16, on values <= 1) is allowed. Compiled on a GPU, ``tl.exp`` of fp32 may use the
hardware's exp2 approximation, a couple of ulps: inside the same bounds.

Inputs are made on ``kernel_device()`` (cpu in the interpreter, cuda when compiled); the
references run on the same tensors.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import llmu  # noqa: F401  (sets the Triton mode before triton is imported)
from llmu.attention import kernels, reference
from llmu.attention.kernels import SOFTMAX_ONE_BLOCK_MAX
from llmu.runtime import kernel_device

pytestmark = pytest.mark.kernels

KDEV = kernel_device()  # cpu in Triton's interpreter, cuda when the kernels are compiled

F32 = dict(atol=1e-6, rtol=1e-5)
LOW = {torch.float16: dict(atol=1e-3, rtol=1e-3), torch.bfloat16: dict(atol=8e-3, rtol=8e-3)}


def _expected(x, temperature=1.0, dim=-1):
    return torch.softmax(x.double() / temperature, dim=dim)


@pytest.mark.parametrize(
    "shape",
    [
        (1, 1),                             # a single logit: probability 1
        (1, 7),                             # batch 1, ragged row (not a power of two)
        (3, 1000),
        (2, 3, 129),                        # leading dimensions are flattened into rows
        (2, SOFTMAX_ONE_BLOCK_MAX),         # the largest row held in one block
        (2, SOFTMAX_ONE_BLOCK_MAX + 1),     # the smallest streamed row: a 1-column last block
        (3, 49152),                         # SmolLM2's vocabulary: a streamed row of 12 blocks
    ],
)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_reference_and_torch(shape, temperature):
    torch.manual_seed(0)
    x = torch.randn(shape, device=KDEV) * 4
    y = kernels.softmax(x, temperature)
    assert y.shape == x.shape and y.dtype == x.dtype
    torch.testing.assert_close(y, reference.softmax(x, -1, temperature), **F32)
    torch.testing.assert_close(y.double(), _expected(x, temperature), **F32)
    # Each row is a probability distribution.
    torch.testing.assert_close(y.double().sum(-1), torch.ones(shape[:-1], dtype=torch.float64, device=KDEV), atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [100, SOFTMAX_ONE_BLOCK_MAX + 100])
def test_low_precision(dtype, n):
    torch.manual_seed(1)
    x = (torch.randn(4, n, device=KDEV) * 3).to(dtype)
    y = kernels.softmax(x, 0.8)
    assert y.dtype == dtype
    # The reference for a low-precision input: the exact softmax of the values it holds.
    torch.testing.assert_close(y.double(), _expected(x.double(), 0.8), **LOW[dtype])


@pytest.mark.parametrize("n", [3, 20000])
def test_large_scores_stay_finite(n):
    # exp(1000) overflows float32 (max ~ 3.4e38 ~ exp(88.7)): only the max-subtraction saves it.
    x = torch.arange(n, dtype=torch.float32, device=KDEV)[None, :] + 1000.0
    y = kernels.softmax(x)
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y.double(), _expected(x), **F32)
    x = torch.randn(3, n, device=KDEV) * 1e4
    torch.testing.assert_close(kernels.softmax(x).double(), _expected(x), **F32)


def test_large_negative_scores():
    x = torch.tensor([[-1000.0, -1001.0, -1002.0]], device=KDEV)
    torch.testing.assert_close(kernels.softmax(x).double(), _expected(x), **F32)


@pytest.mark.parametrize("n", [50, 10000])
def test_small_temperature_approaches_argmax(n):
    torch.manual_seed(2)
    x = torch.randn(4, n, device=KDEV)
    winners = torch.randint(0, n, (4,), device=KDEV)
    x[torch.arange(4, device=KDEV), winners] = x.amax(-1) + 0.05  # a clear best logit, 0.05 above the rest
    y = kernels.softmax(x, 1e-3)
    torch.testing.assert_close(y.double(), _expected(x, 1e-3), **F32)
    # At T = 1e-3 a gap of 0.05 is a factor exp(-50) per rival: all the mass is on the winner.
    assert (y.argmax(-1) == winners).all()
    assert (y.amax(-1) > 0.999).all()


@pytest.mark.parametrize("n", [50, 10000])
def test_large_temperature_approaches_uniform(n):
    torch.manual_seed(3)
    x = torch.randn(4, n, device=KDEV)
    y = kernels.softmax(x, 100.0)
    torch.testing.assert_close(y.double(), _expected(x, 100.0), atol=1e-8, rtol=1e-5)
    # |x| < 6, so at T = 100 every probability is within exp(+-0.12) of 1/n.
    assert ((y * n - 1).abs() < 0.13).all()


@pytest.mark.parametrize("n", [10, 3 * 4096 + 5])
def test_masked_logits(n):
    # Logits set to -inf (a top-k filter, a causal mask) get probability exactly 0; a row whose
    # first blocks are all -inf (the streamed case) must not turn into NaN.
    torch.manual_seed(4)
    x = torch.randn(2, n, device=KDEV)
    x[:, : n // 2 + 1] = -float("inf")
    y = kernels.softmax(x)
    assert (y[:, : n // 2 + 1] == 0).all()
    torch.testing.assert_close(y.double(), _expected(x), **F32)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's -inf - -inf
@pytest.mark.parametrize("n", [10, SOFTMAX_ONE_BLOCK_MAX + 10])
def test_all_masked_row_is_nan_like_torch(n):
    x = torch.full((2, n), -float("inf"), device=KDEV)
    x[1, 3] = 0.0
    y = kernels.softmax(x)
    assert torch.isnan(y[0]).all() and torch.isnan(torch.softmax(x, -1)[0]).all()
    assert y[1, 3] == 1.0 and y[1].sum() == 1.0


@pytest.mark.parametrize("dim", [0, 1, -2])
def test_other_dims_and_strided_input(dim):
    torch.manual_seed(5)
    x = torch.randn(6, 50, 3, device=KDEV).transpose(0, 1)  # not contiguous
    torch.testing.assert_close(kernels.softmax(x, 2.0, dim=dim).double(), _expected(x, 2.0, dim), **F32)


def test_empty_input():
    assert kernels.softmax(torch.empty(0, 5, device=KDEV)).shape == (0, 5)


def test_backward_matches_torch():
    torch.manual_seed(6)
    x = torch.randn(3, 9000, device=KDEV, requires_grad=True)
    dy = torch.randn(3, 9000, device=KDEV)
    y = kernels.softmax(x, 0.5)
    (gx,) = torch.autograd.grad(y, x, dy)
    x2 = x.detach().requires_grad_()
    (gx2,) = torch.autograd.grad(torch.softmax(x2 / 0.5, -1), x2, dy)
    torch.testing.assert_close(gx, gx2, atol=1e-6, rtol=1e-4)


@settings(max_examples=20, deadline=None)
@given(
    rows=st.integers(1, 4),
    cols=st.one_of(st.integers(1, 300), st.integers(SOFTMAX_ONE_BLOCK_MAX - 3, SOFTMAX_ONE_BLOCK_MAX + 4200)),
    temperature=st.floats(0.05, 20.0),
    scale=st.floats(0.1, 50.0),
    seed=st.integers(0, 2**16),
)
def test_random_shapes(rows, cols, temperature, scale, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = (torch.randn(rows, cols, generator=g, device="cpu") * scale).to(KDEV)
    # fp32 rounds z = x / T to a relative 6e-8, an absolute error of about 6e-8 * |z|, and
    # exp() turns that into the same *relative* error in each probability. With |z| up to
    # 50 * 4 / 0.05 = 4000 that is ~2.4e-4, far above F32's rtol, and not the kernel's fault: the
    # tolerance grows with the largest |z| of the example (4 ulps of it, never below F32).
    z_max = (x.abs().max() / temperature).item()
    rtol = max(F32["rtol"], 4 * torch.finfo(torch.float32).eps * z_max)
    torch.testing.assert_close(kernels.softmax(x, temperature).double(), _expected(x, temperature),
                               atol=F32["atol"], rtol=rtol)


# ---- bad inputs: every one is refused with a message naming the argument ----------------------


@pytest.mark.parametrize("temperature", [0, 0.0, -1.0])
def test_non_positive_temperature(temperature):
    with pytest.raises(ValueError, match="temperature must be positive"):
        kernels.softmax(torch.randn(2, 3, device=KDEV), temperature)


@pytest.mark.parametrize("temperature", [math.inf, math.nan])
def test_non_finite_temperature(temperature):
    with pytest.raises(ValueError, match="temperature"):
        kernels.softmax(torch.randn(2, 3, device=KDEV), temperature)


@pytest.mark.parametrize("temperature", [True, "1.0", None, torch.tensor(1.0)])
def test_temperature_must_be_a_number(temperature):
    with pytest.raises(TypeError, match="temperature"):
        kernels.softmax(torch.randn(2, 3, device=KDEV), temperature)


def test_not_a_tensor():
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        kernels.softmax([[1.0, 2.0]])


@pytest.mark.parametrize("dtype", [torch.int64, torch.float64, torch.bool])
def test_unsupported_dtype(dtype):
    with pytest.raises(TypeError, match="x must have dtype"):
        kernels.softmax(torch.zeros(2, 3, dtype=dtype, device=KDEV))


def test_zero_dim_tensor():
    with pytest.raises(ValueError, match="at least one dimension"):
        kernels.softmax(torch.tensor(1.0, device=KDEV))


@pytest.mark.parametrize("dim", [2, -3])
def test_dim_out_of_range(dim):
    with pytest.raises(ValueError, match="dim"):
        kernels.softmax(torch.randn(2, 3, device=KDEV), dim=dim)


def test_wrong_device(kdev, off_device):
    # A tensor on a device the kernel cannot read: PyTorch's data-less "meta" device in the
    # interpreter, a CPU tensor when the kernels are compiled for the GPU.
    with pytest.raises(ValueError, match=f"x must be on {kdev.type}, got {off_device.type}"):
        kernels.softmax(torch.empty(2, 3, device=off_device))
