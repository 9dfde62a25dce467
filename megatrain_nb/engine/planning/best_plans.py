"""The fastest plans within the budgets: the planner's choices priced by the predicted step time.

Where the planner has a choice that changes a step's time -- the checkpoint interval (recompute
vs activation memory), where final gradients wait for a clipping norm (host RAM vs the disk
tier), whether the master weights live on the disk tier -- :func:`best_plans` makes the plan of
each candidate (``planner.make_plan``, so each is held to the same budgets), predicts its step
(``prediction.predict_step``) and returns the fastest ``k`` that fit. A choice the caller pinned
(:func:`pinned_of`: a field the caller passed, or set away from its EngineConfig default) is not
varied; ``device_cap`` holds every candidate's device working set to a number of bytes (the
engine: the rules' own plan's, when the user gave no device budget). The engine
takes the fastest when it knows the machine's rates (``plan_pick.pick_plan``); ``mt.estimate``
lists the three fastest.

Not candidates, because the prediction cannot tell them apart: the prefetch depth
(``EngineOverrides.inflight_depth``), the update chunk and the host cache's size only change host
RAM (a deeper or larger one never predicts faster, so the model would always take the smallest or
the largest, which the rules already do); held weight buffers are not priced; a window's layout is
made per step by the rules (device, then host RAM, then disk; fewest groups), which the prediction
orders the same way.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import List, Optional

from .planner import Plan, Workload, make_plan
from .prediction import StepPrediction, predict_step

#: A plan must be predicted this much faster than the rules' own to be taken instead of it (the
#: prediction does not price everything: held buffers, per-chunk costs; it is judged within
#: -20%/+25% of the measured step, so a gain of a few percent is inside its error; a tie keeps the
#: rules'). (2% let bench_overlap's clipped disk-tier engine take a plan that ran slower.)
MARGIN = 0.10
#: Predicted times closer than this (relative) are one time: plans that differ in where a few bytes
#: wait, not in their schedule's bounds.
TIE = 1e-6

#: The EngineConfig fields best_plans varies, and the value that leaves each free (its default;
#: checkpoint_interval None also means "the planner picks").
CHOICES = {"checkpoint_interval": (1, None), "clip_hold": ("auto",), "offload_params": (None,)}
#: The value of each of CHOICES that asks the planner to decide, even when the caller passed it.
DECIDE = {"checkpoint_interval": None, "clip_hold": "auto", "offload_params": None}


def pinned_of(cfg) -> dict:
    """The choices ``cfg`` pins: each of :data:`CHOICES` the caller passed (``EngineConfig.given``),
    whatever its value -- ``checkpoint_interval=1`` passed is pinned though it is the default --
    unless it is the value that asks the planner (:data:`DECIDE`), and each set away from its free
    values."""
    given = getattr(cfg, "given", frozenset())
    return {name: getattr(cfg, name) for name, free in CHOICES.items()
            if getattr(cfg, name) not in free or (name in given and getattr(cfg, name) != DECIDE[name])}


def pinned_by_value(cfg) -> dict:
    """The choices set away from their free values (``mt.estimate``: its arguments always reach
    the config, so only a value other than the default says the caller set it)."""
    return {name: getattr(cfg, name) for name, free in CHOICES.items() if getattr(cfg, name) not in free}


@dataclass
class PlanChoice:
    """One candidate: the EngineConfig fields it sets, its plan and its predicted step."""
    choice: dict
    plan: Plan
    prediction: StepPrediction

    def describe(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.choice.items()) or "the planner's defaults"


def candidate_choices(cfg, shape, workload: Workload, *, pinned: Optional[dict] = None) -> List[dict]:
    """The EngineConfig changes worth comparing (``pinned``: field -> value not to vary)."""
    pinned = pinned or {}
    n = max(shape.num_layers, 1)
    ks = [cfg.checkpoint_interval] if "checkpoint_interval" in pinned else sorted(
        {0, 1, 2, 3, 4, max(1, int(math.sqrt(n)))})
    holds = [cfg.clip_hold]
    if cfg.offload_dir and workload.clipped and "clip_hold" not in pinned:
        holds = ["host", "disk"]
    params = [cfg.offload_params]
    if cfg.offload_dir and "offload_params" not in pinned:
        params = [None, True]
    return [{"checkpoint_interval": k, "clip_hold": h, "offload_params": p}
            for k, h, p in itertools.product(ks, holds, params)]


def best_plans(units, shape, cfg, workload: Workload, rates, *, cuda: bool, disk_bytes: Optional[int] = None,
               state_units=None, k: Optional[int] = 3, pinned: Optional[dict] = None,
               device_cap: Optional[int] = None) -> List[PlanChoice]:
    """The ``k`` fastest feasible plans (fastest first; a tie goes to less host RAM; ``k`` None:
    every one). ``pinned``: as :func:`pinned_of` says (None: ``pinned_of(cfg)``); ``device_cap``:
    bytes no candidate's device working set may pass (None: only the budgets)."""
    pinned = pinned_of(cfg) if pinned is None else pinned
    out, seen = [], set()
    for choice in candidate_choices(cfg, shape, workload, pinned=pinned):
        c = cfg.replace(**choice)
        plan = make_plan(units, shape, c, cuda=cuda, workload=workload, disk_bytes=disk_bytes,
                         state_units=state_units)
        if not plan.feasible or (device_cap is not None and plan.device["total"] > device_cap):
            continue
        key = plan_key(plan)
        if key in seen:   # another choice that came to the same plan
            continue
        seen.add(key)
        pred = predict_step(units, shape, c, plan, workload, rates, cuda=cuda)   # (one rank: sharding not priced)
        out.append(PlanChoice(choice=choice, plan=plan, prediction=pred))
    out.sort(key=lambda pc: (pc.prediction.step_seconds, pc.plan.host["total"]))
    return out if k is None else out[:k]


def plan_key(plan: Plan) -> tuple:
    """What tells two plans apart for a step's time: the interval, the placement, the window's layout."""
    return (plan.checkpoint_interval, tuple(sorted(plan.placement.items())),
            (plan.window or {}).get("checkpoint_interval"), (plan.window or {}).get("groups"))


def engine_pick(found: List[PlanChoice], rules: Plan) -> Optional[PlanChoice]:
    """The plan an engine takes of ``found`` (fastest first): the fastest, unless the rules' own
    plan (``rules``, made under the same budgets and workload) is predicted within :data:`MARGIN`
    of it; None when nothing was found."""
    if not found:
        return None
    own = next((pc for pc in found if plan_key(pc.plan) == plan_key(rules)), None)
    if own is not None and own.prediction.step_seconds <= found[0].prediction.step_seconds * (1 + MARGIN):
        return own
    return found[0]
