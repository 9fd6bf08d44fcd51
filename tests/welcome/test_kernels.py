"""Module 00 kernels (vector add, row softmax) against torch, on the kernel device: CPU tensors in
Triton's interpreter, CUDA tensors when the kernels are compiled on a GPU."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings, strategies as st

import llmu  # noqa: F401  (sets the Triton mode before triton is imported)
from llmu.runtime import interpreting, kernel_device
from llmu.welcome import add, naive_softmax, softmax, stable_softmax

pytestmark = pytest.mark.kernels

KDEV = kernel_device()

# Tolerances.
# add: float32 and float16 sums are formed in float32 and rounded once, which is exactly what
# torch does, so they must match bit for bit. Triton's CPU interpreter converts float32 to
# bfloat16 by truncation instead of round-to-nearest, so a bfloat16 sum may be off the exact
# (float32) sum by up to one bf16 ulp: bf16 keeps 8 significant bits, so that is 2**-7 relative.
# (Compiled on a GPU the conversion rounds to nearest like torch's, so the bound holds with margin.)
# softmax: float32 is compared with 1e-6 absolute / 1e-5 relative: the kernel and torch sum the
# exponentials in a different order (and the blocked kernel rescales partial sums), which moves
# the result by a few float32 ulps. 16-bit outputs are compared in float32 against the float32
# softmax of the same inputs, to within one rounding of the output dtype (plus the interpreter's
# bf16 truncation: 2 ulps).
SOFTMAX_TOL = {torch.float32: (1e-6, 1e-5), torch.float16: (1e-3, 1e-3), torch.bfloat16: (8e-3, 8e-3)}


def _randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    # Drawn on the CPU from a seeded CPU generator (the same numbers on every machine), then moved
    # to the kernel device.
    g = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randn(*shape, generator=g, device="cpu") * scale).to(dtype).to(KDEV)


# ------------------------------------------------------------------------------------------- add


@pytest.mark.parametrize("n", [1, 7, 1000, 1024, 4097, 100_003])
@pytest.mark.parametrize("block_size", [16, 1024])
def test_add_matches_torch_fp32(n, block_size):
    x, y = _randn(n, seed=1), _randn(n, seed=2)
    assert torch.equal(add(x, y, block_size=block_size), x + y)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_add_half_precision(dtype):
    x, y = _randn(4097, dtype=dtype, seed=1), _randn(4097, dtype=dtype, seed=2)
    out = add(x, y)
    assert out.dtype == dtype and out.shape == x.shape
    if dtype == torch.float16:
        assert torch.equal(out, x + y)
    else:
        torch.testing.assert_close(out.float(), x.float() + y.float(), atol=0, rtol=2**-7)


@pytest.mark.skipif(
    interpreting(),
    reason="compiled only: Triton's CPU interpreter converts float32 to bfloat16 by truncation "
    "(test_add_half_precision allows for it); compiled kernels round to nearest, like torch",
)
def test_add_bf16_is_exact_when_compiled():
    # The kernel adds in float32 and rounds once, as torch does: on a GPU, bf16 matches bit for bit.
    x, y = _randn(100_003, dtype=torch.bfloat16, seed=1), _randn(100_003, dtype=torch.bfloat16, seed=2)
    assert torch.equal(add(x, y), x + y)


def test_add_keeps_shape_of_contiguous_nd_tensors():
    x, y = _randn(3, 5, 7, seed=1), _randn(3, 5, 7, seed=2)
    assert torch.equal(add(x, y, block_size=32), x + y)


def test_add_empty():
    x = torch.empty(0, device=KDEV)
    assert add(x, x).shape == (0,)


def test_add_does_not_write_past_the_end():
    # The output is a view into a larger buffer; the masked tail must leave the rest untouched.
    n, block = 1000, 256
    x, y = _randn(n, seed=1), _randn(n, seed=2)
    buf = torch.full((n + 50,), 123.0, device=KDEV)
    # add allocates its own output, so check through the kernel directly.
    from llmu.welcome.kernels import _add_kernel

    _add_kernel[((n + block - 1) // block,)](x, y, buf, n, BLOCK_SIZE=block)
    assert torch.equal(buf[:n], x + y)
    assert torch.all(buf[n:] == 123.0)


@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 5000), log_block=st.integers(4, 11))
def test_add_random_sizes(n, log_block):
    x, y = _randn(n, seed=n), _randn(n, seed=n + 1)
    assert torch.equal(add(x, y, block_size=2**log_block), x + y)


def test_add_bad_inputs(kdev, off_device):
    x = torch.randn(8, device=kdev)
    with pytest.raises(ValueError, match="y must have the shape"):
        add(x, torch.randn(9, device=kdev))
    with pytest.raises(TypeError, match="y has dtype"):
        add(x, torch.randn(8, dtype=torch.float16, device=kdev))
    with pytest.raises(TypeError, match="x must have dtype"):
        add(torch.arange(8, device=kdev), torch.arange(8, device=kdev))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        add([1.0] * 8, x)
    with pytest.raises(ValueError, match="x must be contiguous"):
        add(torch.randn(4, 4, device=kdev).t(), torch.randn(4, 4, device=kdev))
    with pytest.raises(ValueError, match=f"y must be on {kdev.type}, got {off_device.type}"):
        add(x, torch.randn(8, device=off_device))
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        add(x, x, block_size=100)
    with pytest.raises(ValueError, match="block_size must be positive"):
        add(x, x, block_size=0)


# --------------------------------------------------------------------------------------- softmax


@pytest.mark.parametrize(
    "shape",
    [(1, 1), (1, 7), (3, 1000), (2, 1024), (2, 4097), (1, 10_000), (33, 65), (7,)],
)
def test_softmax_matches_torch_fp32(shape):
    x = _randn(*shape, seed=3, scale=3.0)
    atol, rtol = SOFTMAX_TOL[torch.float32]
    torch.testing.assert_close(softmax(x), torch.softmax(x, dim=-1), atol=atol, rtol=rtol)


@pytest.mark.parametrize("block_size", [16, 64, 128, 1024, 4096])
def test_softmax_block_size_does_not_change_the_result(block_size):
    # Rows of 1000 columns: several blocks (16..128, the online-softmax path), one block with a
    # ragged tail (1024) and one block mostly masked (4096).
    x = _randn(4, 1000, seed=4, scale=5.0)
    atol, rtol = SOFTMAX_TOL[torch.float32]
    torch.testing.assert_close(softmax(x, block_size=block_size), torch.softmax(x, -1), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_softmax_half_precision(dtype):
    x = _randn(5, 777, dtype=dtype, seed=5, scale=4.0)
    out = softmax(x)
    assert out.dtype == dtype
    atol, rtol = SOFTMAX_TOL[dtype]
    torch.testing.assert_close(out.float(), torch.softmax(x.float(), -1), atol=atol, rtol=rtol)


@pytest.mark.parametrize("offset", [1000.0, -1000.0, 1e30])
def test_softmax_large_scores_are_stable(offset):
    x = _randn(3, 300, seed=6) + offset
    out = softmax(x, block_size=64)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, torch.softmax(x, -1), atol=1e-6, rtol=1e-5)
    # ... where the textbook formula overflows (exp(+1000) = inf) or underflows (0 / 0).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert not torch.isfinite(naive_softmax(x)).all()


def test_softmax_rows_sum_to_one_and_handle_minus_inf():
    x = _randn(4, 5000, seed=7)
    x[0, :4500] = -float("inf")  # the first blocks of this row are entirely -inf
    x[1, 10:] = -float("inf")
    out = softmax(x, block_size=1024)
    torch.testing.assert_close(out.sum(-1), torch.ones(4, device=KDEV), atol=1e-5, rtol=0)
    torch.testing.assert_close(out, torch.softmax(x, -1), atol=1e-6, rtol=1e-5)
    assert torch.all(out[0, :4500] == 0)


def test_softmax_all_minus_inf_row_is_nan_like_torch():
    x = torch.full((2, 10), -float("inf"), device=KDEV)
    x[1] = 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy reports 0/0 in the interpreter
        out = softmax(x)
    assert torch.isnan(out[0]).all() and torch.isnan(torch.softmax(x, -1)[0]).all()
    torch.testing.assert_close(out[1], torch.full((10,), 0.1, device=KDEV))


def test_softmax_strided_rows():
    # Rows of a wider matrix: row stride 64, last dimension contiguous.
    x = _randn(6, 64, seed=8)[:, 3:50]
    assert not x.is_contiguous()
    torch.testing.assert_close(softmax(x), torch.softmax(x, -1), atol=1e-6, rtol=1e-5)


def test_stable_reference_matches_torch():
    x = _randn(3, 100, seed=9, scale=100.0)
    torch.testing.assert_close(stable_softmax(x), torch.softmax(x, -1))


@settings(max_examples=12, deadline=None)
@given(m=st.integers(1, 6), n=st.integers(1, 3000), scale=st.sampled_from([0.1, 1.0, 30.0, 1000.0]))
def test_softmax_random_shapes(m, n, scale):
    x = _randn(m, n, seed=m * 7919 + n, scale=scale)
    torch.testing.assert_close(softmax(x), torch.softmax(x, -1), atol=1e-6, rtol=1e-5)


def test_softmax_bad_inputs(kdev, off_device):
    with pytest.raises(ValueError, match="x must have 1 or 2 dimensions"):
        softmax(torch.randn(2, 3, 4, device=kdev))
    with pytest.raises(TypeError, match="x must have dtype"):
        softmax(torch.ones(3, 4, dtype=torch.float64, device=kdev))
    with pytest.raises(ValueError, match="x must be contiguous in its last dimension"):
        softmax(torch.randn(8, 8, device=kdev).t())
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        softmax(torch.randn(2, 8, device=kdev), block_size=48)
    with pytest.raises(ValueError, match=f"x must be on {kdev.type}, got {off_device.type}"):
        softmax(torch.randn(2, 8, device=off_device))


# ------------------------------------------- softmax over rows longer than a block (notebook 00, exercise 4)
# The launcher fixes the block and the kernel walks the row: the online softmax of _softmax_kernel.


@pytest.mark.parametrize("n_cols", [1, 1023, 1024, 1025, 3 * 1024 + 17])
def test_softmax_rows_around_a_block_of_1024(n_cols):
    # One column; one lane short of a block; exactly a block; one column into a second block; three
    # blocks and a ragged tail of 17.
    x = _randn(3, n_cols, seed=n_cols, scale=3.0)
    atol, rtol = SOFTMAX_TOL[torch.float32]
    torch.testing.assert_close(softmax(x, block_size=1024), torch.softmax(x, -1), atol=atol, rtol=rtol)


def test_softmax_100k_columns():
    # 98 blocks of 1024, the last 672 columns wide; the maximum rises in many of them.
    x = _randn(2, 100_000, seed=11, scale=3.0)
    atol, rtol = SOFTMAX_TOL[torch.float32]
    torch.testing.assert_close(softmax(x, block_size=1024), torch.softmax(x, -1), atol=atol, rtol=rtol)


def test_softmax_100k_nearly_equal_fp16_scores_sum_in_float32():
    # The sum of exponentials is about 100,000, beyond float16's largest value (65,504): only a float32
    # sum gives probabilities of about 1e-5 here (a float16 one gives inf, and zeros). The output is
    # one rounding to float16 of float32's softmax; 1e-6 absolute covers float16's subnormal spacing
    # (6e-8) at these values.
    x = _randn(2, 100_000, dtype=torch.float16, seed=12, scale=0.01)
    out = softmax(x, block_size=1024)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), torch.softmax(x.float(), -1), atol=1e-6, rtol=1e-3)


def test_softmax_minus_inf_across_blocks():
    x = _randn(4, 3000, seed=13, scale=3.0)
    x[0, :2048] = -float("inf")  # the first two blocks of 1024 are -inf only
    x[1, ::3] = -float("inf")
    x[2] = -float("inf")
    x[2, 1500] = 5.0             # one finite score, in the middle block
    x[3] = -float("inf")         # no finite score: NaN, as torch.softmax gives
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy reports -inf - (-inf) in the interpreter
        out = softmax(x, block_size=1024)
    torch.testing.assert_close(out[:3], torch.softmax(x[:3], -1), atol=1e-6, rtol=1e-5)
    one_hot = torch.zeros(3000, device=KDEV)
    one_hot[1500] = 1.0
    assert torch.equal(out[2], one_hot)
    assert torch.isnan(out[3]).all()


def test_softmax_scores_that_jump_between_blocks():
    # From -1000 to +1000 after the first block (the sum so far is rescaled by exp(-2000) = 0) and
    # from +1000 to -1000 (the maximum must stay that of the row so far); and 1e4 * N(0, 1).
    x = _randn(3, 3000, seed=14)
    x[0, :1024] -= 1000.0
    x[0, 1024:] += 1000.0
    x[1, :1024] += 1000.0
    x[1, 1024:] -= 1000.0
    x[2] *= 1e4
    out = softmax(x, block_size=1024)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, torch.softmax(x, -1), atol=1e-6, rtol=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert not torch.isfinite(naive_softmax(x)).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_softmax_half_precision_in_blocks(dtype):
    x = _randn(3, 3000, dtype=dtype, seed=15, scale=4.0)
    out = softmax(x, block_size=256)
    assert out.dtype == dtype
    atol, rtol = SOFTMAX_TOL[dtype]
    torch.testing.assert_close(out.float(), torch.softmax(x.float(), -1), atol=atol, rtol=rtol)
