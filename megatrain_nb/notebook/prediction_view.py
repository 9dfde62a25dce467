"""What the displays show of a run's predicted step against its measured one.

The numbers are the trainer's (``Trainer.measured_vs_predicted``: the prediction taken as the
run started and the engine telemetry its steps carried up), so nothing here calls into the
engine while it trains; the table is ``engine.prediction_check.comparison_rows``, the one the
CLI prints. A run without rates (no prediction) or in worker processes (no trainer in this
kernel) shows nothing new:

- ``%megatrain status``: the predicted step, then the per-phase table once two steps ran and
  the >25% line (:func:`status_lines`);
- the dashboard: the predicted step beside the measured one and the >25% line, under the links
  (:func:`prediction_html`).
"""
from __future__ import annotations

import html
from typing import Any, Optional

from megatrain_nb.engine.planning.prediction import fmt_seconds
from megatrain_nb.engine.planning.prediction_check import comparison_lines, off_text


def session_report(session: Any) -> Optional[dict]:
    """The session's trainer's ``measured_vs_predicted()`` (None: no trainer here, no rates).
    Before the run starts the trainer prices its plan (the engine is idle then); once it has
    started only what the run recorded is read."""
    trainer = getattr(session, "trainer", None)
    get = getattr(trainer, "measured_vs_predicted", None)
    if not callable(get):
        return None
    if getattr(trainer, "prediction_watch", None) is None and (session.state != "idle" or session.released):
        return None   # starting, or released before a first run: not asked of the engine
    return get()


def status_lines(report: Optional[dict]) -> list:
    """``%megatrain status``'s lines: the predicted step and bottleneck, then (two steps in)
    predicted vs measured per phase and the >25% line; [] without a report."""
    if report is None:
        return []
    pred = report["prediction"]
    head = f"predicted step {fmt_seconds(pred.step_seconds)}; bottleneck: {pred.bottleneck}"
    if report["measured"] is None:
        return [head + " (measured per phase once 2 steps ran)"]
    return [head] + comparison_lines(pred, report["measured"], report["steps"])


def prediction_html(report: Optional[dict], fg2: str) -> str:
    """The dashboard's block: predicted step, measured step (the mean since the first step) and
    how far apart, and the >25% line when there is one; "" without a report."""
    if report is None:
        return ""
    pred, measured = report["prediction"], report["measured"]
    text = f"predicted step {fmt_seconds(pred.step_seconds)}"
    if measured is not None:
        off = off_text(pred.step_seconds, measured["step"])
        text += f" · measured {fmt_seconds(measured['step'])}" + (f" ({off})" if off else "")
    text += f" · bottleneck: {html.escape(pred.bottleneck)}"
    out = (f"<div class='mtnb-dash-prediction' style='font-size:12px;font-family:sans-serif;color:{fg2}'>"
           f"{text}</div>")
    if report.get("difference"):
        out += (f"<div class='mtnb-dash-prediction-off' style='font-size:12px;font-family:sans-serif;"
                f"color:#e08a00'>{html.escape(report['difference'])}</div>")
    return out
