"""The fastest plans within the budgets: the planner's choices priced by the predicted step time.

Where the planner has a choice that changes a step's time -- the checkpoint interval (recompute
vs activation memory), where final gradients wait for a clipping norm (host RAM vs the disk
tier), whether the master weights live on the disk tier -- :func:`best_plans` makes the plan of
each candidate (``planner.make_plan``, so each is held to the same budgets), predicts its step
(``prediction.predict_step``) and returns the fastest ``k`` that fit. A choice the caller pinned
in the EngineConfig (a ``checkpoint_interval``, ``clip_hold`` other than "auto", an
``offload_params``) is not varied. The engine's planner itself still decides by its rules;
``mt.estimate`` lists these so a user can pin the fastest.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import List, Optional

from .planner import Plan, Workload, make_plan
from .prediction import StepPrediction, predict_step


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
               state_units=None, k: int = 3, pinned: Optional[dict] = None) -> List[PlanChoice]:
    """The ``k`` fastest feasible plans (fastest first; a tie goes to less host RAM)."""
    out, seen = [], set()
    for choice in candidate_choices(cfg, shape, workload, pinned=pinned):
        c = cfg.replace(**choice)
        plan = make_plan(units, shape, c, cuda=cuda, workload=workload, disk_bytes=disk_bytes,
                         state_units=state_units)
        if not plan.feasible:
            continue
        key = (plan.checkpoint_interval, tuple(sorted(plan.placement.items())),
               (plan.window or {}).get("checkpoint_interval"), (plan.window or {}).get("groups"))
        if key in seen:   # another choice that came to the same plan
            continue
        seen.add(key)
        pred = predict_step(units, shape, c, plan, workload, rates, cuda=cuda)   # (one rank: sharding not priced)
        out.append(PlanChoice(choice=choice, plan=plan, prediction=pred))
    out.sort(key=lambda pc: (pc.prediction.step_seconds, pc.plan.host["total"]))
    return out[:k]
