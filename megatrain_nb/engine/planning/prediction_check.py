"""A built engine's prediction and the check of it against the run: ``engine.prediction``,
``Trainer.prediction``, and the line a run prints when a measured phase is off by more than 25%.

Rates come from, in order: the ones given (``engine.rates = mt.measure_machine()``), else the
machine's cached measurement (``engine.measure.cached_rates``; it
measures nothing), else none and the prediction is ``None``. Nothing is measured when an engine
is built: a measurement takes up to a minute and loads the machine, so it runs only when the
user asks (``mt.measure_machine()``, ``megatrain-nb machine``).
"""
from __future__ import annotations

import time
from typing import Optional

from .planner import ModelShape, Workload, engine_window_plan
from .rates_cache import cached_rates   # (a name of this module: tests replace it)
from .prediction import StepPrediction, fmt_seconds, predict_step

#: A measured phase this much off its prediction (either way) is reported.
OFF_BY = 0.25


def engine_prediction(engine, workload: Optional[Workload] = None, rates=None) -> Optional[StepPrediction]:
    """The step of ``engine``'s plan for ``workload`` (default: its last step's tokens and
    micro-batches, clipped; None before its first step), at ``rates`` (default as the module says)."""
    import torch

    rates = rates or getattr(engine, "rates", None) or cached_rates(str(engine.device), engine.config.offload_dir)
    if rates is None:
        return None
    if workload is None:
        last = engine.counters.last_step or {}
        if not last.get("tokens"):
            return None
        mb = max(int(last.get("micro_batches") or 1), 1)
        workload = Workload(batch=1, seq=max(int(last["tokens"]) // mb, 1), accumulation=mb)
    plan = engine.plan
    if workload.accumulation > 1:
        cap = None
        if engine.device.type == "cuda":
            cap = torch.cuda.get_device_properties(engine.device).total_memory
        wp = engine_window_plan(plan, engine.model_config, engine.config, len(engine.layer_units),
                                tokens=workload.batch * workload.seq, micro_batches=workload.accumulation,
                                device_capacity=cap)
        window = dict(wp.to_dict(), tokens_per_weight_fetch=0)
        plan = type(plan)(**{**plan.to_dict(), "window": window})
    shape = ModelShape.of(engine.model_config)
    cache = getattr(engine.disk, "capacity", 0) if engine.disk is not None else 0
    pred = predict_step(engine.units, shape, engine.config, plan, workload, rates,
                        cuda=engine.device.type == "cuda", cache_bytes=cache)
    pred.plan_choice = getattr(engine.plan, "choice", None)
    return pred


def measured_phases(before: dict, after: dict) -> dict:
    """Seconds per optimizer step between two ``engine.telemetry()`` snapshots: the step, the
    optimizer's work, the disk's busy time each way, the host->device link's, and the waits."""
    steps = max(after["steps"] - before["steps"], 1)
    d = lambda get: (get(after) - get(before)) / steps  # noqa: E731
    link = lambda name: d(lambda t: t.get("link_seconds", {}).get(name, 0.0))  # noqa: E731
    out = {"step": d(lambda t: t["step_seconds"]), "optimizer": d(lambda t: t["optimizer_seconds"]),
           "disk_read": link("disk_to_host"), "disk_write": link("host_to_disk")}
    out["waits"] = {k: (after["stall_seconds"].get(k, 0.0) - before["stall_seconds"].get(k, 0.0)) / steps
                    for k in after["stall_seconds"]}
    return out


#: What a phase's miss says, when it is the largest (slower than predicted; faster: "faster than ...").
_WHY = {"compute": "compute slower than its measured rate (a busy CPU, or rates measured at other shapes: "
                   "mt.measure_machine(model=...))",
        "disk_read": "the disk reads slower than its measured rate",
        "disk_write": "the disk writes slower than its measured rate",
        "optimizer": "AdamW slower than measured (a busy CPU?)"}


def rates_age_words(measured_at: float, now: Optional[float] = None) -> str:
    """How old the machine's rates are, and how to measure them again."""
    age = max((time.time() if now is None else now) - measured_at, 0.0)
    return (f"The machine's rates were measured {fmt_seconds(age)} ago: a machine whose speed moves (a shared "
            "or virtual one: 1.4-1.8x within half an hour on the 2-core VM the project is developed on) needs "
            "them measured again when it is as quiet as the run, mt.measure_machine(offload_dir=..., "
            "refresh=True) or `megatrain-nb machine --refresh`")


def difference_line(pred: StepPrediction, measured: dict, now: Optional[float] = None) -> Optional[str]:
    """A line when the measured step is more than ``OFF_BY`` off the prediction: by how much, and
    the phase with the largest absolute miss in seconds (the compute, the optimizer, the disk
    each way), and how old the machine's rates are (``pred.rates_measured_at``, at ``now``) with
    how to measure them again; or None. A plan the engine took from this prediction
    (``pred.plan_choice``) is named with the way back to the rules' plan."""
    step = measured["step"]
    if pred.step_seconds <= 0 or abs(step / pred.step_seconds - 1) <= OFF_BY:
        return None
    ph = pred.phases
    expect = {"compute": ph["forward"] + ph["backward"] + ph["recompute"],
              "optimizer": ph["optimizer"] + ph["codec"],
              "disk_read": ph["disk_read"], "disk_write": ph["disk_write"]}
    got = dict(measured, compute=max(step - sum(measured.get("waits", {}).values()), 0.0))
    misses = {name: got.get(name, 0.0) - p for name, p in expect.items() if p > 0 and got.get(name, 0.0) > 0}
    worst = max(misses, key=lambda n: abs(misses[n]), default=None)
    line = (f"measured step {fmt_seconds(step)} vs predicted {fmt_seconds(pred.step_seconds)} "
            f"({step / pred.step_seconds - 1:+.0%})")
    if worst is not None and abs(got[worst] / expect[worst] - 1) > OFF_BY:
        ratio = got[worst] / expect[worst]
        why = _WHY[worst] if ratio > 1 else "faster than its measured rate"
        line += (f": the largest miss is {worst.replace('_', ' ')}, {fmt_seconds(got[worst])} vs predicted "
                 f"{fmt_seconds(expect[worst])} ({ratio - 1:+.0%}, {why})")
    else:
        waits = {k: v for k, v in measured.get("waits", {}).items() if v > 0.05 * step}
        line += ("; waits per step: " + ", ".join(f"{k} {fmt_seconds(v)}" for k, v in waits.items())
                 if waits else "; no phase stands out: compute slower than its measured rate (a busy CPU?)")
    if pred.rates_measured_at:
        line += ". " + rates_age_words(pred.rates_measured_at, now)
    if pred.plan_choice:
        line += (f". The plan was picked by this prediction ({', '.join(f'{k}={v!r}' for k, v in pred.plan_choice.items())}): "
                 f"MEGATRAIN_NB_PLAN_BY=rules or EngineOverrides(plan_by='rules') builds the rules' plan")
    return line


def comparison_rows(pred: StepPrediction, measured: Optional[dict]) -> list:
    """The per-phase table of a run, predicted beside measured (seconds per optimizer step):
    ``[(phase, predicted, measured)]``, a number None where there is none (nothing measured
    yet; a window, which the engine does not time). Rows: the step; the compute (predicted: the
    forward, backward and recompute; measured: the step less its waits) and the windows the
    prediction lays it in; the optimizer (AdamW with the codec); the disk's busy time each way;
    the waits (predicted: the step beyond its compute; measured: ``stall_seconds`` summed).
    ``measured``: :func:`measured_phases`' dict."""
    ph = pred.phases
    compute = ph["forward"] + ph["backward"] + ph["recompute"]
    m = measured or {}
    waits = sum(m.get("waits", {}).values()) if measured else None
    rows = [("step", pred.step_seconds, m.get("step")),
            ("compute", compute, max(m["step"] - waits, 0.0) if measured else None)]
    rows += [(f"  window: {name}", s, None) for name, s in pred.windows.items()]
    rows += [("optimizer", ph["optimizer"] + ph["codec"], m.get("optimizer")),
             ("disk read", ph["disk_read"], m.get("disk_read")),
             ("disk write", ph["disk_write"], m.get("disk_write")),
             ("waits", max(pred.step_seconds - compute, 0.0), waits)]
    return rows


def off_text(predicted: Optional[float], measured: Optional[float]) -> str:
    """How far ``measured`` is from ``predicted`` ("+40%"), "" when either is missing or 0."""
    if not predicted or measured is None or predicted <= 0:
        return ""
    return f"{measured / predicted - 1:+.0%}"


def comparison_lines(pred: StepPrediction, measured: Optional[dict], steps: int = 0) -> list:
    """:func:`comparison_rows` as text (the CLI's summary, ``%megatrain status``): a title, one
    line a phase, and :func:`difference_line`'s line when the step is more than ``OFF_BY`` off."""
    title = (f"predicted vs measured per step (over {steps} step{'s' if steps != 1 else ''}, the first left out)"
             if measured else f"predicted step {fmt_seconds(pred.step_seconds)}; measured once 2 steps ran")
    lines = [title, f"  {'phase':<28} {'predicted':>10} {'measured':>10}"]
    for name, p, m in comparison_rows(pred, measured):
        lines.append(f"  {name:<28} {_cell(p):>10} {_cell(m):>10}  {off_text(p, m)}".rstrip())
    causes = {k: v for k, v in (measured or {}).get("waits", {}).items() if v > 0}
    if causes:
        lines.append("  waits by cause: " + ", ".join(f"{k} {fmt_seconds(v)}" for k, v in causes.items()))
    off = difference_line(pred, measured) if measured else None
    if off:
        lines.append(f"prediction: {off}")
    return lines


def _cell(s: Optional[float]) -> str:
    return "-" if s is None else fmt_seconds(s)
