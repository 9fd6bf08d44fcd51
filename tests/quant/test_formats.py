"""Module 10's formats: integer quantization, packing, FP8, GGUF blocks, representable values.

Tolerances:

- round to nearest: inside the range a group's codes cover, ``|w - dequantize(quantize(w))|`` is at
  most half a step, ``s / 2``; the check allows ``s / 2 * (1 + 1e-5)`` for float32 rounding of
  ``w / s`` and ``(q - z) * s``;
- zero (and any value that is a code) comes back exactly: ``(z - z) * s == 0`` in floating point;
- FP8: rounding to nearest keeps a relative error of at most half an ulp, ``2^-4`` for E4M3 (3
  mantissa bits) and ``2^-3`` for E5M2, for values in the normal range; ``to_fp8`` itself must equal
  torch's own cast bit for bit;
- min-max rounding (``quantize_minmax``): every value within half a step of its code, the group's
  minimum exactly (``0 * s + m``); on the file's Q4_1 tensors it finds the file's own codes again;
- GGUF: ``from_gguf`` + ``dequantize`` equals ``llmu.models.quants.dequantize`` bit for bit (same
  float32 operations in the same order); the ``(q - z) * s`` form with the float zero ``-m / d`` is
  within a few float32 ulps of it (``1e-6`` of the tensor's largest magnitude).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

import llmu  # noqa: F401
from llmu.models import GGUFFile, quants
from llmu.quant import formats
from llmu.quant.formats import (
    QuantizedTensor,
    dequantize,
    fake_quantize,
    from_fp8,
    from_gguf,
    pack_int4,
    quantize,
    quantize_minmax,
    representable_values,
    to_fp8,
    unpack_int4,
)


def _w(n, k, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * scale


def _steps(qt: QuantizedTensor) -> torch.Tensor:
    """The scale of every element, ``(N, K)``."""
    return qt.scale.repeat_interleave(qt.group_size, dim=1)


SHAPES = [(1, 32), (7, 96), (5, 128), (3, 384)]


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("granularity,group_size", [("tensor", 128), ("channel", 128), ("group", 32)])
@pytest.mark.parametrize("shape", SHAPES)
def test_round_trip_error_is_at_most_half_a_step(bits, symmetric, granularity, group_size, shape):
    w = _w(*shape, seed=bits)
    qt = quantize(w, bits, symmetric=symmetric, granularity=granularity, group_size=group_size)
    n, k = shape
    g = {"tensor": k, "channel": k, "group": group_size}[granularity]
    assert qt.codes.shape == (n, k) and qt.codes.dtype == torch.uint8
    assert qt.scale.shape == (n, k // g) == qt.zero.shape and qt.group_size == g
    assert int(qt.codes.max()) <= 2**bits - 1
    err = (w - dequantize(qt)).abs()
    assert (err <= _steps(qt) / 2 * (1 + 1e-5)).all()
    if granularity == "tensor":
        assert (qt.scale == qt.scale[0, 0]).all() and (qt.zero == qt.zero[0, 0]).all()
    if symmetric:
        assert (qt.zero == 2 ** (bits - 1)).all()
        assert int(qt.codes.min()) >= 1  # the lowest code is never used


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("bits", [3, 4, 8])
def test_zero_is_exact(symmetric, bits):
    w = _w(4, 64, seed=1)
    w[:, ::5] = 0.0
    deq = fake_quantize(w, bits, symmetric=symmetric, group_size=32)
    assert (deq[:, ::5] == 0).all()


def test_all_positive_group_still_represents_zero():
    w = _w(2, 32).abs() + 1.0  # min > 0: the range is widened to [0, max]
    qt = quantize(w, 4, group_size=32)
    assert (qt.zero == 0).all()
    assert (dequantize(qt) - w).abs().max() <= qt.scale.max() / 2 * (1 + 1e-5)


@pytest.mark.parametrize("symmetric", [False, True])
def test_zero_and_constant_groups_stay_finite(symmetric):
    w = torch.zeros(3, 64)
    w[1, :32] = 0.5  # a constant group
    w[2] = -2.0
    qt = quantize(w, 4, symmetric=symmetric, group_size=32)
    assert torch.isfinite(qt.scale).all() and (qt.scale > 0).all() and torch.isfinite(qt.zero).all()
    torch.testing.assert_close(dequantize(qt), w, atol=1e-6, rtol=0)


def test_non_contiguous_input_gives_the_same_codes_and_is_not_mutated():
    base = _w(96, 8, seed=3)
    w = base.t()  # (8, 96), not contiguous
    assert not w.is_contiguous()
    before = w.clone()
    a = quantize(w, 4, group_size=32)
    b = quantize(w.contiguous(), 4, group_size=32)
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scale, b.scale) and torch.equal(a.zero, b.zero)
    assert torch.equal(w, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_dtype_is_kept_and_input_untouched(dtype):
    w = _w(4, 64).to(dtype)
    before = w.clone()
    qt = quantize(w, 8, group_size=64)
    assert dequantize(qt).dtype == dtype and qt.scale.dtype == torch.float32
    assert torch.equal(w, before)


def test_nbytes_counts_packed_codes_and_fp16_scales():
    qt = quantize(_w(8, 256), 4, group_size=128)
    assert qt.nbytes == 8 * 256 // 2 + 8 * 2 * 2 * 2  # codes + (scale, zero) fp16 per group
    sym = quantize(_w(8, 256), 8, symmetric=True, granularity="channel")
    assert sym.nbytes == 8 * 256 + 8 * 2


# -- bad inputs ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(bits=5), ValueError, "bits"),
        (dict(bits=True), ValueError, "bits"),
        (dict(bits=4, group_size=48), ValueError, "group_size 48 does not divide"),
        (dict(bits=4, group_size=0), ValueError, "group_size"),
        (dict(bits=4, group_size=32.0), ValueError, "group_size"),
        (dict(bits=4, granularity="row"), ValueError, "granularity"),
    ],
)
def test_bad_formats(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        quantize(_w(4, 64), **kwargs)


@pytest.mark.parametrize(
    "w,exc,match",
    [
        (torch.tensor([[1.0, float("inf")]]), ValueError, "inf or nan"),
        (torch.tensor([[1.0, float("nan")]]), ValueError, "inf or nan"),
        (torch.ones(4), ValueError, "2-D"),
        (torch.ones(2, 4, dtype=torch.int32), TypeError, "float"),
        (torch.ones(0, 4), ValueError, "empty"),
        ([[1.0, 2.0]], TypeError, "torch.Tensor"),
    ],
)
def test_bad_weights(w, exc, match):
    with pytest.raises(exc, match=match):
        quantize(w, 4, granularity="channel")


def test_validate_rejects_zero_scales_and_bad_shapes():
    qt = quantize(_w(4, 64), 4, group_size=32)
    qt.validate()
    bad = QuantizedTensor(qt.codes, qt.scale.clone(), qt.zero, 4, 32, False, "group")
    bad.scale[0, 0] = 0
    with pytest.raises(ValueError, match="scale holds zeros"):
        bad.validate()
    with pytest.raises(ValueError, match="shape"):
        QuantizedTensor(qt.codes, qt.scale[:, :1], qt.zero, 4, 32, False, "group").validate()
    with pytest.raises(ValueError, match="exceed"):
        QuantizedTensor(qt.codes + 16, qt.scale, qt.zero, 4, 32, False, "group").validate()
    with pytest.raises(TypeError, match="float32"):
        QuantizedTensor(qt.codes, qt.scale.double(), qt.zero, 4, 32, False, "group").validate()


# -- int4 packing -------------------------------------------------------------------------------------


def test_pack_layout_low_nibble_first():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    assert pack_int4(codes).tolist() == [[0x21, 0x0F]]


@pytest.mark.parametrize("shape", [(1, 2), (3, 64), (2, 5, 34)])
def test_pack_unpack_round_trip(shape):
    codes = torch.randint(0, 16, shape, dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.shape == (*shape[:-1], shape[-1] // 2)
    assert torch.equal(unpack_int4(packed), codes)
    nc = torch.randint(0, 16, (shape[-1], 3), dtype=torch.uint8).t()  # non-contiguous
    assert torch.equal(unpack_int4(pack_int4(nc)), nc)


def test_pack_bad_inputs():
    with pytest.raises(TypeError, match="uint8"):
        pack_int4(torch.zeros(2, 4, dtype=torch.int8))
    with pytest.raises(ValueError, match="even"):
        pack_int4(torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="0..15"):
        pack_int4(torch.full((1, 2), 16, dtype=torch.uint8))
    with pytest.raises(TypeError, match="uint8"):
        unpack_int4(torch.zeros(2, 3))


# -- FP8 ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt,rel", [("e4m3", 2**-4), ("e5m2", 2**-3)])
@pytest.mark.parametrize("granularity", ["tensor", "channel"])
def test_fp8_matches_torch_cast_and_error_bound(fmt, rel, granularity):
    w = _w(6, 80, seed=4) * torch.logspace(-2, 1, 6)[:, None]
    before = w.clone()
    w8, scale = to_fp8(w, fmt, granularity=granularity)
    dtype = formats.FP8_FORMATS[fmt]
    assert w8.dtype == dtype and scale.shape == ((1, 1) if granularity == "tensor" else (6, 1))
    assert torch.equal(w8.view(torch.uint8), (w / scale).to(dtype).view(torch.uint8))
    assert w8.float().abs().max() == torch.finfo(dtype).max  # the largest magnitude maps to the max
    back = from_fp8(w8, scale)
    normal = (w / scale).abs() >= torch.finfo(dtype).smallest_normal
    assert ((back - w).abs() <= rel * w.abs() * (1 + 1e-6))[normal].all()
    assert torch.equal(w, before)
    assert set(w8.float().unique().tolist()) <= set(representable_values(fmt).tolist())


def test_fp8_bad_inputs():
    with pytest.raises(ValueError, match="fmt"):
        to_fp8(_w(2, 4), "e3m4")
    with pytest.raises(ValueError, match="granularity"):
        to_fp8(_w(2, 4), granularity="group")
    with pytest.raises(ValueError, match="inf"):
        to_fp8(torch.tensor([[float("inf")]]))
    w8, scale = to_fp8(torch.zeros(2, 4))
    assert (scale == 1).all() and (from_fp8(w8, scale) == 0).all()


# -- representable values -----------------------------------------------------------------------------


@pytest.mark.parametrize("fmt,count,largest", [("int8", 256, 127), ("int4", 16, 7), ("e4m3", 253, 448),
                                               ("e5m2", 247, 57344), ("bf16", 65279, None), ("fp16", 63487, 65504)])
def test_representable_values(fmt, count, largest):
    v = representable_values(fmt)
    assert v.dtype == torch.float64 and v.numel() == count
    assert (v[1:] > v[:-1]).all() and torch.isfinite(v).all()
    if largest is not None:
        assert v.max() == largest
    dtypes = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "bf16": torch.bfloat16, "fp16": torch.float16}
    if fmt in dtypes:  # every value is a value of the format
        assert torch.equal(v.to(dtypes[fmt]).double(), v)
    with pytest.raises(ValueError, match="fmt"):
        representable_values("int5")


# -- GGUF blocks --------------------------------------------------------------------------------------


def _blocks_with_edge_cases(qtype):
    x = _w(4, 128, seed=5)
    x[0, :32] = 0.0  # an all-zero block: d = 0
    x[1, 32:64] = -0.75  # a constant block: d = 0 (Q4_1 keeps m = -0.75)
    x[2, 64:96] = 3.0
    raw = quants.quantize_q4_1(x) if qtype == quants.Q4_1 else quants.quantize_q8_0(x)
    return raw.reshape(4, -1), (4, 128)


@pytest.mark.parametrize("qtype", [quants.Q4_1, quants.Q8_0])
def test_from_gguf_synthetic_blocks_bit_for_bit(qtype):
    raw, shape = _blocks_with_edge_cases(qtype)
    qt = from_gguf(raw, qtype, shape).validate()
    ref = quants.dequantize(raw, qtype, shape)
    assert torch.equal(dequantize(qt), ref)
    assert qt.group_size == 32 and qt.bits == (4 if qtype == quants.Q4_1 else 8)
    assert qt.symmetric == (qtype == quants.Q8_0)
    plain = QuantizedTensor(qt.codes, qt.scale, qt.zero, qt.bits, 32, qt.symmetric, "group")  # (q - z) * s
    torch.testing.assert_close(dequantize(plain), ref, atol=1e-6 * ref.abs().max().item(), rtol=0)


@pytest.mark.parametrize("name,rows", [("blk.0.attn_v.weight", None), ("blk.7.ffn_down.weight", None),
                                       ("token_embd.weight", 2048)])
def test_from_gguf_real_model_tensors_bit_for_bit(name, rows):
    t = GGUFFile().tensor(name)
    raw, shape = t.raw, t.shape
    if rows is not None:  # a slice of the 49,152-row embedding table is plenty
        raw, shape = raw[:rows], (rows, shape[1])
    qt = from_gguf(raw, t.qtype, shape)
    ref = quants.dequantize(raw, t.qtype, shape)
    assert torch.equal(dequantize(qt), ref)
    if rows is None:
        assert torch.equal(dequantize(from_gguf(t)), t.dequantize())  # the GGUFTensor form
    plain = QuantizedTensor(qt.codes, qt.scale, qt.zero, qt.bits, 32, qt.symmetric, "group")
    torch.testing.assert_close(dequantize(plain), ref, atol=1e-6 * ref.abs().max().item(), rtol=0)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("shape", SHAPES)
def test_minmax_rounding_is_within_half_a_step_and_spans_each_group(bits, shape):
    w = _w(*shape, seed=bits).abs() + 1.0    # all positive: no group holds zero
    qt = quantize_minmax(w, bits, group_size=32)
    back = dequantize(qt)
    assert ((back - w).abs() <= _steps(qt) / 2 * (1 + 1e-5)).all()
    groups = qt.codes.reshape(shape[0], -1, 32)
    assert (groups.amin(-1) == 0).all() and (groups.amax(-1) == 2**bits - 1).all()   # the whole grid is used
    assert torch.equal(back.reshape(shape[0], -1, 32).amin(-1), w.reshape(shape[0], -1, 32).amin(-1))
    # the integer-zero format spends its codes on the range down to 0: a coarser grid here
    assert (dequantize(quantize(w, bits, group_size=32)) - w).abs().mean() > (back - w).abs().mean()


def test_minmax_constant_and_bad_groups():
    qt = quantize_minmax(torch.full((2, 64), -0.5), 4, group_size=32)
    assert torch.equal(qt.codes, torch.zeros(2, 64, dtype=torch.uint8)) and (qt.scale == 1).all()
    assert torch.equal(dequantize(qt), torch.full((2, 64), -0.5))
    with pytest.raises(ValueError, match="group_size"):
        quantize_minmax(_w(2, 48), 4, group_size=32)
    with pytest.raises(ValueError, match="bits"):
        quantize_minmax(_w(2, 64), 5, group_size=32)


@pytest.mark.parametrize("name", ["blk.0.attn_v.weight", "blk.7.ffn_down.weight"])
def test_minmax_finds_the_files_q4_1_codes_again(name):
    qt = from_gguf(GGUFFile().tensor(name))
    again = quantize_minmax(dequantize(qt), 4, group_size=32)
    assert torch.equal(again.codes, qt.codes)
    torch.testing.assert_close(again.scale, qt.scale, rtol=1e-5, atol=0)
    torch.testing.assert_close(dequantize(again), dequantize(qt), atol=1e-6 * dequantize(qt).abs().max().item(),
                               rtol=0)


def test_from_gguf_bad_inputs():
    raw, shape = _blocks_with_edge_cases(quants.Q4_1)
    with pytest.raises(ValueError, match="qtype and shape"):
        from_gguf(raw)
    with pytest.raises(ValueError, match="qtype"):
        from_gguf(raw, quants.F32, shape)
    with pytest.raises(ValueError, match="multiple of 32"):
        from_gguf(raw, quants.Q4_1, (8, 48))
    with pytest.raises(ValueError, match="needs"):
        from_gguf(raw, quants.Q4_1, (8, 128))


# -- random shapes ------------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 9), groups=st.integers(1, 4), g=st.sampled_from([2, 8, 32]), bits=st.sampled_from([2, 3, 4, 8]),
       symmetric=st.booleans(), scale=st.floats(1e-3, 1e3), seed=st.integers(0, 2**16))
def test_random_shapes(n, groups, g, bits, symmetric, scale, seed):
    w = _w(n, groups * g, seed=seed, scale=scale)
    qt = quantize(w, bits, symmetric=symmetric, group_size=g)
    assert int(qt.codes.max()) <= 2**bits - 1
    assert ((w - dequantize(qt)).abs() <= _steps(qt) / 2 * (1 + 1e-5)).all()
    if bits <= 4 and (groups * g) % 2 == 0:
        assert torch.equal(unpack_int4(qt.packed()), qt.codes)
