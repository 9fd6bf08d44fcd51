"""AWQ (``llmu.quant.awq``): the scale search, the folding of scales into the previous operations,
and the whole-model driver.

What is checked:

- folding is exact: a block with scales folded into its norms, ``v_proj`` and ``up_proj`` computes
  the same logits as before (tiny GQA decoder: 6 query heads over 2 KV heads, and an MHA one); scales
  that differ across the query heads of a KV group are not folded into ``v_proj`` but handed back;
- the search: ``alpha = 0`` is RTN exactly, so the chosen scales never give a larger calibration
  error than RTN; on a layer with outlier input channels AWQ's output error is well below RTN's;
  tied scales are tied;
- clipping: ``clip_search`` with no shrink returns ratio 1 (RTN) everywhere; on groups with one large
  weight it clips most of them and its group-partial output error is never above RTN's, and well
  below it; ``apply_clip`` clamps each group to ``[-r m, r m]``;
- the model driver: a copy, every projection a ``QuantLinear``, ``input_scale`` only where asked,
  output error below RTN's on the tiny decoder, ``quantize_model(method="awq")``; bad inputs.

Tolerances: folding multiplies and divides float32 weights by the same scales, which changes them
by an ulp or so; through two blocks and the LM head the logits (of size ~1-10) agree to 1e-4
absolute. The search's alpha-0 error equals RTN's up to float32 summation order (rtol 1e-6).
"""

from __future__ import annotations

import copy

import pytest
import torch

import llmu  # noqa: F401
from llmu.models import tiny_llama
from llmu.quant.awq import apply_clip, awq_search, clip_search, fold_layer_scales, quantize_model_awq
from llmu.quant.formats import fake_quantize

TOL = dict(rtol=1e-4, atol=1e-4)
IDS = torch.randint(0, 97, (3, 20), generator=torch.Generator().manual_seed(0))


def _scales(layer, seed, tied=True):
    g = torch.Generator().manual_seed(seed)
    attn = layer.self_attn
    h, hkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    o = torch.rand(hkv, 1 if tied else h // hkv, d, generator=g).expand(hkv, h // hkv, d).reshape(-1) + 0.25
    return {"qkv": torch.rand(layer.self_attn.q_proj.in_features, generator=g) * 4 + 0.1, "o": o * 3,
            "gate_up": torch.rand(layer.mlp.gate_proj.in_features, generator=g) + 0.5,
            "down": torch.rand(layer.mlp.down_proj.in_features, generator=g) * 2 + 0.2}


@pytest.mark.parametrize("kv_heads", [2, 6, 1])
@pytest.mark.parametrize("mode", ["tie", "input_scale", "skip"])
def test_folding_is_exact(kv_heads, mode):
    model = tiny_llama(0, num_key_value_heads=kv_heads)
    ref = model(IDS).logits
    folded = copy.deepcopy(model)
    for i, layer in enumerate(folded.layers):
        leftover = fold_layer_scales(layer, _scales(layer, i), gqa_o_proj=mode)
        # tied scales fold into v_proj, except when asked to keep an input scale under GQA
        assert bool(leftover) == (mode == "input_scale" and kv_heads != 6)
    assert not torch.equal(folded.layers[0].mlp.down_proj.weight, model.layers[0].mlp.down_proj.weight)
    torch.testing.assert_close(folded(IDS).logits, ref, **TOL)


def test_untied_gqa_scales_are_handed_back():
    model = tiny_llama(1)
    folded = copy.deepcopy(model)
    layer = folded.layers[0]
    s = _scales(layer, 0, tied=False)
    leftover = fold_layer_scales(layer, s, gqa_o_proj="tie")
    assert torch.equal(leftover["self_attn.o_proj"], s["o"])
    assert torch.equal(layer.self_attn.o_proj.weight, model.layers[0].self_attn.o_proj.weight)  # untouched
    torch.testing.assert_close(folded(IDS).logits, model(IDS).logits, **TOL)
    # the caller's unfused form: W diag(s) fed x / s computes the same
    x = torch.randn(5, 48)
    w = layer.self_attn.o_proj.weight
    torch.testing.assert_close((x / s["o"]) @ (w * s["o"]).T, x @ w.T, rtol=1e-5, atol=1e-5)


def _outlier_layer(seed=0, k=64, n=32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(512, k, generator=g)
    x[:, [3, 17, 40]] *= 30  # three salient input channels
    w = torch.randn(n, k, generator=g)
    return x, w


@pytest.mark.parametrize("bits,group", [(3, 32), (4, 64), (4, 16), (2, 32)])
def test_search_beats_rtn_on_outliers(bits, group):
    x, w = _outlier_layer()
    fmt = dict(group_size=group)
    s, alpha, errors = awq_search(x, [w], bits, **fmt)
    rtn = float(((x @ fake_quantize(w, bits, **fmt).T - x @ w.T) ** 2).mean())
    assert errors[0] == pytest.approx(rtn, rel=1e-6)  # alpha = 0 is RTN
    awq = float((((x / s) @ fake_quantize(w * s, bits, **fmt).T - x @ w.T) ** 2).mean())
    assert awq == pytest.approx(min(errors), rel=1e-5)
    assert awq < 0.9 * rtn and alpha > 0
    assert len(errors) == 20 and s.shape == (64,) and (s > 0).all()


def test_search_never_worse_than_rtn_and_ties():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(200, 48, generator=g)  # no outliers: RTN may well be the best choice
    ws = [torch.randn(16, 48, generator=g), torch.randn(8, 48, generator=g)]
    s, alpha, errors = awq_search(x, ws, 4, group_size=16, n_grid=10)
    assert min(errors) <= errors[0] and len(errors) == 10
    tie = lambda v: v.view(2, 3, 8).mean(1, keepdim=True).expand(2, 3, 8).reshape(-1)  # noqa: E731
    s, _, _ = awq_search(x, ws, 4, group_size=16, tie=tie, max_tokens=50)
    assert torch.equal(s.view(2, 3, 8), s.view(2, 3, 8)[:, :1].expand(2, 3, 8))


def _heavy_tailed_layer(seed=5):
    """Inputs (300, 64) and weights (24, 64) drawn from Student's t with 3 degrees of freedom: a few
    large weights per group set the group's range, as in real layers."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(300, 64, generator=g)
    chi2 = torch.randn(3, 24, 64, generator=g).pow(2).sum(dim=0)
    w = torch.randn(24, 64, generator=g) / (chi2 / 3).sqrt()
    return x, w


def _partial_errors(x, w, w_hat, group):
    xg, wg, hg = x.view(-1, 64 // group, group), w.view(-1, 64 // group, group), w_hat.view(-1, 64 // group, group)
    return (torch.einsum("tgk,ngk->ntg", xg, hg) - torch.einsum("tgk,ngk->ntg", xg, wg)).pow(2).mean(dim=1)


def test_clip_without_shrink_is_rtn():
    x, w = _heavy_tailed_layer()
    ratios = clip_search(x, w, 3, group_size=16, max_shrink=0.0)
    assert ratios.shape == (24, 4) and torch.equal(ratios, torch.ones(24, 4))
    assert torch.equal(apply_clip(w, ratios, 16), w)


@pytest.mark.parametrize("bits,gain", [(3, 0.95), (4, 0.99)])  # measured: 0.91 and 0.97 of RTN's error
def test_clip_search_beats_rtn_group_by_group(bits, gain):
    x, w = _heavy_tailed_layer()
    ratios = clip_search(x, w, bits, group_size=16, n_tokens=300)
    assert ((ratios <= 1) & (ratios > 0.5)).all()
    assert (ratios < 1).float().mean() > 0.2  # heavy tails: many groups want a clip
    clipped = fake_quantize(apply_clip(w, ratios, 16), bits, group_size=16)
    rtn = fake_quantize(w, bits, group_size=16)
    e_clip, e_rtn = _partial_errors(x, w, clipped, 16), _partial_errors(x, w, rtn, 16)
    assert (e_clip <= e_rtn * (1 + 1e-5)).all()  # r = 1 is on the grid: never worse, group by group
    assert e_clip.sum() < gain * e_rtn.sum()


def test_apply_clip_clamps_each_group():
    w = torch.tensor([[1.0, -4.0, 2.0, 0.5, 3.0, -1.0]])
    out = apply_clip(w, torch.tensor([[0.5, 1.0 / 3.0]]), 3)
    torch.testing.assert_close(out, torch.tensor([[1.0, -2.0, 2.0, 0.5, 1.0, -1.0]]))
    assert torch.equal(w, torch.tensor([[1.0, -4.0, 2.0, 0.5, 3.0, -1.0]]))  # a new tensor


def test_model_clip_changes_the_codes():
    model, ids = tiny_llama(0), _calib()
    with_clip = quantize_model_awq(model, ids, 3, group_size=16)
    without = quantize_model_awq(model, ids, 3, group_size=16, clip=False)
    a, b = with_clip.layers[0].mlp.down_proj, without.layers[0].mlp.down_proj
    assert not torch.equal(a.codes, b.codes) or not torch.equal(a.scale, b.scale)
    # q_proj and k_proj are never clipped: same alpha, same scales, same codes
    assert torch.equal(with_clip.layers[0].self_attn.q_proj.codes, without.layers[0].self_attn.q_proj.codes)


def _calib():
    return torch.randint(0, 97, (8, 24), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("mode", ["tie", "input_scale", "skip"])
def test_model(mode):
    from llmu.quant import QuantLinear, quantize_model

    model, ids = tiny_llama(0), _calib()
    before = copy.deepcopy(model.state_dict())
    ref = model(ids).logits
    q = quantize_model_awq(model, ids, 3, group_size=16, gqa_o_proj=mode)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # untouched
    layers = [m for m in q.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 14
    with_scale = [n for n, m in q.named_modules() if isinstance(m, QuantLinear) and m.input_scale is not None]
    assert with_scale == (["layers.0.self_attn.o_proj", "layers.1.self_attn.o_proj"] if mode == "input_scale" else [])
    assert len(q.awq_alpha) == 2 and ("o" in q.awq_alpha[0]) == (mode != "skip")
    rtn = quantize_model(model, "rtn", 3, group_size=16)
    err = lambda m: float(((m(ids).logits - ref) ** 2).mean())  # noqa: E731
    assert err(q) < err(rtn)
    if mode == "tie":
        via = quantize_model(model, "awq", 3, group_size=16, calibration=ids)
        torch.testing.assert_close(via(ids).logits, q(ids).logits)


def test_model_skip_and_inplace():
    from llmu.models.llama import Linear
    from llmu.quant import QuantLinear

    model, ids = tiny_llama(0), _calib()
    ref = model(ids).logits
    q = quantize_model_awq(model, ids, 8, group_size=16, skip=("layers.0",), inplace=True)
    assert q is model
    assert all(isinstance(m, Linear) for m in q.layers[0].modules() if isinstance(m, (Linear, QuantLinear)))
    assert isinstance(q.layers[1].mlp.up_proj, QuantLinear)
    torch.testing.assert_close(q(ids).logits, ref, rtol=0.05, atol=0.05)  # 8 bits: close to float


@pytest.mark.parametrize("call,err,match", [
    (lambda m, ids: quantize_model_awq(m, ids, 4, group_size=16, gqa_o_proj="fold"), ValueError, "gqa_o_proj"),
    (lambda m, ids: quantize_model_awq(m, ids, 4, group_size=10), ValueError, "does not divide"),
    (lambda m, ids: quantize_model_awq(m, ids, 7, group_size=16), ValueError, "bits"),
    (lambda m, ids: quantize_model_awq(m, "text", 4, group_size=16), TypeError, "calibration"),
    (lambda m, ids: fold_layer_scales(m.layers[0], {"qkv": torch.ones(5)}), ValueError, "scales\\['qkv'\\]"),
    (lambda m, ids: fold_layer_scales(m.layers[0], {"qkv": -torch.ones(48)}), ValueError, "positive"),
    (lambda m, ids: fold_layer_scales(m.layers[0], {"ffn": torch.ones(48)}), ValueError, "unknown group"),
    (lambda m, ids: fold_layer_scales(m.layers[0], {}, gqa_o_proj="x"), ValueError, "gqa_o_proj"),
    (lambda m, ids: awq_search(torch.ones(10), [torch.ones(4, 10)], 4), ValueError, "x must be"),
    (lambda m, ids: awq_search(torch.ones(3, 10), [torch.ones(4, 8)], 4, group_size=4), ValueError, "inputs"),
    (lambda m, ids: awq_search(torch.ones(3, 8), [], 4), ValueError, "at least one"),
    (lambda m, ids: awq_search(torch.ones(3, 8), [torch.ones(4, 8)], 4, n_grid=0), ValueError, "n_grid"),
    (lambda m, ids: awq_search(torch.ones(3, 8), [torch.ones(4, 8)], 4, group_size=3), ValueError, "divide"),
    (lambda m, ids: clip_search(torch.ones(8), torch.ones(4, 8), 4, group_size=4), ValueError, "x must be"),
    (lambda m, ids: clip_search(torch.ones(3, 8), torch.ones(4, 6), 4, group_size=2), ValueError, "inputs"),
    (lambda m, ids: clip_search(torch.ones(3, 8), torch.ones(4, 8), 4, group_size=3), ValueError, "divide"),
    (lambda m, ids: clip_search(torch.ones(3, 8), torch.ones(4, 8), 4, group_size=4, max_shrink=1.0), ValueError,
     "max_shrink"),
    (lambda m, ids: clip_search(torch.ones(3, 8), torch.ones(4, 8), 4, group_size=4, n_grid=0), ValueError, "n_grid"),
    (lambda m, ids: apply_clip(torch.ones(4, 8), torch.ones(4, 3), 4), ValueError, "ratios"),
])
def test_bad_inputs(call, err, match):
    with pytest.raises(err, match=match):
        call(tiny_llama(0), _calib())
