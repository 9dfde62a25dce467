"""The optimizer-state codec as a plan choice (docs/TIERS.md, "The codec as a plan choice").

A codec changes where the optimizer states can live: fp32 AdamW moments take 8 B/param, int8's
about 2, int4's about 1. With a disk tier the planner puts the states there whatever their size;
a codec that makes them fit in host RAM removes their disk traffic from every step (read and
written once per update), and a codec that shrinks them on the disk tier cuts that traffic 4-8x.
:func:`choose_codec` makes the plan of each (codec, states in RAM or on the disk tier) with the
planner, under the same budgets, and picks:

- **without rates (the rules)**: exact fp32 states in RAM when they fit; else the recommended
  codec (int8) in RAM; else int8 on the disk tier; else the first candidate that fits (int4 in
  RAM, fp32 then int4 on the disk tier) -- lossless first, no disk for the states before a smaller
  disk footprint, the finer codec before the coarser;
- **with rates** (``MachineRates``): the fastest predicted plan (``prediction.predict_step``),
  unless the rules' pick is predicted within ``best_plans.MARGIN`` of it (the prediction is
  judged within -20%/+25%; a gain inside its error keeps the rules' choice).

``EngineConfig(optimizer_compression="auto")`` builds the engine with its pick
(:func:`engine_codec`: ``engine.codec`` says which and why; the engine's config then names the
codec, so its checkpoints record it and a resume builds the same);
``mt.estimate(..., compression="auto")`` takes its pick; an estimate with a codec set prints
:func:`codec_advice`, a line saying when another codec would make the disk tier unnecessary for
the states or is predicted faster. Imports no torch beyond what the planner's codec sizes need.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import List, Optional

from .best_plans import MARGIN
from . import plan_pick
from ..family import max_positions
from .planner import ModelShape, UnitSpec, Workload, make_plan
from .prediction import fmt_seconds, predict_step

#: The codec ``optimizer_compression=True`` means (``updates.codecs.RECOMMENDED_CODEC``).
RECOMMENDED = "int8"
#: The rules' order of (codec, states on the disk tier): lossless first, the states off the disk
#: before a smaller disk footprint, the finer codec before the coarser.
RULES_ORDER = (("none", False), (RECOMMENDED, False), (RECOMMENDED, True), ("int4", False), ("none", True),
               ("int4", True))


@dataclass
class CodecCandidate:
    codec: str
    states_on_disk: bool
    plan: object
    step_seconds: Optional[float] = None   # predicted, with rates

    def describe(self) -> str:
        where = "on the disk tier" if self.states_on_disk else "in host RAM"
        label = "fp32 (exact)" if self.codec == "none" else f"{self.codec} (lossy)"
        return f"{label} optimizer states {where}"


@dataclass
class CodecChoice:
    """The pick (``codec``, ``states_on_disk``, its ``plan``), ``by`` "rules" or "prediction",
    and every feasible candidate (``candidates``, in the rules' order)."""
    codec: str
    states_on_disk: bool
    plan: object
    by: str
    candidates: List[CodecCandidate] = field(default_factory=list)

    @property
    def chosen(self) -> CodecCandidate:
        return next(c for c in self.candidates if (c.codec, c.states_on_disk) == (self.codec, self.states_on_disk))

    def reason(self) -> str:
        c = self.chosen
        if self.by == "prediction":
            return f"{c.describe()}: the fastest predicted ({fmt_seconds(c.step_seconds)} per step)"
        before = [CodecCandidate(k, d, None).describe()
                  for k, d in RULES_ORDER[:RULES_ORDER.index((c.codec, c.states_on_disk))]]
        return f"{c.describe()}: " + ("the rules' first choice, it fits" if not before else
                                      "the rules' first that fits (before it: " + "; ".join(before) + ")")


def candidates(units, shape, cfg, workload: Workload, *, cuda: bool, disk_bytes: Optional[int] = None,
               state_units=None, codecs=None, on_disk: Optional[bool] = None) -> List[CodecCandidate]:
    """Every feasible (codec, states in RAM or on the disk tier), in the rules' order. The states
    go to the disk tier exactly when one exists (``cfg.offload_dir``), so "in RAM" is the plan
    without it (the master weights then stay in RAM too). ``on_disk``: only the candidates with
    the states there (True) or in RAM (False); None = both."""
    out = []
    for codec, disk in RULES_ORDER:
        if (codecs is not None and codec not in codecs) or (disk and not cfg.offload_dir) or \
                (on_disk is not None and disk != on_disk):
            continue
        on_disk_here = disk
        c = cfg.replace(optimizer_compression=codec, **({} if on_disk_here else {"offload_dir": None}))
        plan = make_plan(units, shape, c, cuda=cuda, workload=workload,
                         disk_bytes=disk_bytes if on_disk_here else None, state_units=state_units)
        if plan.feasible:
            out.append(CodecCandidate(codec, on_disk_here, plan))
    return out


def choose_codec(units, shape, cfg, workload: Workload, *, cuda: bool, disk_bytes: Optional[int] = None,
                 state_units=None, rates=None, codecs=None, on_disk: Optional[bool] = None) -> Optional[CodecChoice]:
    """The codec and the states' tier the planner picks (see the module); None when nothing fits."""
    found = candidates(units, shape, cfg, workload, cuda=cuda, disk_bytes=disk_bytes, state_units=state_units,
                       codecs=codecs, on_disk=on_disk)
    if not found:
        return None
    rules = found[0]
    pick, by = rules, "rules"
    if rates is not None:
        for c in found:
            cc = cfg.replace(optimizer_compression=c.codec, **({} if c.states_on_disk else {"offload_dir": None}))
            c.step_seconds = predict_step(units, shape, cc, c.plan, workload, rates, cuda=cuda).step_seconds
        fastest = min(found, key=lambda c: c.step_seconds)
        if fastest.step_seconds * (1 + MARGIN) < rules.step_seconds:
            pick, by = fastest, "prediction"
    return CodecChoice(pick.codec, pick.states_on_disk, pick.plan, by, found)


def codec_advice(choice: Optional[CodecChoice], codec: str, states_on_disk: bool) -> Optional[str]:
    """A line for an estimate whose codec was set (``codec``, its states ``states_on_disk``) when
    the planner's pick differs: another codec keeps the states off the disk tier, or is predicted
    faster. None when the pick is the same, or nothing fits."""
    if choice is None or (choice.codec, choice.states_on_disk) == (codec, states_on_disk):
        return None
    c = choice.chosen
    why = []
    if states_on_disk and not c.states_on_disk:
        why.append("fit host RAM beside the rest (no disk traffic for the states)")
    if c.step_seconds is not None:
        mine = next((x for x in choice.candidates if (x.codec, x.states_on_disk) == (codec, states_on_disk)), None)
        if mine is not None and mine.step_seconds:
            why.append(f"predicted {fmt_seconds(c.step_seconds)} per step against {fmt_seconds(mine.step_seconds)}")
    if not why:
        return None
    return f"codec: {c.describe()} {'; '.join(why)} (optimizer_compression='auto' lets the planner pick)"


def estimate_pick(compression, units, shape, cfg, workload: Workload, *, cuda: bool, disk_bytes=None,
                  state_units=None, rates=None):
    """``mt.estimate``'s codec: (the codec's name, the :class:`CodecChoice`) -- ``compression``
    "auto" takes the pick (the recommended codec when nothing fits), a codec's name stays."""
    choice = choose_codec(units, shape, cfg, workload, cuda=cuda, disk_bytes=disk_bytes, state_units=state_units,
                          rates=rates)
    if compression != "auto":
        return compression, choice
    return (choice.codec if choice is not None else RECOMMENDED), choice


def estimate_lines(compression, choice: Optional[CodecChoice], codec: str, plan) -> List[str]:
    """The estimate's line about its codec: the pick and why ("auto"), else :func:`codec_advice`."""
    if compression == "auto":
        return [f"codec (optimizer_compression='auto'): {choice.reason()}"] if choice is not None else []
    advice = codec_advice(choice, codec, plan.placement.get("optimizer_states") == "disk")
    return [advice] if advice else []


#: What ``optimizer_compression`` accepts besides a codec's name: the planner picks.
AUTO = "auto"


@dataclass(frozen=True)
class CodecPick:
    """What an engine asked for (``asked``: "auto" or a codec) and built with (``codec``), where
    its states live (``states_on_disk``), ``by`` "rules" / "prediction" / "given" / "checkpoint",
    and ``reason``, said in words (``engine.codec``; the run header shows it with the plan)."""
    asked: str
    codec: str
    states_on_disk: bool
    by: str
    reason: str

    def line(self) -> str:
        return (f"codec {self.codec} (optimizer_compression='auto': {self.reason})" if self.asked == AUTO
                else f"codec {self.codec} (as given)")


def _spec(u) -> UnitSpec:
    return UnitSpec(u.name, u.numel, u.kind, getattr(u, "tied_output", False))


def engine_codec(units, model_config, cfg, *, device, state_units=None, workload: Optional[Workload] = None,
                 saved: Optional[str] = None):
    """(the config the engine's parts are built from, the :class:`CodecPick`). ``cfg`` asking
    "auto": the codec :func:`choose_codec` picks with the states where the config puts them (on
    the disk tier exactly when ``offload_dir`` is given: the engine never drops a tier the user
    named), priced at the rates the plan's pick uses (none under ``plan_by="rules"`` or
    ``MEGATRAIN_NB_PLAN_BY=rules``); ``saved`` (a checkpoint's codec) wins over a new pick, so
    a resume builds what the run was built with. A codec named stays."""
    on_disk = bool(cfg.offload_dir)
    if cfg.optimizer_compression != AUTO:
        return cfg, CodecPick(cfg.optimizer_compression, cfg.optimizer_compression, on_disk, "given", "as given")
    if saved is not None:
        return cfg.replace(optimizer_compression=saved), CodecPick(
            AUTO, saved, on_disk, "checkpoint", f"the checkpoint's codec, {saved!r}, kept on resume")
    work = workload or Workload()
    if max_positions(model_config) and work.seq > max_positions(model_config):   # (as the plan's pick prices)
        work = dataclasses.replace(work, seq=max_positions(model_config))
    base = ModelShape.of(model_config)
    shape = ModelShape(base.hidden_size, len(units) - 2, base.intermediate_size, base.vocab_size)
    specs = [_spec(u) for u in units]
    held = None if state_units is None else [_spec(u) for u in state_units]
    rules_only = (cfg.overrides.plan_by == "rules" or
                  os.environ.get(plan_pick.PLAN_BY_ENV, "auto") == "rules")
    rates = None if rules_only else (cfg.rates or plan_pick.cached_rates(str(device), cfg.offload_dir))
    choice = choose_codec(specs, shape, cfg.replace(optimizer_compression=RECOMMENDED), work,
                          cuda=device.type == "cuda", state_units=held, rates=rates, on_disk=on_disk)
    if choice is None:   # nothing fits: the recommended codec, whose plan refuses with the numbers
        return cfg.replace(optimizer_compression=RECOMMENDED), CodecPick(
            AUTO, RECOMMENDED, on_disk, "rules", "no codec fits the budgets; the recommended one is tried")
    return cfg.replace(optimizer_compression=choice.codec), CodecPick(
        AUTO, choice.codec, choice.states_on_disk, choice.by, choice.reason())


def checkpoint_codec(folder) -> Optional[str]:
    """The codec a checkpoint's optimizer states were written in -- its
    ``optimizer_states.safetensors`` records it, a linked one's ``linked.json`` too -- or None
    when ``folder`` holds neither (a sharded checkpoint checks its codec on load and names it
    in its refusal)."""
    folder = os.fspath(folder)
    linked = os.path.join(folder, "linked.json")   # (tiers/linked.py LINKED_FILE)
    if os.path.isfile(linked):
        with open(linked) as f:
            return json.load(f).get("codec")
    path = os.path.join(folder, "optimizer_states.safetensors")
    if not os.path.isfile(path):
        return None
    from safetensors import safe_open   # (the planner stays light: only a resume reads one)

    with safe_open(path, "pt") as fh:
        return (fh.metadata() or {}).get("codec", "none")
