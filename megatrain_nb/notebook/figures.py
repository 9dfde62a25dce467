"""Plotly figures of a run for the exported report (static figures, plotly.js inlined once),
and what the dashboard shares with them (event grouping and labels, memory kinds).

``add_*`` puts a panel's traces into a figure at a subplot; ``fill_*`` writes a
:class:`RunView` into them. The live dashboard does not use plotly (a FigureWidget puts its
~5 MB bundle into the notebook's widget state): it draws with ``chart.py``.

Example::

    fig = loss_figure()                    # a static go.Figure
    fill_loss(fig, session.run_log.view())
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from megatrain_nb.formatting import fmt_bytes

from .run_log import RunView, disk_cache_line, tier_summary

TIERS = ("device", "host", "disk")
KINDS = ("weights", "grads", "optimizer", "activations", "other")
_KIND_COLORS = ("#4c78a8", "#f58518", "#54a24b", "#b279a2", "#bab0ac")
EVENT_COLORS = {"pause": "#f58518", "resume": "#54a24b", "lr": "#e45756", "checkpoint": "#72b7b2",
                "stop": "#9d755d", "error": "#b00020"}
HEAT_LABELS = {"grad_norm": "log10 gradient norm", "update_ratio": "log10 update / weight",
               "weight_norm": "log10 weight norm"}
_MARGIN = dict(l=60, r=20, t=50, b=40)
_LEGEND = dict(orientation="h", y=1.02, yanchor="bottom", x=1, xanchor="right")


def event_label(e: dict) -> str:
    kind = e.get("kind", "?")
    if kind == "lr":
        prev = e.get("previous")
        return f"lr {_g(prev)}→{_g(e.get('value'))}" if prev is not None else f"lr {_g(e.get('value'))}"
    if kind == "checkpoint":
        return "ckpt"
    if kind == "recovery":   # (on_nonfinite="rewind": back to a snapshot, lower LR)
        return f"recovered → step {e.get('to_step')}, lr ×{_g(e.get('lr_factor'))}"
    return kind.replace("_", " ")


def _g(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, (int, float)) else str(v)


_PRIORITY = ("error", "lr", "stop", "checkpoint", "pause", "resume")


def grouped_events(events: list[dict], max_markers: int = 40) -> list[tuple[int, str, str]]:
    """(step, label, color) per step that has events: events at one step (pause, lr, resume
    applied at the same boundary) share one marker, labelled in order."""
    by_step: dict[int, list[dict]] = {}
    for e in events:
        by_step.setdefault(int(e.get("step", 0)), []).append(e)
    out = []
    for step in sorted(by_step)[-max_markers:]:
        group = by_step[step]
        kinds = [e.get("kind", "") for e in group]
        main = next((k for k in _PRIORITY if k in kinds), kinds[0])
        color = EVENT_COLORS.get(main, "#e45756" if main.endswith("failed") else "#888")
        out.append((step, " · ".join(event_label(e) for e in group), color))
    return out


def event_markers(events: list[dict], xref: str = "x", max_markers: int = 40,
                  x_range: tuple[float, float] | None = None, plot_px: float = 900.0,
                  rows: int = 3) -> tuple[list[dict], list[dict]]:
    """Vertical dotted lines at each event's step over the whole figure height, labelled on
    top: horizontal labels in up to ``rows`` rows, each in the first row where it does not
    touch the previous one (widths estimated for a plot ``plot_px`` wide); a label that fits
    no row is left to its line's hover text. Returns (shapes, annotations)."""
    shapes, notes = [], []
    groups = grouped_events(events, max_markers)
    lo, hi = x_range if x_range else ((min(g[0] for g in groups), max(g[0] for g in groups)) if groups else (0, 1))
    per_px = max(hi - lo, 1) / plot_px
    ends: list[float] = []
    for x, label, color in groups:
        shapes.append(dict(type="line", xref=xref, yref="paper", x0=x, x1=x, y0=0, y1=1,
                           line=dict(color=color, width=1.5, dash="dot")))
        width = (6.5 * len(label) + 8) * per_px
        right_side = x + width <= hi + 1e-9
        start = x if right_side else x - width
        row = next((i for i, end in enumerate(ends) if start >= end), None)
        if row is None and len(ends) < rows:
            ends.append(float("-inf"))
            row = len(ends) - 1
        if row is None:
            continue
        ends[row] = start + width
        notes.append(dict(x=x, y=1.0, xref=xref, yref="paper", text=label, showarrow=False, hovertext=label,
                          xanchor="left" if right_side else "right", yanchor="bottom", yshift=2 + 14 * row,
                          font=dict(size=10, color=color)))
    return shapes, notes


# ---- loss and learning rate -----------------------------------------------------------------------
def add_loss(fig: go.Figure, *, row: int = 1, col: int = 1, lr_row: int = 2) -> None:
    fig.add_trace(go.Scatter(name="train loss", mode="lines", x=[], y=[], line=dict(color="#4c78a8")), row, col)
    fig.add_trace(go.Scatter(name="eval loss", mode="lines+markers", x=[], y=[], line=dict(color="#f58518")), row, col)
    fig.add_trace(go.Scatter(name="learning rate", mode="lines", x=[], y=[], line=dict(color="#54a24b", shape="hv")),
                  lr_row, col)
    fig.update_yaxes(title_text="loss", row=row, col=col)
    fig.update_yaxes(title_text="lr", exponentformat="e", rangemode="tozero", row=lr_row, col=col)
    fig.update_xaxes(title_text="optimizer step", row=lr_row, col=col)


def fill_loss(fig, view: RunView, base: int = 0, xref: str = "x") -> None:
    x, y = view.curves.get("loss", (np.zeros(0), np.zeros(0)))
    lx, ly = view.curves.get("lr", (np.zeros(0), np.zeros(0)))
    ex, ey = view.eval
    xs = [a for a in (x, lx, ex) if len(a)]
    x_range = (float(min(a.min() for a in xs)), float(max(a.max() for a in xs))) if xs else None
    shapes, notes = event_markers(view.events, xref=xref, x_range=x_range)
    with fig.batch_update():
        fig.data[base].x, fig.data[base].y = x, y
        fig.data[base + 1].x, fig.data[base + 1].y = ex, ey
        fig.data[base + 2].x, fig.data[base + 2].y = lx, ly
        fig.layout.shapes = shapes
        fig.layout.annotations = notes


def loss_figure(height: int = 420) -> go.Figure:
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.68, 0.32], vertical_spacing=0.08)
    add_loss(fig)
    fig.update_layout(height=height, template="plotly_white", legend=_LEGEND, margin=dict(_MARGIN, t=110),
                      title=dict(text="Loss and learning rate", x=0.01, y=0.98))
    return fig


# ---- memory tiers -----------------------------------------------------------------------------------
def kind_group(name: str) -> str:
    n = name.lower()
    if "grad" in n:
        return "grads"
    if any(s in n for s in ("optim", "adam", "moment", "exp_avg", "state")):
        return "optimizer"
    if any(s in n for s in ("activ", "checkpoint", "logit", "workspace")):
        return "activations"
    if any(s in n for s in ("weight", "param", "master", "slot")):
        return "weights"
    return "other"


def add_memory(fig: go.Figure, *, row: int | None = None, col: int | None = None) -> None:
    at = dict(row=row, col=col) if row else {}
    for kind, color in zip(KINDS, _KIND_COLORS):
        fig.add_trace(go.Bar(name=kind, orientation="h", y=list(TIERS), x=[0, 0, 0], marker_color=color,
                             hovertemplate="%{hovertext}<extra>" + kind + "</extra>",
                             hovertext=[""] * 3), **at)
    fig.add_trace(go.Scatter(name="capacity", mode="markers", y=list(TIERS), x=[None] * 3,
                             hoverinfo="skip",
                             marker=dict(symbol="line-ns-open", size=26, color="#222", line=dict(width=3))), **at)
    fig.update_layout(barmode="stack")
    fig.update_yaxes(autorange="reversed", **at)


def memory_bars(memory: dict | None) -> dict:
    """Per kind group the share of each tier's capacity it uses (%), hover texts in bytes, the
    capacity marker (100 % where a capacity is known) and tick labels "used / capacity".
    A tier without a known capacity is drawn against its own peak, labelled so."""
    tiers = tier_summary(memory)
    n = len(TIERS)
    nbytes = {k: [0.0] * n for k in KINDS}
    pct = {k: [0.0] * n for k in KINDS}
    ticks, marker = list(TIERS), [None] * n
    for i, tier in enumerate(TIERS):
        t = tiers.get(tier)
        if not t:
            continue
        for name, b in t["kinds"].items():
            nbytes[kind_group(name)][i] += b
        accounted = sum(nbytes[k][i] for k in KINDS)
        used = t["used"] if math.isfinite(t["used"]) else accounted
        nbytes["other"][i] += max(0.0, used - accounted)
        cap = t["capacity"]
        if cap is not None and math.isfinite(cap) and cap > 0:
            denom, marker[i] = cap, 100.0
            ticks[i] = f"{tier}<br>{fmt_bytes(used)} / {fmt_bytes(cap)}"
        else:
            # no capacity: the bar is the share of the tier's own peak, and says so (no "100%")
            peak = t["peak"] if math.isfinite(t["peak"]) else 0.0
            denom = max(sum(nbytes[k][i] for k in KINDS), peak) or 1.0
            ticks[i] = f"{tier}<br>{fmt_bytes(used)}, no limit set<br>(bar: share of peak {fmt_bytes(peak)})"
        for k in KINDS:
            pct[k][i] = 100.0 * nbytes[k][i] / denom
        cache = disk_cache_line((memory or {}).get(tier))
        if cache:
            ticks[i] += f"<br>{cache}"
    hover = {k: [fmt_bytes(b) for b in v] for k, v in nbytes.items()}
    return {"pct": pct, "hover": hover, "marker": marker, "ticks": ticks}


def fill_memory(fig, view: RunView, base: int = 0, axis: str = "xaxis", yaxis: str = "yaxis") -> None:
    m = memory_bars(view.memory)
    with fig.batch_update():
        for i, kind in enumerate(KINDS):
            fig.data[base + i].x = m["pct"][kind]
            fig.data[base + i].hovertext = m["hover"][kind]
        fig.data[base + len(KINDS)].x = m["marker"]
        fig.layout[axis].title.text = "% of the tier's capacity"
        fig.layout[yaxis].tickvals = list(TIERS)
        fig.layout[yaxis].ticktext = m["ticks"]


def memory_figure(height: int = 260) -> go.Figure:
    fig = go.Figure()
    add_memory(fig)
    fig.update_layout(height=height, template="plotly_white", margin=_MARGIN, legend=_LEGEND,
                      title=dict(text="Memory tiers by kind", x=0.01))
    return fig


# ---- layers -----------------------------------------------------------------------------------------
def add_heatmap(fig: go.Figure, *, row: int | None = None, col: int | None = None, colorbar_x: float | None = None) -> None:
    at = dict(row=row, col=col) if row else {}
    bar = dict(thickness=12, **({"x": colorbar_x} if colorbar_x is not None else {}))
    fig.add_trace(go.Heatmap(z=[[]], x=[], y=[], colorscale="Viridis", colorbar=bar, name="layers x steps"), **at)
    fig.update_xaxes(title_text="optimizer step", **at)
    fig.update_yaxes(autorange="reversed", **at)  # embed on top, head at the bottom: the model's order


def fill_heatmap(fig, units: list[str], steps: list[int], z: np.ndarray, metric: str, index: int = 0) -> None:
    with np.errstate(divide="ignore", invalid="ignore"):
        lz = np.where(z > 0, np.log10(np.where(z > 0, z, 1.0)), np.nan) if z.size else z
    with fig.batch_update():
        fig.data[index].z = lz if z.size else [[]]
        fig.data[index].x = steps
        fig.data[index].y = units
        fig.data[index].colorbar.title = dict(text=HEAT_LABELS.get(metric, metric), side="right")


def heatmap_figure(metric: str = "grad_norm", height: int = 320) -> go.Figure:
    fig = go.Figure()
    add_heatmap(fig)
    fig.update_layout(height=height, template="plotly_white", margin=_MARGIN,
                      title=dict(text=f"Layers × steps: {HEAT_LABELS.get(metric, metric)}", x=0.01))
    return fig


def add_histogram(fig: go.Figure, *, row: int | None = None, col: int | None = None) -> None:
    at = dict(row=row, col=col) if row else {}
    fig.add_trace(go.Bar(x=[], y=[], marker_color="#4c78a8", name="weights"), **at)
    fig.update_yaxes(title_text="count", **at)


def fill_histogram(fig, stats: dict | None, unit: str = "", index: int = 0, axis: str = "xaxis") -> None:
    counts = (stats or {}).get("hist_counts") or []
    edges = (stats or {}).get("hist_edges") or []
    if len(edges) == len(counts) + 1 and counts:
        e = np.asarray(edges, dtype=float)
        centers, widths = (e[:-1] + e[1:]) / 2, np.diff(e)
    else:
        centers, widths = np.zeros(0), np.zeros(0)
    with fig.batch_update():
        fig.data[index].x, fig.data[index].y, fig.data[index].width = centers, list(counts), widths
        fig.layout[axis].title.text = f"weights of {unit}" if unit else "weight value"
        # an explicit range: autorange would keep what it computed for the empty first frame
        fig.layout[axis].range = [float(edges[0]), float(edges[-1])] if len(centers) else None
