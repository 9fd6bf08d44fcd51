"""Module 10's ``int8_decode`` benchmark entry: registered, and its rows on a tiny model.

Timings are not asserted (other processes share the machine); the order of the runs (float and
int8 in turn), the rows' fields, the quantized paths they name and the ratios' arithmetic are.
"""

from __future__ import annotations

import pytest
import torch

import llmu  # noqa: F401
from llmu.bench.registry import REGISTRY
from llmu.models import Linear, loading, tiny_llama
from llmu.quant import bench
from llmu.quant.linear import int8pack_available


def test_entry_is_registered():
    entry = REGISTRY["int8_decode"]
    assert entry is bench.INT8_DECODE and entry.module == "10_quantization" and entry.run is not None
    assert entry.cpu_sizes and entry.gpu_sizes
    for size in entry.cpu_sizes + entry.gpu_sizes:
        assert size["new"] >= 64 and size["repeats"] >= 3


def test_int8_model_is_symmetric_per_channel_8bit():
    model = tiny_llama(0)
    q = bench.int8_model(model)
    layer = q.layers[0].mlp.up_proj
    assert layer.bits == 8 and layer.symmetric and layer.granularity == "channel"
    assert isinstance(model.layers[0].mlp.up_proj, Linear)  # the float model is left alone


def test_measure_decode_bad_inputs():
    with pytest.raises(ValueError, match="new_tokens"):
        bench.measure_decode({"a": tiny_llama(0, vocab_size=300)}, new_tokens=1)
    with pytest.raises(ValueError, match="empty"):
        bench.measure_decode({})


def test_float_and_int8_run_in_turn():
    model = tiny_llama(0, vocab_size=300)
    p = bench.compare_decode({"fp32": model, "int8": bench.int8_model(model)}, prompt_len=4, new_tokens=3,
                             repeats=3)
    assert p.order == ["fp32", "int8"] * 3 and p.base == "fp32" and p.figure == "decode_tokens_per_s"
    assert p.reference is None and p.mismatches == {}  # int8 changes the function: outputs not compared
    assert len(p.outputs["int8"][0]) == 3
    tps = bench.measure_decode({"fp32": model}, prompt_len=4, new_tokens=3, repeats=1)
    assert set(tps) == {"fp32"} and tps["fp32"] > 0


def test_run_rows_on_a_tiny_model(monkeypatch):
    monkeypatch.setattr(loading, "load_model", lambda dtype, device: tiny_llama(0, vocab_size=300).to(dtype))
    rows = bench._run({"prompt": 4, "new": 3, "repeats": 2}, "cpu")
    assert [r["provider"] for r in rows] == ["fp32", "int8 (fp32 activations)", "bf16", "int8 (bf16 activations)"]
    by = {r["provider"]: r for r in rows}
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["ms"] == pytest.approx(1e3 / r["tokens_per_s"])
        assert r["kind"] == "torch" and r["phase"] == "decode" and r["flops"] > 0
        assert r["rounds"] == 2 and "load_avg_start" in r and r.get("status", "ok") == "ok"
    assert by["fp32"]["ratio"] is None and by["fp32"]["ratio_to"] == "fp32"
    assert by["bf16"]["ratio"] is None and by["bf16"]["ratio_to"] == "bf16"
    q = by["int8 (bf16 activations)"]
    assert q["ratio_to"] == "bf16" and q["ratio_min"] <= q["ratio"] <= q["ratio_max"]
    assert isinstance(q["ratio_overlaps_1"], bool)
    assert q["ratio_vs_fp32"] == pytest.approx(q["tokens_per_s"] / by["fp32"]["tokens_per_s"])
    assert by["fp32"]["path"] == "float" and by["int8 (fp32 activations)"]["path"] == "int8 scaled"
    if int8pack_available("cpu", torch.bfloat16):
        assert q["path"] == "int8pack"
    assert by["int8 (fp32 activations)"]["bytes"] < by["bf16"]["bytes"] < by["fp32"]["bytes"]
