"""What the displays show of a preference (DPO) run: TRL's reward margin and accuracy.

``mt.DPOTrainer`` puts ``rewards/margins`` (the chosen answer's log-prob gain over the
reference minus the rejected one's, times ``beta``) and ``rewards/accuracies`` (the share of
pairs whose margin is positive) in every step's record. Read here from the run's records, so a
run that is not DPO shows nothing new:

- ``%megatrain status``: a ``reward margin M, accuracy A`` part (:func:`reward_parts`);
- the dashboard: a small chart of both over steps, in its extra figures (:func:`attach_reward_panel`);
- the report: a section with that figure and a table (:func:`reward_section`);
- the sidebar's card: the beacon's ``reward_margin`` and ``reward_accuracy`` (``channel/beacon.py``).
"""
from __future__ import annotations

import math
from typing import Any

from .chart_panel import add_chart_panel

MARGIN, ACCURACY = "rewards/margins", "rewards/accuracies"


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def reward_parts(last: dict) -> list:
    """``["reward margin 0.0971", "accuracy 0.975"]`` for a DPO step's record; [] otherwise."""
    if not _finite(last.get(MARGIN)):
        return []
    parts = [f"reward margin {last[MARGIN]:.4g}"]
    if _finite(last.get(ACCURACY)):
        parts.append(f"accuracy {last[ACCURACY]:.3g}")
    return parts


def reward_series(records: list, max_points: int = 400) -> dict:
    """``{"x": steps, "margin": [...], "accuracy": [...]}`` of the records that carry them (every
    k-th one past ``max_points``, the last always kept)."""
    rows = [r for r in records if _finite(r.get(MARGIN))]
    if len(rows) > max_points:
        k = math.ceil(len(rows) / max_points)
        rows = rows[::k] + ([rows[-1]] if (len(rows) - 1) % k else [])
    return {"x": [int(r.get("step", 0) or 0) for r in rows], "margin": [float(r[MARGIN]) for r in rows],
            "accuracy": [float(r[ACCURACY]) if _finite(r.get(ACCURACY)) else None for r in rows]}


def reward_spec(records: list, height: int = 150, max_points: int = 400) -> dict:
    """The chart's spec (the dashboard's and the report's ``panels`` kind): the margin and the
    accuracy side by side on one step axis."""
    s = reward_series(records, max_points)
    return {"kind": "panels", "columns": 2, "height": height,
            "panels": [{"title": "reward margin", "zero": False, "note": "no DPO step logged yet",
                        "series": [{"name": "reward margin", "color": "#3b7dd8", "x": s["x"], "y": s["margin"]}]},
                       {"title": "reward accuracy", "note": "no DPO step logged yet", "range": [0, 1],
                        "series": [{"name": "reward accuracy", "color": "#2a9d5c", "x": s["x"],
                                    "y": s["accuracy"]}]}]}


def is_preference_run(session: Any) -> bool:
    """A session whose trainer is an mt.DPOTrainer (told without importing trl), or whose ranks
    in worker processes train one (``remote.ProcessRun.training_kind``)."""
    return (hasattr(getattr(session, "trainer", None), "reference_seconds")
            or getattr(session, "training_kind", None) == "dpo")


def attach_reward_panel(dashboard: Any) -> None:
    """Add the reward chart to ``dashboard``'s extra figures when its session trains DPO."""
    if is_preference_run(dashboard.session):
        dashboard.reward_chart = add_chart_panel(dashboard, "Preference: reward margin and accuracy", reward_spec)


def reward_section(records: list):
    """(markdown, chart spec) of the report's preference section; None when the run is not DPO."""
    s = reward_series(records, max_points=2000)
    if not s["x"]:
        return None
    pick = sorted({0, len(s["x"]) // 2, len(s["x"]) - 1})
    rows = "".join(f"| {s['x'][i]} | {s['margin'][i]:.4g} | "
                   f"{'–' if s['accuracy'][i] is None else format(s['accuracy'][i], '.3g')} |\n" for i in pick)
    md = ("## Preference training\n\nTRL's reward margin (the chosen answer's log-prob gain over the reference "
          "minus the rejected one's, times `beta`) and reward accuracy (the share of pairs whose margin is "
          "positive), per step.\n\n| step | reward margin | reward accuracy |\n|---|---|---|\n" + rows)
    return md, reward_spec(records, height=200, max_points=2000)
