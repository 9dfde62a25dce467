"""The predicted step time: the engine's own schedule priced at a machine's rates.

:func:`predict_step` takes what the planner decided (``planner.Plan``: tiers, checkpoint
interval, the window's groups), the workload (``planner.Workload``) and a
:class:`~.rates.MachineRates`, counts what one optimizer step moves and computes, and lays
those amounts on the engine's streams:

* **compute** (the device, or on a CPU "device" every core): the forward ``2·N·T`` FLOPs
  (``N``: the parameters of the matmuls, layers and head; ``T``: tokens per step), the
  backward ``4·N·T``, the recompute (every layer's forward again under autograd at checkpoint
  interval k >= 1, plus the inner layers of a block once more at k > 1), and causal attention
  (``2·b·s²·h`` per layer forward, ``h`` the heads' width; twice that backward) at the head size's
  forward and backward rates for rows of ``s`` tokens (``MachineRates.attention_rates``: a CPU's
  measured by row length, the backward's apart);
* **host->device / device->host** (``h2d``/``d2h``): each load of a unit in the compute order
  (``StepRunner.schedule``: embedding, head, layers; then per block the recompute and the
  backward), in the compute dtype; each unit's fp32 gradient leaving once per group;
  boundary activations kept in host RAM both ways; prefetched, so they overlap the compute;
* **disk** (one device: its reads and writes add): the step's disk accesses as the host cache
  sees them (``disk_cache.step_accesses`` through ``disk_cache.plan_cache`` at the cache's
  capacity: what the cache cannot keep), gradients held on the disk tier for the clipping
  norm (written and read once), boundary activations on the disk tier;
* **optimizer**: AdamW (one worker thread, ``adamw_per_thread``) pipelined with the codec's
  decode and encode threads (``codec_per_thread``) for compressed states;
* **cast** (CUDA, a compute dtype narrower than fp32): each update writes its unit's
  compute-dtype shadow (``HostStore.refresh_shadow``: master weights in RAM) on the update's
  thread, so a load is one copy with no cast; with the master weights on the disk tier (no host
  cache) each update writes the unit's compute-dtype copy there too and a load reads that copy:
  the compute dtype's bytes, no cast (``weight_store.DiskWeights``' ``shadow``); with a host cache
  the transport casts each load on the CPU instead (its one pinned cast buffer). Priced at
  :data:`CAST_VS_ADAMW` x AdamW's rate, in the update chain or before the load's copy;
* **tiles**: where the plan runs a layer's MLP in tiles (``plan.tile_tokens``: only where the
  layer does not fit, ``tiling.tile_tokens_for``), the tiled backward runs each tile's MLP forward
  once more (counted in the recompute).

How they overlap is the engine's: a step is two windows, the forward and the backward (with
its recompute), each as long as its slowest stream. Without clipping each update starts as its
gradient becomes final: the optimizer runs in the backward's window, and the next forward
waits for the embedding's update, the last one (exposed). With clipping (``max_grad_norm`` >
0, the default) the updates wait for the global norm at the end of the backward and run in the
next forward's order while that forward waits for each unit in turn: the optimizer runs in the
forward's window. Disk and link bytes are split between the windows by the forward's share of
the units' loads.

Cores: on a CPU "device" the compute, AdamW, the codec threads and the copies share
``rates.cores``; a phase then takes at least its CPU work (core-seconds) over the cores, so
with few cores the CPU-bound phases add rather than overlap (on CUDA only AdamW, the codec and
pageable copies take cores). A CPU device's compute rates are one thread's (measured so:
``MachineRates.compute_threads``) and its compute runs on ``compute_team()`` threads, every core
but one: the engine's own threads run beside it, and an intra-op team with a pre-empted thread
waits at its barrier (on the 2-core machine a step takes as long with one compute thread as with
two). Disk I/O (O_DIRECT) is counted as taking no core.
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace
from typing import Dict, List, Optional

from . import rates as rates_mod
from .rates import elementwise_accesses
from .rates_cache import cached_rates
from .planner import codec_bytes_per_param, codec_in_blocks

#: The engine's own threads beside the updates that each need a core on a CUDA machine: the step's
#: (kernel launches, the loss), the host->device copies (``mtnb-h2d``) and the gradient intake
#: (``mtnb-d2h``). Disk I/O (O_DIRECT) waits on the device and is counted as taking none.
ENGINE_CORE_THREADS = 3


def update_threads(cuda: bool, cores: Optional[int] = None, given: Optional[int] = None) -> int:
    """Threads each AdamW update runs on (``EngineConfig.optimizer_threads``): ``given``; else on
    CUDA the host's ``cores`` (None: this process's) less :data:`ENGINE_CORE_THREADS`, at least
    1; on a CPU device 1 (its compute takes the cores)."""
    if given:
        return int(given)
    if not cuda:
        return 1
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(int(cores) - ENGINE_CORE_THREADS, 1)


PHASES = ("forward", "backward", "recompute", "h2d", "d2h", "disk_read", "disk_write", "optimizer", "codec", "cast")
#: A cast of fp32 weights to the compute dtype moves 6 bytes a parameter (4 read, 2 written) where
#: the fused AdamW moves 28 (weight, gradient and two moments read; weight and moments written):
#: both memory-bound on one thread, the cast is priced at AdamW's measured rate times 28 / 6.
CAST_VS_ADAMW = 28 / 6
STREAMS = {"compute": "compute", "h2d": "host->device", "d2h": "device->host", "disk": "disk",
           "optimizer": "optimizer", "cpu": "CPU cores"}


@dataclass
class StepPrediction:
    """One optimizer step's predicted time. ``phases``: seconds of each kind of work (as if it
    ran alone); ``streams``: seconds each resource is busy; ``windows``: the parts of the step
    that follow one another ("step" unclipped; "forward + updates" and "backward" clipped);
    ``bottleneck``: the stream that bounds most of the step; ``overlaps``: what runs beside what."""
    step_seconds: float
    phases: Dict[str, float]
    streams: Dict[str, float]
    windows: Dict[str, float]
    bottleneck: str
    overlaps: List[str]
    tokens_per_step: int
    bytes: Dict[str, int] = field(default_factory=dict)
    flops: float = 0.0
    notes: List[str] = field(default_factory=list)
    source: str = ""
    #: The EngineConfig fields the engine's plan took from this prediction (``Plan.choice``; None:
    #: the rules' plan): a step well off the prediction then names the way back to the rules.
    plan_choice: Optional[dict] = None
    #: When the rates were measured (``MachineRates.measured_at``, seconds since the epoch; None:
    #: a profile's or made-up rates): a step well off the prediction names their age.
    rates_measured_at: Optional[float] = None

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_step / self.step_seconds if self.step_seconds > 0 else 0.0

    def run_seconds(self, max_steps: int) -> float:
        """Seconds for ``max_steps`` optimizer steps."""
        return max(int(max_steps), 0) * self.step_seconds

    def seconds_per_billion_tokens(self) -> float:
        return 1e9 / self.tokens_per_second if self.tokens_per_second else math.inf

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tokens_per_second"] = self.tokens_per_second
        return d

    def lines(self) -> List[str]:
        head = (f"predicted step {fmt_seconds(self.step_seconds)} ({fmt_rate(self.tokens_per_second)}, "
                f"1B tokens in {fmt_seconds(self.seconds_per_billion_tokens())}); bottleneck: {self.bottleneck}"
                + (f" [rates: {self.source}]" if self.source else ""))
        rows = [f"  {p:<10} {fmt_seconds(s):>9}" + (f"  {fmt_gb(self.bytes[p])}" if self.bytes.get(p) else "")
                for p, s in self.phases.items() if s > 0 or self.bytes.get(p)]
        return [head, "  phase      seconds (alone)"] + rows + [f"  overlap: {o}" for o in self.overlaps] + \
            [f"  note: {n}" for n in self.notes]

    def __str__(self) -> str:
        return "\n".join(self.lines())


def fmt_seconds(s: float) -> str:
    if s == math.inf:
        return "inf"
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    if s < 120:
        return f"{s:.2f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h" if s < 172800 else f"{s / 86400:.1f} days"


def fmt_rate(tokens_per_second: float) -> str:
    """Tokens/s as text: whole numbers from 100 up, three significant digits below (a 100B model on
    a CPU's rates runs 0.0123 tokens/s, not "0")."""
    v = tokens_per_second
    if not v or not math.isfinite(v):
        return "0 tokens/s" if not v else "inf tokens/s"
    return f"{v:,.0f} tokens/s" if v >= 100 else f"{v:.3g} tokens/s"


def fmt_gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _per(amount: float, rate: float, what: str, missing: List[str]) -> float:
    """``amount / rate``; a rate of 0 (not measured) counts 0 s and is named in the notes."""
    if amount <= 0:
        return 0.0
    if not rate or rate <= 0:
        missing.append(what)
        return 0.0
    return amount / rate


#: The disk's traffic a step's prediction counts apart (bytes, and with ``_files`` the files).
_DISK_KEYS = ("read", "write", "state_read", "state_write", "start_read", "start_write")


def _disk_s(d: dict, kind: str, rates, what: str = "", missing: Optional[List[str]] = None) -> float:
    """Seconds the disk takes for ``d[kind]`` bytes (a :func:`_disk_bytes` figure) in
    ``d[kind + "_files"]`` files: the bytes at the measured bandwidth, each file at its measured
    cost beyond them (``MachineRates.disk_read_file_s``; 0 where not measured)."""
    read = kind.endswith("read")
    t = _per(d[kind], rates.disk_read if read else rates.disk_write, what, [] if missing is None else missing)
    cost = float(getattr(rates, "disk_read_file_s" if read else "disk_write_file_s", 0.0) or 0.0)
    return t + (d.get(kind + "_files", 0.0) * cost if t > 0 else 0.0)


def compute_order(units, k: int, groups: int = 1) -> list:
    """The units' loads of one step (``StepRunner.schedule``), once per group: the embedding, the
    layers, the head (the engine binds the head after the last layer once its first step has seen
    the model use no head module before its layers: every family the engine supports but one
    whose module registered after the layers runs before them)."""
    embed, head, layers = units[0], units[-1], list(units[1:-1])
    order = [embed] + layers + [head]
    if k > 0:
        for b in reversed(range(0, len(layers), k)):
            end = min(b + k, len(layers))
            order += layers[b:end - 1] + list(reversed(layers[b:end]))
    return [u for u in order if u.numel > 0] * max(groups, 1)


#: A window split into more groups than this is priced from this many (each group's loads and disk
#: accesses repeat the one before's; the rest scaled): an estimate of 10**12 micro-batches in groups
#: would otherwise list every load of the step.
GROUPS_LISTED = 16


def _disk_bytes(units, order, cfg, plan, clipped: bool, cache_bytes: int, scale: float = 1.0,
                shadow: int = 0) -> Dict[str, int]:
    """Disk bytes read and written per step: the schedule's accesses through the host cache
    (``order``: the step's loads, or ``1 / scale`` of them: the schedule's figures times ``scale``;
    ``shadow``: the bytes a parameter of the tier's compute-dtype copy the loads read, 0: none)."""
    # light: the host cache's module (torch) away from the planning modules' import (--help, mt.estimate)
    from ..tiers.disk_cache import held_after_backward, plan_cache, step_accesses

    if not cfg.offload_dir:
        return dict.fromkeys(_DISK_KEYS + tuple(k + "_files" for k in _DISK_KEYS), 0) | \
            {"raw_read": 0, "raw_write": 0, "read_miss": 0.0, "weights_on_disk": False}
    on_disk = plan.placement.get("master_weights") == "disk"
    per = codec_bytes_per_param(cfg.optimizer_compression)
    states = plan.placement.get("optimizer_states") == "disk"
    updates = [units[0]] + list(units[1:-1]) + [units[-1]]
    held = None   # a clipped step without a host cache: the backward's last reads held for their updates
    if on_disk and clipped and cache_bytes <= 0:
        held = held_after_backward(order, updates, held_units=_held_units(units, cfg, plan),
                                   depth=cfg.overrides.inflight_depth)
    seq = step_accesses(order, updates, clipped=clipped, params_on_disk=on_disk,
                        state_key=lambda u: f"state-{u.index}", state_nbytes=lambda u: int(per * u.numel),
                        shadow_bytes=shadow, held=held)
    if not states:
        seq = [a for a in seq if not a[0].startswith("state-")]
    raw_r = sum(b for _, op, b in seq if op == "R")
    raw_w = sum(b for _, op, b in seq if op == "W")
    cp = plan_cache(seq, max(int(cache_bytes), 0)) if seq else None
    read, write = (cp.read_bytes, cp.write_bytes) if cp else (0, 0)
    if scale != 1.0:
        raw_r, raw_w, read, write = (int(x * scale) for x in (raw_r, raw_w, read, write))
    # the optimizer states' share of what reaches the disk (the cache keeps each kind alike)
    st_r = sum(b for k, op, b in seq if op == "R" and k.startswith("state-"))
    st_w = sum(b for k, op, b in seq if op == "W" and k.startswith("state-"))
    state_read, state_write = int(read * st_r / raw_r) if raw_r else 0, int(write * st_w / raw_w) if raw_w else 0
    miss = read / raw_r if raw_r else 1.0   # the share of the schedule's reads the cache cannot serve
    miss_w = write / raw_w if raw_w else 1.0
    # the files moved: the schedule's accesses, each a file, in the share the cache lets reach the disk
    files = {"read": miss * sum(op == "R" for _, op, _ in seq), "write": miss_w * sum(op == "W" for _, op, _ in seq),
             "state_read": miss * sum(op == "R" and k.startswith("state-") for k, op, _ in seq),
             "state_write": miss_w * sum(op == "W" and k.startswith("state-") for k, op, _ in seq)}
    # unclipped, weights on the disk tier behind a host cache: the next forward's first need, the
    # embedding's updated weights, is written, then read back (the head's load comes after the
    # layers) -- as much of it as reaches the disk past the cache. Without a cache the last updates'
    # buffers stay as fresh copies for the next forward (``weight_store.fresh_after_step``: the
    # embedding's always, the first the forward reads): no read back, the write goes behind
    start_read = start_write = 0
    files["start_read"] = files["start_write"] = 0.0
    if on_disk and not clipped and cache_bytes > 0:
        start_read = int((shadow or 4) * units[0].numel * miss)
        start_write = int(4 * units[0].numel * miss_w) if raw_w else 0
        files["start_read"], files["start_write"] = miss, miss_w
    elif states and not clipped and cache_bytes <= 0 and codec_in_blocks(cfg.optimizer_compression):
        # compressed states on the disk tier without a host cache are updated range by range inside
        # the update (``OptimizerStates.ranged_io``: nothing read ahead, nothing written behind), and
        # so are the weights of a unit no backward handed its buffer to (the embedding and the head:
        # ``DiskWeights.ranged_update``). The embedding's, the backward's last update and the next
        # forward's first need, then runs in the open: its codes and weights read and written, the
        # rewrite committed, and the weights read back by the forward's load (measured on the tenth
        # session's quiet run: the forward waited 0.066-0.107 s a step for it, priced at 0.005-0.009)
        codes, w = int(per * units[0].numel), (4 * units[0].numel if on_disk else 0)
        start_read, start_write = codes + 2 * w, codes + w
        files["start_read"], files["start_write"] = 1.0 + 2 * bool(w), 1.0 + bool(w)
    if plan.placement.get("gradients") == "disk" and clipped:   # held for the norm: written, read back
        n = 4 * sum(u.numel for u in units)
        read, write = read + n, write + n
        files["read"] += len(units)
        files["write"] += len(units)
    window = plan.window or {}
    if window.get("tier") == "disk":
        b = boundary_total(window)
        read, write = read + b, write + b
    if scale != 1.0:
        files = {k: v * scale for k, v in files.items()}
    return {"read": read, "write": write, "raw_read": raw_r, "raw_write": raw_w, "state_read": state_read,
            "state_write": state_write, "start_read": start_read, "start_write": start_write, "read_miss": miss,
            "weights_on_disk": on_disk} | {k + "_files": v for k, v in files.items()}


def _held_units(units, cfg, plan) -> int:
    """``parts.held_weight_units`` from the plan alone: the override, else as many units as the room
    ``max_host_gb`` leaves beside the plan's host needs (no budget: free RAM decides, and every unit
    is assumed to fit, as ``default_cache_bytes`` assumes of a cache)."""
    if cfg.overrides.held_weight_units is not None:
        return min(cfg.overrides.held_weight_units, len(units))
    if cfg.max_host_gb is None:
        return len(units)
    room = max(int(cfg.max_host_gb * (1 << 30)) - plan.host["total"], 0)
    return min(len(units), room // max(4 * max((u.numel for u in units), default=0), 1))


def boundary_total(window: dict) -> int:
    """Boundary activations of every micro-batch of a window (``boundary_bytes`` is its largest group's)."""
    return int(window["boundary_bytes"] / max(window["group_size"], 1) * window["micro_batches"])


def _specs(units) -> list:
    return [SimpleNamespace(index=i, numel=u.numel, kind=u.kind) for i, u in enumerate(units)]


def step_amounts(units, shape, cfg, plan, workload, *, cuda: bool, cache_bytes: int) -> dict:
    """What one optimizer step computes and moves: FLOPs per kind, bytes per link, parameters updated."""
    units = _specs(units)
    window = plan.window or {}
    k = window.get("checkpoint_interval", plan.checkpoint_interval)
    groups = window.get("groups", 1)
    tokens = workload.batch * workload.seq * workload.accumulation
    n_layers = max(len(units) - 2, 1)
    layer_n = sum(u.numel for u in units[1:-1])
    head_n = units[-1].numel or units[0].numel   # a tied head multiplies by the embedding's weights
    cb = 2 if cfg.precision == "bf16" else 4
    rec = 0.0 if k == 0 else 1 + (n_layers - math.ceil(n_layers / max(k, 1))) / n_layers
    width = shape.layer().query_width()   # (the query heads' width: the hidden size where the config does not say)
    attn = 2.0 * workload.batch * workload.seq ** 2 * width * n_layers * workload.accumulation
    listed = min(max(groups, 1), GROUPS_LISTED)
    order = compute_order(units, k, listed)
    scale = max(groups, 1) / listed
    boundary = boundary_total(window) if window.get("tier") == "host" else 0
    total = sum(u.numel for u in units)
    cast = cuda and cb < 4
    on_disk = plan.placement.get("master_weights") == "disk"
    copy = cast and on_disk and not cache_bytes   # the disk tier's compute-dtype copy (no host cache)
    return {
        "tokens": tokens, "k": k, "groups": groups,
        "tile_flops": _tile_flops(shape, plan, workload, n_layers),
        # the compute-dtype copy: written by each update (RAM; the disk tier's copy), or cast by the
        # transport per load (the disk tier behind a host cache)
        "cast_update_params": total if cast and (copy or not on_disk) else 0,
        "cast_load_params": int(sum(u.numel for u in order) * scale) if cast and on_disk and not copy else 0,
        "forward_flops": 2.0 * (layer_n + head_n) * tokens, "backward_flops": 4.0 * (layer_n + head_n) * tokens,
        "head_flops": 2.0 * head_n * tokens,
        "recompute_flops": 2.0 * layer_n * tokens * rec,
        "attention_flops": {"forward": attn, "backward": 2 * attn, "recompute": attn * rec},
        "h2d": int(sum(u.numel for u in order) * scale) * cb + boundary, "d2h": 4 * total * groups + boundary,
        "forward_loads": sum(u.numel for u in order[:len(units)]) * cb,
        "disk": _disk_bytes(units, order, cfg, plan, workload.clipped, cache_bytes, scale, shadow=cb if copy else 0),
        "params": total, "state_bytes_fp32": 8 * total, "codec": cfg.optimizer_compression,
        "compute_bytes": cb, "elementwise": _elementwise_amounts(shape, tokens, n_layers, rec, total,
                                                                 workload.accumulation),
    }


#: Element accesses a parameter of each micro-batch: its gradient buffer zeroed (a write) and each
#: matmul's weight gradient added into it (read, read, write).
GRAD_ACCESSES_PER_PARAM = 4


def _elementwise_amounts(shape, tokens: int, n_layers: int, rec: float, params: int, micro: int) -> Dict[str, float]:
    """Element accesses of the step's non-matmul work per phase (``rates.elementwise_accesses``):
    each layer's norms, rotary, activation and residual adds -- once forward, twice backward, ``rec``
    more forwards' worth recomputed; each micro-batch's gradient buffers zeroed and summed into
    (:data:`GRAD_ACCESSES_PER_PARAM`), counted with the backward. ``logits``: the loss head's
    log-softmax forward and backward, a logit a token and vocabulary entry (its own rate)."""
    h = shape.hidden_size
    i = shape.intermediate_size or 4 * h
    one = elementwise_accesses(tokens, h, i, passes=1.0) * n_layers
    return {"forward": one, "recompute": one * rec,
            "backward": 2 * one + GRAD_ACCESSES_PER_PARAM * params * max(int(micro), 1),
            "logits": float(tokens) * shape.vocab_size}


def _tile_flops(shape, plan, workload, n_layers: int) -> float:
    """The MLP forward a tiled layer's backward runs again (its tiles recomputed with gradients):
    ``2 · 3 · hidden · intermediate`` FLOPs a token (a gated MLP's three matmuls) on every layer,
    where a micro-batch's tokens exceed the plan's tile (0: untiled)."""
    tile, tokens = int(getattr(plan, "tile_tokens", 0) or 0), workload.batch * workload.seq
    if not tile or tokens <= tile:
        return 0.0
    inter = shape.intermediate_size or 4 * shape.hidden_size
    return 2.0 * 3 * shape.hidden_size * inter * tokens * workload.accumulation * n_layers


def _shapes_missing(rates, shape, workload, bf16: bool) -> str:
    """A note when measured rates lack this model's matmul shape at the workload's tokens (they were
    measured at a default shape: the compute's time is rough), else ""."""
    if rates.source != "measured" or bf16:
        return ""
    tokens, h = workload.batch * workload.seq, shape.hidden_size
    inter = shape.intermediate_size or 4 * h
    if f"{tokens}x{h}x{inter}" in rates.matmul_by_shape or any(
            k.split("x")[1:] == [str(h), str(inter)] for k in rates.matmul_by_shape):
        return ""
    return (f"the compute rates were measured at a default shape, not this model's ({tokens} tokens x {h} x {inter}): "
            f"the compute's time is rough; mt.measure_machine(model=..., tokens={tokens}) measures its shapes "
            "(seconds) and keeps them in the cache")


def _matmul_rate(rates, shape, workload, bf16: bool = False) -> float:
    """FLOP/s of the step's matmuls: bf16 compute at the bf16 rate (measured at the default shape
    only), fp32 at the model's shape where it was measured, else the default shape's."""
    if bf16 and getattr(rates, "bf16_matmul_flops", 0):
        return float(rates.bf16_matmul_flops)
    key = f"{workload.batch * workload.seq}x{shape.hidden_size}x{shape.intermediate_size or 4 * shape.hidden_size}"
    return float(rates.matmul_by_shape.get(key) or rates.matmul_flops)


def step_team(rates, shape, workload, *, bf16: bool, cuda: bool) -> float:
    """What a CPU device's step gets from torch's threads over the one-thread count of its layers'
    work (matmuls, attention, non-matmul), measured on a step-like chain of operations at a small
    and a large size and interpolated at the micro-batch's tokens x hidden
    (``MachineRates.step_speedup``); 0: not measured (an older cache), a GPU, bf16 or rates not one
    thread's -- then the matmul's team (``compute_team``) and the memcpy's (``memory_team``) apply."""
    if cuda or bf16 or rates.compute_threads != 1 or not getattr(rates, "step_team", None):
        return 0.0
    return rates.step_speedup(workload.batch * workload.seq, shape.hidden_size)


def head_dim(shape) -> int:
    """A layer's attention head size (64 where the model's config does not say)."""
    d = shape.layer()
    return int(d.head_size()) if d.heads or d.head_dim else 64


def _compute_rates(rates, shape, workload, *, bf16: bool, cuda: bool) -> tuple:
    """(matmul, attention forward, attention backward) FLOP/s of the step's compute: the measured
    rates -- the attention's at the model's head size and the micro-batch's row length
    (``MachineRates.attention_rates``) --, a CPU device's (one thread's:
    ``MachineRates.compute_threads``) times what its compute gets from the threads (the step's
    measured team at its size, :func:`step_team`; else the matmul's team)."""
    mm = _matmul_rate(rates, shape, workload, bf16)
    fwd, bwd = rates.attention_rates(head_dim(shape), workload.seq, bf16=bf16)
    scale = step_team(rates, shape, workload, bf16=bf16, cuda=cuda) or rates.compute_scale(cuda)
    return mm * scale, (fwd or mm) * scale, (bwd or fwd or mm) * scale


def predict_step(units, shape, cfg, plan, workload, rates, *, cuda: bool,
                 cache_bytes: Optional[int] = None) -> StepPrediction:
    """The predicted :class:`StepPrediction` of one optimizer step (see the module's docstring).

    ``units``: the plan's units (``planner.UnitSpec`` or the engine's, embedding first, head
    last); ``shape``: ``planner.ModelShape``; ``cfg``: the EngineConfig; ``plan``: its
    ``planner.Plan``; ``workload``: ``planner.Workload``; ``rates``: ``MachineRates``;
    ``cache_bytes``: the disk tier's host cache (None: 0 when ``cfg.host_cache_gb`` is 0, else
    the host budget left beside the plan, else unlimited)."""
    if cache_bytes is None:
        cache_bytes = default_cache_bytes(cfg, plan)
    a = step_amounts(units, shape, cfg, plan, workload, cuda=cuda, cache_bytes=cache_bytes)
    missing: List[str] = []
    bf16 = cfg.precision == "bf16"
    mm, at, at_back = _compute_rates(rates, shape, workload, bf16=bf16, cuda=cuda)
    ph = {"forward": _per(a["forward_flops"], mm, "matmul_flops", missing)
          + _per(a["attention_flops"]["forward"], at, "attention_flops", missing),
          "backward": _per(a["backward_flops"], mm, "matmul_flops", missing)
          + _per(a["attention_flops"]["backward"], at_back, "attention_flops", missing),
          "recompute": _per(a["recompute_flops"] + a["tile_flops"], mm, "matmul_flops", missing)
          + _per(a["attention_flops"]["recompute"], at, "attention_flops", missing)}
    if not cuda:   # a CPU device's non-matmul work: memory-bound, at its own measured rates
        scale = rates.memory_team() if rates.compute_threads == 1 else 1.0   # (memory-bound: the memcpy's speed-up)
        layer = step_team(rates, shape, workload, bf16=bf16, cuda=cuda) or scale   # (the layers' chain, measured)
        ew = float(getattr(rates, "elementwise_rate", 0.0) or 0.0) * layer
        sm = float(getattr(rates, "softmax_rate", 0.0) or 0.0) * scale
        said = missing if rates.source == "measured" else []   # (a profile's or made-up rates: none is none)
        for phase in ("forward", "backward", "recompute"):
            ph[phase] += _per(a["elementwise"][phase], ew, "elementwise_rate", said)
        ph["backward"] += _per(a["elementwise"]["logits"], sm, "softmax_rate", said)
    h2d_rate = _h2d_rate(rates, cuda)
    d2h_rate = (rates.d2h_pinned or rates.d2h_pageable) if cuda else rates.d2h_pageable
    ph["h2d"] = _per(a["h2d"], h2d_rate, "h2d", missing)
    ph["d2h"] = _per(a["d2h"], d2h_rate, "d2h", missing)
    ph["disk_read"] = _disk_s(a["disk"], "read", rates, "disk_read", missing)
    ph["disk_write"] = _disk_s(a["disk"], "write", rates, "disk_write", missing)
    team = a["update_threads"] = min(update_threads(cuda, rates.cores, getattr(cfg, "optimizer_threads", None)),
                                     max(int(rates.cores or 1), 1))
    ph["optimizer"] = _per(a["params"], rates.adamw_per_thread * team, "adamw_per_thread", missing)
    cast_rate = (rates.adamw_per_thread or 0.0) * CAST_VS_ADAMW   # (the shadow's cast: torch's threads in the worker, the team's count)
    a["cast_update_s"] = _per(a["cast_update_params"], cast_rate * team, "adamw_per_thread", missing)
    a["cast_load_s"] = _per(a["cast_load_params"], cast_rate, "adamw_per_thread", missing)
    ph["cast"] = a["cast_update_s"] + a["cast_load_s"]
    codec = cfg.optimizer_compression
    ph["codec"] = 0.0 if codec == "none" else _per(a["state_bytes_fp32"], (rates.codec_per_thread or {}).get(codec, 0),
                                                   f"codec_per_thread[{codec}]", missing)
    a["step_team"] = step_team(rates, shape, workload, bf16=bf16, cuda=cuda)
    a["head_share"] = min(a["head_flops"] / mm / ph["forward"], 1.0) if ph["forward"] > 0 and mm > 0 else 0.0
    pred = _schedule(ph, a, rates, cuda=cuda, clipped=workload.clipped, units=units)
    pred.overlaps.append(_threads_words(team, rates, cfg, cuda, a["codec"]))
    pred.bytes = {"h2d": a["h2d"], "d2h": a["d2h"], "disk_read": a["disk"]["read"], "disk_write": a["disk"]["write"],
                  "disk_state_read": a["disk"]["state_read"], "disk_state_write": a["disk"]["state_write"]}
    pred.flops = a["forward_flops"] + a["backward_flops"] + a["recompute_flops"] + a["tile_flops"] + \
        sum(a["attention_flops"].values())
    pred.source = rates.source
    pred.rates_measured_at = getattr(rates, "measured_at", None) if rates.source == "measured" else None
    rough = _shapes_missing(rates, shape, workload, bf16)
    if rough:
        pred.notes.append(rough)
    if missing:
        pred.notes.append("rates not measured, counted as 0 s: " + ", ".join(sorted(set(missing)))
                          + " (none published: once `megatrain-nb machine` has measured the CPU here, a profile uses its rates)")
    if a["disk"]["raw_read"] + a["disk"]["raw_write"] > a["disk"]["read"] + a["disk"]["write"]:
        saved = a["disk"]["raw_read"] + a["disk"]["raw_write"] - a["disk"]["read"] - a["disk"]["write"]
        pred.notes.append(f"the host cache ({fmt_gb(cache_bytes)}) saves {fmt_gb(saved)} of disk traffic per step")
    return pred


def default_cache_bytes(cfg, plan) -> int:
    """The disk tier's host cache as ``disk_cache.cache_budget`` sizes it, from the plan alone."""
    if not cfg.offload_dir or cfg.host_cache_gb == 0:
        return 0
    if cfg.host_cache_gb is not None:
        return int(cfg.host_cache_gb * (1 << 30))
    if cfg.max_host_gb is not None:
        return max(int(cfg.max_host_gb * (1 << 30)) - plan.host["total"], 0)
    return plan.disk.get("total", 0)   # no budget: free RAM decides; assume the disk tier fits


def _schedule(ph: Dict[str, float], a: dict, rates, *, cuda: bool, clipped: bool, units) -> StepPrediction:
    """Lay the phases on the streams (see the module's docstring): the step's two windows, the
    forward and the backward, each bound by its slowest stream; the updates in the backward's
    window (unclipped) or the next forward's (clipped)."""
    cores, cast_u, cast_l = max(int(rates.cores or 1), 1), a.get("cast_update_s", 0.0), a.get("cast_load_s", 0.0)
    threads = a.get("update_threads", 1)                            # each update's team (update_threads)
    opt = max(ph["optimizer"] + cast_u, ph["codec"] / min(2, cores))  # AdamW (+ the shadow's cast) beside the codec
    opt_cpu = (ph["optimizer"] + cast_u) * threads + ph["codec"]    # core-seconds of the update
    copy_cpu = cast_l if cuda else ph["h2d"] + ph["d2h"]            # a CPU "device" copies with a core
    h2d, disk = ph["h2d"] + cast_l, ph["disk_read"] + ph["disk_write"]   # a disk-tier load: cast, then copied
    f = a["forward_loads"] / a["h2d"] if a["h2d"] else 0.0          # the forward's share of the loads

    # a CPU device's team of torch's threads holds every core while it computes at its measured
    # speed-up; the engine's other CPU work beside it (AdamW, the codecs, the copies) pre-empts one of
    # its threads, and it waits at its barrier: that work adds in full. Not measured (an older cache):
    # every core but one computes, the rest shares the cores (as before)
    measured_team = getattr(rates, "team_matmul_flops", 0.0) > 0
    team = 0 if cuda else cores if measured_team or rates.compute_threads != 1 else rates.compute_team()
    # the update chain: a unit's update reads its states, decodes, steps, encodes and writes them
    # back; its disk traffic and its CPU work (on the cores the compute leaves; with compressed
    # states, at the chain's own measured rate where there is one) add up
    state_disk = _disk_s(a["disk"], "state_read", rates) + _disk_s(a["disk"], "state_write", rates)
    measured = chain_rate(rates, a["codec"], threads, cuda)
    cpu_chain = a["params"] / measured + cast_u if measured else \
        opt if cuda else max(opt, opt_cpu / max(cores - team, 1))
    chain = _chain(state_disk, cpu_chain, units, a["params"], cuda)

    # unclipped, the next forward's first need: the embedding's update (its states read ahead, written
    # behind: the backward window's disk stream, not a wait), behind a host cache its weights' write and
    # read-back; compressed states without a cache: its ranged reads and writes too (_disk_bytes)
    share = units[0].numel / max(a["params"], 1)
    first_disk = _disk_s(a["disk"], "start_read", rates) + _disk_s(a["disk"], "start_write", rates)
    first = cpu_chain * share + first_disk

    beside = 0.0 if cuda else float(getattr(rates, "compute_beside_disk", 0.0) or 0.0)
    update_key = "disk" if state_disk > chain / 2 else "optimizer"   # an update chain mostly waiting on the disk

    def window(compute_s, h2d_s, d2h_s, disk_s, opt_s, opt_core_s, copy_s):
        if 0.0 < beside < 1.0 and compute_s > 0:   # a CPU device's compute slows while the disk is busy
            busy = min(disk_s, compute_s) / compute_s
            compute_s *= (1.0 - busy) + busy / beside
        streams = {"compute": compute_s, "h2d": h2d_s if cuda else 0.0, "d2h": d2h_s if cuda else 0.0,
                   "disk": disk_s, "optimizer": opt_s,
                   "cpu": compute_s + opt_core_s + copy_s if measured_team else
                   (compute_s * team + opt_core_s + copy_s) / cores}
        key = max(streams, key=streams.get)
        if key == "optimizer":
            key = update_key
        if key == "cpu":   # CUDA waits for the host's cores, busy with the updates; a CPU device's threads run
            # slower beside the updates and copies, they do not wait (no stall in its telemetry): the compute
            key = ("optimizer" if cuda and opt_core_s > 0 else "compute") + "+cpu"
        return max(streams.values()), streams, key

    fc, bc = ph["forward"], ph["backward"] + ph["recompute"]
    on_f = 1.0 if clipped else 0.0
    other = disk - state_disk   # the weights' (and held gradients', boundaries') traffic follows the loads
    tf, sf, kf = window(fc, h2d * f, 0.0, other * f + state_disk * on_f, chain * on_f, opt_cpu * on_f,
                        copy_cpu * f)
    tb, sb, kb = window(bc, h2d * (1 - f), ph["d2h"], other * (1 - f) + state_disk * (1 - on_f),
                        chain * (1 - on_f), opt_cpu * (1 - on_f), copy_cpu * (1 - f))
    overlaps = ["host->device prefetch overlaps the compute (the next units load while one computes)",
                "disk reads run ahead and writes behind in the I/O threads (reads and writes share the disk)"]
    if not cuda:
        overlaps += _cpu_words(rates, cores, beside, disk, measured_team, a.get("step_team", 0.0))
    if clipped:   # the forward waits for the embedding's update, then for each layer's and the head's in turn
        tf = max(tf, _forward_after_updates(units, chain, cpu_chain, sf, a, rates, cuda))
        windows = {"forward + updates": tf, "backward": tb}
        overlaps.append("clipping: updates wait for the global norm after the backward, then overlap only "
                        "the next forward (each unit's forward waits for its update)")
    else:   # the embedding's gradient is the backward's last and the next forward's first need
        windows = {"forward": tf, "backward + updates": tb, "exposed update": first}
        overlaps.append("updates start as each gradient becomes final and overlap the backward; the next "
                        "forward waits for the embedding's, the last")
    exposed = {} if clipped else {"disk": first_disk, "optimizer": first - first_disk}
    top = _bottleneck(windows, ((tf, sf, kf), (tb, sb, kb)), clipped, exposed, update_key)
    bottleneck = STREAMS[top.split("+")[0]] + (" (sharing the CPU cores)" if top.endswith("+cpu") else "")
    return StepPrediction(step_seconds=sum(windows.values()), phases=dict(ph),
                          streams={k: sf[k] + sb[k] for k in sf}, windows=windows, bottleneck=bottleneck,
                          overlaps=overlaps, tokens_per_step=a["tokens"])


def _forward_after_updates(units, chain: float, cpu_chain: float, sf: Dict[str, float], a: dict, rates,
                           cuda: bool) -> float:
    """A clipped forward's window behind the updates (:func:`forward_behind_updates`). Updates
    that read their states from the disk queue behind what the disk does in that window (``sf``'s
    disk stream: the weights and states the updates before them write behind): their chain goes
    at the pace of the window's whole disk stream, not of their own reads and writes alone."""
    if a["disk"]["state_read"]:
        chain = _chain(sf["disk"], cpu_chain, units, a["params"], cuda)
    return forward_behind_updates(units, chain, sf["compute"], a["head_share"], _load_per_param(a, rates, cuda))


def _cpu_words(rates, cores: int, beside: float, disk: float, measured_team: bool, step: float = 0.0) -> List[str]:
    """The overlaps' lines on a CPU device's cores (``step``: the step's measured team, ``step_team``)."""
    speed = (f"its layers' work at {step:.2f}x their one-thread count (measured on a step-like chain of operations: "
             "MachineRates.step_team, at this micro-batch's tokens x hidden)" if step else
             f"{rates.compute_team():.2f}x one thread's rates (measured: MachineRates.team_matmul_flops)")
    words = [f"CPU device: its compute runs on torch's threads at {speed} "
             f"on all {cores} core(s); AdamW, the codec threads and the "
             "copies beside it pre-empt one of its threads and the team waits: their core-seconds add to a window's "
             "compute" if measured_team else
             f"CPU device: compute, AdamW, the codec threads and the copies share {cores} core(s): "
             "a window takes at least its core-seconds / cores"]
    if 0.0 < beside < 1.0 and disk > 0:
        words.append(f"CPU device: its compute runs at {beside:.2f}x its rate alone while the disk tier "
                     "reads and writes beside it (measured: MachineRates.compute_beside_disk)")
    return words


def _threads_words(team: int, rates, cfg, cuda: bool, codec: str) -> str:
    """The estimate's line on the update's threads."""
    why = "EngineConfig.optimizer_threads" if getattr(cfg, "optimizer_threads", None) else \
        (f"the host's {int(rates.cores or 1)} cores less the engine's {ENGINE_CORE_THREADS}" if cuda
         else "a CPU device's compute has the cores")
    fused = f"; a fused {codec} chunk's count the two codec threads, at least 3" if codec != "none" else ""
    return (f"optimizer: each update on {team} thread(s) ({why}{fused}), priced at the per-thread rates "
            f"times the threads")


def _chain(state_disk: float, cpu_s: float, units, params: int, cuda: bool) -> float:
    """Seconds of a step's update chain: its states' disk time and its CPU time. On CUDA the states
    are read a unit ahead and written behind by the I/O threads beside the update's cores: the
    longer of the two, plus the largest unit's disk time (the first read, the last write). On a
    CPU device the I/O threads' copies and checksums share the cores: they add (as measured)."""
    if not cuda:
        return state_disk + cpu_s
    big = max((u.numel for u in units), default=0) / max(params, 1)
    return max(state_disk, cpu_s) + state_disk * big


def chain_rate(rates, codec: str, threads: int, cuda: bool) -> float:
    """Parameters/s of a step's compressed updates at the measured ``update_chain`` (0: none
    measured): per thread of its measurement (``MachineRates.chain_threads``) times the threads a
    fused chunk runs on -- the update's team, the two codec threads joining it (at least 3) --
    on the cores it gets. A CPU device's prediction takes its own measurement (the engine's split
    beside a compute thread, as a step runs it) scaled by the threads over that split's."""
    measured = (getattr(rates, "update_chain", None) or {}).get(codec)
    if not measured:
        return 0.0
    team = max(int(threads), 3)
    if not cuda:   # this machine's own measurement, beside a compute thread as a step runs it
        free = max(int(rates.cores or 1) - 1, 1)
        return measured * min(team, free) / min(3, free)
    return measured / rates.chain_threads() * min(team, max(int(rates.cores or 1), 1))


def forward_behind_updates(units, chain_s: float, compute_s: float, head_share: float,
                           load_per_param: float = 0.0) -> float:
    """A clipped step's forward window: the updates wait for the global norm, then run one unit
    after another in the forward's order (``chain_s`` in all, each unit its share by size), and
    the forward waits for each unit's: the embedding's before the first layer, each layer's before
    that layer computes, the head's before its compute (``head_share`` of ``compute_s``) after the
    last layer (``StepRunner.head_late``: the head is bound after the layers). A unit's load starts
    only once its update has written its weights: ``load_per_param`` seconds a parameter (the copy
    into its slot; on the disk tier first the copy out of the host cache, or the read) after each
    update."""
    total = sum(u.numel for u in units) or 1
    per = [chain_s * u.numel / total for u in units]
    load = [load_per_param * u.numel for u in units]
    c_layer = compute_s * (1.0 - head_share) / max(len(units) - 2, 1)
    done = per[0]
    t = done + load[0]
    for u, lu in zip(per[1:-1], load[1:-1]):
        done += u
        t = max(t, done + lu) + c_layer
    return max(t, done + per[-1] + load[-1]) + compute_s * head_share


def _h2d_rate(rates, cuda: bool) -> float:
    """Bytes/s of a unit's load into its slot: pinned on CUDA where measured, a CPU device's memcpy."""
    return (rates.h2d_pinned or rates.h2d_pageable) if cuda else rates.h2d_pageable


def _load_per_param(a: dict, rates, cuda: bool) -> float:
    """Seconds a parameter of a unit's load takes once its update is done: the copy into its slot
    (compute dtype, at the host->device rate), and with the master weights on the disk tier
    before it the fp32 weights out of the host cache (a host memcpy; a CPU device's copy rate, a
    GPU machine's pageable one) where the cache keeps them, else read from the disk."""
    h2d = _h2d_rate(rates, cuda)
    t = a["compute_bytes"] / h2d if h2d else 0.0
    if a.get("cast_load_params") and rates.adamw_per_thread:   # the transport's cast before the copy
        t += 1.0 / (rates.adamw_per_thread * CAST_VS_ADAMW)
    if a["disk"]["weights_on_disk"]:
        miss = a["disk"]["read_miss"]
        copy, read = rates.h2d_pageable, rates.disk_read
        t += 4.0 * ((1.0 - miss) / copy if copy else 0.0) + 4.0 * (miss / read if read else 0.0)
    return t


def _bottleneck(windows: Dict[str, float], parts, clipped: bool, exposed: Dict[str, float], update_key: str) -> str:
    """The stream a step waits for most, as a training step's telemetry shows it: each window's
    time beyond its compute belongs to the stream that bounds it (a clipped forward's to the
    updates it waits for); an unclipped step's exposed update to the streams it is made of
    (``exposed``: its disk reads and writes to the disk, the rest to the optimizer). When the
    waits are under a tenth of the step, the stream that bounds the most of it (the compute,
    typically)."""
    step = sum(windows.values())
    waits: Dict[str, float] = {}
    for i, (t, streams, key) in enumerate(parts):
        wait = t - streams["compute"]
        if clipped and i == 0 and t > max(streams.values()) * (1 + 1e-9):
            key = update_key   # (longer than any stream, the cores' sharing too: waiting for the updates in turn)
        if wait > 0 and key != "compute":
            waits[key] = waits.get(key, 0.0) + wait
    for key, wait in exposed.items():
        if wait > 0:
            waits[key] = waits.get(key, 0.0) + wait
    if waits and sum(waits.values()) > 0.1 * step:
        return max(waits, key=waits.get)
    binding: Dict[str, float] = {}
    for t, _, key in parts:
        binding[key] = binding.get(key, 0.0) + t
    return max(binding, key=binding.get)


def resolve_rates(rates):
    """A MachineRates from itself, a dict of its fields, or a profile's name (``rates.rates_for``,
    its per-thread CPU rates, which nobody publishes, from this machine's cached measurement)."""
    if isinstance(rates, dict):
        bad = rates_mod.check_rates(rates)
        if bad:
            raise ValueError("rates: values that are not plausible rates: " + "; ".join(bad))
        return rates_mod.MachineRates.from_dict(rates)
    if isinstance(rates, str):
        return rates_mod.rates_for(rates, cpu=cached_rates("cpu"))
    return rates_mod.rates_for(rates)
