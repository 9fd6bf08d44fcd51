"""Activation outliers: a few input channels of a layer carry values tens to hundreds of times larger
than the rest, and they are why activations are hard to quantize while weights are easy.

Measured on SmolLM2 (module 10's notebook): the inputs of ``down_proj`` in the last layers reach
magnitudes in the thousands in a handful of channels while the median channel stays near 1, and
the same few channels (the same indices, layer after layer) stand out in the normalised inputs
of ``q_proj`` and ``gate_proj``. One scale for the whole activation tensor (per-tensor int8) is
then set by the outlier: every ordinary value lands on a handful of codes near zero, and its
relative error is large. Per-token scales do not help (every token has the outlier channel);
per-channel scales would, but a matmul cannot apply a different scale to each *input* channel of
``x`` after the integer product. The ways out are the course's next steps: keep activations in
floating point and quantize only weights (weight-only int4/int8), or move the difficulty from
activations to weights with a per-channel rescaling ``x / s``, ``W * s`` (SmoothQuant; AWQ
chooses ``s`` to protect the weights that meet large activations).

- :func:`input_magnitudes`: the largest ``|x|`` of every input channel of every projection, over
  the tokens of a text;
- :func:`outlier_rows`: a table of those, one row per projection (max, median, ratio, top channels);
- :func:`activation_quant_error`: the relative error of quantizing an activation tensor with one
  scale per tensor, per token or per channel;
- :func:`figure`: a heatmap of channel magnitudes over the layers, for one kind of projection.
"""

from __future__ import annotations

import torch

from llmu.quant.formats import quant_params

__all__ = ["PROJECTIONS", "input_magnitudes", "outlier_rows", "activation_quant_error", "figure"]

#: The projections of a Llama block, by the module name's last part.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@torch.inference_mode()
def input_magnitudes(model, input_ids, projections=("q_proj", "o_proj", "gate_proj", "down_proj")) -> dict:
    """``{module name: (K,) float32}``: the largest ``|x|`` each input channel of each chosen projection
    sees over all the tokens of ``input_ids`` (``(B, T)`` or ``(T,)``), one forward pass."""
    unknown = set(projections) - set(PROJECTIONS)
    if unknown:
        raise ValueError(f"projections must be among {PROJECTIONS}, got {sorted(unknown)}")
    mags: dict[str, torch.Tensor] = {}

    def hook(name):
        def record(module, inputs, output):
            x = inputs[0].detach().float().abs().reshape(-1, inputs[0].shape[-1]).amax(dim=0)
            mags[name] = torch.maximum(mags[name], x) if name in mags else x
        return record

    handles = [m.register_forward_hook(hook(name)) for name, m in model.named_modules()
               if name.rsplit(".", 1)[-1] in projections and name.startswith("layers.")]
    if not handles:
        raise ValueError("the model has no projections named layers.<i>.<...>.<projection>")
    try:
        model(input_ids)
    finally:
        for h in handles:
            h.remove()
    return {k: v.cpu() for k, v in mags.items()}


def outlier_rows(mags: dict, top: int = 3) -> list[dict]:
    """One row per projection: layer, projection, max and median channel magnitude, their ratio,
    and the ``top`` largest channels (in the model's order of layers)."""
    rows = []
    for name, m in mags.items():
        parts = name.split(".")
        med = float(m.median())
        rows.append({"layer": int(parts[1]), "projection": parts[-1], "max": float(m.max()), "median": med,
                     "ratio": float(m.max()) / med if med > 0 else float("inf"),
                     "top channels": m.topk(min(top, m.numel())).indices.tolist()})
    return rows


def activation_quant_error(x: torch.Tensor, bits: int = 8, granularity: str = "tensor") -> float:
    """How much symmetric ``bits``-bit quantization of the activations ``x`` (``(tokens, channels)``)
    damages a typical channel: the relative error ``||x_c - deq(q(x))_c|| / ||x_c||`` of each
    channel ``c``, averaged over the channels, with one scale per tensor, per token (row) or per
    channel (column). (The error relative to the whole tensor would hide the damage: an outlier
    channel dominates the tensor's norm and is itself represented well.)"""
    if not isinstance(x, torch.Tensor) or x.ndim != 2 or not x.is_floating_point():
        raise ValueError(f"x must be a 2-D float tensor (tokens, channels), got "
                         f"{getattr(x, 'shape', type(x).__name__)}")
    if granularity not in ("tensor", "token", "channel"):
        raise ValueError(f"granularity must be 'tensor', 'token' or 'channel', got {granularity!r}")
    xf = x.detach().float()
    rows = {"tensor": xf.reshape(1, -1), "token": xf, "channel": xf.t()}[granularity]
    scale, zero = quant_params(rows, bits, symmetric=True)
    q = torch.clamp(torch.round(rows / scale) + zero, 0, 2**bits - 1)
    deq = (q - zero) * scale
    if granularity == "channel":
        deq = deq.t()
    deq = deq.reshape(xf.shape)
    norms = xf.norm(dim=0)
    errs = (xf - deq).norm(dim=0)
    live = norms > 0  # an all-zero channel is represented exactly by any scale
    return float((errs[live] / norms[live]).mean()) if live.any() else 0.0


def figure(mags: dict, projection: str = "down_proj", *, log: bool = True):
    """Heatmap of channel magnitudes (``log10`` by default), one row per layer, for one projection."""
    from llmu import viz

    names = sorted((n for n in mags if n.endswith("." + projection)), key=lambda n: int(n.split(".")[1]))
    if not names:
        raise ValueError(f"no magnitudes recorded for {projection!r}; recorded: "
                         f"{sorted({n.rsplit('.', 1)[-1] for n in mags})}")
    z = torch.stack([mags[n] for n in names])
    if log:
        z = z.clamp_min(1e-6).log10()
    return viz.heatmap(z.numpy(), y=[f"layer {n.split('.')[1]}" for n in names],
                       title=f"largest |input| of each {projection} channel" + (" (log10)" if log else ""),
                       xlabel="input channel", ylabel="", colorscale="Magma")
