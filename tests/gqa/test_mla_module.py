"""llmu.gqa.mla (MLA as a module with its latent cache) and llmu.grading.mla (how notebook 07's
exercise 5 reads a learner's cache and decode step).

Tolerances: in float64 the module's two paths and the reference functions differ only by the
order of the sums, about 1e-15 at these sizes; 1e-10 leaves a wide margin and still catches any
wrong formula (they are off by 0.1 or more). In float32 the absorbed decode is within 1e-6 of the
unabsorbed layer here (24-bit mantissa, a few hundred products per output); the notebook's 1e-4
is checked with the same margin.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import llmu  # noqa: F401
from llmu.gqa import reference as R
from llmu.gqa.mla import WEIGHT_NAMES, LatentCache, MLAAttention
from llmu.grading.mla import OpShapes, cache_numel, op_shapes, per_head_tensors, tensors_in

F64 = dict(atol=1e-10, rtol=1e-10)
F32 = dict(atol=1e-5, rtol=1e-5)

# (d_model, n_heads, head_dim, latent_dim, rope_dim): the notebook's, ragged ones, one head, a tiny one
SHAPES = [(64, 4, 16, 32, 8), (40, 3, 12, 20, 6), (24, 1, 8, 12, 4), (18, 2, 6, 10, 2)]


def _layer(shape, dtype=torch.float64, seed=0):
    d_model, h, dh, dc, dr = shape
    p = R.MLAWeights.random(d_model=d_model, n_heads=h, head_dim=dh, latent_dim=dc, rope_dim=dr, dtype=dtype, seed=seed)
    return p, MLAAttention(p)


def _x(b, t, d_model, dtype=torch.float64, seed=1):
    return torch.randn(b, t, d_model, dtype=dtype, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("b, t", [(1, 1), (2, 9), (3, 17)])
def test_forward_is_the_unabsorbed_layer_and_caches_the_latents(shape, b, t):
    p, layer = _layer(shape)
    x = _x(b, t, shape[0])
    out, cache = layer(x)
    torch.testing.assert_close(out, R.mla_unabsorbed(x, p), **F64)
    c, k_r = p.latent(x, torch.arange(t))
    torch.testing.assert_close(cache.c, c, **F64)
    torch.testing.assert_close(cache.k_r, k_r, **F64)
    assert len(cache) == t and cache.batch == b
    assert cache.numel() == cache_numel(cache) == b * t * (p.latent_dim + p.rope_dim)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("b, prompt, steps", [(1, 1, 10), (2, 5, 4), (3, 7, 3)])
def test_decode_steps_equal_the_whole_sequence_and_the_library_decode(shape, b, prompt, steps):
    p, layer = _layer(shape, seed=2)
    x = _x(b, prompt + steps, shape[0], seed=3)
    full = R.mla_unabsorbed(x, p)
    _, cache = layer(x[:, :prompt])
    c, k_r = p.latent(x[:, :prompt], torch.arange(prompt))
    for s in range(prompt, prompt + steps):
        old = cache
        out, cache = layer.decode(x[:, s:s + 1], cache)
        lib, c, k_r = R.mla_decode(x[:, s:s + 1], c, k_r, p)
        assert out.shape == (b, 1, shape[0])
        torch.testing.assert_close(out, full[:, s:s + 1], **F64)
        torch.testing.assert_close(out, lib, **F64)
        assert len(old) == s and len(cache) == s + 1          # a new cache; the old one is left as it was
    torch.testing.assert_close(cache.c, c, **F64)
    torch.testing.assert_close(cache.k_r, k_r, **F64)
    assert cache_numel(cache) == b * (prompt + steps) * (p.latent_dim + p.rope_dim)


def test_float32_decode_within_1e_6_of_the_unabsorbed_layer():
    """The figure behind the notebook's tolerance (1e-4): float32 rounding of regrouped sums."""
    p, layer = _layer(SHAPES[0], torch.float32, seed=6)
    x = _x(2, 9, 64, torch.float32, seed=6)
    full = R.mla_unabsorbed(x, p)
    _, cache = layer(x[:, :5])
    worst = 0.0
    for s in range(5, 9):
        out, cache = layer.decode(x[:, s:s + 1], cache)
        worst = max(worst, (out - full[:, s:s + 1]).abs().max().item())
    assert worst < 1e-6
    torch.testing.assert_close(out, full[:, 8:], **F32)


def test_empty_cache_decode_is_a_one_token_prefill():
    p, layer = _layer(SHAPES[1])
    x = _x(2, 1, 40)
    out, cache = layer.decode(x, layer.empty_cache(2))
    torch.testing.assert_close(out, R.mla_unabsorbed(x, p), **F64)
    assert len(cache) == 1


def test_module_holds_the_weights_as_parameters_and_trains():
    p, layer = _layer(SHAPES[0])
    assert isinstance(layer, nn.Module)
    params = dict(layer.named_parameters())
    assert sorted(params) == sorted(WEIGHT_NAMES)
    for name in WEIGHT_NAMES:
        assert torch.equal(params[name], getattr(p, name))
        assert params[name].data_ptr() != getattr(p, name).data_ptr()   # copied, not shared
    out, _ = layer(_x(2, 6, 64))
    out.square().sum().backward()
    assert all(params[n].grad is not None and params[n].grad.abs().sum() > 0 for n in WEIGHT_NAMES)
    back = layer.to_weights()
    for name in WEIGHT_NAMES:
        assert torch.equal(getattr(back, name), getattr(p, name))
    assert (back.n_heads, back.head_dim, back.rope_dim, back.rope_base) == (p.n_heads, p.head_dim, p.rope_dim,
                                                                           p.rope_base)


def test_module_moves_with_to():
    p, layer = _layer(SHAPES[1], torch.float32)
    layer = layer.to(torch.float64)
    x = _x(1, 5, 40)
    p64 = R.MLAWeights(*(getattr(p, n).double() for n in WEIGHT_NAMES), p.n_heads, p.head_dim, p.rope_dim)
    torch.testing.assert_close(layer(x)[0], R.mla_unabsorbed(x, p64), **F64)


@pytest.mark.parametrize("shape", SHAPES)
def test_decode_builds_no_per_head_key_or_value(shape):
    d_model, h, dh, dc, dr = shape
    p, layer = _layer(shape, torch.float32)
    x = _x(1, 17, d_model, torch.float32)
    _, cache = layer(x[:, :16])
    (out, _), shapes = op_shapes(layer.decode, x[:, 16:], cache)
    assert shapes, "the recorder saw no operation"
    assert per_head_tensors(shapes, positions=(16, 17), n_heads=h, head_dim=dh) == []
    # the forward pass, which rebuilds them, is flagged
    _, shapes = op_shapes(layer, x)
    assert per_head_tensors(shapes, positions=17, n_heads=h, head_dim=dh)


def test_unabsorbed_decode_is_flagged_however_it_is_written():
    p, layer = _layer(SHAPES[1], torch.float32)
    x = _x(1, 17, 40, torch.float32)
    _, cache = layer(x[:, :16])
    c = torch.cat([cache.c, x[:, 16:] @ layer.w_dkv], 1)

    def matmul(c):
        return c @ layer.w_uk                                                       # (1, 17, 36)

    def einsum(c):
        return torch.einsum("btc,chd->bhtd", c, layer.w_uk.view(20, 3, 12))         # (1, 3, 17, 12)

    def one_head_at_a_time(c):
        return [c @ layer.w_uv[:, 12 * i:12 * (i + 1)] for i in range(3)]          # (1, 17, 12) each

    def old_cache_only(c):
        return cache.c @ layer.w_uk                                                 # (1, 16, 36)

    for fn in (matmul, einsum, one_head_at_a_time, old_cache_only):
        _, shapes = op_shapes(fn, c)
        assert per_head_tensors(shapes, positions=(16, 17), n_heads=3, head_dim=12), fn.__name__


def test_per_head_tensors_rules():
    shapes = [("a", (1, 3, 1, 17)), ("b", (3, 17, 20)), ("c", (1, 3, 1, 12)), ("d", (204,)), ("e", (51, 12)),
              ("f", (17, 17)), ("g", (12, 36))]
    flagged = per_head_tensors(shapes, positions=17, n_heads=3, head_dim=12)
    assert [op for op, _ in flagged] == ["d", "e"]          # 17 * 12 flattened; 3 * 17 rows of d_h
    with pytest.raises(ValueError, match="n_heads"):
        per_head_tensors(shapes, positions=17, n_heads=0, head_dim=12)
    with pytest.raises(ValueError, match="positions"):
        per_head_tensors(shapes, positions=(), n_heads=3, head_dim=12)
    with pytest.raises(ValueError, match="positions"):
        per_head_tensors(shapes, positions=0, n_heads=3, head_dim=12)


def test_op_shapes_records_views_and_results():
    a, b = torch.randn(2, 5, 3), torch.randn(3, 4)
    with OpShapes() as rec:
        y = (a @ b).transpose(1, 2)
    assert (2, 5, 4) in [s for _, s in rec.shapes] and y.shape == (2, 4, 5)
    assert ("transpose", (2, 4, 5)) in rec.shapes
    with OpShapes() as rec:
        parts = torch.randn(1, 6, 4).split(2, dim=1)                # a tuple of tensors: each recorded
        y = torch.nn.functional.linear(parts[0], torch.randn(3, 4))
    assert [s for _, s in rec.shapes].count((1, 2, 4)) == 3 and (1, 2, 3) in [s for _, s in rec.shapes]


def test_op_shapes_does_not_import_dynamo():
    """Entering the recorder is free: no torch._dynamo import (seconds, and memory, on a laptop)."""
    import subprocess
    import sys

    code = ("import sys, torch; from llmu.grading.mla import op_shapes; op_shapes(torch.matmul, torch.ones(2, 2), "
            "torch.ones(2, 2)); print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@dataclasses.dataclass
class _Pair:
    c: torch.Tensor
    k_r: torch.Tensor
    length: int


class _Slotted:
    __slots__ = ("c", "k_r")

    def __init__(self, c, k_r):
        self.c, self.k_r = c, k_r


def test_tensors_in_any_structure_each_tensor_once():
    c, k_r = torch.zeros(2, 5, 8), torch.zeros(2, 5, 3)
    want = 2 * 5 * 11
    layer = nn.Linear(4, 4)
    for cache in ((c, k_r), [c, k_r], {"c": c, "k_r": k_r}, _Pair(c, k_r, 5), _Slotted(c, k_r),
                  {"layers": [(c, k_r)]}, (c, k_r, c), (c, k_r, layer), _Pair(c, k_r, 5).__dict__ | {"me": layer}):
        assert cache_numel(cache) == want, cache
    assert tensors_in((c, [k_r, {"x": c}])) == [c, k_r]
    loop = [c]
    loop.append(loop)                                        # a cycle is walked once
    assert cache_numel(loop) == c.numel()
    assert cache_numel((c, k_r, torch.zeros(()))) == want + 1   # a tensor counter counts
    assert cache_numel(None) == 0 and cache_numel("text") == 0


@pytest.mark.parametrize("call, error, match", [
    (lambda layer: MLAAttention({"w_dkv": torch.zeros(2, 2)}), TypeError, "MLAWeights"),
    (lambda layer: layer(torch.zeros(5, 40)), ValueError, "x must be"),
    (lambda layer: layer(torch.zeros(1, 4, 41)), ValueError, "d_model = 40"),
    (lambda layer: layer(torch.zeros(1, 0, 40)), ValueError, "x must be"),
    (lambda layer: layer([[0.0]]), TypeError, "x must be a torch.Tensor"),
    (lambda layer: layer.decode(torch.zeros(2, 2, 40), layer(torch.zeros(2, 3, 40))[1]), ValueError, "x_new"),
    (lambda layer: layer.decode(torch.zeros(1, 1, 40), layer(torch.zeros(2, 3, 40))[1]), ValueError, "cache must be"),
    (lambda layer: layer.decode(torch.zeros(1, 1, 40), LatentCache(torch.zeros(1, 3, 7), torch.zeros(1, 3, 6))),
     ValueError, "d_c = 20"),
    (lambda layer: layer.decode(torch.zeros(1, 1, 40), (torch.zeros(1, 3, 20), torch.zeros(1, 3, 6))), TypeError,
     "LatentCache"),
    (lambda layer: LatentCache(torch.zeros(1, 3, 20), torch.zeros(1, 4, 6)), ValueError, "one B and T"),
    (lambda layer: LatentCache(torch.zeros(1, 3, 20), None), TypeError, "k_r"),
    (lambda layer: layer.empty_cache(0), ValueError, "batch"),
])
def test_bad_inputs(call, error, match):
    _, layer = _layer(SHAPES[1], torch.float32)
    with pytest.raises(error, match=match):
        call(layer)
