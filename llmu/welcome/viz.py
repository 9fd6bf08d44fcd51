"""Module 00's picture: which Triton program covers which elements of a vector."""

from __future__ import annotations

import math

import plotly.express as px
import plotly.graph_objects as go

__all__ = ["program_map", "program_map_figure"]


def program_map(n: int, block: int) -> list[tuple[int, int, bool]]:
    """``(program, lane, active)`` for every lane of every program that a launch over ``n``
    elements with ``BLOCK_SIZE = block`` starts: element ``program * block + lane`` is read and
    written only where ``active`` (the mask ``offset < n``) is true."""
    if n < 1 or block < 1:
        raise ValueError(f"n and block must be positive, got n={n}, block={block}")
    programs = math.ceil(n / block)
    return [(p, lane, p * block + lane < n) for p in range(programs) for lane in range(block)]


def program_map_figure(n: int, block: int) -> go.Figure:
    """One square per lane, coloured by program; masked-off lanes of the last program in grey."""
    cells = program_map(n, block)
    programs = cells[-1][0] + 1
    palette = px.colors.qualitative.Plotly
    fig = go.Figure()
    for p in range(programs):
        lanes = [c for c in cells if c[0] == p]
        on = [c for c in lanes if c[2]]
        off = [c for c in lanes if not c[2]]
        fig.add_trace(go.Scatter(
            x=[p * block + c[1] for c in on], y=[0] * len(on), mode="markers",
            marker=dict(symbol="square", size=14, color=palette[p % len(palette)]),
            name=f"program {p}", hovertemplate="element %{x}<br>program " + str(p) + "<extra></extra>",
        ))
        if off:
            fig.add_trace(go.Scatter(
                x=[p * block + c[1] for c in off], y=[0] * len(off), mode="markers",
                marker=dict(symbol="square-x-open", size=14, color="lightgray"),
                name="masked off", hovertemplate="offset %{x} ≥ N: masked<extra></extra>",
            ))
    fig.update_layout(
        title=f"N = {n}, BLOCK_SIZE = {block}: grid = cdiv({n}, {block}) = {programs} program(s), "
              f"{programs * block - n} masked lane(s)",
        height=220, margin=dict(l=20, r=20, t=50, b=30),
        yaxis=dict(visible=False), xaxis=dict(title="offset = pid * BLOCK_SIZE + lane"),
    )
    return fig
