"""Activation outliers: the magnitudes recorded, the table, and why per-tensor activation scales fail."""

from __future__ import annotations

import pytest
import torch

from llmu.data import text
from llmu.models import tiny_llama
from llmu.quant import outliers


def test_magnitudes_are_the_largest_input_of_each_channel():
    model = tiny_llama()
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    seen = {}
    def keep(module, inputs, output):
        seen.setdefault("x", inputs[0])  # (a forward hook that returns a value replaces the output)

    h = model.layers[1].mlp.down_proj.register_forward_hook(keep)
    mags = outliers.input_magnitudes(model, ids, projections=("down_proj", "q_proj"))
    model(ids)
    h.remove()
    assert set(mags) == {f"layers.{i}.{p}" for i in range(2)
                         for p in ("mlp.down_proj", "self_attn.q_proj")}
    torch.testing.assert_close(mags["layers.1.mlp.down_proj"], seen["x"][0].abs().amax(0))
    assert not any(m._forward_hooks for m in model.modules()), "hooks must be removed"


def test_rows_and_figure():
    mags = {"layers.0.mlp.down_proj": torch.tensor([1.0, 2.0, 100.0, 1.0]),
            "layers.1.mlp.down_proj": torch.tensor([1.0, 50.0, 1.0, 1.0])}
    rows = outliers.outlier_rows(mags, top=1)
    assert rows[0] == {"layer": 0, "projection": "down_proj", "max": 100.0, "median": 1.0, "ratio": 100.0,
                       "top channels": [2]}
    fig = outliers.figure(mags)
    assert fig.data[0].z.shape == (2, 4)
    with pytest.raises(ValueError, match="no magnitudes recorded for 'q_proj'"):
        outliers.figure(mags, "q_proj")


def test_one_outlier_channel_ruins_per_tensor_scales():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g)
    clean = {gr: outliers.activation_quant_error(x, 8, gr) for gr in ("tensor", "token", "channel")}
    x[:, 7] *= 300  # one channel, in every token, as in a real model
    dirty = {gr: outliers.activation_quant_error(x, 8, gr) for gr in ("tensor", "token", "channel")}
    assert all(e < 0.02 for e in clean.values())
    # the error of the ordinary channels explodes with a shared scale; only per-channel scales are immune
    assert dirty["tensor"] > 10 * clean["tensor"] and dirty["token"] > 10 * clean["token"]
    assert dirty["channel"] == pytest.approx(clean["channel"], rel=0.2)


@pytest.mark.slow
def test_smollm2_has_massive_down_proj_inputs(smollm2):
    model, tok = smollm2
    ids = torch.tensor([tok.encode(text("essays"))[:128]])
    rows = outliers.outlier_rows(outliers.input_magnitudes(model, ids, projections=("down_proj",)))
    assert max(r["ratio"] for r in rows) > 100, "the last layers' down_proj inputs have channels 100x the median"


def test_bad_inputs():
    with pytest.raises(ValueError, match="projections"):
        outliers.input_magnitudes(tiny_llama(), torch.tensor([[1]]), projections=("w_proj",))
    with pytest.raises(ValueError, match="granularity"):
        outliers.activation_quant_error(torch.ones(2, 2), granularity="row")
    with pytest.raises(ValueError, match="2-D float"):
        outliers.activation_quant_error(torch.ones(3))
