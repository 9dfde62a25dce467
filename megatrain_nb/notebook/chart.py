"""The dashboard's charts: a light anywidget (``chart.js``, a few kilobytes of plain SVG
drawing, no chart library) fed a JSON spec built here from a :class:`RunView`.

Why not plotly's FigureWidget: each one puts plotly.js (~5 MB) into the notebook's widget
state, so a saved notebook with a dashboard weighed ~10 MB. A ``Chart`` carries its small
module and its data only. The exported report draws with the same module (``static_chart.py``).

Example::

    c = Chart(spec=training_spec(session.run_log.view(), total=session.total_steps))
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import anywidget
import numpy as np
import traitlets

from .figures import HEAT_LABELS, grouped_events
from .run_log import RunView

_ESM = (Path(__file__).with_name("chart.js")).read_text(encoding="utf-8")


class Chart(anywidget.AnyWidget):
    """One chart; ``spec["kind"]`` is ``"training"`` (loss, eval loss, lr, event markers) or
    ``"layers"`` (weight histogram, layers x steps heatmap)."""

    _esm = _ESM
    spec = traitlets.Dict().tag(sync=True)


def json_nums(a: Any, digits: int = 5) -> list:
    """JSON numbers (NaN/inf -> null), rounded to ``digits`` significant digits: the spec
    goes over the comm and into the saved widget state."""
    out = []
    for v in np.asarray(a, dtype=float).ravel().tolist():
        out.append(float(f"{v:.{digits}g}") if math.isfinite(v) else None)
    return out


def training_spec(view: RunView, total: int | None = None, height: int = 300) -> dict:
    x, y = view.curves.get("loss", (np.zeros(0), np.zeros(0)))
    lx, ly = view.curves.get("lr", (np.zeros(0), np.zeros(0)))
    ex, ey = view.eval
    events = [{"step": s, "label": label, "color": color} for s, label, color in grouped_events(view.events)]
    return {"kind": "training", "version": view.version, "step": view.step, "total": total, "height": height,
            "loss": {"x": json_nums(x, 7), "y": json_nums(y)}, "eval": {"x": json_nums(ex, 7), "y": json_nums(ey)},
            "lr": {"x": json_nums(lx, 7), "y": json_nums(ly)}, "events": events}


def layers_spec(view: RunView, unit: str | None, metric: str, heat: tuple, height: int = 240) -> dict:
    """``heat``: (units, steps, z) of ``metric`` from the same moment as ``view``."""
    stats = view.layers.get(unit) if unit else None
    counts = list((stats or {}).get("hist_counts") or [])
    edges = list((stats or {}).get("hist_edges") or [])
    units, steps, z = heat
    z = np.asarray(z, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        lz = np.where(z > 0, np.log10(np.where(z > 0, z, 1.0)), np.nan) if z.size else z
    step = (stats or {}).get("step")
    return {"kind": "layers", "version": view.version, "height": height,
            "hist_title": (f"{'matrices' if (stats or {}).get('hist_of') == 'matrices' else 'weights'} of {unit}"
                           + (f" (step {step})" if step is not None else "")) if unit else "weight values",
            "hist": {"counts": json_nums(counts), "edges": json_nums(edges)},
            "heat_title": f"layers × steps: {HEAT_LABELS.get(metric, metric)}",
            "heat": {"units": list(units), "steps": [int(s) for s in steps],
                     "z": [json_nums(row, 4) for row in lz] if lz.size else [], "label": HEAT_LABELS.get(metric, metric)}}
