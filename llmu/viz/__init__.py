"""Plotly and ipywidgets helpers the notebooks share.

Every function returns a ``plotly.graph_objects.Figure`` in the course's look (white background,
one size, the same colours in every notebook), so a notebook cell ends with the figure and
Jupyter shows it. Inputs may be torch tensors, numpy arrays or lists.

``interactive(fn, **controls)`` wires sliders and dropdowns to a function that returns a figure.
It does not use ``go.FigureWidget`` (that needs the anywidget package): each change of a control
calls ``fn`` again and shows the new figure in an ``ipywidgets.Output``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import plotly.graph_objects as go
import plotly.io as pio

__all__ = ["COLORS", "WIDTH", "HEIGHT", "style", "heatmap", "line", "bars", "scatter_text",
           "interactive"]

#: Default figure size in pixels (fits a JupyterLab cell on a laptop screen).
WIDTH, HEIGHT = 760, 440

#: The trace colours, in order (colour-blind-safe qualitative palette, Okabe-Ito).
COLORS = ["#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000"]

# plotly's white template with the course's font, colours and margins, built once.
_TEMPLATE = go.layout.Template(pio.templates["plotly_white"])
_TEMPLATE.layout.update(
    font=dict(family="Inter, Helvetica, Arial, sans-serif", size=13),
    colorway=COLORS,
    margin=dict(l=60, r=20, t=60, b=50),
    hovermode="closest",
    legend=dict(bgcolor="rgba(255,255,255,0.6)"),
)


def _array(values) -> np.ndarray:
    """A numpy copy of a tensor, array or list (tensors are detached and moved to the CPU)."""
    try:
        import torch

        if isinstance(values, torch.Tensor):
            values = values.detach().float().cpu().numpy() if values.is_floating_point() \
                else values.detach().cpu().numpy()
    except ImportError:  # pragma: no cover - torch is a dependency of llmu
        pass
    return np.asarray(values)


def style(fig: go.Figure, title: str | None = None, xlabel: str | None = None,
          ylabel: str | None = None, width: int | None = WIDTH, height: int | None = HEIGHT) -> go.Figure:
    """Apply the course's template, size, title and axis labels to ``fig`` (in place) and return it."""
    fig.update_layout(template=_TEMPLATE, width=width, height=height)
    if title is not None:
        fig.update_layout(title=dict(text=title, x=0.02, xanchor="left"))
    if xlabel is not None:
        fig.update_xaxes(title_text=xlabel)
    if ylabel is not None:
        fig.update_yaxes(title_text=ylabel)
    return fig


def heatmap(z, x: Sequence | None = None, y: Sequence | None = None, title: str | None = None,
            colorscale: str = "Viridis", zmin: float | None = None, zmax: float | None = None,
            zmid: float | None = None, xlabel: str | None = None, ylabel: str | None = None,
            text: bool = False, **layout) -> go.Figure:
    """A matrix as coloured cells, row 0 at the top (as a matrix is printed, e.g. attention weights).

    ``x``/``y`` label the columns/rows (token strings, say). ``zmid`` centres a diverging
    ``colorscale`` such as ``"RdBu"`` on a value; ``text=True`` writes each value in its cell.
    """
    z = _array(z)
    if z.ndim != 2:
        raise ValueError(f"heatmap: z must be 2-D, got shape {tuple(z.shape)}")
    trace = go.Heatmap(z=z, x=list(x) if x is not None else None, y=list(y) if y is not None else None,
                       colorscale=colorscale, zmin=zmin, zmax=zmax, zmid=zmid)
    if text:
        trace.update(texttemplate="%{z:.2f}")
    fig = go.Figure(trace)
    fig.update_yaxes(autorange="reversed")
    return style(fig, title, xlabel, ylabel).update_layout(**layout)


def line(x, ys: Mapping[str, Sequence] | Sequence, title: str | None = None,
         xlabel: str | None = None, ylabel: str | None = None, log_x: bool = False,
         log_y: bool = False, mode: str = "lines", **layout) -> go.Figure:
    """One line per entry of ``ys`` (``{"name": values}``; a single sequence makes one unnamed
    line) against the shared ``x``. ``log_x``/``log_y`` switch the axes to log scale."""
    if not isinstance(ys, Mapping):
        ys = {"": ys}
    xs = _array(x)
    fig = go.Figure()
    for name, values in ys.items():
        values = _array(values)
        if values.shape[0] != xs.shape[0]:
            raise ValueError(f"line: series {name!r} has {values.shape[0]} values for {xs.shape[0]} x values")
        fig.add_trace(go.Scatter(x=xs, y=values, name=str(name), mode=mode, showlegend=bool(name)))
    if log_x:
        fig.update_xaxes(type="log")
    if log_y:
        fig.update_yaxes(type="log")
    return style(fig, title, xlabel, ylabel).update_layout(**layout)


def bars(labels: Sequence, values, title: str | None = None, xlabel: str | None = None,
         ylabel: str | None = None, horizontal: bool = False, text: Sequence[str] | None = None,
         color: str | Sequence[str] | None = None, **layout) -> go.Figure:
    """One bar per label (``horizontal=True`` for long labels, such as tokens with their
    probabilities). ``text`` writes a string on each bar; ``color`` is one colour or one per bar."""
    values = _array(values)
    labels = [str(label) for label in labels]
    if len(labels) != values.shape[0]:
        raise ValueError(f"bars: {len(labels)} labels for {values.shape[0]} values")
    kw = dict(marker_color=color if color is not None else COLORS[0],
              text=list(text) if text is not None else None)
    bar = go.Bar(y=labels, x=values, orientation="h", **kw) if horizontal else go.Bar(x=labels, y=values, **kw)
    fig = go.Figure(bar)
    if horizontal:
        fig.update_yaxes(autorange="reversed")  # the first label on top, as in a list
    return style(fig, title, xlabel, ylabel).update_layout(**layout)


def scatter_text(x, y, text: Sequence[str], title: str | None = None, color=None,
                 xlabel: str | None = None, ylabel: str | None = None, show_text: bool = True,
                 **layout) -> go.Figure:
    """Labelled points, e.g. word embeddings projected to two dimensions. ``color``: one value per
    point (a number for a colour scale, or a group name for one trace per group)."""
    xs, ys = _array(x), _array(y)
    text = [str(t) for t in text]
    if not (xs.shape[0] == ys.shape[0] == len(text)):
        raise ValueError(f"scatter_text: x, y and text need one value per point "
                         f"({xs.shape[0]}, {ys.shape[0]}, {len(text)})")
    mode = "markers+text" if show_text else "markers"
    fig = go.Figure()
    colors = None if color is None else list(color)
    if colors is not None and len(colors) != len(text):
        raise ValueError(f"scatter_text: color needs one value per point, got {len(colors)}")
    if colors is not None and all(isinstance(c, str) for c in colors):
        for group in dict.fromkeys(colors):  # one trace per group, in order of appearance
            idx = [i for i, c in enumerate(colors) if c == group]
            fig.add_trace(go.Scatter(x=xs[idx], y=ys[idx], text=[text[i] for i in idx], mode=mode,
                                     name=group, textposition="top center"))
    else:
        marker = dict(color=colors, colorscale="Viridis", showscale=True) if colors is not None else {}
        fig.add_trace(go.Scatter(x=xs, y=ys, text=text, mode=mode, marker=marker,
                                 textposition="top center", showlegend=False))
    return style(fig, title, xlabel, ylabel).update_layout(**layout)


def _show(result) -> None:
    if result is None:
        return
    if isinstance(result, go.Figure):
        result.show()
    else:
        from IPython.display import display

        display(result)


def interactive(fn: Callable[..., object], **controls):
    """Controls wired to ``fn``: each change calls ``fn(**values)`` and shows what it returns.

    ``controls`` are what ``ipywidgets.interactive`` accepts: a widget, ``(min, max, step)`` for a
    slider, a list for a dropdown, a bool for a checkbox, ``ipywidgets.fixed(v)`` for a constant.
    ``fn`` returns a plotly figure (or anything Jupyter can display, or None). The returned widget
    shows the controls above an ``Output`` holding the latest result; ``widget.result`` is that
    result (``widget.error`` the exception if ``fn`` raised, whose traceback the Output shows),
    ``widget.controls`` maps each control's name to its widget, and ``widget.update()``
    recomputes from the current values.
    """
    import ipywidgets as widgets

    out = widgets.Output()

    def update(**values):
        with out:
            out.clear_output(wait=True)
            try:
                result = fn(**values)
            except Exception as exc:  # shown under the controls, where the learner looks
                box.result, box.error = None, exc
                _show_traceback()
                return
            box.result, box.error = result, None
            _show(result)

    box = widgets.VBox()
    box.result, box.error = None, None
    # ipywidgets.interactive builds the controls and calls `update` once with their initial values.
    inner = widgets.interactive(update, {"manual": False}, **controls)
    controls_ = [c for c in inner.children if c is not inner.out]
    box.children = [*controls_, out]
    box.controls = {getattr(c, "description", ""): c for c in controls_}
    box.output = out
    box.update = inner.update
    return box


def _show_traceback() -> None:
    try:
        from IPython import get_ipython

        ip = get_ipython()
    except ImportError:  # pragma: no cover - ipywidgets depends on IPython
        ip = None
    if ip is not None:
        ip.showtraceback()
    else:
        import traceback

        traceback.print_exc()
