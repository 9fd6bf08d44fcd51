"""AWQ (Lin et al., 2023): scale the weights that see large activations up before rounding them.

A projection's output ``y = W x`` is a sum over input channels; a few channels carry activations
far larger than the rest (the *salient* ones), and the rounding error of their weights is
multiplied by those large inputs. AWQ does not keep them in float. It uses an identity::

    W x  =  (W diag(s)) (x / s)          for any positive per-input-channel scales s

and quantizes ``W diag(s)`` instead of ``W``. With ``s_j > 1`` for a salient channel ``j``, its
weights span more of their group's range, so their *relative* rounding error shrinks (the group's
scale is set by its largest weight and barely moves when only a few columns grow), while
``x_j / s_j`` makes the error count for less in the output.

How large should ``s`` be? AWQ measures the mean magnitude of each input channel over the
calibration tokens, ``s_x = mean |x|``, and searches one exponent ``alpha``::

    s = s_x ^ alpha, normalised so that sqrt(max(s) min(s)) = 1,    alpha on a grid of 20 in [0, 1)

keeping the ``alpha`` whose *quantized* group (the projections that read the same input: q/k/v,
or gate/up) gives the smallest mean squared output error on the calibration tokens. ``alpha = 0``
is ``s = 1``, plain RTN, so on those tokens AWQ's error is never larger than RTN's.

The ``1 / s`` costs nothing at inference when it can be *folded* into the operation that produces
``x`` (the scales are applied once to the float weights, then everything is rounded with RTN):

=====================  ==============================================================
projections            where ``1 / s`` goes
=====================  ==============================================================
q_proj, k_proj, v_proj the gain of ``input_layernorm`` (RMSNorm ends with ``* weight``)
gate_proj, up_proj     the gain of ``post_attention_layernorm``
down_proj              the rows of ``up_proj`` (``silu(g) * (u / s)``: the product is linear in u)
o_proj                 the rows of ``v_proj``: attention outputs are weighted sums of values
=====================  ==============================================================

The last one needs care with grouped-query attention. ``o_proj`` reads the ``H * D`` attention
outputs, ``v_proj`` writes ``Hkv * D`` values, and each value row serves the ``H / Hkv`` query
heads of its group. Dividing a value row by ``s`` divides channel ``d`` of *every* head of the
group, so the fold is exact only when the scales agree across the heads of a group.
``gqa_o_proj`` chooses:

- ``"tie"`` (default): search scales from the activation magnitudes averaged over the heads of a
  group, so they agree by construction, and fold them into ``v_proj``;
- ``"input_scale"``: free per-channel scales, kept unfolded as the ``input_scale`` of the
  ``QuantLinear`` (one extra multiply of the input at inference);
- ``"skip"``: leave ``o_proj`` unscaled (what the reference implementation does when the shapes
  of ``v_proj`` and ``o_proj`` differ).

With ``H == Hkv`` (multi-head attention) all three folds are exact and ``"tie"`` is free scaling.

**Clipping** (:func:`clip_search`, AWQ's second search, ``auto_clip`` in the reference code).
After scaling, the weights are rounded with RTN, whose group scale is set by the group's largest
weight. Shrinking that range (clipping the few largest weights of a group to ``r * max|w|``)
gives every other weight of the group a finer step, at the price of an error on the clipped
ones. For each output row and group, :func:`clip_search` tries ``r`` on a grid from 1 down to
``1 - max_shrink`` and keeps the one whose group-partial outputs ``sum_k w[n, k] x[t, k]`` (``k``
in the group) are closest to the float ones on calibration tokens. As in the reference code,
``q_proj`` and ``k_proj`` are not clipped (their error matters through the attention scores,
which this per-group output measure does not see). ``clip=False`` turns it off.
"""

from __future__ import annotations

import copy

import torch

from llmu.quant.formats import _check_format, check_weight, fake_quantize, quantize
from llmu.quant.gptq import _calibration_batch, _skipped, check_model_format

__all__ = ["GQA_O_PROJ", "apply_clip", "awq_search", "clip_search", "fold_layer_scales", "quantize_model_awq",
           "search_layer_scales"]

GQA_O_PROJ = ("tie", "input_scale", "skip")

#: The groups AWQ scales, by key: the projections that read one input.
GROUPS = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}


def _normalise(s: torch.Tensor) -> torch.Tensor:
    s = s.clamp(min=1e-4)
    return s / (s.max() * s.min()).sqrt()


def awq_search(x: torch.Tensor, weights, bits: int = 4, *, n_grid: int = 20, tie=None, max_tokens: int | None = 4096,
               **fmt) -> tuple[torch.Tensor, float, list[float]]:
    """The AWQ scales for the projections ``weights`` (each ``(N_i, K)``) that read inputs ``x`` ``(tokens, K)``.

    ``fmt`` is the RTN format (``group_size``, ``symmetric``, ``granularity``). ``tie``: an
    optional function that averages a ``(K,)`` vector over channels that must share a scale.
    ``max_tokens``: use at most this many tokens (evenly spaced) for the error. Returns
    ``(s (K,), best alpha, mean squared output error for each alpha of the grid)``.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.ndim != 2:
        raise ValueError(f"x must be a 2-D float tensor of inputs (tokens, K), got "
                         f"{getattr(x, 'shape', type(x).__name__)}")
    if isinstance(weights, torch.Tensor):
        weights = [weights]
    if not weights:
        raise ValueError("weights must hold at least one (N, K) matrix")
    for i, w in enumerate(weights):
        check_weight(w, f"weights[{i}]")
        if w.shape[1] != x.shape[1]:
            raise ValueError(f"weights[{i}] has {w.shape[1]} inputs but x has {x.shape[1]} features")
    if isinstance(n_grid, bool) or not isinstance(n_grid, int) or n_grid < 1:
        raise ValueError(f"n_grid must be a positive int, got {n_grid!r}")
    x = x.float()
    if max_tokens is not None and x.shape[0] > max_tokens:
        x = x[torch.linspace(0, x.shape[0] - 1, max_tokens).long()]
    # -- the statistic: mean |x| per input channel
    s_x = x.abs().mean(dim=0)
    ws = [w.detach().float() for w in weights]
    refs = [x @ w.T for w in ws]
    errors, best, best_s = [], None, None
    for i in range(n_grid):
        alpha = i / n_grid
        s = s_x.pow(alpha)
        if tie is not None:  # after the power: pow may round equal inputs differently (vector vs scalar code)
            s = tie(s)
        s = _normalise(s)
        # -- quantize W diag(s), feed x / s: the output error this alpha costs
        xs = x / s
        err = sum(float(((xs @ fake_quantize(w * s, bits, **fmt).float().T - y) ** 2).mean())
                  for w, y in zip(ws, refs))
        errors.append(err)
        if best is None or err < errors[best]:
            best, best_s = i, s
    return best_s, best / n_grid, errors


def _gqa_tie(num_heads: int, num_kv_heads: int, head_dim: int):
    n_rep = num_heads // num_kv_heads

    def tie(v: torch.Tensor) -> torch.Tensor:
        # channel h*D + d of the attention output; heads h of one KV group share channel d's scale
        return v.view(num_kv_heads, n_rep, head_dim).mean(dim=1, keepdim=True).expand(-1, n_rep, -1).reshape(-1)
    return tie


def _o_mode(layer, gqa_o_proj: str) -> str:
    attn = layer.self_attn
    if attn.num_heads == attn.num_kv_heads:
        return "fold"  # MHA: every o_proj channel has its own value row
    return gqa_o_proj


def search_layer_scales(layer, inputs: dict, bits: int, *, gqa_o_proj: str = "tie", skip=(), prefix: str = "",
                        n_grid: int = 20, max_tokens: int | None = 4096, **fmt) -> dict:
    """AWQ scales of one block's four groups from their captured ``inputs`` (name -> ``(tokens, K)``).

    Returns ``{"qkv": s, "o": s, "gate_up": s, "down": s}`` (groups entirely in ``skip`` and an
    o_proj under ``gqa_o_proj="skip"`` are left out), with ``result["alpha"]`` the chosen exponents.
    """
    attn = layer.self_attn
    out, alphas = {}, {}
    for key, names in GROUPS.items():
        kept = [n for n in names if not _skipped(f"{prefix}{n}", skip)]
        if not kept:
            continue
        tie = None
        if key == "o":
            mode = _o_mode(layer, gqa_o_proj)
            if mode == "skip":
                continue
            if mode == "tie":
                tie = _gqa_tie(attn.num_heads, attn.num_kv_heads, attn.head_dim)
        ws = [layer.get_submodule(n).weight for n in kept]
        out[key], alphas[key], _ = awq_search(inputs[names[0]], ws, bits, n_grid=n_grid, tie=tie,
                                              max_tokens=max_tokens, **fmt)
    out["alpha"] = alphas
    return out


@torch.no_grad()
def fold_layer_scales(layer, scales: dict, *, gqa_o_proj: str = "tie") -> dict:
    """Apply AWQ ``scales`` to one block in place: ``W diag(s)`` for the projections, ``1 / s`` folded.

    ``scales``: any of ``"qkv"``, ``"o"``, ``"gate_up"``, ``"down"`` -> ``(K,)`` positive scales.
    The block computes the same function afterwards (up to float rounding) - except for an o_proj
    scale that cannot be folded exactly (GQA with ``gqa_o_proj="input_scale"``, or scales that differ
    across the heads of a KV group): o_proj is then left untouched and ``{"self_attn.o_proj": s}``
    is returned, for the caller to quantize ``W diag(s)`` and multiply o_proj's input by ``1 / s``
    (``QuantLinear(..., input_scale=1 / s)``).
    """
    if gqa_o_proj not in GQA_O_PROJ:
        raise ValueError(f"gqa_o_proj must be one of {GQA_O_PROJ}, got {gqa_o_proj!r}")
    for key, s in scales.items():
        if key == "alpha":
            continue
        if key not in GROUPS:
            raise ValueError(f"scales has an unknown group {key!r}; groups are {sorted(GROUPS)}")
        k = layer.get_submodule(GROUPS[key][0]).in_features
        if not isinstance(s, torch.Tensor) or s.shape != (k,) or not torch.isfinite(s).all() or not (s > 0).all():
            raise ValueError(f"scales[{key!r}] must be ({k},) finite positive scales, got "
                             f"{getattr(s, 'shape', type(s).__name__)}")
    attn, mlp = layer.self_attn, layer.mlp
    leftover = {}

    def scale_columns(names, s):
        for n in names:
            lin = layer.get_submodule(n)
            lin.weight.mul_(s.to(lin.weight.dtype)[None, :])

    def scale_rows(lin, s):
        lin.weight.div_(s.to(lin.weight.dtype)[:, None])
        if lin.bias is not None:
            lin.bias.div_(s.to(lin.bias.dtype))

    if "qkv" in scales:
        s = scales["qkv"]
        layer.input_layernorm.weight.div_(s.to(layer.input_layernorm.weight.dtype))
        scale_columns(GROUPS["qkv"], s)
    if "gate_up" in scales:
        s = scales["gate_up"]
        layer.post_attention_layernorm.weight.div_(s.to(layer.post_attention_layernorm.weight.dtype))
        scale_columns(GROUPS["gate_up"], s)
    if "down" in scales:
        s = scales["down"]
        scale_rows(mlp.up_proj, s)
        scale_columns(GROUPS["down"], s)
    if "o" in scales:
        s = scales["o"]
        h, hkv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
        per_head = s.view(hkv, h // hkv, d)
        # tied: equal across the heads of each group (to float rounding; then made exactly equal)
        tied = torch.allclose(per_head, per_head[:, :1].expand_as(per_head), rtol=1e-6, atol=0)
        if (tied and gqa_o_proj != "input_scale") or h == hkv:
            s = per_head[:, :1].expand_as(per_head).reshape(-1)
            # -- each value row (KV head g, channel d) carries the scale its query heads share
            scale_rows(attn.v_proj, per_head[:, 0].reshape(-1))
            scale_columns(GROUPS["o"], s)
        else:
            leftover["self_attn.o_proj"] = s  # o_proj left as it is: the caller quantizes W diag(s)
    return leftover


@torch.no_grad()
def clip_search(x: torch.Tensor, w: torch.Tensor, bits: int = 4, *, n_grid: int = 20, max_shrink: float = 0.5,
                n_tokens: int = 512, rows_per_batch: int = 64, **fmt) -> torch.Tensor:
    """AWQ's clipping ratios ``(N, K / G)`` for ``w`` ``(N, K)`` read by inputs ``x`` ``(tokens, K)``.

    For each row and group of ``G`` inputs (``fmt``: ``group_size``, ``symmetric``,
    ``granularity`` as :func:`~llmu.quant.formats.quantize`), the ratio ``r`` in
    ``1, 1 - 1/n_grid, ...`` (down to ``1 - max_shrink``, excluded) whose clipped and RTN-rounded
    weights ``clamp(w, -r m, r m)`` (``m`` the group's largest ``|w|``) give group-partial outputs
    closest to the float ones on ``n_tokens`` evenly spaced tokens. ``r = 1`` is plain RTN, so on
    those tokens the chosen clip is never worse than none.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.ndim != 2:
        raise ValueError(f"x must be a 2-D float tensor of inputs (tokens, K), got {getattr(x, 'shape', type(x).__name__)}")
    check_weight(w)
    if w.shape[1] != x.shape[1]:
        raise ValueError(f"w has {w.shape[1]} inputs but x has {x.shape[1]} features")
    if isinstance(n_grid, bool) or not isinstance(n_grid, int) or n_grid < 1:
        raise ValueError(f"n_grid must be a positive int, got {n_grid!r}")
    if isinstance(max_shrink, bool) or not isinstance(max_shrink, (int, float)) or not 0 <= max_shrink < 1:
        raise ValueError(f"max_shrink must be a number in [0, 1), got {max_shrink!r}")
    n, k = w.shape
    g = _check_format(bits, fmt.get("granularity", "group"), fmt.get("group_size", 128), k)
    x = x.float()
    if x.shape[0] > n_tokens:
        x = x[torch.linspace(0, x.shape[0] - 1, n_tokens).long()]
    xg = x.reshape(-1, k // g, g)                                   # (T, groups, G)
    ratios = torch.empty(n, k // g)
    steps = [1 - i / n_grid for i in range(int(max_shrink * n_grid))] or [1.0]
    for r0 in range(0, n, rows_per_batch):
        wg = w[r0:r0 + rows_per_batch].detach().float().reshape(-1, k // g, g)  # (rows, groups, G)
        ref = torch.einsum("tgk,ngk->ntg", xg, wg)                  # group-partial outputs
        absmax = wg.abs().amax(dim=2, keepdim=True)
        best_err = torch.full(wg.shape[:2], float("inf"))
        best = torch.ones(wg.shape[:2])
        for r in steps:
            # -- clip the group to [-r m, r m], round it, compare the partial outputs
            m = absmax * r
            clipped = torch.maximum(torch.minimum(wg, m), -m)
            q = fake_quantize(clipped.reshape(-1, k), bits, **fmt).float().reshape(wg.shape)
            err = (torch.einsum("tgk,ngk->ntg", xg, q) - ref).pow(2).mean(dim=1)   # (rows, groups)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best = torch.where(better, torch.full_like(best, r), best)
        ratios[r0:r0 + rows_per_batch] = best
    return ratios


def apply_clip(w: torch.Tensor, ratios: torch.Tensor, group_size: int) -> torch.Tensor:
    """``w`` ``(N, K)`` with each group's weights clamped to ``[-r m, r m]`` (``m`` its largest ``|w|``,
    ``r`` from ``ratios`` ``(N, K / G)``); a new tensor."""
    n, k = w.shape
    if ratios.shape != (n, k // group_size):
        raise ValueError(f"ratios must be (N, K / group_size) = {(n, k // group_size)}, got {tuple(ratios.shape)}")
    wg = w.reshape(n, k // group_size, group_size)
    m = wg.abs().amax(dim=2, keepdim=True) * ratios.to(w.dtype)[..., None]
    return torch.maximum(torch.minimum(wg, m), -m).reshape(n, k)


#: Projections AWQ does not clip (as the reference: their error acts through the attention scores).
NO_CLIP = ("self_attn.q_proj", "self_attn.k_proj")


def quantize_model_awq(model, calibration=None, bits: int = 4, *, group_size: int = 128, symmetric: bool = False,
                       granularity: str = "group", inplace: bool = False, skip=(), gqa_o_proj: str = "tie",
                       n_grid: int = 20, max_tokens: int | None = 4096, clip: bool = True, n_samples: int = 16,
                       seq_len: int = 256, seed: int = 0, batch_size: int = 8, log=None):
    """Every projection of the blocks quantized with AWQ scales and RTN; returns the model (a copy unless ``inplace``).

    Block by block: capture the float inputs of the four groups on the calibration tokens, search
    each group's scales (:func:`awq_search`), fold them (:func:`fold_layer_scales`), move the
    calibration hidden states through the (float, rescaled: same function) block. Then every
    projection is rounded with RTN into a ``QuantLinear``. ``calibration``, ``skip`` and ``log``
    as in :func:`llmu.quant.gptq.quantize_model_gptq`; ``gqa_o_proj`` as in this module's docstring.
    ``clip``: also search each group's clipping ratio (:func:`clip_search`; not with
    ``granularity="tensor"``). ``model.awq_alpha`` records the chosen exponents, per layer.
    """
    from llmu.quant.calibration import BlockRunner
    from llmu.quant.linear import QuantLinear

    if gqa_o_proj not in GQA_O_PROJ:
        raise ValueError(f"gqa_o_proj must be one of {GQA_O_PROJ}, got {gqa_o_proj!r}")
    check_model_format(model, bits, granularity, group_size, skip)
    fmt = dict(group_size=group_size, symmetric=symmetric, granularity=granularity)
    ids = _calibration_batch(calibration, n_samples, seq_len, seed)
    if not inplace:
        model = copy.deepcopy(model)
    runner = BlockRunner(model, ids, batch_size=batch_size)
    leftovers, alphas, clips = [], [], {}
    for li, layer in enumerate(model.layers):
        names = [GROUPS[k][0] for k in GROUPS]
        inputs = runner.capture(layer, names)
        scales = search_layer_scales(layer, inputs, bits, gqa_o_proj=gqa_o_proj, skip=skip, prefix=f"layers.{li}.",
                                     n_grid=n_grid, max_tokens=max_tokens, **fmt)
        alphas.append(scales.pop("alpha"))
        leftovers.append(fold_layer_scales(layer, scales, gqa_o_proj=gqa_o_proj))
        if clip and granularity != "tensor":
            # -- clipping ratios of the scaled weights, from the inputs they will read (x / s)
            for key, group in GROUPS.items():
                x = inputs[group[0]]
                s = scales.get(key, leftovers[-1].get(group[0]))
                if s is not None:
                    x = x / s
                for nm in group:
                    if nm in NO_CLIP or _skipped(f"layers.{li}.{nm}", skip):
                        continue
                    w = layer.get_submodule(nm).weight
                    if nm in leftovers[-1]:
                        w = w * leftovers[-1][nm][None, :]
                    clips[(li, nm)] = clip_search(x, w, bits, n_grid=n_grid, **fmt)
        del inputs
        runner.advance(layer)
        if log is not None:
            log(f"awq: layer {li} alphas {alphas[-1]}")
    # -- round everything with RTN (o_proj with an unfolded scale quantizes W diag(s), reads x / s)
    for li, layer in enumerate(model.layers):
        for names in GROUPS.values():
            for nm in names:
                if _skipped(f"layers.{li}.{nm}", skip):
                    continue
                parent_name, _, child = nm.rpartition(".")
                parent = layer.get_submodule(parent_name)
                lin = getattr(parent, child)
                bias = None if lin.bias is None else lin.bias.detach().clone()
                s = leftovers[li].get(nm)
                w = lin.weight if s is None else lin.weight * s.to(lin.weight.dtype)[None, :]
                if (li, nm) in clips:
                    w = apply_clip(w, clips[(li, nm)], group_size if granularity == "group" else w.shape[1])
                inv = None if s is None else 1.0 / s
                setattr(parent, child, QuantLinear(quantize(w, bits, **fmt), bias, input_scale=inv))
    model.awq_alpha = alphas
    return model
