"""Per-layer statistics as the user sees them: which unit a name or index means, and a
dict that renders as a small table with a histogram in a notebook.

The numbers come with each step's record (``EngineOutput.layer_stats``, switched on for a
Session by ``EngineConfig.layer_stats``), which the engine fills during its optimizer step while
each unit is in hand (no extra pass over the weights); the run log keeps them.
"""
from __future__ import annotations

import html
import math
from typing import Any

from .static_chart import img

#: the per-unit statistics shown as numbers (the histogram is drawn)
SCALARS = ("weight_norm", "grad_norm", "update_norm", "update_ratio")


def resolve_unit(layer: Any, names: list[str]) -> str:
    """``3`` -> the fourth decoder layer ("model.layers.3"); ``-1`` -> the last one; a unit name
    ("embed", "model.layers.3", "head") or its short form ("layers.3", "3") is checked against
    the engine's units."""
    decoder = [n for n in names if n not in ("embed", "head")]
    if isinstance(layer, bool):
        raise TypeError("layer must be an int index or a unit name, not a bool")
    if isinstance(layer, int):
        if not decoder:
            return f"layers.{layer}" if layer >= 0 else _unknown(layer, names)
        try:
            return decoder[layer]
        except IndexError:
            raise IndexError(f"layer {layer} is out of range: the model has {len(decoder)} decoder "
                             f"layers (0..{len(decoder) - 1})") from None
    name = str(layer).strip()
    if name.lstrip("-").isdigit():
        return resolve_unit(int(name), names)
    if not names or name in names:
        return name
    matches = [n for n in names if n.endswith("." + name)]
    if len(matches) == 1:
        return matches[0]
    return _unknown(layer, names)


def _unknown(layer: Any, names: list[str]) -> str:
    shown = ", ".join(names) if len(names) <= 8 else ", ".join(names[:3] + ["..."] + names[-2:])
    raise LookupError(f"no unit {layer!r}; units are {shown or '(none yet: train a step first)'}")


class LayerReport(dict):
    """``session.inspect(layer)``: a dict (``unit, step, weight_norm, grad_norm, update_norm,
    update_ratio, hist_counts, hist_edges, history``) that displays as a table + histogram."""

    def __init__(self, stats: dict, *, unit: str, history: dict):
        super().__init__(stats)
        self["unit"] = unit
        self["history"] = {m: {"step": s, "value": v} for m, (s, v) in history.items()}

    def __repr__(self) -> str:
        scalars = ", ".join(f"{k}={fmt_stat(self.get(k))}" for k in SCALARS)
        return f"<LayerReport {self['unit']} at step {self.get('step', '?')}: {scalars}>"

    def _repr_html_(self) -> str:
        rows = stats_rows_html(self)
        return (f"<div><b>{html.escape(str(self['unit']))}</b> at step {self.get('step', '?')}"
                f"<div style='display:flex;gap:16px;align-items:flex-end'>"
                f"<table>{rows}</table>{_histogram_img(self)}</div></div>")


def _histogram_img(stats: dict) -> str:
    """The histogram as an image: an untrusted notebook's sanitizer takes inline SVG apart (its
    two labels ran together as "-0.096291.037"), an ``<img>`` of it stays whole."""
    return img(histogram_svg(stats.get("hist_counts"), stats.get("hist_edges")), "weight histogram")


def histogram_svg(counts: Any, edges: Any, width: int = 260, height: int = 90) -> str:
    """A dependency-free SVG bar chart (shown as an image in notebooks and reports)."""
    if not counts or not edges or len(edges) != len(counts) + 1:
        return ""
    top = max(counts) or 1
    bw = width / len(counts)
    bars = "".join(
        f"<rect x='{i * bw:.1f}' y='{height - 14 - (c / top) * (height - 18):.1f}' width='{max(bw - 1, 0.5):.1f}' "
        f"height='{(c / top) * (height - 18):.1f}' fill='#4c78a8'/>" for i, c in enumerate(counts))
    lo, hi = fmt_stat(edges[0]), fmt_stat(edges[-1])
    return (f"<svg width='{width}' height='{height}' xmlns='http://www.w3.org/2000/svg'>{bars}"
            f"<text x='0' y='{height - 2}' font-size='10' fill='#757575'>{lo}</text>"
            f"<text x='{width}' y='{height - 2}' font-size='10' fill='#757575' text-anchor='end'>{hi}</text></svg>")


def stats_rows_html(stats: dict) -> str:
    """One table row per statistic in SCALARS (the dashboard's and ``inspect``'s tables)."""
    return "".join(f"<tr><th style='text-align:left'>{k.replace('_', ' ')}</th><td>{fmt_stat(stats.get(k))}</td></tr>"
                   for k in SCALARS)


def fmt_stat(v: Any) -> str:
    """A statistic as HTML-safe text: floats to 4 significant digits (nan/inf shown as such)."""
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        return f"{v:.4g}"
    return html.escape(str(v)) if v is not None else "–"
