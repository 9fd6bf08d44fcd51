"""``QuantLinear``: the quantized layer against ``F.linear(x, dequantize(qt))``.

Tolerances: in float32 every path computes the same sums in another order (the "int8 scaled" path
applies the row scale after the dot product instead of before), so results agree to ``1e-5``
relative to the output's magnitude (``atol = 1e-5 * max|y|``); the dequantize path is the
reference itself (exact). bf16 activations (``aten._weight_int8pack_mm``) are compared with bf16's
own precision: ``2^-7`` relative, a few units of it for sums of ~100 products (``atol = 3e-2 *
max|y|``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import llmu  # noqa: F401
from llmu.models import GGUFFile, Linear, quants
from llmu.quant.formats import QuantizedTensor, dequantize, from_gguf, quantize
from llmu.quant.linear import QuantLinear, int8pack_available

pytestmark = pytest.mark.kernels


def _x(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(*shape, generator=g, device="cpu").to(dtype)


def _close(y, ref, rel=1e-5):
    torch.testing.assert_close(y, ref, atol=rel * ref.abs().max().item(), rtol=0)


FORMATS = [
    dict(bits=4, group_size=32),
    dict(bits=4, symmetric=True, group_size=64),
    dict(bits=3, granularity="channel"),
    dict(bits=2, group_size=16),
    dict(bits=8, granularity="group", group_size=32),
    dict(bits=8, symmetric=True, granularity="channel"),
    dict(bits=8, symmetric=True, granularity="tensor"),
    dict(bits=8, granularity="channel"),
]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()))
@pytest.mark.parametrize("xshape", [(1, 1), (3,), (2, 5)])
@pytest.mark.parametrize("nk", [(1, 64), (17, 192)])
def test_forward_matches_dequantize_then_linear(fmt, xshape, nk):
    n, k = nk
    w = _x(n, k, seed=1)
    qt = quantize(w, **fmt)
    bias = _x(n, seed=2)
    layer = QuantLinear(qt, bias)
    x = _x(*xshape, k, seed=3)
    y = layer(x)
    assert y.shape == (*xshape, n) and y.dtype == x.dtype
    _close(y, F.linear(x, dequantize(qt), bias))
    int8_rows = fmt["bits"] == 8 and fmt.get("symmetric") and fmt.get("granularity") in ("channel", "tensor")
    assert layer.last_path == ("int8 scaled" if int8_rows else "dequantize")


@pytest.mark.skipif(not int8pack_available("cpu", torch.bfloat16), reason="no fast aten._weight_int8pack_mm here")
def test_int8pack_path_for_bf16_activations():
    w = _x(40, 96, seed=4)
    layer = QuantLinear(quantize(w, 8, symmetric=True, granularity="channel"))
    x = _x(3, 96, seed=5, dtype=torch.bfloat16)
    y = layer(x)
    assert layer.last_path == "int8pack" and y.dtype == torch.bfloat16
    ref = F.linear(x.float(), layer.dequantized())
    _close(y.float(), ref, rel=3e-2)
    assert not int8pack_available("cpu", torch.float32)  # slow scalar loop there: "int8 scaled" is used


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_int8_scaled_path_in_half_precision(dtype, monkeypatch):
    monkeypatch.setattr("llmu.quant.linear.INT8PACK_FAST", {})
    layer = QuantLinear(quantize(_x(24, 64, seed=14), 8, symmetric=True, granularity="channel"))
    x = _x(2, 64, seed=15, dtype=dtype)
    y = layer(x)
    assert layer.last_path == "int8 scaled" and y.dtype == dtype
    _close(y.float(), F.linear(x.float(), layer.dequantized()), rel=3e-2)


def test_int8_codes_are_the_stored_codes_minus_128():
    qt = quantize(_x(8, 32), 8, symmetric=True, granularity="channel")
    layer = QuantLinear(qt)
    assert torch.equal(layer._codes_i8.to(torch.int16), qt.codes.to(torch.int16) - 128)


def test_cache_keeps_the_dequantized_weight():
    qt = quantize(_x(16, 64), 4, group_size=32)
    layer = QuantLinear(qt, cache=True)
    x = _x(2, 64, seed=6)
    y = layer(x)
    assert layer._weight is not None and torch.equal(layer._weight, dequantize(qt))
    assert torch.equal(layer(x), y) and layer.last_path == "dequantize"
    assert "_weight" not in layer.state_dict()


def test_input_scale_multiplies_x_first():
    qt = quantize(_x(12, 64), 4, group_size=32)
    s = _x(64, seed=7).abs() + 0.5
    layer = QuantLinear(qt, input_scale=s)
    x = _x(3, 64, seed=8)
    _close(layer(x), F.linear(x * s, dequantize(qt)))


def test_from_linear_does_not_touch_the_linear():
    lin = Linear(64, 24, weight=_x(24, 64, seed=9), bias=True)
    with torch.no_grad():
        lin.bias.copy_(_x(24, seed=10))
    before = lin.weight.clone()
    layer = QuantLinear.from_linear(lin, bits=4, group_size=32)
    assert torch.equal(lin.weight, before)
    assert torch.equal(layer.bias, lin.bias) and layer.bias.data_ptr() != lin.bias.data_ptr()
    x = _x(2, 64, seed=11)
    _close(layer(x), F.linear(x, layer.dequantized(), lin.bias))
    assert (layer.dequantized() - lin.weight).abs().max() <= layer.scale.max() / 2 * (1 + 1e-5)


def test_nbytes_and_repr():
    layer = QuantLinear(quantize(_x(32, 256), 4, group_size=128), _x(32))
    assert layer.nbytes == 32 * 256 // 2 + 32 * 2 * 2 * 2 + 32 * 4
    text = repr(layer)
    assert "bits=4" in text and "group_size=128" in text and "in_features=256" in text and "out_features=32" in text


def test_buffers_move_and_save():
    layer = QuantLinear(quantize(_x(8, 64), 4, group_size=32), _x(8))
    state = layer.state_dict()
    assert {"codes", "scale", "zero", "bias"} <= set(state) and "_codes_i8" not in state
    half = layer.to(torch.float64)  # floats change dtype, the uint8 codes do not
    assert half.codes.dtype == torch.uint8
    assert isinstance(layer.qt, QuantizedTensor) and layer.qt.codes is layer.codes


def test_gguf_weight_in_a_quantlinear():
    t = GGUFFile().tensor("blk.0.attn_k.weight")  # Q4_1, (192, 576)
    layer = QuantLinear(from_gguf(t))
    w = quants.dequantize(t.raw, t.qtype, t.shape)
    assert torch.equal(layer.dequantized(), w)
    x = _x(2, 576, seed=12)
    assert torch.equal(layer(x), F.linear(x, w))
    assert layer.nbytes == t.nbytes  # 20 bytes per block of 32: 16 of codes, d and m in fp16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel path runs on CUDA tensors")
def test_cuda_uses_the_kernels_when_there():
    from llmu.quant.linear import _kernels

    for fmt, expected in ((dict(bits=4, group_size=64), "kernel int4"),
                          (dict(bits=8, symmetric=True, granularity="channel"), "kernel int8")):
        qt = quantize(_x(64, 256), **fmt)
        layer = QuantLinear(qt).cuda()
        x = _x(3, 256, seed=13).cuda()
        y = layer(x)
        if _kernels() is not None:
            assert layer.last_path == expected
        torch.testing.assert_close(y.cpu(), F.linear(x.cpu(), dequantize(qt)), atol=1e-3, rtol=1e-3)


# -- bad inputs ---------------------------------------------------------------------------------------


def test_bad_construction():
    qt = quantize(_x(8, 64), 4, group_size=32)
    with pytest.raises(TypeError, match="qt must be a QuantizedTensor"):
        QuantLinear(_x(8, 64))
    with pytest.raises(ValueError, match=r"bias must have shape \(8,\)"):
        QuantLinear(qt, _x(9))
    with pytest.raises(TypeError, match="bias"):
        QuantLinear(qt, torch.zeros(8, dtype=torch.int64, device="cpu"))
    with pytest.raises(ValueError, match="input_scale holds zeros"):
        QuantLinear(qt, input_scale=torch.zeros(64, device="cpu"))
    with pytest.raises(ValueError, match="input_scale must have shape"):
        QuantLinear(qt, input_scale=torch.ones(8, device="cpu"))
    with pytest.raises(ValueError, match="inf or nan"):
        QuantLinear(qt, torch.full((8,), float("nan"), device="cpu"))
    zero_scale = QuantizedTensor(qt.codes, torch.zeros_like(qt.scale), qt.zero, 4, 32, False, "group")
    with pytest.raises(ValueError, match="scale holds zeros"):
        QuantLinear(zero_scale)
    with pytest.raises(TypeError, match="weight"):
        QuantLinear.from_linear(torch.nn.ReLU())
    with pytest.raises(ValueError, match="group_size"):
        QuantLinear.from_linear(Linear(64, 8, weight=_x(8, 64)), bits=4, group_size=48)


def test_bad_x():
    layer = QuantLinear(quantize(_x(8, 64), 4, group_size=32))
    with pytest.raises(ValueError, match="in_features=64"):
        layer(_x(2, 63))
    with pytest.raises(TypeError, match="floating-point"):
        layer(torch.ones(2, 64, dtype=torch.int64, device="cpu"))
    with pytest.raises(ValueError, match="in_features"):
        layer(torch.tensor(1.0, device="cpu"))
