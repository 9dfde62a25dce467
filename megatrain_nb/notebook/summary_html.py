"""A self-contained HTML picture of a run: no scripts, no external resources, so it renders
where widgets cannot (nbconvert, GitHub, a notebook opened without the kernel) and it is what
a saved notebook keeps once the run has ended.

Example::

    from IPython.display import HTML
    HTML(summary_html(session, session.run_log.view()))
"""
from __future__ import annotations

import html
import math
import re
import time
from typing import Any

import numpy as np

from megatrain_nb.formatting import fmt_bytes, fmt_num, fmt_seconds

from .figures import TIERS, event_label, grouped_events, kind_group
from .grpo_view import grpo_html
from .lifecycle import LIVE
from .run_log import RunView, disk_cache_line, tier_summary
from .sample_watch import answers_html
from .static_chart import img

STATE_COLORS = {"idle": "#888", "running": "#2e7d32", "paused": "#ef6c00", "stopped": "#6d4c41",
                "finished": "#1565c0", "failed": "#b00020"}


def eta_seconds(session: Any, view: RunView) -> float | None:
    total = session.total_steps
    # paused: no ETA (the run is not moving towards its end)
    if not total or view.step_time_s is None or session.state != "running":
        return None
    return max(0, total - view.step) * view.step_time_s


FG = "var(--jp-ui-font-color1, #1f1f1f)"
FG2 = "var(--jp-ui-font-color2, #616161)"
TRACK = "var(--jp-layout-color3, #e0e0e0)"
BORDER = "var(--jp-border-color2, #d0d0d0)"


def header_html(session: Any, view: RunView) -> str:
    """The run at a glance, loss first and large: loss, state, step/total with a bar, ETA
    (while running), tokens/s, the MLP's tile (when the last step's rows ran in tiles), lr,
    elapsed. Everything from one ``view``."""
    state = session.state
    total = session.total_steps
    frac = min(1.0, view.step / total) if total else 0.0
    color = STATE_COLORS.get(state, "#888")
    last = view.last
    loss = _last_loss(view)
    eta = eta_seconds(session, view)
    cells = [
        f"step <b class='mtnb-dash-step'>{view.step}</b>{'/' + str(total) if total else ''}",
        *([f"ETA {fmt_seconds(eta)}"] if eta is not None else []),
        f"{fmt_num(view.tokens_per_s, ',.0f')} tok/s",
        *([f"MLP tiles of {int(last['tile_tokens']):,} tokens"] if last.get("tile_tokens") else []),
        f"lr <b class='mtnb-dash-lr'>{fmt_num(last.get('lr'), '.3g')}</b>",
        f"elapsed {fmt_seconds(view.elapsed_s)}",
    ]
    requested = getattr(session, "requested_lr", None)
    if requested is not None and state in LIVE and _differs(requested, last.get("lr")):
        cells.insert(2, f"<span class='mtnb-dash-lr-pending'>lr {fmt_num(requested, '.3g')} from the next step</span>")
    summary = session.summary() if hasattr(session, "summary") else {}
    notes = []
    if summary.get("diverged_at") is not None:
        notes.append(f"<span class='mtnb-diverged' style='color:#d32f2f;font-weight:bold'>diverged at step "
                     f"{int(summary['diverged_at'])} (NaN/inf; weights kept from the step before)</span>")
    if summary.get("skipped_steps"):
        notes.append(f"<span class='mtnb-skipped' style='color:#e08a00'>{int(summary['skipped_steps'])} non-finite "
                     "step(s) skipped</span>")
    bar = (f"<div style='height:4px;background:{TRACK};margin-top:6px;border-radius:2px'><div style='height:4px;"
           f"width:{frac * 100:.1f}%;background:{color};border-radius:2px'></div></div>") if total else ""
    err = ""
    if state == "failed" and session.error_traceback:
        err = (f"<details open style='margin-top:4px;color:#d32f2f'><summary>{html.escape(session.summary()['error'])}"
               f"</summary><pre style='font-size:11px;white-space:pre-wrap'>{html.escape(session.error_traceback)}</pre>"
               "</details>")
    loss_text = fmt_num(loss) if loss is not None else "–"
    return (f"<div class='mtnb-dash-header' data-step='{view.step}' style='font-family:sans-serif;color:{FG}'>"
            f"<div style='display:flex;flex-wrap:wrap;align-items:baseline;gap:4px 18px'>"
            f"<span style='white-space:nowrap'><span style='color:{FG2};font-size:13px'>loss</span> "
            f"<span class='mtnb-dash-loss' style='font-size:28px;font-weight:600;line-height:1.1'>{loss_text}</span></span>"
            f"<span style='white-space:nowrap;font-size:14px'><b>{html.escape(session.name)}</b> "
            f"<span class='mtnb-dashboard-state' style='background:{color};color:white;border-radius:3px;"
            f"padding:1px 6px'>{state}</span></span>"
            f"<span style='font-size:13px;color:{FG2};display:flex;flex-wrap:wrap;gap:2px 14px'>"
            + "".join(f"<span style='white-space:nowrap'>{c}</span>" for c in cells)
            + "</span></div>"
            + (f"<div style='font-size:13px;margin-top:2px'>{' · '.join(notes)}</div>" if notes else "")
            + f"{bar}{err}</div>")


def _last_loss(view: RunView) -> float | None:
    v = view.last.get("loss")
    if isinstance(v, (int, float)) and math.isfinite(v):
        return float(v)
    _, y = view.curves.get("loss", (np.zeros(0), np.zeros(0)))
    finite = y[np.isfinite(y)] if len(y) else y
    return float(finite[-1]) if len(finite) else None


def _differs(a: Any, b: Any) -> bool:
    return not (isinstance(b, (int, float)) and abs(float(a) - float(b)) <= 1e-12 * max(abs(float(a)), 1e-30))


KIND_COLORS = {"weights": "#4c78a8", "grads": "#f58518", "optimizer": "#54a24b", "activations": "#b279a2",
               "other": "#9e9e9e"}
#: a capped tier's room left: its own colour (light, striped), never the track's grey "other" shares
FREE_COLOR = "repeating-linear-gradient(45deg, #d7ead9 0 4px, #eef6ef 4px 8px)"


def _tier_text(used: float, peak: float, cap: float | None) -> str:
    """The words beside a tier's bar: "1.2 GiB used of 16 GiB (8%) · 14.8 GiB free"; without a
    limit, "1.2 GiB in use, at most 3 GiB so far (no limit set)", or "nothing stored here"."""
    if cap:
        return (f"{fmt_bytes(used)} used of {fmt_bytes(cap)} ({fmt_num(100 * used / cap, '.1f')}%) · "
                f"{fmt_bytes(max(0.0, cap - used))} free")
    if used <= 0 and peak <= 0:
        return "nothing stored here (no limit set)"
    return f"{fmt_bytes(used)} in use, at most {fmt_bytes(max(used, peak))} so far (no limit set)"


def memory_tiers_html(view: RunView) -> str:
    """Each memory tier as a labelled bar: used against the tier's capacity, split by what it
    holds (weights, grads, optimizer states, activations, other); a tier without a known
    capacity is drawn against its own peak and says so (no percentage)."""
    tiers = tier_summary(view.memory)
    if not tiers:
        return (f"<div class='mtnb-dash-memory' style='font-family:sans-serif;font-size:12px;color:{FG2}'>"
                "memory tiers: not reported yet</div>")
    rows = []
    for name in TIERS:
        t = tiers.get(name)
        if not t:
            continue
        kinds = {k: 0.0 for k in KIND_COLORS}
        for k, b in t["kinds"].items():
            kinds[kind_group(k)] += b
        accounted = sum(kinds.values())
        used = t["used"] if math.isfinite(t["used"]) else accounted
        kinds["other"] += max(0.0, used - accounted)
        cap = t["capacity"]
        capped = cap is not None and math.isfinite(cap) and cap > 0
        peak = t["peak"] if math.isfinite(t["peak"]) else 0.0
        denom = cap if capped else max(used, peak, sum(kinds.values())) or 1.0
        text = _tier_text(used, peak, cap if capped else None)
        segs = "".join(
            f"<div title='{k}: {fmt_bytes(b)}' class='mtnb-tier-seg' data-kind='{k}' style='width:"
            f"{min(100.0, 100 * b / denom):.2f}%;min-width:{2 if b > 0 else 0}px;background:{KIND_COLORS[k]}'></div>"
            for k, b in kinds.items() if b > 0)
        if capped and cap > sum(kinds.values()):   # the room left: its own colour, at the bar's end
            free = cap - sum(kinds.values())
            segs += (f"<div title='free: {fmt_bytes(free)}' class='mtnb-tier-seg' data-kind='free' style='flex:1;"
                     f"background:{FREE_COLOR}'></div>")
        cache = disk_cache_line((view.memory or {}).get(name))
        track = (f"border:1px dashed {BORDER};background:transparent" if not capped else f"background:{TRACK}")
        rows.append(
            f"<div class='mtnb-tier' data-tier='{name}' style='margin:4px 0 8px'>"
            f"<div style='display:flex;flex-wrap:wrap;gap:0 10px;align-items:baseline'>"
            f"<b style='min-width:48px'>{name}</b><span class='mtnb-tier-text' style='color:{FG2}'>{text}</span></div>"
            f"<div style='display:flex;height:10px;border-radius:3px;overflow:hidden;margin-top:2px;{track}'>{segs}</div>"
            + (f"<div style='color:{FG2};font-size:11px'>{html.escape(cache)}</div>" if cache else "")
            + "</div>")
    legend = "".join(
        f"<span style='white-space:nowrap'><span style='display:inline-block;width:10px;height:10px;border-radius:2px;"
        f"background:{c};margin-right:4px;vertical-align:-1px'></span>{k}</span>"
        for k, c in list(KIND_COLORS.items()) + [("free", FREE_COLOR)])
    return (f"<div class='mtnb-dash-memory' style='font-family:sans-serif;font-size:12px;color:{FG}'>"
            f"<div style='font-weight:600;margin-bottom:2px'>Memory tiers</div>{''.join(rows)}"
            f"<div style='display:flex;flex-wrap:wrap;gap:2px 12px;color:{FG2}'>{legend}</div></div>")


def loss_svg(view: RunView, width: int = 520, height: int = 140) -> str:
    """The loss curve (with eval points and event markers) as an SVG document; shown as an
    image (``static_chart.img``): a notebook's sanitizer keeps that, inline SVG it takes apart."""
    x, y = view.curves.get("loss", (np.zeros(0), np.zeros(0)))
    if len(x) < 2:
        return ""
    ex, ey = view.eval
    ys = np.concatenate([y, ey[np.isfinite(ey)]]) if len(ey) else y
    x0, x1 = float(x.min()), float(x.max()) or 1.0
    y0, y1 = float(ys.min()), float(ys.max())
    if y1 <= y0:
        y1 = y0 + 1.0
    pad = 6
    n_rows = min(3, len(grouped_events(view.events)))
    top = 4 + 12 * n_rows
    height += 12 * max(0, n_rows - 1)

    def px(a):
        return pad + (a - x0) / ((x1 - x0) or 1.0) * (width - 2 * pad)

    def py(b):
        return height - pad - 12 - (b - y0) / (y1 - y0) * (height - top - pad - 14)

    pts = " ".join(f"{px(a):.1f},{py(b):.1f}" for a, b in zip(x, y))
    parts = [f"<polyline fill='none' stroke='#4c78a8' stroke-width='1.5' points='{pts}'/>"]
    for a, b in zip(ex, ey):
        if math.isfinite(b):
            parts.append(f"<circle cx='{px(a):.1f}' cy='{py(b):.1f}' r='2.5' fill='#f58518'/>")
    # marker labels in rows above the curve, none touching another, none past the edges
    rows_end: list[float] = []
    for step, label, c in grouped_events(view.events):
        xe = px(float(step))
        w = 6.0 * len(label)  # generous for 10 px sans-serif
        lx = xe + 2 if xe + 2 + w <= width else max(0.0, xe - 2 - w)
        row = next((i for i, end in enumerate(rows_end) if lx >= end + 6), None)
        if row is None and len(rows_end) < 3:
            rows_end.append(-1e9)
            row = len(rows_end) - 1
        parts.append(f"<line x1='{xe:.1f}' x2='{xe:.1f}' y1='{top}' y2='{height - pad}' stroke='{c}' "
                     f"stroke-dasharray='3,3'><title>step {step}: {html.escape(label)}</title></line>")
        if row is None:
            continue  # no room: the line and its tooltip remain
        rows_end[row] = lx + w
        parts.append(f"<text x='{lx:.1f}' y='{11 + 12 * row}' font-size='10' fill='{c}'>{html.escape(label)}</text>")
    parts.append(f"<text x='{width - pad}' y='{height - 4}' font-size='10' fill='#757575' text-anchor='end'>"
                 f"loss {y0:.3g}–{y1:.3g}, steps {x0:.0f}–{x1:.0f}</text>")
    return f"<svg width='{width}' height='{height}' xmlns='http://www.w3.org/2000/svg'>{''.join(parts)}</svg>"


def memory_table(view: RunView) -> str:
    tiers = tier_summary(view.memory)
    if not tiers:
        return ""
    rows = "".join(
        f"<tr><td>{t}</td><td>{fmt_bytes(tiers[t]['used'])}</td><td>{fmt_bytes(tiers[t]['peak'])}</td>"
        f"<td>{fmt_bytes(tiers[t]['capacity'])}</td></tr>" for t in TIERS if t in tiers)
    cache = disk_cache_line((view.memory or {}).get("host"))
    note = f"<div style='font-size:11px'>{html.escape(cache)}</div>" if cache else ""
    return ("<table style='font-size:12px'><tr><th>tier</th><th>used</th><th>peak</th><th>capacity</th></tr>"
            f"{rows}</table>{note}")


def rank_memory_table(view: RunView) -> str:
    """Several ranks: each rank's used / peak bytes per tier (from the latest logging step)."""
    ranks = view.rank_memory
    if not ranks or len(ranks) < 2:
        return ""
    rows = []
    for r, mem in enumerate(ranks):
        tiers = tier_summary(mem)
        cells = "".join(f"<td>{fmt_bytes(tiers[t]['used'])} ({fmt_bytes(tiers[t]['peak'])})</td>"
                        if t in tiers else "<td>–</td>" for t in TIERS)
        rows.append(f"<tr><td>rank {r}</td>{cells}</tr>")
    head = "".join(f"<th>{t} used (peak)</th>" for t in TIERS)
    return f"<table style='font-size:12px'><tr><th></th>{head}</tr>{''.join(rows)}</table>"


def events_table(events: list[dict], limit: int = 12) -> str:
    if not events:
        return ""
    rows = "".join(
        f"<tr><td>{e.get('step')}</td><td>{html.escape(event_label(e))}</td>"
        f"<td>{html.escape(str(e.get('source', '')))}</td>"
        f"<td>{time.strftime('%H:%M:%S', time.localtime(e.get('time', 0)))}</td></tr>"
        for e in events[-limit:])
    more = f"<div style='font-size:11px'>({len(events) - limit} earlier)</div>" if len(events) > limit else ""
    return ("<table style='font-size:12px'><tr><th>step</th><th>event</th><th>source</th><th>time</th></tr>"
            f"{rows}</table>{more}")


def final_key(session: Any) -> str:
    """The class suffix of a run's static snapshot (``probe.RenderProbe.key``): letters and digits."""
    return re.sub(r"[^A-Za-z0-9_-]", "", str(getattr(session, "id", "") or ""))


def summary_html(session: Any, view: RunView, *, final: bool = False) -> str:
    """The whole static summary: header, loss curve, memory tiers, events. ``final``: the
    snapshot a run leaves (class ``mtnb-final-<key>``: hidden on a page where the run's live
    dashboard renders, shown where it does not -- a saved notebook, an export)."""
    note = (f"<div style='font-size:11px;color:{FG2}'>Static snapshot of the run (saved with the notebook).</div>"
            if final else "")
    cls = f"megatrain-summary mtnb-final-snapshot mtnb-final-{final_key(session)}" if final else "megatrain-summary"
    return (f"<div class='{cls}' style='border:1px solid {BORDER};padding:8px;border-radius:4px;color:{FG}'>"
            f"{header_html(session, view)}{note}"
            f"<div style='display:flex;gap:16px;flex-wrap:wrap;align-items:flex-start;margin-top:6px'>"
            f"<div>{img(loss_svg(view), 'loss curve')}</div><div>{memory_table(view)}{rank_memory_table(view)}"
            f"{events_table(view.events)}</div></div>{grpo_html(session.run_log.records())}"
            f"{answers_html(getattr(session, 'sample_watch', None))}</div>")


def session_summary(session: Any) -> dict:
    """A small JSON-able picture of a run (``Session.summary``: the magic, the HTML summary)."""
    last, error = session.run_log.last_record(), session.error
    return {"id": session.id, "name": session.name, "state": session.state, "step": session.step,
            "total_steps": session.total_steps, "loss": last.get("loss"), "lr": last.get("lr"),
            "tokens_per_s": last.get("tokens_per_s"), "events": len(session.events),
            "error": None if error is None else f"{type(error).__name__}: {error}",
            "diverged_at": getattr(error, "step", None) if session.diverged else None,
            "skipped_steps": last.get("skipped_steps") or 0}
