"""Module 10's kernels: int4 and int8 weight-only matmuls == ``x @ dequantize(qt).T`` in torch.

Every case runs both code paths (GEMV and GEMM) on the same inputs, so the decode path is also
checked at M = 17 and the prefill path at M = 1.

Tolerances: in float32 the kernel and torch compute the same products (the dequantized weights
are exact functions of the codes, scales and zeros) summed in a different order, and the GEMV
applies a group's scale once to the group's sum: rounding only, a few ulps of a dot product of K
terms. With ``|x| ~ 1`` and ``|W| ~ 1`` the outputs are ~sqrt(K) in size, so atol 1e-4 (K <= 1536)
with rtol 1e-5 is several times the worst seen. Half precision (GPU only) is compared with the
float32 product of the same rounded ``x``: the GEMM rounds each dequantized weight to x's dtype
before ``tl.dot`` (bf16: 8 bits of mantissa) and the output is rounded once, so the error is
~2^-8 relative to ``sum |x| |W|``: atol 0.05 for bf16 and 0.01 for fp16 on outputs of size ~10.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from llmu import runtime
from llmu.quant import formats, kernels

pytestmark = pytest.mark.kernels

DEV = runtime.kernel_device()
ATOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}
RTOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def make(m, n, k, group_size, symmetric=False, dtype=torch.float32, seed=0, lead=()):
    """``x (*lead, M, K)`` on the kernel device and the RTN-quantized ``(N, K)`` weights."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    w = torch.randn(n, k, generator=g, device="cpu")
    x = torch.randn(*lead, m, k, generator=g, device="cpu").to(DEV, dtype)
    if group_size == k:
        qt = formats.quantize(w, 4, symmetric=symmetric, granularity="channel")
    else:
        qt = formats.quantize(w, 4, symmetric=symmetric, group_size=group_size)
    return x, qt


def args(qt):
    return qt.packed().to(DEV), qt.scale.to(DEV), qt.zero.to(DEV), qt.group_size


def ref(x, qt):
    """The float32 product the kernels must reproduce."""
    return x.float() @ formats.dequantize(qt).to(x.device).float().T


def check(y, x, qt, n):
    assert y.shape == (*x.shape[:-1], n) and y.dtype == x.dtype and y.device == x.device
    torch.testing.assert_close(y.float(), ref(x, qt), atol=ATOL[x.dtype], rtol=RTOL[x.dtype])


# (M, N, K, G): N and K off every block size; M = 1 / 3 / 17 / 128; groups of 32, 64, 128 and the
# whole row (per channel), including a row (K = 100) no tile size divides.
CASES = [
    (1, 100, 96, 32),
    (3, 70, 192, 64),
    (17, 33, 256, 128),
    (128, 40, 384, 128),
    (3, 50, 100, 100),        # per channel, K = 100: groups end inside tiles
    (1, 24, 256, 256),        # per channel, K a power of two: one group spans several tiles
    (17, 9, 64, 32),          # fewer outputs than a block
]


@pytest.mark.parametrize("m,n,k,g", CASES)
@pytest.mark.parametrize("symmetric", [False, True], ids=["asym", "sym"])
@pytest.mark.parametrize("path", ["gemv", "gemm"])
def test_int4_matches_dequantize_then_matmul(m, n, k, g, symmetric, path):
    x, qt = make(m, n, k, g, symmetric)
    check(kernels.int4_matmul(x, *args(qt), path=path), x, qt, n)


@pytest.mark.parametrize("m", [1, 3, 17])
def test_default_path_and_leading_dims(m):
    x, qt = make(m, 40, 128, 32, lead=(2,))
    y = kernels.int4_matmul(x, *args(qt))
    check(y, x, qt, 40)
    assert kernels.choose_path(m) == ("gemv" if m <= kernels.GEMV_MAX_M else "gemm")


def test_smollm2_shaped_layers():
    # the MLP's up projection (1536 x 576) at decode, its down projection (576 x 1536) at prefill
    x, qt = make(1, 1536, 576, 64)
    check(kernels.int4_matmul(x, *args(qt)), x, qt, 1536)
    x, qt = make(17, 576, 1536, 128, seed=1)
    check(kernels.int4_matmul(x, *args(qt)), x, qt, 576)


@pytest.mark.parametrize("code", [0, 15])
@pytest.mark.parametrize("path", ["gemv", "gemm"])
def test_extreme_codes(code, path):
    # every nibble 0 (or 15), and scales/zeros that vary by group: W[n, k] = (code - z) * s exactly
    n, k, g = 20, 128, 32
    qt = formats.QuantizedTensor(
        codes=torch.full((n, k), code, dtype=torch.uint8, device="cpu"),
        scale=torch.linspace(0.01, 2.0, n * k // g, device="cpu").reshape(n, k // g),
        zero=torch.arange(n * k // g, dtype=torch.float32, device="cpu").remainder(16).reshape(n, k // g),
        bits=4, group_size=g, symmetric=False, granularity="group")
    x = torch.randn(3, k, generator=torch.Generator(device="cpu").manual_seed(3), device="cpu").to(DEV)
    assert int(qt.packed()[0, 0]) == (0x00 if code == 0 else 0xFF)
    check(kernels.int4_matmul(x, *args(qt), path=path), x, qt, n)


@pytest.mark.parametrize("path", ["gemv", "gemm"])
def test_strided_inputs(path):
    # x a column slice, packed / scale / zero transposed copies: the launchers follow strides
    x, qt = make(3, 30, 64, 32)
    wide = torch.randn(3, 2 * 64, device=DEV)
    wide[:, ::2] = x
    xs = wide[:, ::2]
    packed, scale, zero, g = args(qt)
    packed_t = packed.T.contiguous().T
    assert not xs.is_contiguous() and not packed_t.is_contiguous()
    check(kernels.int4_matmul(xs, packed_t, scale.T.contiguous().T, zero, g, path=path), x, qt, 30)


@pytest.mark.parametrize("g,inside", [(32, True), (64, True), (128, True), (1024, True), (100, False), (2, False)])
def test_gemv_tile_fits_in_a_group_when_it_can(g, inside):
    # a tile inside one group applies the scale and zero once per row; otherwise per byte
    block_kh = kernels._gemv_blocks(4096, 4096, g)[1]
    assert block_kh >= 16 and (g % (2 * block_kh) == 0) == inside


def test_empty_batch():
    x, qt = make(0, 16, 64, 32)
    y = kernels.int4_matmul(x, *args(qt))
    assert y.shape == (0, 16)


@settings(max_examples=6, deadline=None)
@given(m=st.integers(1, 20), n=st.integers(1, 40), groups=st.integers(1, 3),
       g=st.sampled_from([2, 16, 32, 64]), symmetric=st.booleans(), seed=st.integers(0, 2**16))
def test_int4_random_shapes(m, n, groups, g, symmetric, seed):
    x, qt = make(m, n, groups * g, g, symmetric, seed=seed)
    for path in kernels.PATHS:
        check(kernels.int4_matmul(x, *args(qt), path=path), x, qt, n)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("path", ["gemv", "gemm"])
def test_half_precision_small(dtype, path):
    # one small case everywhere (the interpreter upcasts bfloat16 before tl.dot); the grid is GPU-only
    x, qt = make(5, 40, 128, 32, dtype=dtype)
    check(kernels.int4_matmul(x * 0.1, *args(qt), path=path), x * 0.1, qt, 40)
    x, codes, scale, q8 = make8(5, 40, 128, dtype=dtype)
    check(kernels.int8_matmul(x * 0.1, codes, scale, path=path), x * 0.1, q8, 40)


@pytest.mark.skipif(runtime.interpreting(), reason="half precision kernels are tested on a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k,g", CASES + [(1, 4096, 4096, 128), (512, 1000, 1536, 64)])
@pytest.mark.parametrize("path", ["gemv", "gemm"])
def test_int4_half_precision_on_gpu(dtype, m, n, k, g, path):
    x, qt = make(m, n, k, g, dtype=dtype)
    x = x * 0.1      # outputs of size ~sqrt(K) / 10: the tolerance is absolute
    check(kernels.int4_matmul(x, *args(qt), path=path), x, qt, n)


# ----------------------------------------------------------------------------------------------
# int8
# ----------------------------------------------------------------------------------------------


def make8(m, n, k, dtype=torch.float32, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    w = torch.randn(n, k, generator=g, device="cpu")
    qt = formats.quantize(w, 8, symmetric=True, granularity="channel")
    codes, scale = kernels.int8_codes(qt)
    return torch.randn(m, k, generator=g, device="cpu").to(DEV, dtype), codes.to(DEV), scale.to(DEV), qt


@pytest.mark.parametrize("m,n,k", [(1, 100, 96), (3, 70, 200), (17, 33, 257), (128, 40, 128), (1, 1536, 576)])
@pytest.mark.parametrize("path", ["gemv", "gemm"])
def test_int8_matches_dequantize_then_matmul(m, n, k, path):
    x, codes, scale, qt = make8(m, n, k)
    check(kernels.int8_matmul(x, codes, scale, path=path), x, qt, n)
    check(kernels.int8_matmul(x, codes, scale[:, None], path=path), x, qt, n)   # (N, 1) scales too


def test_int8_codes_are_the_signed_codes():
    qt = formats.quantize(torch.tensor([[-1.0, 0.0, 0.5, 1.0]], device="cpu"), 8, symmetric=True,
                          granularity="channel")
    codes, scale = kernels.int8_codes(qt)
    assert codes.dtype == torch.int8 and codes.tolist() == [[-127, 0, 64, 127]]
    torch.testing.assert_close(codes.float() * scale[:, None], formats.dequantize(qt))
    with pytest.raises(ValueError, match="8-bit symmetric"):
        kernels.int8_codes(formats.quantize(torch.randn(4, 8, device="cpu"), 4, group_size=4))
    with pytest.raises(ValueError, match="8-bit symmetric"):
        kernels.int8_codes(formats.quantize(torch.randn(4, 8, device="cpu"), 8, symmetric=False, granularity="channel"))


@pytest.mark.skipif(runtime.interpreting(), reason="half precision kernels are tested on a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k", [(1, 100, 96), (17, 33, 257), (1, 4096, 4096), (512, 1000, 1536)])
@pytest.mark.parametrize("path", ["gemv", "gemm"])
def test_int8_half_precision_on_gpu(dtype, m, n, k, path):
    x, codes, scale, qt = make8(m, n, k, dtype=dtype)
    x = x * 0.1
    check(kernels.int8_matmul(x, codes, scale, path=path), x, qt, n)


# ----------------------------------------------------------------------------------------------
# Bad inputs: every one a clear error naming the argument
# ----------------------------------------------------------------------------------------------


def test_int4_bad_inputs(off_device):
    x, qt = make(2, 16, 64, 32)
    packed, scale, zero, g = args(qt)
    call = kernels.int4_matmul
    with pytest.raises(TypeError, match="packed must have dtype uint8"):
        call(x, qt.codes.to(DEV).to(torch.int8)[:, :32], scale, zero, g)
    with pytest.raises(TypeError, match="scale must have dtype float32"):
        call(x, packed, scale.half(), zero, g)
    with pytest.raises(TypeError, match="zero must have dtype float32"):
        call(x, packed, scale, zero.double(), g)
    with pytest.raises(TypeError, match="x must have dtype"):
        call(x.to(torch.int32), packed, scale, zero, g)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        call(x.tolist(), packed, scale, zero, g)
    with pytest.raises(ValueError, match="x has 63 input features"):
        call(x[:, :63], packed, scale, zero, g)
    with pytest.raises(ValueError, match="x must have at least 1 dimension"):
        call(x[0, 0], packed, scale, zero, g)
    with pytest.raises(ValueError, match="packed must have 2 dimensions"):
        call(x, packed[None], scale, zero, g)
    with pytest.raises(ValueError, match="packed must hold at least one byte"):
        call(x[:, :0], packed[:, :0], scale, zero, g)
    with pytest.raises(ValueError, match="group_size 48 does not divide"):
        call(x, packed, scale, zero, 48)
    with pytest.raises(ValueError, match="group_size must be even"):
        call(x[:, :6], packed[:, :3], scale, zero, 3)
    for bad in (0, -32, 32.0, True, None):
        with pytest.raises(ValueError, match="group_size must be a positive int"):
            call(x, packed, scale, zero, bad)
    with pytest.raises(ValueError, match=r"scale must have shape \(N, K / group_size\)"):
        call(x, packed, scale[:, :1], zero, g)
    with pytest.raises(ValueError, match=r"zero must have shape \(N, K / group_size\)"):
        call(x, packed, scale, zero[:15], g)
    with pytest.raises(ValueError, match="scale must have shape"):
        call(x, packed, scale, zero, 64)          # a valid group size, but not the one scale was made for
    with pytest.raises(ValueError, match="path must be one of"):
        call(x, packed, scale, zero, g, path="gemm2")
    with pytest.raises(ValueError, match="path='gemv' runs one program per row"):
        call(torch.zeros(65536, 64, device=DEV), packed, scale, zero, g, path="gemv")
    dev = off_device.type
    with pytest.raises(ValueError, match=f"x must be on {DEV.type}"):
        call(x.to(off_device), packed, scale, zero, g)
    with pytest.raises(ValueError, match=f"packed must be on {DEV.type}"):
        call(x, packed.to(off_device), scale, zero, g)
    with pytest.raises(ValueError, match=f"scale must be on {DEV.type}"):
        call(x, packed, scale.to(off_device), zero, g)
    assert dev != DEV.type


def test_int8_bad_inputs(off_device):
    x, codes, scale, _ = make8(2, 16, 64)
    call = kernels.int8_matmul
    with pytest.raises(TypeError, match="codes must have dtype int8"):
        call(x, codes.to(torch.uint8), scale)
    with pytest.raises(TypeError, match="scale must have dtype float32"):
        call(x, codes, scale.half())
    with pytest.raises(ValueError, match="scale must have N = 16 entries"):
        call(x, codes, scale[:15])
    with pytest.raises(ValueError, match=r"scale must be \(N,\) or \(N, 1\)"):
        call(x, codes, scale[:, None].expand(16, 2))
    with pytest.raises(ValueError, match="x has 32 input features"):
        call(x[:, :32], codes, scale)
    with pytest.raises(ValueError, match="codes must be a non-empty"):
        call(x[:, :0], codes[:, :0], scale)
    with pytest.raises(ValueError, match="path must be one of"):
        call(x, codes, scale, path="auto")
    with pytest.raises(ValueError, match=f"codes must be on {DEV.type}"):
        call(x, codes.to(off_device), scale)
