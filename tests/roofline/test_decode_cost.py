"""Module 05's decode-step accounting (``llmu.roofline.decode_cost``): the ops of one step counted
by hand on small configs, the weights equal to the model's real parameters, how the counts scale
with the batch and the context, GQA against MHA, the roofline prediction, bad input, and the
measurement on a tiny model."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings, strategies as st

import llmu  # noqa: F401
from llmu.models import LlamaConfig, tiny_llama
from llmu.roofline.decode_cost import (
    LAYER_OPS,
    OP_NAMES,
    StepOp,
    measure_decode_steps,
    predict_time,
    step_cost,
    step_totals,
)

SMOL = LlamaConfig()  # SmolLM2-135M: 30 layers, d 576, 9 query and 3 KV heads of 64, f 1536, V 49152


def tiny(**kw) -> LlamaConfig:
    base = dict(vocab_size=11, hidden_size=6, intermediate_size=10, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=4)
    return LlamaConfig(**{**base, **kw})


def ops(cfg, *args, **kw) -> dict:
    return {op.name: (op.flops, op.bytes) for op in step_cost(cfg, *args, **kw)}


def weight_bytes(cfg, context=5, **kw) -> float:
    """The bytes of a step that do not grow with the batch: b(B) = W + B a, so W = 2 b(1) - b(2)."""
    return 2 * step_totals(step_cost(cfg, 1, context, **kw))[1] - step_totals(step_cost(cfg, 2, context, **kw))[1]


def test_every_op_by_hand_on_a_tiny_config():
    # d 6, f 10, L 2, H 4, Hkv 2, D 4 (q width 16, kv width 8), V 11; B 3, context 4 (n = 5), bf16.
    got = ops(tiny(), 3, 4)
    assert list(got) == list(OP_NAMES)
    L, B, e = 2, 3, 2
    assert got["attn_norm"] == got["mlp_norm"] == (L * 4 * B * 6, L * e * (6 + 2 * B * 6))
    assert got["q_proj"] == (L * 2 * B * 6 * 16, L * e * (6 * 16 + B * 6 + B * 16))
    assert got["k_proj"] == got["v_proj"] == (L * 2 * B * 6 * 8, L * e * (6 * 8 + B * 6 + B * 8))
    assert got["attention"] == (L * 4 * B * 4 * 5 * 4, L * (e * 2 * B * 16 + e * 2 * B * 5 * 8))
    assert got["o_proj"] == (L * 2 * B * 16 * 6, L * e * (16 * 6 + B * 16 + B * 6))
    assert got["gate_proj"] == got["up_proj"] == (L * 2 * B * 6 * 10, L * e * (6 * 10 + B * 6 + B * 10))
    assert got["down_proj"] == (L * 2 * B * 10 * 6, L * e * (10 * 6 + B * 10 + B * 6))
    assert got["final_norm"] == (4 * B * 6, e * (6 + 2 * B * 6))
    assert got["lm_head"] == (2 * B * 6 * 11, e * (6 * 11 + B * 6 + B * 11))
    assert all(isinstance(f, int) and isinstance(b, int) for f, b in got.values())


def test_smollm2_figures():
    got = ops(SMOL, 1, 63)
    assert got["q_proj"] == (19_906_560, 19_975_680)
    assert got["k_proj"] == (6_635_520, 6_681_600)
    assert got["attention"] == (4_423_680, 1_543_680)
    assert got["lm_head"] == (56_623_104, 56_722_560)


@pytest.mark.parametrize("cfg", [
    SMOL,
    tiny(),
    tiny(tie_word_embeddings=False),
    tiny(num_key_value_heads=4),                     # MHA
    tiny(num_key_value_heads=1, num_hidden_layers=3),  # MQA
    tiny(attention_bias=True, attention_out_bias=True),
    tiny(head_dim=6),                                # q width 24 != hidden 6
], ids=["smollm2", "tied", "untied", "mha", "mqa", "biases", "wide-heads"])
def test_weights_read_are_the_models_parameters(cfg):
    """Every parameter is read once per step; with an untied head, the embedding table is stored
    but a step reads only B rows of it (neglected), so it is left out."""
    params = cfg.num_parameters()
    if cfg is not SMOL:
        assert tiny_llama(**{k: getattr(cfg, k) for k in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "tie_word_embeddings", "attention_bias",
            "attention_out_bias")}).num_parameters() == params
    table = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    for e in (2, 4):
        assert weight_bytes(cfg, elem_bytes=e) == e * (params - table)
    assert SMOL.num_parameters() == 134_515_008


def test_tied_and_untied_steps_cost_the_same():
    assert ops(tiny(tie_word_embeddings=True), 4, 9) == ops(tiny(tie_word_embeddings=False), 4, 9)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 300), st.integers(0, 5000), st.sampled_from([1, 2, 4]))
def test_flops_grow_with_the_batch_bytes_are_weights_plus_per_sequence(batch, context, e):
    one, many = ops(SMOL, 1, context, elem_bytes=e), ops(SMOL, batch, context, elem_bytes=e)
    w = weight_bytes(SMOL, context, elem_bytes=e)
    per_sequence = step_totals(step_cost(SMOL, 1, context, elem_bytes=e))[1] - w
    for name in OP_NAMES:
        assert many[name][0] == batch * one[name][0]
    assert step_totals(step_cost(SMOL, batch, context, elem_bytes=e))[1] == w + batch * per_sequence


def test_only_attention_grows_with_the_context():
    short, long = ops(SMOL, 8, 10), ops(SMOL, 8, 1010)
    for name in OP_NAMES:
        if name != "attention":
            assert short[name] == long[name]
    L, H, D, Hkv, B = 30, 9, 64, 3, 8
    assert long["attention"][0] - short["attention"][0] == L * 4 * B * H * 1000 * D
    # the cache read: keys and values of 1000 more positions, every sequence, every layer
    assert long["attention"][1] - short["attention"][1] == L * 2 * 2 * B * 1000 * Hkv * D


def test_gqa_reads_less_cache_than_mha_for_the_same_flops():
    gqa, mha, mqa = (ops(tiny(num_key_value_heads=h), 4, 100) for h in (2, 4, 1))
    assert gqa["attention"][0] == mha["attention"][0] == mqa["attention"][0]
    cache = {h: o["attention"][1] - 2 * 2 * 4 * 16 * 2 for h, o in ((2, gqa), (4, mha), (1, mqa))}  # less q, out
    assert cache[4] == 2 * cache[2] == 4 * cache[1]
    assert mha["k_proj"][0] == 2 * gqa["k_proj"][0] and mha["q_proj"] == gqa["q_proj"]


def test_kv_cache_element_size():
    base, fp8 = ops(SMOL, 4, 100), ops(SMOL, 4, 100, kv_elem_bytes=1)
    L, Hkv, D, B, n = 30, 3, 64, 4, 101
    assert base["attention"][1] - fp8["attention"][1] == L * 2 * B * n * Hkv * D
    assert base["k_proj"][1] - fp8["k_proj"][1] == L * B * Hkv * D  # the keys written into the cache
    assert base["q_proj"] == fp8["q_proj"] and base["attention"][0] == fp8["attention"][0]
    assert ops(SMOL, 4, 100, kv_elem_bytes=2) == base
    half = ops(SMOL, 2, 7, elem_bytes=0.5, kv_elem_bytes=2)
    assert half["q_proj"][1] == 30 * 0.5 * (576 * 576 + 2 * 576 + 2 * 576)


def test_prediction_is_a_sum_of_per_op_roofs():
    costs = [("a", 4e12, 1e9), ("b", 1e12, 2e12)]
    assert predict_time(costs, 1e15, 1e12) == pytest.approx(4e-3 + 2.0, rel=1e-12)
    assert predict_time([], 1e15, 1e12) == 0
    # batch 1: every op memory-bound, the prediction is the bytes over the bandwidth
    c = step_cost(SMOL, 1, 1024)
    assert predict_time(c, 989.5e12, 3.35e12) == pytest.approx(step_totals(c)[1] / 3.35e12, rel=1e-12)
    assert predict_time(c, 989.5e12, 3.35e12) * 1e6 == pytest.approx(87.6, abs=0.05)
    # a CPU's low ridge: the products compute-bound at batch 64, attention still memory-bound,
    # so the sum of the maxima exceeds the maximum of the sums
    c = step_cost(SMOL, 64, 64, elem_bytes=4)
    f, b = step_totals(c)
    assert predict_time(c, 92.7e9, 7.1e9) > max(f / 92.7e9, b / 7.1e9) * 1.01
    assert predict_time((StepOp("x", 10, 20) for _ in range(3)), 1e12, 1e9) == pytest.approx(60 / 1e9, rel=1e-12)


@pytest.mark.parametrize("bad", [
    dict(batch=0), dict(batch=-1), dict(batch=2.0), dict(batch=True), dict(context=-1), dict(context=1.5),
    dict(context=True), dict(elem_bytes=0), dict(elem_bytes=-2), dict(elem_bytes=float("nan")),
    dict(elem_bytes=True), dict(kv_elem_bytes=0), dict(kv_elem_bytes=-1.0),
])
def test_bad_arguments_raise_value_error(bad):
    args = dict(batch=2, context=3, elem_bytes=2, kv_elem_bytes=None) | bad
    with pytest.raises(ValueError, match=next(iter(bad))):
        step_cost(SMOL, **args)


def test_bad_config_and_costs():
    with pytest.raises(TypeError, match="cfg"):
        step_cost(object(), 1, 0)
    for peak, bw in ((0, 1e9), (1e12, -1), (float("inf"), 1e9), (True, 1e9)):
        with pytest.raises(ValueError):
            predict_time([("a", 1, 1)], peak, bw)
    for costs in ([("a", 1)], [("a", -1, 2)], [("a", 1, float("nan"))]):
        with pytest.raises(ValueError, match="costs"):
            predict_time(costs, 1e12, 1e9)
    with pytest.raises(TypeError, match="costs"):
        predict_time(5, 1e12, 1e9)


def test_measure_decode_steps_on_a_tiny_model():
    model = tiny_llama()
    rows = measure_decode_steps(model, (1, 3), context=5, steps=2, threads=1)
    assert [r["batch"] for r in rows] == [1, 3]
    for r in rows:
        assert r["context"] == 5 and r["steps"] == 2
        assert 0 < r["ms_min"] <= r["ms"] <= r["ms_max"] and math.isclose(r["ms_per_token"], r["ms"] / r["batch"])
    with pytest.raises(ValueError, match="batches"):
        measure_decode_steps(model, (), context=5)
    with pytest.raises(ValueError, match="batches"):
        measure_decode_steps(model, (0,), context=5)
    with pytest.raises(ValueError, match="context"):
        measure_decode_steps(model, (1,), context=model.config.max_position_embeddings)


def test_layer_ops_are_the_first_ten():
    assert OP_NAMES[:10] == LAYER_OPS and OP_NAMES[10:] == ("final_norm", "lm_head")
