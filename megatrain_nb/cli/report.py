"""What the command line prints about a run: the header before its first step, the progress
bar, the summary at its end (memory tiers, the disk tier's host cache, streaming).

Read only once a trainer exists (it imports torch: `megatrain-nb --help` never loads it;
``megatrain_nb.cli`` names its functions lazily)."""
from __future__ import annotations

import sys
import time
from typing import Optional

from megatrain_nb.engine.memory import precision_note
from megatrain_nb.engine.planning.planner import codec_bytes_per_param
from megatrain_nb.engine.planning.prediction import fmt_rate, fmt_seconds
from megatrain_nb.engine.planning.prediction_check import comparison_lines
from megatrain_nb.engine.telemetry import waits_by_cause
from megatrain_nb.engine.tiers.diskspace import filesystem_text
from megatrain_nb.formatting import fmt_bytes
from megatrain_nb.trainer.checkpoint import list_checkpoints


def tier_text(memory: Optional[dict]) -> str:
    if not memory:
        return ""
    return " ".join(f"{t} {fmt_bytes(memory.get(t, {}).get('used_bytes'), none='-', compact=True)}"
                    for t in ("device", "host", "disk"))


def run_with_progress(trainer, *, resume=None, out=None) -> dict:
    """Drive ``trainer.iter_steps`` with a progress bar (loss, tokens/s, tier usage); returns a summary."""
    from tqdm.auto import tqdm

    out = out or sys.stdout
    total = trainer.total_steps
    bar = tqdm(total=total, file=out, dynamic_ncols=True, desc="train", mininterval=0.5)
    t0, first, last, memory, tokens, evals = time.time(), None, None, None, 0, []
    check = PredictionCheck(trainer)
    try:
        for rec in trainer.iter_steps(resume_from_checkpoint=resume):
            off = check.line(rec["step"])
            if off:
                bar.write(f"prediction: {off}", file=out)
            first = rec["loss"] if first is None else first
            last = rec
            tokens += rec["tokens"]
            memory = rec.get("memory", memory)
            if "eval_loss" in rec:
                evals.append((rec["step"], rec["eval_loss"], rec["eval_ppl"]))
            bar.n = rec["step"]
            tiers = tier_text(memory)  # empty until the first memory record
            bar.set_postfix_str(f"loss {rec['loss']:.3f} | {rec['tokens_per_s']:.0f} tok/s" + (f" | {tiers}" if tiers else ""),
                                refresh=False)
            bar.refresh()
    finally:
        bar.close()
    elapsed = time.time() - t0
    return {"steps": trainer.state.global_step, "seconds": elapsed, "tokens": tokens, "first_loss": first,
            "last_loss": last["loss"] if last else None, "evals": evals,
            "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0}


def prediction_text(pred, steps: int) -> str:
    """The header's line: the predicted step, the run and the bottleneck."""
    rough = next((n for n in pred.notes if "measured at a default shape" in n), None)
    return (f"predicted {fmt_seconds(pred.step_seconds)} per step ({fmt_rate(pred.tokens_per_second)}), "
            f"{fmt_seconds(pred.run_seconds(steps))} for {steps:,} steps; bottleneck: {pred.bottleneck} "
            f"[rates: {pred.source or 'given'}]" + (f"; rough: {rough}" if rough else ""))


class PredictionCheck:
    """After ``after`` optimizer steps (the first is a warm-up), one line when the measured
    step differs from the prediction by more than 25% (``prediction_check.difference_line``),
    from what the trainer's steps carried up (``Trainer.measured_vs_predicted``): nothing here
    calls into the engine while it trains."""

    def __init__(self, trainer, after: int = 3):
        self.trainer, self.after, self.done = trainer, after, False

    def line(self, step: int) -> Optional[str]:
        if self.done:
            return None
        report = measured_vs_predicted(self.trainer)
        if report is None:
            self.done = True   # no rates: no prediction
            return None
        if report["steps"] < self.after - 1:
            return None
        self.done = True
        return report["difference"]


def measured_vs_predicted(trainer) -> Optional[dict]:
    """``trainer.measured_vs_predicted()``, None for a trainer without one."""
    get = getattr(trainer, "measured_vs_predicted", None)
    return get() if callable(get) else None


def comparison_text(trainer) -> list:
    """The summary's per-phase table, predicted vs measured, once two steps ran ([] otherwise)."""
    report = measured_vs_predicted(trainer)
    if report is None or report["measured"] is None:
        return []
    return comparison_lines(report["prediction"], report["measured"], report["steps"])


def print_summary(trainer, summary: dict, *, model_dir: Optional[str], eval_metrics: Optional[dict], out=None):
    p = lambda *a: print(*a, file=out or sys.stdout)  # noqa: E731
    p("")
    p("== summary ==")
    p(f"steps {summary['steps']} in {summary['seconds']:.1f} s, {summary['tokens']:,} tokens "
      f"({summary['tokens_per_s']:.0f} tokens/s)")
    if summary["first_loss"] is not None:
        p(f"train loss {summary['first_loss']:.3f} -> {summary['last_loss']:.3f}")
    if eval_metrics:
        p(f"eval loss {eval_metrics['eval_loss']:.3f}, perplexity {eval_metrics['eval_ppl']:.1f}"
          + (f", token accuracy {eval_metrics['eval_mean_token_accuracy']:.3f}"
             if "eval_mean_token_accuracy" in eval_metrics else ""))
    mem = trainer.engine.memory_report()
    for tier in ("device", "host", "disk"):
        d = mem.get(tier, {})
        kinds = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in d.items()
                          if isinstance(v, int) and not k.endswith("_bytes") and v)
        p(f"{tier:<6} peak {fmt_bytes(d.get('peak_bytes'))}" + (f" ({kinds})" if kinds else ""))
    tel = trainer.engine.telemetry() or {}
    cache = cache_text(mem.get("host", {}))
    if cache:
        p(cache)
    moved = {k: v for k, v in (tel.get("bytes") or {}).items() if v}
    if moved:
        p("bytes moved: " + ", ".join(f"{k.replace('_', ' ')} {fmt_bytes(v)}" for k, v in moved.items()))
    line = streaming_text(tel)
    if line:
        p("streaming: " + line)
    for line in comparison_text(trainer):
        p(line)
    p("outputs:")
    if model_dir:
        p(f"  model (transformers.AutoModelForCausalLM.from_pretrained): {model_dir}")
    ckpts = list_checkpoints(trainer.args.output_dir, run_id=getattr(trainer, "run_id", None))
    if ckpts:  # this run's only: an earlier run in the same folder is not this run's resume point
        p(f"  checkpoints (resume with resume_from_checkpoint=...): {', '.join(str(c) for c in ckpts)}")
    p(f"  metrics log (JSONL): {trainer.metrics_log.path}")


def cache_text(host: dict) -> str:
    """What the disk tier's host cache holds and how much of the tier reached the disk, said
    plainly (a cache large enough keeps the whole tier in RAM: the disk then holds nothing)."""
    st = host.get("disk_cache_stats") or {}
    if not st:
        return ""
    if not st.get("capacity_bytes"):
        return "no host cache of the disk tier: every access went to the disk"
    kinds = ", ".join(f"{k.replace('_', ' ')} {fmt_bytes(v)}" for k, v in (st.get("by_kind") or {}).items() if v)
    held = (f"host cache of the disk tier: {fmt_bytes(st.get('ram_bytes', 0))} in RAM"
            + (f" ({kinds})" if kinds else "") + f" of its {fmt_bytes(st['capacity_bytes'])}")
    wrote, read = st.get("disk_write_bytes", 0), st.get("disk_read_bytes", 0)
    if not wrote and not read:
        return held + "; nothing reached the disk: the cache held the whole tier"
    return held + f"; reached the disk: {fmt_bytes(wrote)} written, {fmt_bytes(read)} read back"


def disk_text(engine) -> str:
    """Where the disk tier is (filesystem, free space) and how much RAM caches it; "" without one."""
    fs = (engine.memory_report().get("disk") or {}).get("filesystem")
    if not fs:
        return ""
    cache = (engine.telemetry() or {}).get("disk_cache") or {}
    text = f"{fs['path']} {filesystem_text(fs)}"
    if cache.get("capacity_bytes"):
        text += f"; host cache of the disk tier up to {fmt_bytes(cache['capacity_bytes'])} of RAM"
        units = engine.state_units
        tier = sum(engine.states.stored_nbytes(u) for u in units) + (
            4 * sum(u.numel for u in units) if engine.params_on_disk else 0)
        if cache["capacity_bytes"] >= tier:
            text += f", room for the whole tier ({fmt_bytes(tier)}): the disk may hold nothing"
    elif cache:
        text += "; no host cache (every access goes to the disk)"
    return text


# What each stall counter measures: time the training thread waited, whether or not the
# transfer had been started ahead ("issued ahead" is about scheduling, not about arriving in time).
_WAITS = {"device": "for weights to reach the device", "disk": "for disk reads",
          "host_cache": "for copies out of the disk tier's host cache", "decode": "for optimizer states to decode",
          "optimizer": "for optimizer updates", "grad_return": "for gradients to return to the host"}


def streaming_text(tel: dict) -> str:
    """One line on how well streaming hid transfers: how many unit loads were issued ahead of
    need, then how long the step still waited, per cause."""
    pf = (tel.get("prefetch") or {}).get("device") or {}
    parts = []
    loads = (pf.get("ahead") or 0) + (pf.get("late") or 0)
    if loads:
        parts.append(f"{pf.get('ahead', 0) / loads:.0%} of {loads:,} weight loads issued ahead of need")
    stalls = waits_by_cause(tel)
    # a forward's wait for a unit's pending update is the updates', and of it the part they
    # themselves waited for the disk tier
    on_disk = stalls.pop("optimizer_exposed_disk")
    stalls["optimizer"] = stalls.get("optimizer", 0.0) + stalls.pop("optimizer_exposed") + on_disk
    waits = [f"{_WAITS.get(k, k)} {v:.2f} s" + (f" ({on_disk:.2f} s of it theirs for the disk)"
                                                 if k == "optimizer" and on_disk >= 0.005 else "")
             for k, v in stalls.items() if v >= 0.005]
    if tel.get("stall_seconds") is not None:
        parts.append("time spent waiting: " + ", ".join(waits) if waits else "no time spent waiting")
    return "; ".join(parts)


def device_text(engine) -> str:
    import torch

    dev = engine.device
    if dev.type == "cuda":
        return f"{dev} ({torch.cuda.get_device_name(dev)})"
    return f"{dev} ({torch.get_num_threads()} threads)" if dev.type == "cpu" else str(dev)


def plan_text(plan) -> str:
    """The plan's schedule and how its choices were made (``plan.chosen_by``: predicted or the rules')."""
    return (f"checkpoint every {plan.checkpoint_interval} layer(s)" if plan.checkpoint_interval else
            "no recompute (every layer's activations kept)") + f", {plan.layer_slots} layer slots; {plan.chosen_by}"


def print_header(trainer, *, model: str, data: str, out=None) -> None:
    """What a run is about to do, before its first step: model, data, device, tiers, codec."""
    p = lambda *a: print(*a, file=out or sys.stdout)  # noqa: E731
    engine, cfg = trainer.engine, trainer.engine.config
    placement = dict(getattr(getattr(engine, "plan", None), "placement", {}) or {})
    where = {"disk": f"disk ({cfg.offload_dir})", "host": "host RAM"}.get  # noqa: E731
    codec = cfg.optimizer_compression
    p(f"model:  {model}, {engine.num_parameters() / 1e6:,.2f}M parameters, fp32 master weights")
    p(f"data:   {data}")
    p(f"device: {device_text(engine)}")
    note = precision_note(engine.device, cfg.precision, getattr(trainer, "rates", None))
    if note:   # (the user's choice is kept: said, never changed)
        p(f"speed:  {note}")
    if placement:
        p("tiers:  " + ", ".join(f"{k.replace('_', ' ')} in {where(v, v)}" for k, v in placement.items()))
    plan = getattr(engine, "plan", None)
    if getattr(plan, "chosen_by", ""):
        p(f"plan:   {plan_text(plan)}")
    disk = disk_text(engine)
    if disk:
        p(f"disk:   {disk}")
    p(f"codec:  optimizer states {codec} ({codec_bytes_per_param(codec):.2f} bytes/parameter for both Adam "
      "moments" + (", lossy vs fp32 AdamW)" if codec != "none" else ", exact)"))
    tiling = getattr(getattr(engine, "runner", None), "tiling", None)
    if tiling is not None:
        p("tiles:  " + (f"a layer's MLP runs rows longer than {tiling.tile:,} tokens in tiles of {tiling.tile:,} "
                        "tokens (EngineOverrides.tile_tokens pins it)"
                        if tiling.tile else "off (tile_tokens=0): a layer's MLP runs a whole row at once"))
    pred = getattr(trainer, "prediction", None)
    if pred is not None:
        p(f"time:   {prediction_text(pred, trainer.total_steps)}")
    p(f"output: {trainer.args.output_dir} ({trainer.total_steps} steps; metrics in {trainer.metrics_log.path})")
    if trainer.args.max_steps < 1:   # transformers: no step limit, the epochs decide
        p(f"steps:  max_steps {trainer.args.max_steps} means no step limit: num_train_epochs "
          f"{trainer.args.num_train_epochs:g} epochs give {trainer.total_steps:,} optimizer steps (set "
          "training.max_steps or --max-steps for fewer)")
