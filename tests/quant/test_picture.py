"""The number-format picture of module 10 (``llmu.quant.picture``): the values each format gives a
weight tensor, the rounding to them, what it costs, and the figure.

Checked: int4's per-tensor values are the 15 multiples of ``absmax / 7`` (symmetric: the lowest code
is unused); FP8 values are torch's finite float8 values times ``absmax / max_finite``, so the largest
is the tensor's own largest magnitude; bf16 is unscaled; rounding lands every weight on one of the
format's values (and ``round_to_format`` is idempotent); the error summary matches its definitions;
int4 per tensor flushes small weights to zero while E4M3 does not; the figure has the histogram and
the ticks, and draws a band when the values are too many to draw; bad arguments raise ValueError.
"""

from __future__ import annotations

import pytest
import torch

from llmu.quant import picture

W = torch.randn(64, 96, generator=torch.Generator().manual_seed(0)) * 0.05
W[3, 7] = 0.9  # one large weight: sets every per-tensor scale


def test_int_values_are_the_scaled_grid():
    v = picture.format_values(W, "int4")
    assert len(v) == 15
    torch.testing.assert_close(v, torch.arange(-7, 8, dtype=torch.float64) * (0.9 / 7))
    assert len(picture.format_values(W, "int8")) == 255


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_values_reach_the_tensor_absmax(fmt):
    v = picture.format_values(W, fmt)
    assert v.max().item() == pytest.approx(0.9, rel=1e-6) and v.min().item() == pytest.approx(-0.9, rel=1e-6)
    assert (v == 0).sum() == 1


def test_bf16_values_unscaled():
    v = picture.format_values(W, "bf16")
    assert v.max() > 1e38 and len(v) == 65279


@pytest.mark.parametrize("fmt", list(picture.PICTURE_FORMATS))
def test_rounding_lands_on_the_format(fmt):
    r = picture.round_to_format(W, fmt)
    assert r.shape == W.shape and r.dtype == torch.float32
    values = picture.format_values(W, fmt).float()
    if fmt != "bf16":  # every rounded weight is one of the format's values (to float32 rounding)
        nearest = (r.flatten()[:, None] - values[None, :]).abs().min(dim=1).values
        assert nearest.max() <= 1e-6 * 0.9
    torch.testing.assert_close(picture.round_to_format(r, fmt), r)  # idempotent


def test_errors_int4_flushes_e4m3_does_not():
    e4 = picture.format_error(W, "int4")
    assert e4["flushed to zero"] > 0.5 and e4["values used"] <= 15
    r = picture.round_to_format(W, "int4")
    assert e4["relative error"] == pytest.approx(float((W - r).norm() / W.norm()))
    fp = picture.format_error(W, "e4m3")
    assert fp["flushed to zero"] < 0.01 and fp["relative error"] < 0.1 * e4["relative error"]
    assert picture.format_error(W, "bf16")["relative error"] < 0.005


def test_figure_ticks_and_band():
    fig = picture.number_line(W, "int4", zoom=1.0)
    kinds = [t.type for t in fig.data]
    assert kinds == ["bar", "scatter"] and len(fig.data[1].x) == 15
    assert "15 int4 values in view" in fig.layout.title.text
    zoomed = picture.number_line(W, "int8", zoom=0.01)  # +-0.009 around 0, int8's step is 0.9 / 127
    assert list(zoomed.data[1].x) == pytest.approx([-0.9 / 127, 0.0, 0.9 / 127])
    band = picture.number_line(W, "bf16", zoom=1.0)
    assert band.data[1].mode == "lines" and "band" in band.layout.title.text


@pytest.mark.parametrize("call", [
    lambda: picture.format_values(W, "int3"),
    lambda: picture.round_to_format(W, "fp4"),
    lambda: picture.number_line(W, "int4", zoom=0),
    lambda: picture.number_line(W, "int4", zoom=1.5),
    lambda: picture.number_line(W, "int4", bins=0),
    lambda: picture.format_values(torch.ones(3), "int4"),
])
def test_bad_inputs(call):
    with pytest.raises(ValueError):
        call()
