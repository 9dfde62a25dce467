"""What the dashboard, the static snapshot and the report share about a run's picture: event
markers (grouped per step, labelled, coloured), memory kinds and tiers, heatmap labels. The
charts themselves are ``chart.js`` (live, and inlined in reports) and ``summary_html`` /
``static_chart`` (static images); plotly is no longer drawn anywhere but ``mt.compare``'s figure.
"""
from __future__ import annotations

import math
from typing import Any

from megatrain_nb.formatting import fmt_bytes

from .run_log import disk_cache_line, tier_summary

TIERS = ("device", "host", "disk")
KINDS = ("weights", "grads", "optimizer", "activations", "other")
EVENT_COLORS = {"pause": "#f58518", "resume": "#54a24b", "lr": "#e45756", "checkpoint": "#72b7b2",
                "stop": "#9d755d", "error": "#b00020"}
HEAT_LABELS = {"grad_norm": "log10 gradient norm", "update_ratio": "log10 update / weight",
               "weight_norm": "log10 weight norm"}


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
