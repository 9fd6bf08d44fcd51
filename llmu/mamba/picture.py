"""The Blelloch scan, round by round, as data and as a picture (module 13's interactive figure).

:func:`blelloch_rounds` runs the same up-sweep / down-sweep as ``reference._blelloch`` on a short
sequence of scalar pairs ``(a_t, b_t)`` (one channel, one state index) and records the array
after every round, with the positions the round wrote and where each operand came from.
:func:`scan_figure` draws the rounds up to a given one: one row per round, one box per position
showing ``(a, b)``, the boxes a round wrote highlighted, and a line from each operand to the box it
updated. The last row's ``b`` values are the states ``x_t`` of the recurrence.
"""

from __future__ import annotations

from dataclasses import dataclass

import plotly.graph_objects as go

from llmu import viz
from llmu.mamba.reference import combine

__all__ = ["Round", "blelloch_rounds", "scan_figure"]


@dataclass
class Round:
    """The array after one round: ``pairs[i] = (a, b)``; ``edges`` ``(source, target)`` positions
    that the round combined into ``target`` (a source equal to the target means "its own value")."""

    label: str
    pairs: list[tuple[float, float]]
    written: list[int]
    edges: list[tuple[int, int]]


def blelloch_rounds(a, b) -> list[Round]:
    """Every round of a Blelloch scan of the pairs ``(a[t], b[t])`` (numbers; length a power of two).

    Rounds: the input; ``log2 P`` up-sweep rounds; the root set to the identity ``(1, 0)``;
    ``log2 P`` down-sweep rounds (after them, position ``t`` holds the exclusive prefix
    ``e_0 ∘ ... ∘ e_{t-1}``); one last combine with each ``e_t`` (inclusive prefixes)."""
    a, b = [float(x) for x in a], [float(x) for x in b]
    P = len(a)
    if P == 0 or P & (P - 1) or len(b) != P:
        raise ValueError(f"a and b must have the same power-of-two length, got {len(a)} and {len(b)}")
    x = list(zip(a, b))
    rounds = [Round("input: e_t = (a_t, b_t)", list(x), [], [])]
    s = 2
    while s <= P:                                                   # up-sweep
        written, edges = [], []
        for right in range(s - 1, P, s):
            left = right - s // 2
            x[right] = combine(x[left], x[right])
            written.append(right)
            edges += [(left, right), (right, right)]
        rounds.append(Round(f"up-sweep, stride {s}: block totals", list(x), written, edges))
        s *= 2
    x[P - 1] = (1.0, 0.0)
    rounds.append(Round("root := identity (1, 0)", list(x), [P - 1], []))
    s = P
    while s >= 2:                                                   # down-sweep
        written, edges = [], []
        for right in range(s - 1, P, s):
            left = right - s // 2
            parent, left_total = x[right], x[left]
            x[left], x[right] = parent, combine(parent, left_total)
            written += [left, right]
            edges += [(right, left), (right, right), (left, right)]
        rounds.append(Round(f"down-sweep, stride {s}: prefixes pushed down", list(x), written, edges))
        s //= 2
    x = [combine(x[t], (a[t], b[t])) for t in range(P)]
    rounds.append(Round("exclusive ∘ e_t = inclusive: b is x_t", x, list(range(P)), [(t, t) for t in range(P)]))
    return rounds


def scan_figure(rounds: list[Round], upto: int, title: str | None = None) -> go.Figure:
    """Rounds ``0 .. upto`` of :func:`blelloch_rounds`, one row each (round 0 on top)."""
    if not 0 <= upto < len(rounds):
        raise ValueError(f"upto must be in 0..{len(rounds) - 1}, got {upto}")
    P = len(rounds[0].pairs)
    fig = go.Figure()
    for r in range(1, upto + 1):                                    # operand lines
        for src, dst in rounds[r].edges:
            fig.add_trace(go.Scatter(x=[src, dst], y=[-(r - 1), -r], mode="lines", hoverinfo="skip",
                                     line=dict(color=viz.COLORS[1] if src != dst else "#bbbbbb", width=1.5),
                                     showlegend=False))
    for r in range(upto + 1):                                       # the boxes
        rd = rounds[r]
        colours = [viz.COLORS[0] if (t in rd.written and r == upto) else
                   ("#9ecae1" if t in rd.written else "#eeeeee") for t in range(P)]
        fig.add_trace(go.Scatter(
            x=list(range(P)), y=[-r] * P, mode="markers+text", showlegend=False,
            marker=dict(symbol="square", size=46, color=colours, line=dict(color="#555555", width=1)),
            text=[f"{pa:.2f}<br>{pb:.2f}" for pa, pb in rd.pairs], textfont=dict(size=10),
            hovertext=[f"round {r}, t = {t}: a = {pa:.4f}, b = {pb:.4f}" for t, (pa, pb) in enumerate(rd.pairs)],
            hoverinfo="text"))
    fig.update_yaxes(tickvals=[-r for r in range(len(rounds))],
                     ticktext=[f"{r}: {rounds[r].label}" for r in range(len(rounds))],
                     range=[-(len(rounds) - 0.5), 0.6], showgrid=False, zeroline=False)
    fig.update_xaxes(tickvals=list(range(P)), ticktext=[f"t={t}" for t in range(P)], range=[-0.6, P - 0.4],
                     showgrid=False, zeroline=False, side="top")
    viz.style(fig, title or f"Blelloch scan, round {upto}: {rounds[upto].label}  (box: a above b)",
              width=940, height=120 + 62 * len(rounds))
    fig.update_layout(margin=dict(l=330))
    return fig
