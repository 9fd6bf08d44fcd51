"""Mixed precision: a format for each projection, its cost in bits per weight, and the model it gives.

A **plan** maps projections of SmolLM2's blocks, named as :func:`~llmu.quant.apply.quantize_model`
names them (``"layers.7.mlp.down_proj"``), to a round-to-nearest format ``(bits, group_size)``:
asymmetric codes of ``bits`` bits with an fp16 scale and an fp16 zero point per group of
``group_size`` inputs (``llmu.quant.formats``). A weight in that format costs

    bits + 32 / group_size    bits          (4-bit groups of 64: 4.5; 4-bit groups of 192: 4.17)

and a plan's **bits per weight** is the total over its projections (codes plus 32 bits per group,
an integer) divided by their number of weights. The embedding table (tied to the LM head) and the
norms are not projections of the blocks and stay in float: they count in no plan.

- :func:`projection_shapes`: ``{name: (N, K)}`` of a model's projections, in the model's order;
- :func:`plan_bits` / :func:`bits_per_weight`: what a *complete* plan costs;
- :func:`budget_plan`: a two-level plan under a budget, from a score per projection (the
  reference of notebook 10's exercise 5): every projection starts at ``low``, and the projections
  move to ``high`` in order of decreasing score, each one only if the plan still fits the budget;
- :func:`quantized` / :func:`plan_perplexity`: the model with the projections of a plan (complete
  or not) quantized by a given quantizer, and its perplexity on a text. The model is changed in
  place for the duration and put back afterwards: no copy of its 425 MB of projections is made.

Exercise 5's recipe (:data:`BUDGET`, :func:`experiment_ids`): perplexity on the first
:data:`HELDOUT_TOKENS` tokens of the Gospel of Luke after its first quarter (the text section 6's
table evaluates on, never calibrated on), in one window; sensitivities are measured on
:data:`CALIB_TOKENS` tokens of the first quarter. ``python -m llmu.quant.plan`` (one thread, about
a minute) measures, with ``llmu.quant.quantize`` as the quantizer, the held-out perplexities the
notebook's thresholds come from:

======================================================================  =======  ===========
plan                                                                    bits/wt  perplexity
======================================================================  =======  ===========
float32 (the reference: the file's Q4_1 weights, dequantized)              32.0      18.19
uniform RTN, 4 bits in groups of 192                                       4.167      27.05
uniform RTN, 4 bits in groups of 64 (the budget, exactly)                  4.500      26.25
4-bit g192, 8-bit g64 for random projections up to 4.5 (seeds 0-5)       4.496  26.28-27.12
4-bit g192, 8-bit g64 by a scan of the blocks (32 tokens, 3-bit g64)       4.496      23.04
======================================================================  =======  ===========

The exercise's threshold, 25.5, lies between uniform RTN at the budget (26.25) and the scan's
plan (23.04; scans on other calibration tokens, 32 from token 64, 48 and 64 from token 0, 64 from
token 64, give 23.90, 24.10, 23.82 and 23.91). Two finer plans measured once with these functions (each of the 210 projections
alone at 3-bit g64 on 512 calibration tokens, 210 runs): the same two formats by that score, 23.12;
by that score per weight, 25.03. The held-out text is short: uniform 4-bit g64 gives 26.25 on it
and 24.52 on the 2,048 tokens after it, so a plan's gain moves by a few per cent from text to text.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping

import torch
import torch.nn as nn

from llmu.quant.formats import QuantizedTensor, quantize
from llmu.quant.linear import QuantLinear

__all__ = ["BUDGET", "CALIB_TOKENS", "FORMAT_BITS", "HELDOUT_TOKENS", "budget_plan", "bits_per_weight",
           "experiment_ids", "format_cost", "plan_bits", "plan_perplexity", "projection_shapes", "quantized",
           "uniform_plan"]

#: Bit widths a plan may give a projection.
FORMAT_BITS = (2, 3, 4, 8)
#: Exercise 5's budget, in bits per weight: uniform RTN at 4 bits in groups of 64 costs exactly this.
BUDGET = 4.5
#: Exercise 5's held-out text (tokens, one window) and calibration text (tokens).
HELDOUT_TOKENS = 1024
CALIB_TOKENS = 256


def projection_shapes(model: nn.Module) -> dict[str, tuple[int, int]]:
    """``{name: (out_features, in_features)}`` of every projection of the model's blocks, in order
    (the layers :func:`~llmu.quant.apply.quantize_model` quantizes; the tied LM head is not one)."""
    from llmu.quant.apply import _linears

    if not hasattr(model, "replace_linears"):
        raise TypeError(f"model must be an llmu LlamaModel (with replace_linears), got {type(model).__name__}")
    return {name: (int(m.out_features), int(m.in_features)) for name, m in _linears(model)}


def _check_shapes(shapes) -> dict[str, tuple[int, int]]:
    if not isinstance(shapes, Mapping) or not shapes:
        raise ValueError(f"shapes must be a non-empty dict name -> (N, K), got {type(shapes).__name__}")
    out = {}
    for name, shape in shapes.items():
        try:
            n, k = shape
        except (TypeError, ValueError):
            raise ValueError(f"shapes[{name!r}] must be (N, K), got {shape!r}") from None
        if any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in (n, k)):
            raise ValueError(f"shapes[{name!r}] must be two positive ints (N, K), got {shape!r}")
        out[name] = (n, k)
    return out


def _check_format(fmt, what: str, ks=()) -> tuple[int, int]:
    """``fmt`` as ``(bits, group_size)``, checked against every input dimension in ``ks``."""
    try:
        bits, group_size = fmt
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a format (bits, group_size), got {fmt!r}") from None
    if isinstance(bits, bool) or bits not in FORMAT_BITS:
        raise ValueError(f"{what}: bits must be one of {FORMAT_BITS}, got {bits!r}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"{what}: group_size must be a positive int, got {group_size!r}")
    bad = sorted({k for k in ks if k % group_size})
    if bad:
        raise ValueError(f"{what}: group_size {group_size} does not divide the input dimension {bad[0]}")
    return int(bits), int(group_size)


def format_cost(fmt) -> float:
    """Bits per weight of a format ``(bits, group_size)``: ``bits + 32 / group_size`` (an fp16 scale
    and an fp16 zero point per group)."""
    bits, group_size = _check_format(fmt, "fmt")
    return bits + 32 / group_size


def _check_plan(plan, shapes, *, complete: bool) -> dict[str, tuple[int, int]]:
    if not isinstance(plan, Mapping):
        raise TypeError(f"plan must be a dict name -> (bits, group_size), got {type(plan).__name__}")
    unknown = [name for name in plan if name not in shapes]
    if unknown:
        raise ValueError(f"plan names {len(unknown)} layer(s) that are not projections, e.g. {unknown[0]!r} "
                         f"(names look like {next(iter(shapes))!r})")
    if complete:
        missing = [name for name in shapes if name not in plan]
        if missing:
            raise ValueError(f"plan gives no format to {len(missing)} projection(s), e.g. {missing[0]!r}: "
                             "every projection needs one")
    return {name: _check_format(plan[name], f"plan[{name!r}]", (shapes[name][1],)) for name in shapes if name in plan}


def plan_bits(plan, shapes) -> int:
    """Total bits of a complete plan: per projection ``N * K * bits`` of codes and 32 bits per group
    (``N * K / group_size`` groups). ValueError for a missing or unknown projection, a bad format,
    or a group size that does not divide the projection's ``K``."""
    shapes = _check_shapes(shapes)
    plan = _check_plan(plan, shapes, complete=True)
    total = 0
    for name, (bits, group_size) in plan.items():
        n, k = shapes[name]
        total += n * k * bits + 32 * n * (k // group_size)
    return total


def bits_per_weight(plan, shapes) -> float:
    """A complete plan's average bits per weight: :func:`plan_bits` over the number of weights."""
    shapes = _check_shapes(shapes)
    return plan_bits(plan, shapes) / sum(n * k for n, k in shapes.values())


def uniform_plan(shapes, bits: int, group_size: int) -> dict[str, tuple[int, int]]:
    """Every projection of ``shapes`` at ``(bits, group_size)``."""
    shapes = _check_shapes(shapes)
    fmt = _check_format((bits, group_size), "format", [k for _, k in shapes.values()])
    return {name: fmt for name in shapes}


def budget_plan(scores, shapes, budget, low, high) -> dict[str, tuple[int, int]]:
    """A two-level plan within ``budget`` bits per weight, from a score per projection.

    Every projection starts at format ``low``; then, in order of decreasing score (ties in the
    order of ``shapes``), each projection moves to ``high`` if the plan's total bits stay at most
    ``budget`` times the number of weights, and stays at ``low`` otherwise (a later, smaller one
    may still fit). Returns ``{name: format}`` in the order of ``shapes``.

    ValueError: ``scores`` not naming exactly the projections of ``shapes`` or holding a value that
    is not a finite number; ``budget`` not a finite number (a bool is not one), or below the cost
    of ``low`` everywhere; ``low`` or ``high`` not a format whose group size divides every ``K``;
    ``high`` not costing more bits per weight than ``low``.
    """
    shapes = _check_shapes(shapes)
    if not isinstance(scores, Mapping) or set(scores) != set(shapes):
        got = set(scores) if isinstance(scores, Mapping) else set()
        diff = sorted((got - set(shapes)) | (set(shapes) - got))
        raise ValueError(f"scores must name exactly the projections of shapes (differ on {diff[:3]})")
    for name, s in scores.items():
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s):
            raise ValueError(f"scores[{name!r}] must be a finite number, got {s!r}")
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not math.isfinite(budget):
        raise ValueError(f"budget must be a finite number of bits per weight, got {budget!r}")
    ks = [k for _, k in shapes.values()]
    low, high = _check_format(low, "low", ks), _check_format(high, "high", ks)
    if format_cost(high) <= format_cost(low):
        raise ValueError(f"high {high} must cost more bits per weight than low {low} "
                         f"({format_cost(high):g} against {format_cost(low):g})")
    plan = {name: low for name in shapes}
    allowed = budget * sum(n * k for n, k in shapes.values())
    total = plan_bits(plan, shapes)
    if total > allowed:
        raise ValueError(f"budget {budget} is below the cost of low {low} everywhere "
                         f"({format_cost(low):g} bits per weight)")

    def cost(name, fmt):
        n, k = shapes[name]
        return n * k * fmt[0] + 32 * n * (k // fmt[1])

    for name in sorted(shapes, key=lambda name: -scores[name]):  # sorted is stable: ties keep shapes' order
        extra = cost(name, high) - cost(name, low)
        if total + extra <= allowed:
            plan[name] = high
            total += extra
    return plan


#: A quantizer: ``(w (N, K), bits, group_size) -> (codes (N, K) uint8, scale, zero (N, K // G))``,
#: exercise 1's ``my_quantize`` (asymmetric).
Quantizer = Callable[[torch.Tensor, int, int], tuple]


def _llmu_quantizer(w, bits, group_size):
    qt = quantize(w, bits, group_size=group_size)
    return qt.codes, qt.scale, qt.zero


def _layer(linear: nn.Module, bits: int, group_size: int, quantizer: Quantizer, name: str) -> QuantLinear:
    weight = linear.weight.detach()
    out = quantizer(weight, bits, group_size)
    try:
        codes, scale, zero = out
    except (TypeError, ValueError):
        raise TypeError(f"{name}: the quantizer must return (codes, scale, zero), got {type(out).__name__}") from None
    for field, t in (("codes", codes), ("scale", scale), ("zero", zero)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: the quantizer's {field} must be a tensor, got {type(t).__name__}")
    if codes.is_floating_point() and codes.numel() and not torch.equal(codes, codes.round()):
        raise ValueError(f"{name}: the quantizer's codes must be integers")
    codes = codes.detach().round().clamp(0, 255).to(torch.uint8) if codes.dtype != torch.uint8 else codes.detach()
    qt = QuantizedTensor(codes.contiguous(), scale.detach().float().contiguous(), zero.detach().float().contiguous(),
                         bits, group_size, False, "group", torch.float32)
    qt.validate(f"{name} (the quantizer's output)")
    bias = getattr(linear, "bias", None)
    return QuantLinear(qt, None if bias is None else bias.detach()).to(weight.device)


@contextlib.contextmanager
def quantized(model: nn.Module, plan, quantizer: Quantizer | None = None):
    """Inside the ``with`` block, each projection named in ``plan`` is a :class:`QuantLinear` holding
    ``quantizer(weight, bits, group_size)``'s codes (llmu's :func:`~llmu.quant.formats.quantize` by
    default); projections the plan does not name stay as they are. The original layers come back
    on exit, whatever happens inside::

        with quantized(model, {"layers.29.mlp.down_proj": (3, 64)}, my_quantize):
            ppl = perplexity(model, ids)
    """
    shapes = projection_shapes(model)
    plan = _check_plan(plan, shapes, complete=False)
    quantizer = _llmu_quantizer if quantizer is None else quantizer
    if not callable(quantizer):
        raise TypeError(f"quantizer must be callable (w, bits, group_size) -> (codes, scale, zero), "
                        f"got {type(quantizer).__name__}")
    swapped = []
    try:
        with torch.no_grad():
            for name, (bits, group_size) in plan.items():
                parent_name, _, child = name.rpartition(".")
                parent = model.get_submodule(parent_name)
                original = getattr(parent, child)
                setattr(parent, child, _layer(original, bits, group_size, quantizer, name))
                swapped.append((parent, child, original))
        yield model
    finally:
        for parent, child, original in reversed(swapped):
            setattr(parent, child, original)


def plan_perplexity(model: nn.Module, plan, ids: torch.Tensor, quantizer: Quantizer | None = None) -> float:
    """Perplexity on ``ids`` (one sequence, scored in one window) of ``model`` with the projections
    of ``plan`` quantized by ``quantizer`` (:func:`quantized`); the model is unchanged afterwards."""
    from llmu.models.perplexity import perplexity

    if not isinstance(ids, torch.Tensor) or ids.ndim != 1 or ids.is_floating_point() or len(ids) < 2:
        raise ValueError(f"ids must be a 1-D tensor of at least 2 token ids, got "
                         f"{getattr(ids, 'shape', type(ids).__name__)}")
    n = len(ids)
    with quantized(model, plan, quantizer):
        return perplexity(model, ids, window=n, stride=n - 1, max_batch_tokens=n)


def experiment_ids(tokenizer=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exercise 5's texts: (calibration ids, held-out ids). The Gospel of Luke is cut as in section
    6's table (its first quarter calibrates); the calibration ids are the first :data:`CALIB_TOKENS`
    tokens of that quarter, the held-out ids the first :data:`HELDOUT_TOKENS` tokens after it."""
    from llmu.data import text
    from llmu.quant.calibration import split_ids

    if tokenizer is None:
        from llmu.models import load_tokenizer

        tokenizer = load_tokenizer()
    luke = torch.tensor(tokenizer.encode(text("luke_kjv"), add_special_tokens=False), dtype=torch.long)
    calib, heldout = split_ids(luke, 0.25)
    return calib[:CALIB_TOKENS].clone(), heldout[:HELDOUT_TOKENS].clone()


def main(argv=None) -> None:
    """Measure the figures of the module docstring (``python -m llmu.quant.plan``)."""
    import argparse
    import random

    from llmu.models import load_model, load_tokenizer

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--draws", type=int, default=6, help="random plans to score")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model, tokenizer = load_model(), load_tokenizer()
    shapes = projection_shapes(model)
    calib, heldout = experiment_ids(tokenizer)
    low, high = (4, 192), (8, 64)

    def row(label, plan):
        bits = bits_per_weight(plan, shapes) if plan else 32.0
        print(f"{label:58s} {bits:6.3f} {plan_perplexity(model, plan, heldout):9.3f}", flush=True)

    row("float32", {})
    row("uniform 4-bit g192", uniform_plan(shapes, 4, 192))
    row("uniform 4-bit g64", uniform_plan(shapes, 4, 64))
    for seed in range(args.draws):
        draw = random.Random(seed)
        row(f"4-bit g192, 8-bit g64 at random (seed {seed})",
            budget_plan({name: draw.random() for name in shapes}, shapes, BUDGET, low, high))
    scan_ids = calib[:32]
    base = plan_perplexity(model, {}, scan_ids)
    cost = {}
    for i in range(model.config.num_hidden_layers):
        block = {name: (3, 64) for name in shapes if name.startswith(f"layers.{i}.")}
        cost[i] = plan_perplexity(model, block, scan_ids) - base
    scores = {name: cost[int(name.split(".")[1])] for name in shapes}
    row("4-bit g192, 8-bit g64 by a scan of the blocks", budget_plan(scores, shapes, BUDGET, low, high))


if __name__ == "__main__":
    main()
