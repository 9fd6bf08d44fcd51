"""One benchmark entry as a plot: a metric against the entry's size axis, one line per provider.

The rows measured here are solid lines; rows recorded on GPUs (``llmu/data/gpu_results/``) are
dashed lines labelled with the device and the date, so a learner on a laptop sees both at once. The
title's second line names each recorded run with its versions (torch, Triton, CUDA), or says that no
GPU results have been recorded yet.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from llmu.bench.results import device_label, recorded as recorded_rows

METRICS = {
    "ms": "time per call (ms, median)",
    "tflops": "TFLOP/s",
    "gbs": "GB/s",
    "frac_flops": "fraction of peak FLOP/s",
    "frac_bw": "fraction of peak bandwidth",
}


def _rows_of(results_or_rows) -> tuple[list[dict], dict | None]:
    if isinstance(results_or_rows, Mapping):
        return list(results_or_rows.get("rows", [])), dict(results_or_rows)
    return list(results_or_rows), None


def _sort_key(row):
    x = row.get("x")
    return (0, x, "") if isinstance(x, (int, float)) else (1, 0, str(x))


def figure(results_or_rows, name: str, metric: str = "ms", recorded: bool | Sequence[dict] = True,
           log_x: bool | None = None, log_y: bool = True, title: str | None = None):
    """A plotly figure of entry ``name``: ``metric`` against the entry's ``x_axis`` size.

    ``results_or_rows``: what :func:`llmu.bench.run` returns (or :func:`llmu.bench.load` reads), or
    a list of rows. ``metric``: ``"ms"``, ``"tflops"``, ``"gbs"``, ``"frac_flops"`` or
    ``"frac_bw"``. ``recorded``: True adds the GPU rows of ``llmu/data/gpu_results/`` as dashed
    traces, a list of rows adds those, False none; rows of ``results_or_rows`` that are themselves
    recorded (what :func:`llmu.bench.recorded` returns) are drawn dashed too. ``log_x`` defaults to
    True when the sizes span more than a factor of 8.
    """
    import plotly.graph_objects as go

    from llmu import viz

    if metric not in METRICS:
        raise ValueError(f"metric must be one of {sorted(METRICS)}, got {metric!r}")
    rows, results = _rows_of(results_or_rows)
    live = [r for r in rows if r.get("entry") == name and r.get("status") == "ok" and r.get(metric) is not None]
    if recorded is True:
        rec = recorded_rows(name)
        none_recorded = not rec
    elif recorded is False or recorded is None:
        rec = []
    else:
        rec = [r for r in recorded if r.get("entry") == name]
    rec += [r for r in live if r.get("recorded")]  # recorded rows passed as the rows to plot
    live = [r for r in live if not r.get("recorded")]
    if results is not None:  # the live results may themselves be a recorded file: do not draw it twice
        rec = [r for r in rec if r.get("created") != results.get("created")]
    rec = [r for r in rec if r.get("status", "ok") == "ok" and r.get(metric) is not None]

    live_device = device_label(results) if results is not None else None
    fig = go.Figure()
    series: dict[tuple, list[dict]] = {}
    for r in live:
        series.setdefault(("live", r.get("label") or r.get("provider"), live_device or r.get("device")), []).append(r)
    for r in rec:
        series.setdefault(("rec", r.get("label") or r.get("provider"), f"{r['device_name']} {r['date']}"), []).append(r)

    colors = {}
    for (origin, provider, where), group in series.items():
        group.sort(key=_sort_key)
        color = colors.setdefault(provider, viz.COLORS[len(colors) % len(viz.COLORS)])
        hover = [f"{r.get('size_label')}<br>{r.get('dtype')}<br>ms {r['ms']:.4g}"
                 + (f"<br>TFLOP/s {r['tflops']:.3g}" if r.get("tflops") is not None else "")
                 + (f"<br>GB/s {r['gbs']:.4g}" if r.get("gbs") is not None else "")
                 for r in group]
        fig.add_trace(go.Scatter(
            x=[r.get("x") if r.get("x") is not None else r.get("size_label") for r in group],
            y=[r[metric] for r in group],
            name=f"{provider} · {where}" if where else str(provider),
            mode="lines+markers",
            line=dict(color=color, dash="dash" if origin == "rec" else "solid"),
            marker=dict(symbol="diamond" if origin == "rec" else "circle"),
            hovertext=hover, hoverinfo="text+name",
        ))

    xs = [t for tr in fig.data for t in tr.x if isinstance(t, (int, float)) and t > 0]
    if log_x is None:
        log_x = bool(xs) and max(xs) / min(xs) > 8
    x_key = next((r.get("x_key") for r in live + rec if r.get("x_key")), None)
    xlabel = x_key or _guess_x_key(live + rec) or "size"
    runs = list(dict.fromkeys(r.get("run_label") or f"{r['device_name']}, {r['date']}" for r in rec))
    if runs:
        note = "dashed: recorded on " + "; ".join(runs)
    elif recorded is True and none_recorded:
        note = f"no GPU results for {name} have been recorded yet"
    else:
        note = None
    title = title or f"{name}: {METRICS[metric]}"
    viz.style(fig, f"{title}<br><sup>{note}</sup>" if note else title, xlabel, METRICS[metric])
    if log_x and xs:
        fig.update_xaxes(type="log")
    if log_y and fig.data:
        fig.update_yaxes(type="log")
    if not fig.data:
        fig.add_annotation(text=f"no measurements of {name!r} here (all providers skipped or failed)",
                           showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5)
    return fig


def _guess_x_key(rows: list[dict]) -> str | None:
    """The size key whose value is the row's x (the entry's x_axis)."""
    for r in rows:
        for key, value in (r.get("size") or {}).items():
            if value == r.get("x"):
                return key
    return None
