"""The run tree as a figure: every branch's loss, eval loss, learning rate and gradient norm on
shared step axes, each fork point marked, each branch's legend line saying what changed.

``run_tree_figure(runs)`` takes rows like ``session.explorer.tree()`` gives (``name``,
``run_id``, ``parent_run_id``, ``forked_at_step``, ``changes``, ``records``); the dashboard
(``BranchesPanel``), ``mt.compare`` and ``export_report`` draw it.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .run_log import downsample
from .chart import Chart, json_nums

PANELS = (("loss", "loss"), ("eval_loss", "eval loss"), ("lr", "learning rate"), ("grad_norm", "grad norm"))
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#7f7f7f")


def label(run: dict, drawn_from_fork: bool = True) -> str:
    """The branch's legend line: its name, where it came from, what changed. "from step N" where
    its line starts at its fork (its parent drawn beside it); "forked at step N" where the
    steps it shares with its parent are drawn too (the parent is not in the figure)."""
    text = str(run.get("name") or run.get("run_id"))
    at = run.get("forked_at_step")
    if at is not None:
        text += f" (from step {at})" if drawn_from_fork else f" (forked at step {at})"
    if run.get("changes"):
        text += f": {run['changes']}"
    return text


def own_records(run: dict, by_id: dict) -> tuple:
    """(the records to draw for ``run``, whether they start at its fork): a branch whose parent is
    drawn too starts at its fork step (the steps before are its parent's, on the parent's line)."""
    recs = run.get("records") or []
    at = run.get("forked_at_step")
    if at is None or run.get("parent_run_id") not in by_id:
        return recs, at is None
    return [r for r in recs if r.get("step") is not None and r["step"] >= at], True


def run_tree_figure(runs: list[dict], *, height: int = 520, max_points: int = 600,
                    title: Optional[str] = "Run tree") -> go.Figure:
    fig = make_subplots(rows=2, cols=2, shared_xaxes=True, subplot_titles=[t for _, t in PANELS],
                        vertical_spacing=0.12, horizontal_spacing=0.08)
    by_id = {r.get("run_id"): r for r in runs}
    for i, run in enumerate(runs):
        color = COLORS[i % len(COLORS)]
        recs, from_fork = own_records(run, by_id)
        name = label(run, from_fork)
        for k, (key, _) in enumerate(PANELS):
            x, y = _series(recs, key)
            if key != "eval_loss":
                x, y = downsample(x, y, max_points)
            if not len(x):
                continue
            fig.add_trace(go.Scatter(x=x, y=y, name=name, legendgroup=name, showlegend=k == 0 or not _has(recs, "loss"),
                                     mode="lines+markers" if key == "eval_loss" else "lines",
                                     line=dict(color=color, width=1.6)),
                          row=k // 2 + 1, col=k % 2 + 1)
        at = run.get("forked_at_step")
        if at is not None:   # the fork point, on the parent's loss curve where there is one
            parent = by_id.get(run.get("parent_run_id"))
            y = _value_at(parent.get("records") if parent else recs, int(at))
            if y is not None:
                fig.add_trace(go.Scatter(x=[at], y=[y], mode="markers", legendgroup=name, showlegend=False,
                                         marker=dict(symbol="diamond", size=10, color=color,
                                                     line=dict(width=1, color="black")),
                                         hovertext=f"{run.get('name')} forks here", hoverinfo="text"),
                              row=1, col=1)
    _fix_ranges(fig, runs)
    fig.update_layout(height=height, margin=dict(l=50, r=20, t=60 if title else 30, b=40),
                      legend=dict(orientation="h", y=-0.12), template="plotly_white", title=title)
    fig.update_xaxes(title_text="step", row=2)
    return fig


def _fix_ranges(fig: go.Figure, runs: list[dict]) -> None:
    """Axes in range and notes in their panels, as layout values (nothing left to autorange):
    the step axes span the steps drawn; the learning rate and the grad norm start at 0; a panel
    no run has data for says why in its middle, placed in paper coordinates from its axes'
    domains (a reference to an axis without traces is not kept by every renderer)."""
    by_id = {r.get("run_id"): r for r in runs}
    drawn = [own_records(run, by_id)[0] for run in runs]
    steps = [float(r["step"]) for recs in drawn for r in recs if r.get("step") is not None]
    if steps:
        lo, hi = min(steps), max(steps)
        pad = max(0.5, 0.02 * (hi - lo))
        fig.update_xaxes(range=[max(0.0, lo - pad) if lo >= 0 else lo - pad, hi + pad], autorange=False)
    for k, (key, text) in enumerate(PANELS):
        ref = "" if k == 0 else str(k + 1)
        ys = [float(r[key]) for recs in drawn for r in recs if isinstance(r.get(key), (int, float))]
        if key in ("lr", "grad_norm") and ys and min(ys) >= 0:
            fig.layout[f"yaxis{ref}"].update(range=[0, 1.1 * max(ys) or 1.0], autorange=False)
        if not ys:   # a panel no run has data for says why it is empty
            xd, yd = fig.layout[f"xaxis{ref}"].domain, fig.layout[f"yaxis{ref}"].domain
            fig.add_annotation(text=f"no {text} logged" + (" (no eval set)" if key == "eval_loss" else ""),
                               xref="paper", yref="paper", x=(xd[0] + xd[1]) / 2, y=(yd[0] + yd[1]) / 2,
                               xanchor="center", yanchor="middle", showarrow=False, font=dict(color="#888"))


def _series(recs: list[dict], key: str):
    pts = [(float(r["step"]), float(r[key])) for r in recs
           if r.get("step") is not None and isinstance(r.get(key), (int, float))]
    if not pts:
        return np.zeros(0), np.zeros(0)
    a = np.asarray(pts, dtype=float)
    return a[:, 0], a[:, 1]


def _has(recs, key) -> bool:
    return any(isinstance(r.get(key), (int, float)) for r in recs)


def _value_at(recs: Any, step: int) -> Optional[float]:
    best = None
    for r in recs or []:
        s, v = r.get("step"), r.get("loss")
        if s is not None and s <= step and isinstance(v, (int, float)):
            best = float(v)
    return best


def runs_spec(runs: list[dict], *, height: int = 190, max_points: int = 600,
              title: Optional[str] = None) -> dict:
    """The run tree as a spec for the dashboard's own chart (``chart.js``, kind ``panels``):
    one panel per metric on a shared step axis, each branch in its colour, each fork point a
    diamond on its parent's loss curve. The dashboard's Branches panel and the report draw it."""
    by_id = {r.get("run_id"): r for r in runs}
    panels = [{"title": text, "series": [], "points": [],
               "note": f"no {text} logged" + (" (no eval set)" if key == "eval_loss" else "")}
              for key, text in PANELS]
    legend = []
    for i, run in enumerate(runs):
        color = COLORS[i % len(COLORS)]
        recs, from_fork = own_records(run, by_id)
        name = label(run, from_fork)
        legend.append({"name": name, "color": color})
        for k, (key, _) in enumerate(PANELS):
            x, y = _series(recs, key)
            if key != "eval_loss":
                x, y = downsample(x, y, max_points)
            if len(x):
                panels[k]["series"].append({"name": str(run.get("name") or run.get("run_id")), "color": color,
                                            "x": json_nums(x, 7), "y": json_nums(y),
                                            "mode": "lines+points" if key == "eval_loss" else "lines",
                                            "step": key == "lr"})
        at = run.get("forked_at_step")
        if at is not None:
            parent = by_id.get(run.get("parent_run_id"))
            y = _value_at(parent.get("records") if parent else recs, int(at))
            if y is not None:
                panels[0]["points"].append({"x": int(at), "y": y, "color": color,
                                            "title": f"{run.get('name')} forks here (step {at})"})
    return {"kind": "panels", "title": title, "height": height, "columns": 2, "legend": legend, "panels": panels}


class BranchesPanel:
    """The dashboard's run tree: the dashboard's own chart (kind ``panels``) in a box, shown
    once the run has branches and refreshed with the other data panels (its key: every branch's
    log version and the tree's size)."""

    def __init__(self, session: Any):
        import ipywidgets as W

        self.session = session
        self.chart = Chart(layout=W.Layout(width="auto"))
        self.box = W.VBox([W.HTML("<b style='font-family:sans-serif'>Branches</b>"), self.chart],
                          layout=W.Layout(display="none", width="auto"))

    def key(self) -> tuple:
        ex = getattr(self.session, "explorer", None)
        if ex is None:
            return ()
        return tuple((m.session.name, m.session.run_log.version) for m in ex.group.members if m.session) + \
            (len(ex.group.nodes),)

    def update(self, spread: bool = True) -> None:
        """Draw the tree now; ``spread``: also in the dashboards of the tree's other sessions that
        nothing refreshes (a run that finished before its fork trains: its dashboard showed the
        tree without the fork)."""
        ex = getattr(self.session, "explorer", None)
        runs = ex.tree() if ex is not None else []
        if len(runs) < 2:
            return
        self.chart.spec = runs_spec(runs)
        if self.box.layout.display != "":
            self.box.layout.display = ""
        if spread:
            for other in self._idle_others(ex):
                other.branches.update(spread=False)

    def _idle_others(self, ex) -> list:
        out = []
        for m in list(ex.group.members):
            s = getattr(m, "session", None)
            view = getattr(s, "_view", None)
            if s is None or s is self.session or view is None or view.widget is None:
                continue
            if view.live is None or not view.live.running:   # (a live one refreshes itself)
                out.append(view.widget)
        return out
