"""What a number format can represent, drawn over the weights it has to represent (module 10).

A format is a finite set of values. Quantizing a weight means replacing it by the nearest member
of the set, after a *scale* has stretched the set over the weights' range. Where the set is dense
the weights land close to where they were; where it is sparse, far. Two shapes of set:

- **integers** (int8, int4): evenly spaced, ``2^b`` values from ``-absmax`` to ``absmax``. The
  spacing is the same everywhere, so the many small weights near zero (a weight matrix is roughly
  bell-shaped) share the same coarse grid as the rare large ones;
- **floats** (E4M3, E5M2, bf16): each binade ``[2^e, 2^(e+1))`` holds the same number of values
  (``2^mantissa_bits``), so the spacing grows with the magnitude: fine near zero, coarse at the
  ends. The *relative* error is about the same for every value, which suits bell-shaped data.

:func:`format_values` gives a format's values once scaled for a weight tensor (per-tensor
symmetric, as :func:`llmu.quant.formats.fake_quantize` and :func:`llmu.quant.formats.to_fp8` scale
them), :func:`round_to_format` the weights rounded to them, :func:`format_error` what that costs,
and :func:`number_line` the picture: a histogram of the weights above a strip of ticks, one per
representable value, zoomable toward zero.
"""

from __future__ import annotations

import numpy as np
import torch

from llmu.quant.formats import FP8_FORMATS, check_weight, fake_quantize, from_fp8, representable_values, to_fp8

__all__ = ["PICTURE_FORMATS", "format_values", "round_to_format", "format_error", "number_line"]

#: The formats the picture knows, and how many bits each spends per weight (scales aside).
PICTURE_FORMATS = {"int8": 8, "int4": 4, "e4m3": 8, "e5m2": 8, "bf16": 16}
_MAX_TICKS = 1500  # more ticks than this in view are drawn as a band, not one by one


def _check_fmt(fmt: str) -> str:
    if fmt not in PICTURE_FORMATS:
        raise ValueError(f"fmt must be one of {list(PICTURE_FORMATS)}, got {fmt!r}")
    return fmt


def format_values(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """The values ``fmt`` can give the weights ``w`` (sorted, float64), scaled per tensor.

    Integers: ``q * s`` for every signed code ``q`` with ``s = absmax / (2^(b-1) - 1)`` (the
    symmetric per-tensor scale; the lowest code ``-2^(b-1)`` is then never used and is left out).
    FP8: every finite value times ``s = absmax / max_finite``. bf16: every finite bf16 value, no
    scale (the exponent covers any weight's range).
    """
    check_weight(w)
    _check_fmt(fmt)
    values = representable_values(fmt)
    absmax = float(w.detach().abs().max())
    if fmt in ("int8", "int4"):
        top = 2 ** (PICTURE_FORMATS[fmt] - 1) - 1
        values = values[values >= -top]
        return values * (absmax / top if absmax > 0 else 1.0)
    if fmt in FP8_FORMATS:
        return values * (absmax / torch.finfo(FP8_FORMATS[fmt]).max if absmax > 0 else 1.0)
    return values


def round_to_format(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """``w`` rounded to ``fmt`` (per-tensor symmetric scale) and back to float32."""
    check_weight(w)
    _check_fmt(fmt)
    if fmt in ("int8", "int4"):
        return fake_quantize(w, PICTURE_FORMATS[fmt], symmetric=True, granularity="tensor").float()
    if fmt in FP8_FORMATS:
        return from_fp8(*to_fp8(w, fmt))
    return w.detach().to(torch.bfloat16).float()


def format_error(w: torch.Tensor, fmt: str) -> dict:
    """How ``fmt`` treats ``w``: relative error ``||w - r|| / ||w||``, the share of nonzero weights
    rounded to zero, and how many distinct values the rounded tensor uses (``r`` the rounded ``w``)."""
    r = round_to_format(w, fmt)
    wf = w.detach().float()
    nonzero = wf != 0
    return {
        "format": fmt,
        "bits": PICTURE_FORMATS[fmt],
        "relative error": float((wf - r).norm() / wf.norm()) if wf.norm() > 0 else 0.0,
        "flushed to zero": float((r[nonzero] == 0).float().mean()) if nonzero.any() else 0.0,
        "values used": int(torch.unique(r).numel()),
    }


def number_line(w: torch.Tensor, fmt: str = "int4", *, zoom: float = 1.0, bins: int = 160, title: str | None = None):
    """A histogram of ``w`` over ``[-zoom * absmax, zoom * absmax]`` with ``fmt``'s values as ticks.

    ``zoom`` in ``(0, 1]``: 1 shows the whole range, 0.01 the hundredth around zero (where most
    weights are). Returns a plotly figure: the weights' histogram on top (log count), the values the
    format can take below, and the format's error on the whole tensor in the title.
    """
    from plotly.subplots import make_subplots

    from llmu import viz

    check_weight(w)
    _check_fmt(fmt)
    if isinstance(zoom, bool) or not isinstance(zoom, (int, float)) or not 0 < zoom <= 1:
        raise ValueError(f"zoom must be a number in (0, 1], got {zoom!r}")
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
        raise ValueError(f"bins must be a positive int, got {bins!r}")
    wf = w.detach().float().flatten().cpu().numpy()
    absmax = float(np.abs(wf).max()) or 1.0
    lo, hi = -zoom * absmax, zoom * absmax
    counts, edges = np.histogram(wf, bins=bins, range=(lo, hi))
    values = format_values(w, fmt).numpy()
    shown = values[(values >= lo) & (values <= hi)]
    err = format_error(w, fmt)

    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.78, 0.22], vertical_spacing=0.04)
    centers = (edges[:-1] + edges[1:]) / 2
    fig.add_bar(x=centers, y=np.where(counts > 0, counts, np.nan), width=edges[1] - edges[0],
                marker_color=viz.COLORS[5], name="weights", row=1, col=1)
    if len(shown) <= _MAX_TICKS:
        fig.add_scatter(x=shown, y=np.zeros_like(shown), mode="markers", name=f"{fmt} values",
                        marker=dict(symbol="line-ns-open", size=22, color=viz.COLORS[3], line=dict(width=1)),
                        row=2, col=1)
        strip = f"{len(shown)} {fmt} values in view"
    else:  # too dense to draw one by one: a band, and the count
        fig.add_scatter(x=[lo, hi], y=[0, 0], mode="lines", name=f"{fmt} values",
                        line=dict(color=viz.COLORS[3], width=18), row=2, col=1)
        strip = f"{len(shown):,} {fmt} values in view (a band: too dense to draw one by one)"
    fig.update_yaxes(type="log", title_text="weights", row=1, col=1)
    fig.update_yaxes(visible=False, range=[-1, 1], row=2, col=1)
    fig.update_xaxes(range=[lo, hi], title_text="value", row=2, col=1)
    fig.update_layout(showlegend=False)
    head = title or f"{fmt} over the weights"
    return viz.style(fig, f"{head}: {strip}<br><sup>whole tensor: relative error "
                     f"{err['relative error']:.2%}, {err['flushed to zero']:.1%} of weights rounded to 0, "
                     f"{err['values used']:,} distinct values used</sup>")
