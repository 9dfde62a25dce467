"""What the displays show of a GRPO run (``mt.GRPOTrainer``): reward, KL, completion length, and the
step's time split between generation and training.

Every step's record of a GRPO run carries its latest rollouts' ``reward`` (the weighted sum's
mean), ``reward_std``, ``rewards/<function>/mean`` per reward function, ``completion_length``
(mean tokens), ``kl`` (the mean per-token KL to the reference, when ``beta`` != 0), and
``generation_s`` (seconds making the step's rollouts: 0.0 when a stored generation serves it)
beside ``step_time_s`` (the training). Read here from the run's records, so a run that is not
GRPO shows nothing new:

- ``%megatrain status``: a ``reward R, KL K, completions L tokens`` part (:func:`grpo_parts`);
- the dashboard: four small charts over steps in its extra figures (:func:`attach_grpo_panel`);
- the report: a section with that figure and a table (:func:`grpo_section`);
- the static snapshot a run leaves (``summary_html``): the same figure (:func:`grpo_html`).
"""
from __future__ import annotations

import math
from typing import Any

from .chart_panel import add_chart_panel
from .static_chart import img, panels_svg

PER_FUNCTION = ("rewards/", "/mean")
COLORS = ("#e07b39", "#2a9d5c", "#8e5cc4", "#c44e6a", "#3aa6b9", "#7a7a2a")
NOTE = "no GRPO step logged yet"


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def is_grpo_record(r: dict) -> bool:
    return "generation_s" in r and _finite(r.get("reward"))


def function_names(records: list) -> list:
    """The reward functions' names, in the order the records first show them."""
    names: list = []
    for r in records:
        for k in r:
            if k.startswith(PER_FUNCTION[0]) and k.endswith(PER_FUNCTION[1]):
                name = k[len(PER_FUNCTION[0]):-len(PER_FUNCTION[1])]
                if name not in names:
                    names.append(name)
    return names


def _value(r: dict, key: str):
    v = r.get(key)
    return float(v) if _finite(v) else None


def grpo_series(records: list, max_points: int = 400) -> dict:
    """``{"x", "reward", "functions": {name: [...]}, "kl", "length", "generation", "training"}`` of
    the GRPO records (every k-th past ``max_points``, the last always kept)."""
    rows = [r for r in records if is_grpo_record(r)]
    if len(rows) > max_points:
        k = math.ceil(len(rows) / max_points)
        rows = rows[::k] + ([rows[-1]] if (len(rows) - 1) % k else [])
    names = function_names(rows)
    return {"x": [int(r.get("step", 0) or 0) for r in rows], "reward": [_value(r, "reward") for r in rows],
            "functions": {n: [_value(r, f"rewards/{n}/mean") for r in rows] for n in names},
            "kl": [_value(r, "kl") for r in rows], "length": [_value(r, "completion_length") for r in rows],
            "generation": [_value(r, "generation_s") for r in rows],
            "training": [_value(r, "step_time_s") for r in rows]}


def grpo_spec(records: list, height: int = 150, max_points: int = 400) -> dict:
    """The charts' spec (the dashboard's and the report's ``panels`` kind): reward (mean and per
    function), KL (a run with ``beta`` != 0), completion length, and seconds per step making
    rollouts against training."""
    s = grpo_series(records, max_points)
    x = s["x"]
    reward = [{"name": "reward (weighted sum)", "color": "#3b7dd8", "x": x, "y": s["reward"]}]
    reward += [{"name": n, "color": COLORS[i % len(COLORS)], "x": x, "y": ys}
               for i, (n, ys) in enumerate(s["functions"].items())]
    panels = [{"title": "reward: mean and per function", "zero": False, "note": NOTE, "series": reward}]
    if any(v is not None for v in s["kl"]):
        panels.append({"title": "KL to the reference", "note": NOTE,
                       "series": [{"name": "KL", "color": "#c44e6a", "x": x, "y": s["kl"]}]})
    panels.append({"title": "completion length (tokens)", "note": NOTE,
                   "series": [{"name": "mean completion length", "color": "#8e5cc4", "x": x, "y": s["length"]}]})
    panels.append({"title": "seconds per step: generation vs training", "note": NOTE,
                   "series": [{"name": "generation", "color": "#e07b39", "x": x, "y": s["generation"]},
                              {"name": "training", "color": "#2a9d5c", "x": x, "y": s["training"]}]})
    return {"kind": "panels", "columns": 2, "height": height, "panels": panels}


def grpo_parts(last: dict) -> list:
    """``["reward 0.62", "KL 0.0031", "completions 4.2 tokens", "generation 71% of the step"]`` for a
    GRPO step's record; [] otherwise."""
    if not is_grpo_record(last):
        return []
    parts = [f"reward {last['reward']:.4g}"]
    if _finite(last.get("kl")):
        parts.append(f"KL {last['kl']:.3g}")
    if _finite(last.get("completion_length")):
        parts.append(f"completions {last['completion_length']:.3g} tokens")
    gen, train = _value(last, "generation_s"), _value(last, "step_time_s")
    if gen is not None and train and gen + train > 0:
        parts.append(f"generation {gen / (gen + train):.0%} of the step")
    return parts


def time_split(records: list) -> tuple:
    """(generation seconds, training seconds) over the GRPO records."""
    rows = [r for r in records if is_grpo_record(r)]
    return (sum(_value(r, "generation_s") or 0.0 for r in rows), sum(_value(r, "step_time_s") or 0.0 for r in rows))


def is_grpo_run(session: Any) -> bool:
    """A session whose trainer is an mt.GRPOTrainer (told without importing trl), or whose ranks
    in worker processes train one (``remote.ProcessRun.training_kind``)."""
    return (hasattr(getattr(session, "trainer", None), "reward_func_names")
            or getattr(session, "training_kind", None) == "grpo")


def attach_grpo_panel(dashboard: Any) -> None:
    """Add the GRPO charts to ``dashboard``'s extra figures when its session trains GRPO."""
    if is_grpo_run(dashboard.session):
        add_chart_panel(dashboard, "Rewards: reward, KL, completion length, generation vs training", grpo_spec)


def grpo_html(records: list) -> str:
    """The static figure of a GRPO run's records (the run's snapshot); "" when it is not GRPO."""
    if not any(is_grpo_record(r) for r in records):
        return ""
    return f"<div>{img(panels_svg(grpo_spec(records)), 'reward, KL, completion length, generation vs training')}</div>"


def grpo_section(records: list):
    """(markdown, chart spec) of the report's GRPO section; None when the run is not GRPO."""
    s = grpo_series(records, max_points=2000)
    if not s["x"]:
        return None
    pick = sorted({0, len(s["x"]) // 2, len(s["x"]) - 1})
    names = list(s["functions"])

    def f(v, spec=".4g"):
        return "–" if v is None else format(v, spec)

    head = "| step | reward | " + "".join(f"{n} | " for n in names) + "KL | completion length | generation s | training s |"
    rule = "|---" * (6 + len(names)) + "|"
    rows = "".join(f"| {s['x'][i]} | {f(s['reward'][i])} | " + "".join(f"{f(s['functions'][n][i])} | " for n in names)
                   + f"{f(s['kl'][i], '.3g')} | {f(s['length'][i], '.3g')} | {f(s['generation'][i], '.3g')} | "
                     f"{f(s['training'][i], '.3g')} |\n" for i in pick)
    gen, train = time_split(records)
    share = f"{gen / (gen + train):.0%}" if gen + train > 0 else "–"
    md = ("## Learning from rewards\n\nThe rollouts' mean reward (the weighted sum of the reward functions) and "
          "each function's mean, the KL to the reference (`beta` != 0), the mean completion length, and each "
          f"step's seconds making its rollouts against training (generation: {share} of the run's step time).\n\n"
          f"{head}\n{rule}\n{rows}")
    return md, grpo_spec(records, height=200, max_points=2000)
