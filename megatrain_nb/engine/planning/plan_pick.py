"""The engine's plan: the fastest predicted one when the machine's rates are known, else the rules'.

:func:`pick_plan` is what ``parts.build_parts`` calls. It makes the rules' plan
(``planner.engine_plan``: budgets checked, a refusal names the budget) and then, when it has
rates -- ``EngineConfig.rates``, else this machine's cached measurement for the device
(``measure.cached_rates``: written by ``mt.measure_machine()`` / ``megatrain-nb machine``;
nothing is measured here) -- prices every choice left free (``best_plans.pinned_of``: a field at
its default is free, one set is pinned) at the workload and takes the fastest that fits
(``best_plans.best_plans``). ``EngineOverrides(plan_by="rules")`` keeps the rules' plan whatever
the rates, and so does ``MEGATRAIN_NB_PLAN_BY=rules`` for every engine of the process (the test
suite sets it, so its plans never follow a measurement cached on the machine that runs it).
``plan.chosen_by`` says which and why.

The workload: what the caller says the steps will train on (``mt.Trainer`` passes its batch,
sequence length, accumulation and clipping), else the planner's default (``planner.Workload()``:
one row of 2048 tokens, one micro-batch, clipped) -- said so in ``chosen_by``. Candidates are
held to the device budget the user gave (``max_vram_gb``); without one, to the rules' own plan's
device working set at the workload: a pick never grows the device's memory past what the rules
would use (a CPU "device" without a budget is not unlimited), so the working set stays flat in
depth whatever the rates say. A field the caller passed (``EngineConfig.given``) is never varied,
whatever its value. A pick must be predicted ``MARGIN`` faster than the rules' plan (the prediction
is judged within -20%/+25%); a run whose step is well off its prediction says so and names the way
back to the rules' plan (``prediction_check.difference_line``).

Ranks: every rank must run the same schedule, so rank 0's choice is taken by all
(``Dist.all_gather_json``; its rates decide); each rank then plans its own shards with it.
"""
from __future__ import annotations

import os
from typing import Optional

from .best_plans import CHOICES, MARGIN, TIE, best_plans, engine_pick, pinned_of, plan_key
from ..family import max_positions
from .rates_cache import cached_rates   # (a name of this module: tests replace it)
from .planner import GiB, ModelShape, Plan, UnitSpec, Workload, engine_plan, make_plan
from .prediction import fmt_seconds

#: "rules": every engine of the process plans by the rules (as EngineOverrides(plan_by="rules")).
PLAN_BY_ENV = "MEGATRAIN_NB_PLAN_BY"


def pick_plan(units, model_config, cfg, *, device, dist=None, state_units=None,
              workload: Optional[Workload] = None) -> Plan:
    """The engine's plan for ``units`` under ``cfg`` (see the module's docstring)."""
    cuda = device.type == "cuda"
    acc = workload.accumulation if workload is not None else 1   # (slots leave a window's sums their room)
    rows = workload.batch * workload.seq if workload is not None else 1   # (and its rows theirs)
    rules = engine_plan(units, model_config, cfg, cuda=cuda, state_units=state_units, accumulation=acc, rows=rows)
    choice, why = _choose(units, model_config, cfg, device=device, state_units=state_units, workload=workload)
    if dist is not None and dist.world > 1:   # rank 0's choice for every rank
        choice, why = dist.all_gather_json([choice, why])[0]
    if choice is None:
        rules.chosen_by = why
        return rules
    plan = engine_plan(units, model_config, cfg.replace(**choice), cuda=cuda, state_units=state_units,
                       accumulation=acc, rows=rows)
    plan.chosen_by, plan.choice = why, dict(choice)
    return plan


def _choose(units, model_config, cfg, *, device, state_units, workload):
    """(the EngineConfig fields to set, why) or (None, why the rules decide)."""
    if cfg.overrides.plan_by == "rules":
        return None, "rules: EngineOverrides(plan_by='rules')"
    if os.environ.get(PLAN_BY_ENV, "auto") == "rules":
        return None, f"rules: {PLAN_BY_ENV}=rules"
    rates = cfg.rates or cached_rates(str(device), cfg.offload_dir)
    if rates is None:
        return None, ("rules: no measured rates (EngineConfig(rates=mt.measure_machine()), or once "
                      "`megatrain-nb machine` has measured this machine)")
    free = [f for f in CHOICES if f not in pinned_of(cfg)]
    if not free:
        return None, "rules: every choice is pinned (" + ", ".join(CHOICES) + ")"
    work, said = _workload(workload, model_config)
    shape = ModelShape.of(model_config)
    shape = ModelShape(shape.hidden_size, len(units) - 2, shape.intermediate_size, shape.vocab_size)
    specs = [_spec(u) for u in units]
    held = None if state_units is None else [_spec(u) for u in state_units]
    cuda = device.type == "cuda"
    rules = make_plan(specs, shape, cfg, cuda=cuda, workload=work, state_units=held)
    # no device budget given: no pick grows the device working set past the rules' own plan's
    cap = None if cfg.max_vram_gb else int(rules.device["total"] * (1 + TIE))
    found = best_plans(specs, shape, cfg, work, rates, cuda=cuda, state_units=held, k=None, device_cap=cap)
    pick = engine_pick(found, rules)
    held_to = (f"max_vram_gb={cfg.max_vram_gb:g}" if cfg.max_vram_gb else
               f"the rules' device working set, {rules.device['total'] / GiB * 1024:.1f} MiB (no max_vram_gb given)")
    pinned = pinned_of(cfg)
    kept = f"; kept as given: {', '.join(f'{k}={v!r}' for k, v in pinned.items())}" if pinned else ""
    if pick is None:
        return None, f"rules: no free choice fits the budgets at {said}"
    step = fmt_seconds(pick.prediction.step_seconds)
    source = rates.source or "given"
    if pick is not found[0] and pick.prediction.step_seconds > found[0].prediction.step_seconds * (1 + TIE):
        # the rules' own plan, within MARGIN of the fastest (a difference below TIE is a tie)
        return None, (f"rules' plan kept: predicted step {step}, within {MARGIN:.0%} of the fastest of "
                      f"{len(found)} feasible plan(s) ({fmt_seconds(found[0].prediction.step_seconds)}: "
                      f"{found[0].describe()}) at {said}; device held to {held_to}{kept}; rates: {source}")
    if plan_key(pick.plan) == plan_key(rules):
        return None, (f"rules' plan, the fastest predicted ({step}) of {len(found)} feasible plan(s) at {said}; "
                      f"device held to {held_to}{kept}; rates: {source}")
    choice = {k: v for k, v in pick.choice.items() if k in free}
    return choice, (f"predicted step {step}, fastest of {len(found)} feasible plan(s) at {said} "
                    f"({pick.describe()}; the rules' plan predicted {_rules_step(found, rules)}; device held to "
                    f"{held_to}{kept}; rates: {source}; {PLAN_BY_ENV}=rules or "
                    "EngineOverrides(plan_by='rules') builds the rules' plan)")


def _rules_step(found, rules) -> str:
    own = next((pc for pc in found if plan_key(pc.plan) == plan_key(rules)), None)
    return fmt_seconds(own.prediction.step_seconds) if own is not None else "- (it does not fit)"


def _spec(u) -> UnitSpec:
    return UnitSpec(u.name, u.numel, u.kind, getattr(u, "tied_output", False))


def _workload(workload: Optional[Workload], model_config):
    """The workload priced (a row no longer than the model's positions) and how to say it."""
    given = workload is not None
    w = workload or Workload()
    n = max_positions(model_config)
    if n and w.seq > n:
        w = Workload(batch=w.batch, seq=n, accumulation=w.accumulation, gradients=w.gradients, clipped=w.clipped)
    what = (f"{w.batch} x {w.seq} tokens x {w.accumulation} micro-batch(es), "
            f"{'clipped' if w.clipped else 'unclipped'}")
    return w, (f"the run's workload, {what}" if given else f"the planner's default workload, {what} (the run's "
                                                                  "is not known when the engine is built)")
