"""``mt.estimate``: how a model's training state splits over device, host RAM and disk, whether it
fits, and what plain GPU-resident fp32 AdamW would need instead.

Example::

    import megatrain_nb as mt
    est = mt.estimate("llama-100b", vram_gb=80, ram_gb=1024, disk_gb=4096)
    print(est)            # the table; est.feasible, est.limiting_tier, est.to_dict()

Budgets are in GiB, like ``EngineConfig.max_vram_gb``. ``"auto"`` (the default for RAM and disk)
reads this machine's total RAM and the free space where the disk tier would live; ``None`` means
no limit (the table then shows what is needed). The numbers come from the engine's own planner
(``megatrain_nb.engine.planning.planner``), so they are the ones the engine enforces.
"""
from __future__ import annotations

import difflib
import functools
import html
import inspect
import math
import os
import shutil
from dataclasses import dataclass, field
from typing import Optional, Union

from megatrain_nb.engine import family
from megatrain_nb.engine.planning.best_plans import MARGIN, best_plans, engine_pick, pinned_by_value, plan_key
from megatrain_nb.engine.planning.planner import (ModelShape, UnitSpec, Workload, make_plan, persistent_device_bytes,
                                                  unit_specs_from_config)
from megatrain_nb.engine.planning.prediction import fmt_rate, fmt_seconds, predict_step, resolve_rates
from megatrain_nb.engine.planning.rates import precision_words
from megatrain_nb.engine.planning.codec_choice import RECOMMENDED, estimate_lines, estimate_pick
from megatrain_nb.engine.planning.estimator_dpo import format_bytes, reference_cache_bytes, reference_lines
from megatrain_nb.engine.planning.estimator_grpo import plan_generation, price, split_seq
from megatrain_nb.engine.planning.vision_plan import image_tokens_of, vision_lines
from megatrain_nb.model_source import resolve
from megatrain_nb.values import check

GiB = 1024 ** 3
Budget = Union[float, int, str, None]


def _fmt_dec(n: float) -> str:
    if n >= 1e12:
        return f"{n / 1e12:.2f} TB"
    return f"{n / 1e9:.0f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def _fmt_params(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def resolve_config(model):
    """A transformers config from a preset name, a model folder, a config.json, a config, a model
    or an engine (never a Hub id: the estimator downloads nothing). Returns (config, display name)."""
    source = resolve(model, hub=False)
    if source.kind in ("config", "object", "engine"):
        return source.config(), source.name
    return source.config(), os.fspath(model)


def machine_ram() -> Optional[int]:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except Exception:
        return None


def _free_disk_path(path: Optional[str]) -> str:
    p = os.path.abspath(path or os.getcwd())
    while not os.path.exists(p):
        p = os.path.dirname(p)
    return p


def free_disk(path: Optional[str]) -> Optional[int]:
    p = _free_disk_path(path)
    try:
        return int(shutil.disk_usage(p).free)
    except OSError:
        return None


def _gib(nbytes: Optional[int]) -> Optional[float]:
    return None if nbytes is None else nbytes / GiB


def resolve_budget(value: Budget, auto) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, str):
        if value != "auto":
            raise ValueError(f"budget {value!r}: give a number of GiB, 'auto' or None")
        return auto()

    return int(check("budget_gb", value, "budget") * GiB)


def gpu_resident_bytes(config, *, num_parameters: int, batch: int, seq: int) -> dict:
    """Plain PyTorch fp32 AdamW with everything on one device, no activation checkpointing.

    weights 4 B/param + gradients 4 B/param + two Adam moments 8 B/param, plus the activations
    autograd keeps: per layer about ``tokens x (12 h + 4 i) x 4`` bytes (fused attention, no
    seq^2 term) and the logits with their softmax and gradient.
    """

    h = family.hidden_size(config)
    i = int(family.intermediate_size(config) or 4 * h)
    layers = int(getattr(family.text_config(config), "num_hidden_layers", 0) or 0)
    vocab = int(family.vocab_size(config) or 0)
    tok = batch * seq
    act = layers * tok * (12 * h + 4 * i) * 4 + 3 * tok * vocab * 4
    out = {"weights": 4 * num_parameters, "grads": 4 * num_parameters,
           "optimizer_states": 8 * num_parameters, "activations": act}
    out["total"] = sum(out.values())
    return out


@dataclass
class Estimate:
    """The result of :func:`estimate`; ``print()`` it for the table."""

    name: str
    num_parameters: int
    batch: int
    seq: int
    precision: str
    compression: str
    budgets: dict
    plan: object
    gpu_resident: dict
    notes: list = field(default_factory=list)
    by_codec: dict = field(default_factory=dict)   # codec -> the plan with that optimizer-state codec
    names: dict = field(default_factory=dict)      # python argument -> how the caller spells it (CLI flags)
    host_min: Optional[int] = None                 # the least host RAM any plan needs (see estimate())
    reference_cache_bytes: Optional[int] = None    # a DPO run's reference cache (estimate(pairs=...))
    prediction: object = None                      # StepPrediction when estimate(rates=...) was given
    best: list = field(default_factory=list)       # the fastest plans (best_plans.PlanChoice), with rates
    pick: object = None                            # the one an engine given the rates builds (PlanChoice)
    grpo: object = None                            # a GRPO run's generation (estimator_grpo.GenerationPlan)
    precision_note: Optional[str] = None           # fp32 on a GPU: what bf16 or TF32 would give (the run header's line)

    # ------------------------------------------------------------------ time (estimate(rates=...))
    def _pred(self, what: str):
        if self.prediction is None:
            raise ValueError(f"Estimate.{what}: no rates were given; pass rates=mt.measure_machine() or a "
                             "profile name to mt.estimate")
        return self.prediction

    @property
    def step_seconds(self) -> float:
        return self._pred("step_seconds").step_seconds

    @property
    def phases(self) -> dict:
        return dict(self._pred("phases").phases)

    @property
    def bottleneck(self) -> str:
        return self._pred("bottleneck").bottleneck

    @property
    def tokens_per_second(self) -> float:
        return self._pred("tokens_per_second").tokens_per_second

    def run_seconds(self, max_steps: int) -> float:
        return self._pred("run_seconds").run_seconds(max_steps)

    def _time_lines(self) -> list:
        if self.prediction is None:
            return []

        p = self.prediction
        lines = [f"time: {fmt_seconds(p.step_seconds)} per step, {fmt_seconds(p.seconds_per_billion_tokens())} "
                 f"per 1B tokens ({fmt_rate(p.tokens_per_second)}); bottleneck: {p.bottleneck} "
                 f"[rates: {p.source or 'given'}]"]
        lines += ["  " + x for x in p.lines()[1:]]
        if self.best:
            lines.append("fastest plans within the budgets (predicted step, host RAM, disk):")
            for i, pc in enumerate(self.best, 1):
                lines.append(f"  {i}. {fmt_seconds(pc.prediction.step_seconds)} per step, host "
                             f"{format_bytes(pc.plan.host['total'])}, disk {format_bytes(pc.plan.disk['total'])}, "
                             f"device {format_bytes(pc.plan.device['total'])}; bottleneck {pc.prediction.bottleneck}: "
                             f"{pc.describe()}")
            lines.append("  " + self._pick_line())
        return lines

    def _pick_line(self) -> str:
        """Which plan an engine given these rates builds for this workload (engine/planning/plan_pick.py)."""

        rules = plan_key(self.plan)
        if self.pick is None or plan_key(self.pick.plan) == rules:
            which = (f"the rules' plan above (plan {self.best.index(self.pick) + 1})" if self.pick in self.best
                     else f"the rules' plan above (predicted within {MARGIN:.0%} of the fastest)")
        else:
            which = (f"plan {self.best.index(self.pick) + 1}; the table above is the rules' plan, which "
                     "EngineOverrides(plan_by='rules') keeps")
        return (f"an engine given these rates for this workload builds {which}; choices left at their "
                "defaults are free, a field set is pinned")

    @property
    def feasible(self) -> bool:
        return bool(self.plan.feasible)

    @property
    def limiting_tier(self) -> Optional[str]:
        return self.plan.limiting_tier

    @property
    def placement(self) -> dict:
        return dict(self.plan.placement)

    def tiers(self) -> dict:
        """{tier: {kind: bytes, "total": bytes}} of our placement."""
        return {"device": dict(self.plan.device), "host": dict(self.plan.host), "disk": dict(self.plan.disk)}

    def gpus_needed_resident(self) -> Optional[int]:
        vram = self.budgets.get("device")
        return math.ceil(self.gpu_resident["total"] / vram) if vram else None

    def to_dict(self) -> dict:
        return {"name": self.name, "num_parameters": self.num_parameters, "batch": self.batch, "seq": self.seq,
                "precision": self.precision, "compression": self.compression, "budgets": self.budgets,
                "tiers": self.tiers(), "placement": self.placement, "feasible": self.feasible,
                "limiting_tier": self.limiting_tier, "reason": self.plan.reason,
                "layer_slots": self.plan.layer_slots, "checkpoint_interval": self.plan.checkpoint_interval,
                "gpu_resident": self.gpu_resident, "gpus_needed_resident": self.gpus_needed_resident(),
                "window": self.plan.window, "host_min": self.host_min,
                "tile_tokens": self.plan.tile_tokens, "longest_seq": self.plan.longest_seq,
                "reference_cache_bytes": self.reference_cache_bytes,
                "prediction": self.prediction.to_dict() if self.prediction is not None else None,
                "engine_pick": self.pick.choice if self.pick is not None else None,
                "grpo": self.grpo.to_dict() if self.grpo is not None else None,
                "precision_note": self.precision_note,
                "best_plans": [{"choice": pc.choice, "step_seconds": pc.prediction.step_seconds,
                                "bottleneck": pc.prediction.bottleneck,
                                "host_bytes": pc.plan.host["total"], "disk_bytes": pc.plan.disk["total"],
                                "device_bytes": pc.plan.device["total"]} for pc in self.best]}

    def _rows(self):
        kinds = [("weights", "weights"), ("grads", "gradients"), ("optimizer_states", "optimizer states"),
                 ("activations", "activations"), ("buffers", "buffers in flight")]
        rows = []
        for tier in ("device", "host", "disk"):
            d = self.tiers()[tier]
            rows.append([tier, format_bytes(self.budgets.get(tier)), format_bytes(d.get("total", 0))]
                        + [(format_bytes(d[k]) if d.get(k) else "-") for k, _ in kinds])
        return ["tier", "budget", "needed"] + [label for _, label in kinds], rows

    def _gpu_line(self) -> str:
        g = self.gpu_resident
        wgs = g["weights"] + g["grads"] + g["optimizer_states"]
        line = (f"GPU-resident fp32 AdamW (plain PyTorch, no offload): weights {format_bytes(g['weights'])} "
                f"(≈{_fmt_dec(g['weights'])}); with gradients and Adam states {format_bytes(wgs)} (≈{_fmt_dec(wgs)}); "
                f"with activations {format_bytes(g['total'])} (≈{_fmt_dec(g['total'])})")
        n = self.gpus_needed_resident()
        if n is not None:
            line += (f": fits one {format_bytes(self.budgets['device'])} device" if n <= 1 else
                     f": {n}x the {format_bytes(self.budgets['device'])} device budget")
        return line

    def __str__(self) -> str:
        header, rows = self._rows()
        widths = [max(len(str(r[c])) for r in [header] + rows) for c in range(len(header))]
        fmt = "  ".join("{:<%d}" % w for w in widths)
        p = self.plan
        lines = [f"megatrain_nb estimate: {self.name}: {_fmt_params(self.num_parameters)} parameters, "
                 f"batch {self.batch} x seq {self.seq}, {self.precision} compute, fp32 master weights, "
                 f"optimizer states {self.compression}"] + ([self.precision_note] if self.precision_note else []) + [
                 fmt.format(*header)] + [fmt.format(*r) for r in rows]
        lines.append("placement: " + ", ".join(f"{k.replace('_', ' ')} -> {v}" for k, v in p.placement.items())
                     + f"; device: {p.layer_slots} layer slots, checkpoint every {p.checkpoint_interval} layer(s)")
        lines.append("feasible: yes" if p.feasible else
                     f"feasible: NO (limiting tier: {p.limiting_tier}): {self._spell(p.reason)}")
        lines += self._codec_lines()
        lines.append(self._gpu_line())
        lines += self._time_lines()
        lines += self.grpo.lines() if self.grpo is not None else []
        lines += [self._spell(n) for n in self.notes]
        return "\n".join(lines)

    def _spell(self, text: str) -> str:
        """Argument names as the caller knows them (``max_vram_gb`` -> ``--vram`` on the CLI)."""
        for py, shown in sorted(self.names.items(), key=lambda kv: -len(kv[0])):
            text = text.replace(py, shown)
        return text

    def _codec_lines(self) -> list:
        """Each tier's total with and without optimizer-state compression (the 100B comparison)."""
        if not self.by_codec:
            return []
        rows = [["optimizer states", "device", "host", "disk", "fits"]]
        for codec, plan in self.by_codec.items():
            label = {"none": "none (fp32, exact)", "int8": "int8 (lossy)", "int4": "int4 (lossy)"}.get(codec, codec)
            rows.append([label + (" *" if codec == self.compression else ""),
                         format_bytes(plan.device["total"]), format_bytes(plan.host["total"]), format_bytes(plan.disk["total"]),
                         "yes" if plan.feasible else f"NO ({plan.limiting_tier})"])
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        fmt = "  ".join("{:<%d}" % w for w in widths)
        return (["per tier, with and without optimizer-state compression (* = this estimate):"]
                + [fmt.format(*r).rstrip() for r in rows])

    def _repr_html_(self) -> str:
        header, rows = self._rows()
        e = html.escape
        th = "".join(f"<th>{e(h)}</th>" for h in header)
        trs = "".join("<tr>" + "".join(f"<td>{e(str(c))}</td>" for c in r) + "</tr>" for r in rows)
        p = self.plan
        verdict = ("<b style='color:green'>fits</b>" if p.feasible else
                   f"<b style='color:#b00'>does not fit</b> (limiting tier: {e(str(p.limiting_tier))}): {e(p.reason)}")
        return (f"<div><p><b>{e(self.name)}</b>: {_fmt_params(self.num_parameters)} parameters, batch {self.batch} x "
                f"seq {self.seq}, optimizer states {e(self.compression)}</p><table><tr>{th}</tr>{trs}</table>"
                f"<p>placement: {e(', '.join(f'{k} → {v}' for k, v in p.placement.items()))}</p><p>{verdict}</p>"
                f"<p>{e(self._gpu_line())}</p>"
                + (f"<pre>{e(chr(10).join(self._time_lines()))}</pre>" if self.prediction is not None else "")
                + (f"<pre>{e(chr(10).join(self.grpo.lines()))}</pre>" if self.grpo is not None else "")
                + "</div>")


#: keywords people reach for, by the name ``estimate`` has for them (the engine's and the CLI's words)
_KEYWORD_NAMES = {"vram": "vram_gb", "max_vram_gb": "vram_gb", "gpu_gb": "vram_gb", "ram": "ram_gb",
                  "max_host_gb": "ram_gb", "host_gb": "ram_gb", "disk": "disk_gb", "seq_len": "seq",
                  "seq_length": "seq", "max_seq_length": "seq", "batch_size": "batch",
                  "gradient_accumulation_steps": "accumulation", "optimizer_compression": "compression"}
ASSUMED_DEVICE_GB = 80   # estimate's vram_gb when none is given


def _words_first(fn):
    """``estimate``'s entry: an unknown keyword is refused with the name it has here
    (``vram=80`` -> ``vram_gb``), before anything is resolved; without ``vram_gb`` on a machine
    without a GPU, the estimate says which device budget it assumed."""
    params = inspect.signature(fn).parameters

    @functools.wraps(fn)
    def entry(*args, **kwargs):
        for k in kwargs:
            if k not in params:
                near = _KEYWORD_NAMES.get(k) or next(iter(difflib.get_close_matches(k, list(params), n=1)), None)
                hint = f"did you mean {near}={kwargs[k]!r}? " if near else ""
                raise TypeError(f"mt.estimate() got an unknown keyword {k}={kwargs[k]!r}: {hint}It takes "
                                f"{', '.join(p for p in params if p != 'model')}")
        est = fn(*args, **kwargs)
        if "vram_gb" not in kwargs and not _has_gpu():
            est.notes.insert(0, f"device budget: {ASSUMED_DEVICE_GB} GiB assumed (vram_gb's default): this machine "
                                "has no GPU; pass vram_gb= the memory of the GPU you will train on")
        return est
    return entry


def _has_gpu() -> bool:
    import torch   # (the engine's planner has imported it by now)

    return torch.cuda.is_available()


@_words_first
def estimate(model, *, vram_gb: Budget = ASSUMED_DEVICE_GB, ram_gb: Budget = "auto", disk_gb: Budget = "auto", batch: int = 1,
             seq: int = 2048, compression=True, precision: str = "fp32", checkpoint_interval: Optional[int] = 1,
             offload_dir: Union[bool, str, None] = True, device: str = "cuda", world: int = 1,
             names: Optional[dict] = None, accumulation: int = 1, clipping: bool = True,
             layer_major: bool = True, clip_hold: str = "auto", pairs: Optional[int] = None,
             rollouts: Optional[int] = None, completion_length: Optional[int] = None, rates=None,
             image_tokens: Optional[int] = None, max_pixels: Optional[int] = None, beta: float = 0.0) -> Estimate:
    """Bytes per tier, placement, feasibility and the limiting tier for training ``model``.

    ``model``: a preset name, a local model folder, a ``config.json``, a config, a model or an engine.
    ``compression``: the optimizer-state codec (``"none"``, ``"int8"``, ``"int4"``; ``True`` = int8; ``"auto"``:
    the planner's, ``codec_choice``). ``offload_dir``: whether a disk tier exists (a path locates free space).
    ``names``: how messages spell the arguments (the CLI's ``CLI_NAMES``).
    ``accumulation``: micro-batches per optimizer step; layer-major (the engine's default for a
    window) keeps no host gradient accumulator, unless ``clipping`` (global-norm clipping, on by
    default as in TrainingArguments) holds the final gradients for the norm;
    ``layer_major=False`` shows the micro-batch-major path. ``clip_hold``: as ``EngineConfig.clip_hold``
    (an accumulator -- micro-batch-major, or a split window -- stays in RAM whatever it says).
    ``Estimate.host_min``: the least host RAM any plan needs (a short budget's: the disk tier holding all it can).
    ``world``: ranks the state is sharded over (ZeRO-3, one rank's host, disk and budgets; the device
    set unchanged); ``estimator_dist.estimate_scale_out`` adds per-node figures.
    ``pairs``: a DPO run's pairs: its reference pass and cache as lines (``estimator_dpo``).
    ``rollouts``/``completion_length``: a GRPO step's completions and their most tokens (``seq``: prompt +
    completion): ``Estimate.grpo``, its generation and KV cache (``estimator_grpo``); ``beta`` > 0: a reference
    engine on the device (``_checked_beta``). ``image_tokens`` per row (in ``seq``) or ``max_pixels`` per image.
    ``rates``: a ``MachineRates`` or a profile's name: the predicted step (``step_seconds``, ``phases``,
    ``bottleneck``, ``tokens_per_second``, ``run_seconds(n)``) and the three fastest plans within the budgets
    (``best``), the choices left at their defaults varied as an engine given these rates varies them.
    """
    from megatrain_nb.engine.updates.codecs import codec_names, normalize_compression   # (torch: the codecs' kernels)
    from megatrain_nb.engine.config import EngineConfig   # (torch: dtypes and devices)

    batch, seq, accumulation, pairs, rollouts, completion_length = _checked(
        batch=batch, seq=seq, accumulation=accumulation, pairs=pairs, rollouts=rollouts, completion_length=completion_length)
    (grpo, accumulation), beta = split_seq(seq, rollouts, completion_length, batch, accumulation), _checked_beta(beta)
    config, name = resolve_config(model)
    comp, rates = None if compression == "auto" else normalize_compression(compression), resolve_rates(rates)
    units = unit_specs_from_config(config)
    held = shard_specs(units, world) if world > 1 else None   # this rank's part of the state
    disk_path = offload_dir if isinstance(offload_dir, str) else None
    budgets = _budgets(vram_gb, ram_gb, disk_gb, offload_dir)
    accumulator = accumulation > 1 and not layer_major   # micro-batch-major: the host accumulator
    work = Workload(batch=batch, seq=seq, accumulation=accumulation if layer_major else 1, clipped=clipping,
                    gradients="accumulator" if accumulator else "held" if clipping else "none",
                    image_tokens=image_tokens_of(config, image_tokens, max_pixels, seq))

    def cfg_for(codec, host_bytes):
        return EngineConfig(max_vram_gb=_gib(budgets["device"]), max_host_gb=_gib(host_bytes),
                            offload_dir=(disk_path or "disk-tier") if offload_dir else None,
                            optimizer_compression=codec, precision=precision, checkpoint_interval=checkpoint_interval,
                            clip_hold=clip_hold)

    def plan_for(codec, host_bytes):
        return make_plan(units, ModelShape.of(config), cfg_for(codec, host_bytes), cuda=device != "cpu",
                         workload=work, disk_bytes=budgets["disk"], state_units=held)

    comp, choice = estimate_pick(comp or "auto", units, ModelShape.of(config), cfg_for(comp or RECOMMENDED, budgets["host"]),
                                 work, cuda=device != "cpu", disk_bytes=budgets["disk"], state_units=held, rates=rates)
    by_codec = {codec: plan_for(codec, budgets["host"]) for codec in codec_names()}  # the registry: a new codec shows too
    plan = choice.plan if compression == "auto" and choice and not choice.states_on_disk else by_codec[comp]
    # The least host RAM: the plan a one-byte host budget gets (everything that may leave RAM is
    # on the disk tier); the table shows what this budget's plan uses, which may be more.
    host_min = plan_for(comp, 1).host["total"]
    total = sum(u.numel for u in units)
    notes = _estimate_notes(plan, host_min, budgets, accumulation=accumulation, batch=batch, seq=seq,
                            clipping=clipping, accumulator=accumulator, ram_auto=ram_gb == "auto",
                            disk_auto=disk_gb == "auto" and bool(offload_dir), disk_path=disk_path)
    notes += estimate_lines(compression, choice, comp, plan)
    notes += reference_lines(pairs) + live_reference_lines(plan, beta) if pairs is not None else []   # DPO's reference
    notes += vision_lines(config, plan, units, work, budgets["device"], precision, device != "cpu", rates)
    est = Estimate(name=name, num_parameters=total, batch=batch, seq=seq, precision=precision, compression=comp,
                    budgets=budgets, plan=plan, gpu_resident=gpu_resident_bytes(config, num_parameters=total,
                                                                                batch=batch, seq=seq),
                    notes=notes, by_codec=by_codec, names=dict(names or {}), host_min=host_min,
                    reference_cache_bytes=reference_cache_bytes(pairs) if pairs is not None else None,
                    precision_note=precision_words(precision, False, rates) if device != "cpu" else None)
    est.grpo = plan_generation(config, units, plan, budgets, *grpo, precision=precision, reference=beta > 0) if grpo else None
    if rates is not None:
        _add_time(est, config, units, cfg_for(comp, budgets["host"]), work, rates, device=device, state_units=held)
    return est


def _checked_beta(beta) -> float:
    """``beta`` as a float >= 0 (a DPO/GRPO run's KL weight), else a ValueError naming it. Above 0 a
    GRPO run keeps a reference engine with the policy's weight slots and gradient buffers on the
    device between the steps, out of generation's room (``plan_generation(reference=)``); a DPO
    run's reference log-probs are one cached pass, so only a line: a streamed dataset's live
    reference engine keeps the same bytes beside the policy (:func:`live_reference_lines`)."""
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not math.isfinite(beta) or beta < 0:
        raise ValueError(f"beta={beta!r}: the KL weight of a GRPO or DPO run, a number >= 0 (GRPO's default 0.0 "
                         "keeps no reference model; above 0 its engine shares the device)")
    return float(beta)


def live_reference_lines(plan, beta: float) -> list:
    """A DPO estimate's line for its reference's device bytes (``beta`` > 0): a streamed dataset's
    reference log-probs come from a live reference engine kept beside the policy's
    (``decode.share_device``), with the policy's slots and gradient buffers."""
    if beta <= 0:
        return []
    return [f"DPO live reference (a streamed dataset): its engine keeps its weight slots and gradient buffers "
            f"({format_bytes(persistent_device_bytes(plan))}) on the device beside the policy's between steps"]


def _checked(**values) -> list:
    """The estimate's numbers through the values table (rows ``estimate_<name>``; None passes)."""
    return [None if v is None else check(f"estimate_{k}", v, k) for k, v in values.items()]


def _budgets(vram_gb: Budget, ram_gb: Budget, disk_gb: Budget, offload_dir) -> dict:
    """The budgets in bytes per tier ("auto": this machine's RAM, the free space where the disk tier lives)."""
    disk_path = offload_dir if isinstance(offload_dir, str) else None
    return {"device": resolve_budget(vram_gb, lambda: None), "host": resolve_budget(ram_gb, machine_ram),
            "disk": resolve_budget(disk_gb, lambda: free_disk(disk_path)) if offload_dir else None}


def _add_time(est: Estimate, config, units, cfg, work, rates, *, device: str, state_units=None) -> None:
    """The predicted step of the estimate's plan, and the fastest plans within its budgets (the
    choices the caller left at their defaults varied: ``best_plans.pinned_by_value``)."""

    plan = est.plan
    shape = ModelShape.of(config)
    est.prediction = predict_step(units, shape, cfg, plan, work, rates, cuda=device != "cpu")
    found = best_plans(units, shape, cfg, work, rates, cuda=device != "cpu", disk_bytes=est.budgets["disk"],
                       state_units=state_units, k=None, pinned=pinned_by_value(cfg))
    est.best, est.pick = found[:3], engine_pick(found, plan)
    if est.grpo is not None:
        price(est.grpo, config, units, shape, rates, training_s=est.prediction.step_seconds, cuda=device != "cpu")


def _estimate_notes(plan, host_min: int, budgets: dict, *, accumulation: int, batch: int, seq: int,
                    clipping: bool, accumulator: bool, ram_auto: bool, disk_auto: bool,
                    disk_path: Optional[str]) -> list:
    """The lines printed under an estimate's table: the window, clipping, the least host RAM, budgets read here."""
    notes = []
    if plan.window:
        w = plan.window
        notes.append(f"accumulation {accumulation}: {w['reason']} ({format_bytes(w['boundary_bytes'])} of boundary "
                     f"activations on the {w['tier']}); each layer loaded {w['loads_per_layer']:g}x per "
                     f"step; {w['tokens_per_weight_fetch']:,.0f} tokens per weight fetch")
    elif accumulation > 1:
        notes.append(f"accumulation {accumulation}, micro-batch-major: each layer loaded {2 * accumulation}x per step; "
                     f"{batch * seq / 2:,.0f} tokens per weight fetch")
    notes += _long_row_notes(plan, batch, seq)
    if clipping and not accumulator and not (plan.window and plan.window["groups"] > 1):
        notes.append(f"clipping: the final gradients wait for the global norm {_held_where(plan)}")
    if host_min < plan.host["total"]:
        notes.append(f"host RAM: {format_bytes(plan.host['total'])} with this budget; at least {format_bytes(host_min)} "
                     "with everything that may leave it on the disk tier (master weights, gradients held "
                     "for clipping, boundary activations)")
    if ram_auto:
        notes.append(f"host budget: this machine's RAM ({format_bytes(budgets['host'])}); pass ram_gb=... to plan "
                     "for other hardware")
    if disk_auto:
        notes.append(f"disk budget: the free space at {_free_disk_path(disk_path)} ({format_bytes(budgets['disk'])}); "
                     "pass disk_gb=... to plan for other hardware")
    return notes


def _long_row_notes(plan, batch: int, seq: int) -> list:
    """The tile a layer's MLP runs long rows in, where a long row's boundary activations wait,
    and the longest sequence the device budget takes (the planner's figures)."""
    notes = []
    if plan.tile_tokens and batch * seq > plan.tile_tokens:
        notes.append(f"long rows: a layer's MLP runs in tiles of {plan.tile_tokens:,} tokens (its intermediates "
                     f"exist for one tile at a time; EngineOverrides.tile_tokens pins the tile)")
    where = plan.placement.get("activations")
    if where:
        nbytes = plan.host.get("activations") or plan.disk.get("activations", 0)
        notes.append(f"boundary activations ({format_bytes(nbytes)}: every checkpointed layer's input for the "
                     f"backward) wait {'in host RAM' if where == 'host' else 'on the disk tier'}: they do not fit "
                     "beside the device's working set")
    if plan.longest_seq and plan.feasible:
        notes.append(f"longest sequence that fits the device budget at batch {batch}: {plan.longest_seq:,} tokens")
    return notes


def _held_where(plan) -> str:
    if plan.placement["gradients"] == "disk":
        return "on the disk tier (the host budget cannot hold them beside the master weights)"
    return "in host RAM (the host budget holds them)"


def shard_specs(units, world: int, rank: int = 0) -> list:
    """Rank ``rank``'s shard of every unit, as the sharded engine cuts them (``engine/ranks/dist.py``;
    rank 0 holds the largest shards)."""
    from megatrain_nb.engine.ranks.dist import ShardLayout   # (torch: the process group's module)

    if world < 1:
        raise ValueError(f"world={world}: the number of ranks must be >= 1")
    return [UnitSpec(u.name, ShardLayout.make(u.numel, world).numel_of(rank), u.kind) for u in units]


# How the command line and %megatrain spell estimate()'s and the planner's argument names.
# Longer phrases are replaced first.
CLI_NAMES = {"vram_gb": "--vram", "max_vram_gb": "--vram", "ram_gb": "--ram", "max_host_gb": "--ram",
             "ram_gb=...": "--ram GiB", "disk_gb=...": "--disk GiB", "disk_gb": "--disk",
             "optimizer_compression='int8' (or 'int4')": "--compression int8 (or int4)",
             "optimizer_compression='int4'": "--compression int4", "optimizer_compression": "--compression",
             "give an offload_dir": "drop --no-disk", "offload_dir": "--offload-dir",
             "offload_params=True to put the master weights on disk": "a disk tier for the master weights",
             "batch/sequence": "--batch/--seq"}
