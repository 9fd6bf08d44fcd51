"""llmu.viz: each helper's figure holds the data it was given, and interactive() recomputes."""

from __future__ import annotations

import ipywidgets as widgets
import numpy as np
import plotly.graph_objects as go
import pytest
import torch

from llmu import viz


def test_heatmap_holds_the_matrix_and_labels():
    z = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    fig = viz.heatmap(z, x=list("abcd"), y=["r0", "r1", "r2"], title="weights", colorscale="RdBu", zmid=0)
    (trace,) = fig.data
    assert isinstance(trace, go.Heatmap)
    np.testing.assert_array_equal(np.asarray(trace.z), z.numpy())
    assert list(trace.x) == list("abcd") and list(trace.y) == ["r0", "r1", "r2"]
    assert trace.zmid == 0
    assert fig.layout.yaxis.autorange == "reversed"  # row 0 on top, as a matrix is printed
    assert fig.layout.title.text == "weights"
    assert (fig.layout.width, fig.layout.height) == (viz.WIDTH, viz.HEIGHT)


def test_heatmap_accepts_bf16_and_rejects_non_matrices():
    fig = viz.heatmap(torch.ones(2, 2, dtype=torch.bfloat16), text=True)
    assert np.asarray(fig.data[0].z).dtype == np.float32
    assert fig.data[0].texttemplate == "%{z:.2f}"
    with pytest.raises(ValueError, match="2-D"):
        viz.heatmap(torch.ones(2, 2, 2))


def test_line_has_one_trace_per_series():
    x = [1, 2, 4, 8]
    fig = viz.line(x, {"a": [1, 2, 3, 4], "b": np.array([4, 3, 2, 1])}, xlabel="N", ylabel="ms",
                   log_x=True, log_y=True)
    assert [t.name for t in fig.data] == ["a", "b"]
    assert list(fig.data[1].y) == [4, 3, 2, 1] and list(fig.data[0].x) == x
    assert fig.layout.xaxis.type == "log" and fig.layout.yaxis.type == "log"
    assert fig.layout.xaxis.title.text == "N" and fig.layout.yaxis.title.text == "ms"
    single = viz.line([0, 1], [5, 6])
    assert len(single.data) == 1 and single.data[0].showlegend is False
    with pytest.raises(ValueError, match="3 values for 4 x values"):
        viz.line(x, {"short": [1, 2, 3]})


def test_bars_vertical_and_horizontal():
    fig = viz.bars(["x", "y"], torch.tensor([0.25, 0.75]), text=["25%", "75%"])
    (bar,) = fig.data
    assert list(bar.x) == ["x", "y"] and list(bar.y) == [0.25, 0.75] and list(bar.text) == ["25%", "75%"]
    fig = viz.bars(["x", "y"], [1, 2], horizontal=True)
    assert fig.data[0].orientation == "h" and list(fig.data[0].y) == ["x", "y"]
    with pytest.raises(ValueError, match="2 labels for 3 values"):
        viz.bars(["x", "y"], [1, 2, 3])


def test_scatter_text_labels_points_and_groups():
    fig = viz.scatter_text([0, 1, 2], [2, 1, 0], ["cat", "dog", "car"])
    (trace,) = fig.data
    assert list(trace.text) == ["cat", "dog", "car"] and trace.mode == "markers+text"
    fig = viz.scatter_text([0, 1, 2], [2, 1, 0], ["cat", "dog", "car"], color=["animal", "animal", "thing"])
    assert [t.name for t in fig.data] == ["animal", "thing"]
    assert list(fig.data[0].text) == ["cat", "dog"] and list(fig.data[1].x) == [2]
    fig = viz.scatter_text([0, 1], [0, 1], ["a", "b"], color=[0.1, 0.9])
    assert list(fig.data[0].marker.color) == [0.1, 0.9]
    with pytest.raises(ValueError, match="one value per point"):
        viz.scatter_text([0, 1], [0], ["a", "b"])


def test_interactive_recomputes_when_a_control_changes():
    calls = []

    def picture(n=3, scale=1.0):
        calls.append((n, scale))
        return viz.line(list(range(n)), {"y": [scale * i for i in range(n)]})

    w = viz.interactive(picture, n=(1, 10), scale=[1.0, 2.0])
    assert isinstance(w, widgets.VBox)
    assert set(w.controls) == {"n", "scale"}
    assert isinstance(w.children[-1], widgets.Output) and w.output is w.children[-1]
    assert len(calls) == 1  # built once with the initial values
    first = w.result
    w.controls["n"].value = 8
    assert calls[-1] == (8, 1.0) and len(w.result.data[0].x) == 8 and w.result is not first
    w.controls["scale"].value = 2.0
    assert list(w.result.data[0].y)[-1] == 14.0
    n_calls = len(calls)
    w.update()
    assert len(calls) == n_calls + 1


def test_interactive_keeps_going_after_an_error():
    def picture(n=1):
        if n == 2:
            raise RuntimeError("bad n")
        return viz.bars(["n"], [n])

    w = viz.interactive(picture, n=(1, 3))
    w.controls["n"].value = 2
    assert w.result is None and isinstance(w.error, RuntimeError)
    w.controls["n"].value = 3
    assert w.error is None and list(w.result.data[0].y) == [3]
