"""Roofline pictures (plotly, log-log): one roof per device, points labelled."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import plotly.graph_objects as go

from llmu import viz
from llmu.roofline.model import Roof

__all__ = ["roofline_figure"]

#: Marker symbol per phase of a point.
SYMBOLS = {"prefill": "square", "decode": "circle", "both": "diamond", "unclassified": "x", "measured": "star"}


def roofline_figure(roofs: Sequence[Roof], points: Iterable[dict] = (), title: str | None = None,
                    intensity_range: tuple[float, float] | None = None, show_text: bool = True,
                    highlight: str | None = None, **layout) -> go.Figure:
    """A log-log roofline: x = arithmetic intensity (FLOP/byte), y = GFLOP/s.

    ``roofs``: one line each (the slanted memory roof up to the ridge, then the flat compute roof;
    the ridge is marked). ``points``: dicts with ``intensity``, ``gflops`` (where to draw it), and
    optionally ``label`` (written next to it), ``group`` (one legend entry per group), ``phase``
    (the marker: square = prefill, circle = decode, diamond = both, star = measured) and ``hover``.
    ``highlight``: the name of one roof drawn thicker (the others fade).
    """
    roofs = list(roofs)
    points = list(points)
    if not roofs:
        raise ValueError("roofline_figure needs at least one roof")
    for p in points:
        if not (p.get("intensity", 0) > 0 and p.get("gflops", 0) > 0):
            raise ValueError(f"each point needs intensity > 0 and gflops > 0 (a log-log plot), got {p}")
    if intensity_range is None:
        xs = [r.ridge for r in roofs] + [p["intensity"] for p in points]
        intensity_range = (min(0.1, min(xs) / 2), max(1000.0, max(xs) * 4))
    lo, hi = intensity_range
    fig = go.Figure()
    for i, roof in enumerate(roofs):
        color = viz.COLORS[i % len(viz.COLORS)]
        faded = highlight is not None and roof.name != highlight
        x = np.array([lo, roof.ridge, hi]) if lo < roof.ridge < hi else np.array([lo, hi])
        y = roof.attainable(x) / 1e9
        fig.add_trace(go.Scatter(
            x=x, y=y, mode="lines", name=f"{roof.name} ({roof.dtype})",
            line=dict(color=color, width=1.5 if faded else 3, dash="dot" if roof.source == "measured" else None),
            opacity=0.35 if faded else 1.0,
            hovertemplate=(f"{roof.name}<br>peak {roof.peak_flops / 1e12:.3g} TFLOP/s, "
                           f"{roof.bandwidth / 1e9:.4g} GB/s<br>ridge {roof.ridge:.3g} FLOP/byte<extra></extra>")))
        fig.add_trace(go.Scatter(x=[roof.ridge], y=[roof.peak_flops / 1e9], mode="markers", showlegend=False,
                                 marker=dict(color=color, size=8, symbol="triangle-down"), opacity=0.35 if faded else 1,
                                 hovertemplate=f"{roof.name} ridge: {roof.ridge:.3g} FLOP/byte<extra></extra>"))
    groups: dict[str, list[dict]] = {}
    for p in points:
        groups.setdefault(p.get("group", ""), []).append(p)
    for j, (group, pts) in enumerate(groups.items()):
        fig.add_trace(go.Scatter(
            x=[p["intensity"] for p in pts], y=[p["gflops"] for p in pts],
            mode="markers+text" if show_text else "markers", name=group or "ops", showlegend=bool(group),
            text=[p.get("label", "") for p in pts], textposition="top center", textfont=dict(size=10),
            marker=dict(size=10, symbol=[SYMBOLS.get(p.get("phase"), "circle") for p in pts],
                        color=viz.COLORS[(len(roofs) + j) % len(viz.COLORS)], line=dict(width=1, color="white")),
            hovertext=[p.get("hover", p.get("label", "")) for p in pts], hoverinfo="text"))
    fig.update_xaxes(type="log", range=[np.log10(lo), np.log10(hi)])
    fig.update_yaxes(type="log")
    return viz.style(fig, title or "Roofline", "arithmetic intensity (FLOP / byte)",
                     "attainable GFLOP/s", height=520).update_layout(**layout)
