"""llmu.roofline.kernels: the tiled Triton matmul against torch, in Triton's interpreter here.

Tolerances. float32: the kernel and torch sum the same products in another order (other tiles,
another reduction tree); over K of a few hundred that moves the last bits of float32's 24, about
1e-6 of the largest partial sum, so 1e-4 relative and absolute leaves room and still catches a
single wrong product. float16: products of two float16 numbers are exact in float32 and the
kernel sums them in float32, so its result is the exact sum rounded once to float16, within half a
unit in the last place (2**-11 relative, 4.9e-4): compared with the float32 product of the same
inputs, rtol 1e-3 allows two such units. (A float16 accumulator would be off by several: see the
notebook's exercise 5.)
"""

from __future__ import annotations

import pytest
import torch

import llmu  # noqa: F401  (Triton mode first)
from llmu import runtime
from llmu.roofline import kernels as K
from llmu.roofline.kernels import Tiles, default_tiles, fit_tiles, matmul, shared_memory_bytes

DEV = runtime.kernel_device()
TOL32 = dict(rtol=1e-4, atol=1e-4)
TOL16 = dict(rtol=1e-3, atol=1e-3)


def _rand(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEV, dtype)


def _expected(a, b):
    return (a.double() @ b.double())


@pytest.mark.parametrize("m, k, n", [(1, 1, 1), (1, 17, 33), (17, 33, 100), (100, 17, 33), (33, 100, 1),
                                     (64, 64, 64), (100, 100, 100), (65, 5, 97)])
def test_matches_torch_on_ragged_shapes(m, k, n):
    """M, N, K of 1, 17, 33, 100: ragged against the interpreter's 32 x 32 x 32 tiles, K smaller
    than BLOCK_K (5), exactly one tile (64), a last group of one row of tiles (65 rows: 3 row tiles
    with GROUP_M = 2)."""
    a, b = _rand(m, k), _rand(k, n, seed=1)
    c = matmul(a, b)
    assert c.shape == (m, n) and c.dtype == torch.float32
    torch.testing.assert_close(c.double(), _expected(a, b), **TOL32)


def test_float16_accumulates_in_float32():
    """2048 positive products per output: a float32 accumulator keeps the result within two units
    in the last place of float16."""
    g = torch.Generator(device="cpu").manual_seed(2)
    a = torch.rand(40, 2048, generator=g).to(DEV, torch.float16)
    b = torch.rand(2048, 24, generator=g).to(DEV, torch.float16)
    c = matmul(a, b)
    assert c.dtype == torch.float16
    torch.testing.assert_close(c.double(), _expected(a, b), **TOL16)
    a, b = _rand(70, 45, dtype=torch.float16), _rand(33, 45, seed=1, dtype=torch.float16).t()   # ragged, b a view
    torch.testing.assert_close(matmul(a, b).double(), _expected(a, b), **TOL16)


def test_transposed_views_and_slices_are_read_through_their_strides():
    w = _rand(50, 70)                                   # (N, K), a linear layer's weight
    x = _rand(37, 70, seed=1)
    torch.testing.assert_close(matmul(x, w.t()).double(), _expected(x, w.t()), **TOL32)   # x @ W^T
    at = _rand(70, 37, seed=2).t()                      # a transposed A too
    torch.testing.assert_close(matmul(at, w.t()).double(), _expected(at, w.t()), **TOL32)
    big = torch.full((80, 90), float("nan"), device=DEV)
    big[:45, :60] = _rand(45, 60, seed=3)
    a = big[:45, :60]                                   # a slice of a larger buffer: NaN past K
    b = _rand(60, 20, seed=4)
    torch.testing.assert_close(matmul(a, b).double(), _expected(a, b), **TOL32)


def test_out_is_written_in_place_and_only_inside():
    a, b = _rand(45, 60), _rand(60, 37, seed=1)
    big = torch.full((60, 50), -7.0, device=DEV)
    out = big[10:55, 5:42]
    assert matmul(a, b, out=out) is out
    torch.testing.assert_close(out.double(), _expected(a, b), **TOL32)
    outside = torch.ones_like(big, dtype=torch.bool)
    outside[10:55, 5:42] = False
    assert (big[outside] == -7.0).all()
    # float32 output of float16 inputs
    a16, b16 = a.half(), b.half()
    out32 = matmul(a16, b16, out=torch.empty(45, 37, device=DEV))
    torch.testing.assert_close(out32.double(), _expected(a16, b16), **TOL32)


@pytest.mark.parametrize("tiles", [Tiles(16, 16, 16, GROUP_M=1), Tiles(16, 64, 32, GROUP_M=3),
                                   Tiles(64, 16, 16, GROUP_M=8), dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=64,
                                                                      GROUP_M=4, num_warps=8, num_stages=4)])
def test_tile_variants_give_the_same_result(tiles):
    a, b = _rand(70, 90), _rand(90, 100, seed=1)
    ref = matmul(a, b)
    torch.testing.assert_close(matmul(a, b, tiles=tiles), ref, **TOL32)


def test_empty_dimensions():
    assert matmul(_rand(0, 5), _rand(5, 3)).shape == (0, 3)
    assert matmul(_rand(4, 5), _rand(5, 0)).shape == (4, 0)
    assert (matmul(_rand(4, 0), _rand(0, 3)) == 0).all()     # K = 0: an empty sum


def test_bad_inputs_raise_naming_the_argument():
    a, b = _rand(4, 5), _rand(5, 3)
    with pytest.raises(ValueError, match="b must have as many rows"):
        matmul(a, _rand(4, 3))
    with pytest.raises(ValueError, match="a must have 2 dimensions"):
        matmul(_rand(2, 4, 5), b)
    with pytest.raises(TypeError, match="a must be a torch.Tensor"):
        matmul([[1.0]], b)
    with pytest.raises(TypeError, match="b has dtype torch.float16 but a has torch.float32"):
        matmul(a, b.half())
    with pytest.raises(TypeError, match="a must have dtype float32, float16, bfloat16; got int64"):
        matmul(a.long(), b.long())
    with pytest.raises(ValueError, match=r"out must have shape \(M, N\) = \(4, 3\)"):
        matmul(a, b, out=torch.empty(3, 4, device=DEV))
    with pytest.raises(TypeError, match="out must have dtype float16, float32"):
        matmul(a.half(), b.half(), out=torch.empty(4, 3, device=DEV, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="tiles.BLOCK_K must be a power of two of at least 16"):
        matmul(a, b, tiles=dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=24))
    with pytest.raises(ValueError, match="tiles.BLOCK_M must be a power of two of at least 16"):
        matmul(a, b, tiles=Tiles(8, 32, 32))
    with pytest.raises(ValueError, match=r"tiles.num_warps must be one of \(1, 2, 4, 8, 16\)"):
        Tiles(32, 32, 32, num_warps=3)
    with pytest.raises(ValueError, match="tiles.num_stages must be an int from 1 to 6"):
        Tiles(32, 32, 32, num_stages=0)
    with pytest.raises(ValueError, match="tiles.GROUP_M must be a positive int"):
        Tiles(32, 32, 32, GROUP_M=0)
    with pytest.raises(ValueError, match="tiles: unknown keys"):
        matmul(a, b, tiles=dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, BLOCK_Z=1))
    with pytest.raises(TypeError, match="tiles must be a Tiles or a dict"):
        matmul(a, b, tiles=(32, 32, 32))


@pytest.mark.skipif(not runtime.interpreting(), reason="the interpreter refuses bfloat16; a GPU runs it")
def test_bfloat16_is_refused_in_the_interpreter():
    with pytest.raises(TypeError, match="a: bfloat16 needs a GPU"):
        matmul(_rand(4, 5, dtype=torch.bfloat16), _rand(5, 3, dtype=torch.bfloat16))


def test_shared_memory_formula_worked_example():
    """(BM*BK + BK*BN) * elem * stages: 128 x 256 x 64 in bf16, 3 stages = 144 KB (of an H100's 227)."""
    t = Tiles(128, 256, 64, GROUP_M=8, num_warps=8, num_stages=3)
    assert shared_memory_bytes(t, 2) == (128 * 64 + 64 * 256) * 2 * 3 == 147_456 == 144 * 1024
    assert shared_memory_bytes(t.as_dict(), 4) == 2 * 147_456
    assert shared_memory_bytes(t, 2) <= K.H100_SHARED_MEMORY == 227 * 1024
    with pytest.raises(ValueError, match="elem_bytes must be a positive int"):
        shared_memory_bytes(t, 0)


def test_fit_tiles_drops_stages_then_block_k():
    t = Tiles(128, 256, 64, GROUP_M=8, num_warps=8, num_stages=3)
    assert fit_tiles(t, 2, 227 * 1024) == t
    t75 = fit_tiles(t, 2, 64 * 1024)                     # a T4: 144 KB -> 48 KB with 1 stage
    assert (t75.num_stages, t75.BLOCK_K) == (1, 64) and shared_memory_bytes(t75, 2) == 48 * 1024
    tiny = fit_tiles(Tiles(256, 256, 128, num_stages=4), 2, 32 * 1024)
    assert (tiny.num_stages, tiny.BLOCK_K) == (1, 32) and shared_memory_bytes(tiny, 2) <= 32 * 1024


@pytest.mark.parametrize("cap, limit", [((9, 0), 227), ((8, 0), 163), ((8, 9), 99), ((7, 5), 64)])
def test_default_tiles_fit_each_gpu(cap, limit, monkeypatch):
    """What default_tiles picks for each GPU (the compiled shared memory is checked by
    ``llmu gpu-compile``): the tutorial's 128 x 256 x 64, 3 stages, wherever it fits."""
    monkeypatch.setattr(runtime, "capability", lambda: cap)
    monkeypatch.setattr(K, "shared_memory_limit", lambda: limit * 1024)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        t = default_tiles(dtype)
        elem = torch.empty((), dtype=dtype).element_size()
        assert shared_memory_bytes(t, elem) <= limit * 1024
        if elem == 2 and cap >= (8, 0) and limit >= 144:
            assert t == Tiles(128, 256, 64, GROUP_M=8, num_warps=8, num_stages=3)
        if elem == 2 and cap >= (8, 0):
            assert t.num_stages >= 3 and t.BLOCK_M * t.BLOCK_N >= 128 * 128
        if elem == 4:
            assert t.BLOCK_M * t.BLOCK_N <= 64 * 64


def test_interpreter_tiles_are_small():
    if runtime.interpreting():
        assert default_tiles(torch.float32) == default_tiles(torch.float16) == K.INTERPRETER_TILES
    assert K.INTERPRETER_TILES.BLOCK_M * K.INTERPRETER_TILES.BLOCK_N <= 32 * 32


def test_docstring_napkin_math():
    """The figures the module's docstring states, recomputed."""
    from llmu.bench.peaks import peak_for
    from llmu.roofline.model import gemm_bytes, gemm_flops

    h200 = peak_for("NVIDIA H200")
    n, e = 4096, 2
    flops, nbytes = gemm_flops(n, n, n), gemm_bytes(n, n, n, e)
    doc = " ".join(K.__doc__.split())
    assert f"{flops / 1e9:.1f} GFLOP, {flops / (h200.tflops['bfloat16'] * 1e12) * 1e3:.3f} ms" in doc
    assert f"{nbytes / 1e6:.1f} MB, {nbytes / (h200.bandwidth_gbs * 1e9) * 1e6:.0f} us" in doc
    assert f"Intensity {flops / nbytes:.0f} FLOP/byte" in doc
    assert f"ridge ({h200.tflops['bfloat16'] * 1e12 / (h200.bandwidth_gbs * 1e9):.0f})" in doc

    def loads(bm, bn):
        return e * n ** 3 * (1 / bn + 1 / bm)

    assert 2 * 16 * 16 / (e * 32) == 8
    assert f"{loads(16, 16) / 1e9:.1f} GB of loads, {loads(16, 16) / 4.8e12 * 1e3:.1f} ms" in doc
    assert f"{2 * 128 * 256 / (e * 384):.1f} FLOP/byte ({loads(128, 256) / 1e9:.1f} GB, " \
           f"{loads(128, 256) / 4.8e12 * 1e3:.2f} ms" in doc
    assert 128 * 256 * 4 == 128 * 1024 and 128 * 256 // (8 * 32) == 128 and 128 * 256 // (4 * 32) == 256
    assert "128 KB of registers, 128 per thread with 8 warps" in doc and "256 per thread" in doc
