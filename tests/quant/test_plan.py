"""``llmu.quant.plan``: what a plan costs, the two-level plan under a budget, and the model with a
plan's projections quantized (on the tiny decoder; SmolLM2 only in the test marked slow).

Costs are integers (codes plus 32 bits per group), so the budget tests compare exactly. The
quantized model is compared with the float model whose weights are replaced by the dequantized
ones: the same numbers reach the same matmul, so the logits agree to float32 rounding (1e-5 of the
largest logit).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from llmu.models import Linear, tiny_llama
from llmu.models.perplexity import perplexity
from llmu.quant import QuantLinear, dequantize, plan as qplan, quantize

#: SmolLM2-135M's projections, by shape (30 blocks of these seven).
SMOLLM2_BLOCK = {"self_attn.q_proj": (576, 576), "self_attn.k_proj": (192, 576), "self_attn.v_proj": (192, 576),
                 "self_attn.o_proj": (576, 576), "mlp.gate_proj": (1536, 576), "mlp.up_proj": (1536, 576),
                 "mlp.down_proj": (576, 1536)}
SMOLLM2 = {f"layers.{i}.{p}": s for i in range(30) for p, s in SMOLLM2_BLOCK.items()}


def test_format_cost():
    assert qplan.format_cost((4, 64)) == 4.5
    assert qplan.format_cost((8, 32)) == 9.0
    assert qplan.format_cost((3, 192)) == pytest.approx(3 + 1 / 6)
    for bad in ((5, 64), (4, 0), (True, 64), (4, 64.0), 4, (4,)):
        with pytest.raises(ValueError):
            qplan.format_cost(bad)


def test_plan_bits_counts_codes_and_32_bits_per_group():
    shapes = {"a": (4, 64), "b": (3, 96)}                   # odd N, K not a power of two
    plan = {"a": (4, 32), "b": (3, 48)}
    assert qplan.plan_bits(plan, shapes) == 4 * 64 * 4 + 32 * 4 * 2 + 3 * 96 * 3 + 32 * 3 * 2
    assert qplan.bits_per_weight(plan, shapes) == qplan.plan_bits(plan, shapes) / (4 * 64 + 3 * 96)


@pytest.mark.parametrize("fmt, expected", [((4, 64), 4.5), ((4, 192), 4 + 1 / 6), ((8, 64), 8.5), ((3, 32), 4.0)])
def test_uniform_plans_on_smollm2_cost_their_format(fmt, expected):
    plan = qplan.uniform_plan(SMOLLM2, *fmt)
    assert qplan.bits_per_weight(plan, SMOLLM2) == pytest.approx(expected, abs=1e-12)


def test_plans_that_do_not_fit_are_refused():
    shapes = {"a": (4, 64), "b": (3, 96)}
    with pytest.raises(ValueError, match="no format"):
        qplan.plan_bits({"a": (4, 32)}, shapes)
    with pytest.raises(ValueError, match="not projections"):
        qplan.plan_bits({"a": (4, 32), "b": (4, 32), "c": (4, 32)}, shapes)
    with pytest.raises(ValueError, match="does not divide"):
        qplan.plan_bits({"a": (4, 64), "b": (4, 64)}, shapes)   # 64 does not divide 96
    with pytest.raises(ValueError, match="does not divide"):
        qplan.uniform_plan(SMOLLM2, 4, 128)                     # the usual 128 does not divide 576
    with pytest.raises(TypeError):
        qplan.plan_bits([("a", (4, 32))], shapes)
    with pytest.raises(ValueError):
        qplan.plan_bits({"a": (4, 32)}, {"a": (4, -64)})


# -- budget_plan ----------------------------------------------------------------------------------

SMALL = {"x": (2, 64), "y": (2, 64), "z": (4, 64)}        # 128, 128 and 256 weights


@pytest.mark.parametrize("budget, high", [(4.5, []), (5.5, ["y"]), (6.5, ["x", "y"]), (7.5, ["y", "z"]),
                                          (8.5, ["x", "y", "z"]), (100, ["x", "y", "z"])])
def test_budget_plan_moves_the_highest_scores_that_fit(budget, high):
    # all at (4, 64) cost 4.5 * 512 bits; moving x or y to (8, 64) costs 512 more, z 1024:
    # at 6.5 the spare 1024 bits take y, then z does not fit, and x (a lower score) still does
    plan = qplan.budget_plan({"x": 1.0, "y": 3.0, "z": 2.0}, SMALL, budget, (4, 64), (8, 64))
    assert list(plan) == list(SMALL)
    assert sorted(n for n, f in plan.items() if f == (8, 64)) == high
    assert all(f == (4, 64) for n, f in plan.items() if n not in high)
    assert qplan.bits_per_weight(plan, SMALL) <= budget


def test_budget_plan_ties_keep_the_order_of_shapes():
    for order in (["c", "a", "b"], ["b", "a", "c"]):
        shapes = {n: (2, 64) for n in order}
        plan = qplan.budget_plan({n: 0.5 for n in order}, shapes, 4.5 + 4 / 3, (4, 64), (8, 64))
        assert [n for n, f in plan.items() if f == (8, 64)] == order[:1]


@pytest.mark.parametrize("seed", range(6))
def test_budget_plan_is_within_budget_and_maximal(seed):
    """Random shapes (odd row counts, K multiples of 48), scores and budgets: the plan fits, and no
    projection left at low could still move to high (greedy leaves none that fits)."""
    r = random.Random(seed)
    shapes = {f"p{i}": (r.randrange(1, 40), 48 * r.randrange(1, 5)) for i in range(r.randrange(1, 25))}
    scores = {n: r.choice([r.random(), 0.5, -1.0]) for n in shapes}
    low, high = r.choice([((4, 48), (8, 48)), ((3, 16), (4, 16)), ((2, 48), (8, 16))])
    lo, hi = qplan.format_cost(low), qplan.format_cost(high)
    budget = lo + r.random() * (hi - lo)
    plan = qplan.budget_plan(scores, shapes, budget, low, high)
    weights = sum(n * k for n, k in shapes.values())
    total = qplan.plan_bits(plan, shapes)
    assert total <= budget * weights
    for name, fmt in plan.items():
        n, k = shapes[name]
        if fmt == low:
            assert total + n * k * (hi - lo) > budget * weights - 1e-6
    assert set(plan.values()) <= {low, high}


def test_budget_plan_on_smollm2_against_a_direct_greedy():
    g = torch.Generator().manual_seed(0)
    scores = {n: float(v) for n, v in zip(SMOLLM2, torch.rand(len(SMOLLM2), generator=g))}
    plan = qplan.budget_plan(scores, SMOLLM2, 4.5, (4, 192), (8, 64))
    assert qplan.bits_per_weight(plan, SMOLLM2) <= 4.5
    spare = 4.5 * sum(n * k for n, k in SMOLLM2.values()) - qplan.plan_bits(qplan.uniform_plan(SMOLLM2, 4, 192), SMOLLM2)
    moved = []
    for name in sorted(SMOLLM2, key=lambda n: -scores[n]):
        n, k = SMOLLM2[name]
        extra = n * k * 4 + 32 * n * k // 64 - 32 * n * k // 192
        if extra <= spare:
            moved.append(name)
            spare -= extra
    assert sorted(n for n, f in plan.items() if f == (8, 64)) == sorted(moved)


@pytest.mark.parametrize("args, match", [
    (({"x": 1.0, "y": 1.0}, SMALL, 6.0, (4, 64), (8, 64)), "exactly the projections"),
    (({"x": 1.0, "y": 1.0, "z": 1.0, "w": 1.0}, SMALL, 6.0, (4, 64), (8, 64)), "exactly the projections"),
    (({"x": 1.0, "y": float("nan"), "z": 1.0}, SMALL, 6.0, (4, 64), (8, 64)), "finite number"),
    (({"x": 1.0, "y": 1.0, "z": 1.0}, SMALL, 4.4, (4, 64), (8, 64)), "below the cost"),
    (({"x": 1.0, "y": 1.0, "z": 1.0}, SMALL, float("inf"), (4, 64), (8, 64)), "finite number"),
    (({"x": 1.0, "y": 1.0, "z": 1.0}, SMALL, True, (4, 64), (8, 64)), "finite number"),
    (({"x": 1.0, "y": 1.0, "z": 1.0}, SMALL, 6.0, (8, 64), (4, 64)), "more bits"),
    (({"x": 1.0, "y": 1.0, "z": 1.0}, SMALL, 6.0, (4, 64), (4, 64)), "more bits"),
    (({"x": 1.0, "y": 1.0, "z": 1.0}, SMALL, 6.0, (4, 64), (8, 128)), "does not divide"),
    (({"x": 1.0, "y": 1.0, "z": 1.0}, SMALL, 6.0, (4, 64), (16, 64)), "bits must be"),
])
def test_budget_plan_refuses_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        qplan.budget_plan(*args)


# -- the model with a plan's projections quantized ---------------------------------------------------

def _ids(n=40, seed=0):
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed))


def _fake_quantized_copy(model, plan):
    """The float model with each planned weight replaced by its dequantized RTN codes."""
    import copy

    ref = copy.deepcopy(model)
    for name, (bits, gs) in plan.items():
        layer = ref.get_submodule(name)
        layer.weight.data.copy_(dequantize(quantize(layer.weight.detach(), bits, group_size=gs)))
    return ref


@pytest.mark.parametrize("partial", [False, True])
def test_quantized_swaps_the_layers_in_and_out(partial):
    model = tiny_llama(0)
    shapes = qplan.projection_shapes(model)
    plan = {n: ((8, 16) if i % 3 else (3, 48)) for i, n in enumerate(shapes)}
    if partial:
        plan = {n: f for i, (n, f) in enumerate(plan.items()) if i % 2}
    before = {n: model.get_submodule(n) for n in shapes}
    ids = _ids()[None]
    want = _fake_quantized_copy(model, plan)(ids).logits
    with qplan.quantized(model, plan) as m:
        assert m is model
        assert all(isinstance(model.get_submodule(n), QuantLinear) == (n in plan) for n in shapes)
        got = model(ids).logits
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    assert all(model.get_submodule(n) is before[n] and isinstance(before[n], Linear) for n in shapes)


def test_quantized_puts_the_layers_back_after_an_error():
    model = tiny_llama(1)
    shapes = qplan.projection_shapes(model)
    before = {n: model.get_submodule(n) for n in shapes}
    with pytest.raises(RuntimeError, match="inside"):
        with qplan.quantized(model, qplan.uniform_plan(shapes, 4, 16)):
            raise RuntimeError("inside")
    assert all(model.get_submodule(n) is before[n] for n in shapes)

    calls = []

    def bad_quantizer(w, bits, group_size):   # a scale of 0 in the 5th layer it is given
        calls.append(1)
        qt = quantize(w, bits, group_size=group_size)
        return qt.codes, qt.scale * (len(calls) != 5), qt.zero

    with pytest.raises(ValueError, match="zeros"):
        with qplan.quantized(model, qplan.uniform_plan(shapes, 4, 16), bad_quantizer):
            pass
    assert all(model.get_submodule(n) is before[n] for n in shapes)
    with pytest.raises(TypeError, match="codes, scale, zero"):
        with qplan.quantized(model, {"layers.0.mlp.up_proj": (4, 16)}, lambda w, b, g: w):
            pass
    with pytest.raises(ValueError, match="not projections"):
        with qplan.quantized(model, {"layers.9.mlp.up_proj": (4, 16)}):
            pass
    assert all(model.get_submodule(n) is before[n] for n in shapes)


def test_a_quantizer_of_float_codes_is_taken_as_integers():
    model = tiny_llama(2)
    plan = {"layers.1.mlp.down_proj": (4, 32)}

    def float_codes(w, bits, group_size):
        qt = quantize(w, bits, group_size=group_size)
        return qt.codes.float(), qt.scale.double(), qt.zero

    ids = _ids(seed=3)
    assert qplan.plan_perplexity(model, plan, ids, float_codes) == qplan.plan_perplexity(model, plan, ids)


def test_plan_perplexity_is_the_fake_quantized_models():
    model = tiny_llama(3)
    shapes = qplan.projection_shapes(model)
    plan = qplan.uniform_plan(shapes, 3, 16)
    ids = _ids(33, seed=4)                                 # one window of 33: 32 scored tokens
    want = perplexity(_fake_quantized_copy(model, plan), ids, window=33, stride=32)
    assert qplan.plan_perplexity(model, plan, ids) == pytest.approx(want, rel=1e-5)
    assert qplan.plan_perplexity(model, {}, ids) == pytest.approx(perplexity(model, ids, window=33, stride=32),
                                                                  rel=1e-6)
    with pytest.raises(ValueError):
        qplan.plan_perplexity(model, plan, ids[None])
    with pytest.raises(TypeError):
        qplan.projection_shapes(torch.nn.Linear(2, 2))


@pytest.mark.slow
def test_smollm2_recipe(smollm2):
    """SmolLM2's 210 projections; the experiment's texts; a plan of one quantized layer changes the
    perplexity and leaves the model as it was."""
    model, tokenizer = smollm2
    shapes = qplan.projection_shapes(model)
    assert shapes == SMOLLM2
    calib, heldout = qplan.experiment_ids(tokenizer)
    assert calib.shape == (qplan.CALIB_TOKENS,) and heldout.shape == (qplan.HELDOUT_TOKENS,)
    ids = calib[:64]
    ref = qplan.plan_perplexity(model, {}, ids)
    hit = qplan.plan_perplexity(model, {"layers.29.mlp.down_proj": (2, 64)}, ids)
    assert math.isfinite(ref) and hit > ref
    assert qplan.plan_perplexity(model, {}, ids) == ref
