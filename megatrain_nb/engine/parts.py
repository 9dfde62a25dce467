"""build_parts: the one factory of a StreamingEngine's parts, each built complete (nothing is
set on a part after its construction), in dependency order:

units -> (sharded) -> codec ("auto": codec_choice.engine_codec) -> plan (plan_pick: predicted or the rules') -> host store, disk tier (+ host cache) -> weights,
optimizer states -> parameters taken from the model -> AdamW -> transport -> update scheduler (its own
parts likewise: updates.py) -> pager -> boundary store -> step runner (+ the layer proxies) -> steps.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
from torch import nn

from .tiers import io as engine_io
from .config import EngineConfig
from .tiers.host_store import HostStore
from .tiers.materialize import take_parameters
from .updates.optimizer import UnitAdamW
from .transport.pager import Pager
from .planning.codec_choice import CodecPick, engine_codec
from .planning.plan_pick import pick_plan
from .planning.planner import ModelShape, Plan, UnitSpec, Workload, make_plan
from .planning.vision_plan import VisionShape, graphs_kept, vision_placement
from .memory import device_capacity
from .proxies import LayerProxy
from .seams import DiskTier, Transport
from .ranks.sharded import ShardedUnits
from .updates.states import OptimizerStates, open_disk_tier, read_ahead_allowance, stored_state_bytes, update_chunk
from .step import StepRunner, Steps
from .transport.transport import make_transport
from .units import Unit, build_units, find_layer_list, lr_scales
from .vision import freeze, tower_blocks
from .compute.vision_stream import PLACEMENT_ENV, TowerStream, forced_placement
from .discovery import locate
from .updates.updates import UpdateScheduler
from .tiers.staging import disk_staging_buffers
from .tiers.weight_store import WeightStore, make_weight_store
from .window import BoundaryStore
from .tiers.disk_cache import HostCache, cache_budget


@dataclass
class EngineParts:
    units: List[Unit]
    layer_units: List[Unit]
    sharded: Optional[ShardedUnits]
    state_units: List[Unit]          # whole units, or this rank's shards
    persistent_buffers: dict
    plan: Plan
    store: HostStore
    disk: Optional[DiskTier]         # HostCache around the DiskStore, or None
    weights: WeightStore             # RamWeights or DiskWeights
    states: OptimizerStates
    adam: UnitAdamW
    updates: UpdateScheduler         # (its step protocol: seams.StepUpdates)
    transport: Transport             # Cuda | Cpu | Sharded
    pager: Pager
    runner: StepRunner
    boundary: BoundaryStore
    steps: Steps
    workload: Optional[Workload] = None   # what the plan's pick priced (None: the planner's default)
    config: Optional[EngineConfig] = None   # what the parts were built from (a codec named, never "auto")
    codec: Optional[CodecPick] = None       # the codec asked for, built with, and why


class HoldsParts:
    """The engine's parts, held in one :class:`EngineParts` (``self.parts``) and, each, as an
    attribute of its own (``engine.pager``, ``engine.updates``...), named and typed here."""

    parts: EngineParts
    units: List[Unit]
    layer_units: List[Unit]
    sharded: Optional[ShardedUnits]
    state_units: List[Unit]
    persistent_buffers: dict
    plan: Plan
    store: HostStore
    disk: Optional[DiskTier]
    weights: WeightStore
    states: OptimizerStates
    adam: UnitAdamW
    updates: UpdateScheduler
    transport: Transport
    pager: Pager
    runner: StepRunner
    boundary: BoundaryStore
    steps: Steps
    workload: Optional[Workload]
    config: EngineConfig
    codec: Optional[CodecPick]

    def hold(self, parts: EngineParts) -> None:
        """Take ``parts`` (built once, by :func:`build_parts`)."""
        self.parts = parts
        self.units, self.layer_units, self.sharded = parts.units, parts.layer_units, parts.sharded
        self.state_units, self.persistent_buffers, self.plan = parts.state_units, parts.persistent_buffers, parts.plan
        self.store, self.disk, self.weights, self.states = parts.store, parts.disk, parts.weights, parts.states
        self.adam, self.updates, self.transport, self.pager = parts.adam, parts.updates, parts.transport, parts.pager
        self.runner, self.boundary, self.steps = parts.runner, parts.boundary, parts.steps
        self.workload = parts.workload
        # optimizer_compression="auto": the engine's config names the codec picked (what its states,
        # checkpoints and a resume use); engine.codec says it was asked as "auto", and why this one
        self.config, self.codec = parts.config or self.config, parts.codec



def build_parts(model: nn.Module, config: EngineConfig, *, dist, device: torch.device, counters,
                source=None, workload: Optional[Workload] = None, saved_codec: Optional[str] = None) -> EngineParts:
    """Every part of the engine for ``model`` (its parameters move into the stores, its layers are
    replaced by proxies). ``workload``: what steps train on, for the plan's pick (None: the default);
    ``saved_codec``: a checkpoint's codec, which optimizer_compression="auto" keeps (a resume)."""
    freeze(model, config.frozen)   # EngineConfig.frozen: requires_grad off before the units are laid out
    _, _, layers = find_layer_list(model)
    units = build_units(model, layers, split_frozen=dist.world == 1, lr_scale=lr_scales(model, config, dist.world))
    sharded = None
    if dist.world > 1:
        dist.check_same("model", (type(model).__name__, [(u.name, u.numel) for u in units]))
        dist.check_same("optimizer settings", (config.optimizer_compression, config.adam_betas,
                                               config.adam_eps, config.weight_decay, config.precision))
        sharded = ShardedUnits(units, dist, gather_dist=dist.channel("gather"), reduce_dist=dist.channel("reduce"))
    state_units = sharded.shards if sharded is not None else units
    persistent = engine_io.persistent_buffers(model)
    config, codec, plan = _codec_and_plan(units, model.config, config, device, dist, state_units, workload, saved_codec)
    params_on_disk = plan.placement["master_weights"] == "disk"
    pin = device.type == "cuda"
    store = HostStore(state_units, pin=pin, compute_dtype=config.compute_dtype,   # (shards' gathers take fp32)
                      shadows=False if sharded is not None else None)
    disk = _disk_tier(units, config, plan, params_on_disk, counters, state_units)
    depth = config.overrides.inflight_depth
    compute_buffers, optimizer_buffers = disk_staging_buffers(max(u.numel for u in units), depth)
    chunked = update_chunk(config.optimizer_compression, config.overrides.update_chunk_numel,
                           max(u.train_numel for u in state_units)) > 0   # (as OptimizerStates decides)
    weights = make_weight_store(state_units, store, disk=disk if params_on_disk else None, pin=pin, counters=counters,
                                compute_buffers=compute_buffers, optimizer_buffers=optimizer_buffers,
                                ranged=chunked, held_units=held_weight_units(state_units, config, plan, disk))
    # (under a budget -- a promise -- the states read ahead no deeper than the plan (and the cache) counted)
    read_ahead = read_ahead_allowance(state_units, config.optimizer_compression) if config.max_host_gb else None
    states = OptimizerStates(state_units, config, counters, disk=disk, chunk_numel=config.overrides.update_chunk_numel,
                             read_ahead_bytes=read_ahead)
    alloc, put = store.alloc, weights.put_initial
    if sharded is not None:   # each rank keeps its slice of every unit as it is built
        alloc = lambda n: torch.empty(n, dtype=torch.float32)  # noqa: E731 - one unit at a time

        def put(unit, full):
            sh = sharded.shard(unit)
            own = store.alloc(sh.numel)
            own.copy_(full[sh.start:sh.start + sh.numel])
            weights.put_initial(sh, own)
    placeholders = take_parameters(model, units, alloc, put, source)
    weights.finish_initial()
    _move_buffers(model, units[1:-1], device)
    model.config.use_cache = False
    adam = UnitAdamW.for_config(config, cuda=device.type == "cuda")
    # (on CPU, MEGATRAIN_ADVERSARIAL_TRANSPORT=1 makes it the tests' adversarial one)
    transport = make_transport(device, sharded=sharded)
    updates = UpdateScheduler(state_units, grads=store, weights=weights, states=states, adam=adam, counters=counters,
                              disk=disk, depth=depth, sharded=sharded, policy=config.on_nonfinite,
                              staged=transport.stages)
    side = _host_side(updates, weights, store, sharded, device)
    vision = _vision(units, model.config, config, plan, workload, device, sharded is None and not params_on_disk)
    tower, device_units = _tower_stream(model, units, vision, side, placeholders=placeholders, transport=transport,
                                        device=device, dtype=config.compute_dtype, telemetry=counters, depth=depth)
    pager = Pager(device_units, device=device, dtype=config.compute_dtype, layer_slots=plan.layer_slots,
                  source=side["source"], source_done=side["source_done"], transport=transport, telemetry=counters,
                  grad_sink=side["grad_sink"], max_grads_in_flight=depth,
                  votes=updates.votes if sharded is not None else None)
    boundary = BoundaryStore(device, transport, disk=disk)
    runner = StepRunner(model, device_units, pager, placeholders, boundary, device=device,
                        checkpoint_interval=plan.checkpoint_interval,
                        loss_chunk_tokens=config.overrides.loss_chunk_tokens, plan_reads=side["plan_reads"],
                        grad_buffer=side["lend"], tile_tokens=config.overrides.tile_tokens, reached=side["reached"],
                        device_budget=int(config.max_vram_gb * 2**30) if config.max_vram_gb else None,
                        vision=vision[:2] + (tower,))
    for u in units[1:-1]:
        layers[u.layer_index] = LayerProxy(runner.layer_call, u)
    steps = Steps(runner, boundary, updates=updates, pager=pager, counters=counters, config=config,
                  layer_names=[u.name for u in units[1:-1]], clip_hold_disk=plan.placement["gradients"] == "disk")
    return EngineParts(units=units, layer_units=units[1:-1], sharded=sharded, state_units=state_units,
                       persistent_buffers=persistent, plan=plan, store=store, disk=disk, weights=weights,
                       states=states, adam=adam, updates=updates, transport=transport, pager=pager, runner=runner,
                       boundary=boundary, steps=steps, workload=workload, config=config, codec=codec)


def _host_side(updates, weights, store, sharded, device) -> dict:
    """What the pager and the step runner are handed of the host side: the weights' source and its
    done, the gradients' sink, the disk read-ahead, the reached parameters, the lent sum buffers.
    Data parallel, the pager sees whole units and the stores hold shards."""
    side = dict(source=updates.ready_weights, source_done=weights.transfer_done, plan_reads=updates.plan_reads,
                grad_sink=updates.gradient_arrived, reached=None if sharded else store.mark_reached,
                # (a CPU "device" sums each unit's gradient in a pool buffer the update adopts)
                lend=updates.lend_buffer if device.type == "cpu" and sharded is None else None)
    if sharded is not None:
        shard = sharded.shard
        side.update(source=lambda u: updates.ready_weights(shard(u)),
                    source_done=lambda u, t: weights.transfer_done(shard(u), t),
                    plan_reads=lambda order, step: updates.plan_reads([shard(u) for u in order], step),
                    grad_sink=lambda u, g: updates.gradient_arrived(shard(u), g))
    return side


def _codec_and_plan(units, model_config, config: EngineConfig, device, dist, state_units, workload, saved_codec):
    """(the config the parts are built from, the codec's :class:`CodecPick`, the plan): the codec
    first (optimizer_compression="auto": codec_choice.engine_codec), then the plan for it."""
    config, codec = engine_codec(units, model_config, config, device=device, state_units=state_units,
                                 workload=workload, saved=saved_codec)
    plan = pick_plan(units, model_config, config, device=device, dist=dist, state_units=state_units,
                     workload=workload)
    if dist.world > 1:   # ("auto" picks on every rank: the same budgets pick the same codec)
        dist.check_same("optimizer codec", config.optimizer_compression)
    if codec.asked == "auto":   # (the run header prints chosen_by)
        plan.chosen_by = f"{plan.chosen_by}; {codec.line()}"
    return config, codec, plan


def _vision(units, model_config, config: EngineConfig, plan: Plan, workload, device, streams: bool = True):
    """(how many micro-batches' vision graphs a group keeps, whether the tower runs by blocks,
    whether its weights stream by blocks): the tower's placement planned at the run's workload
    (vision_plan.vision_placement: the plan's device bytes for it, the budget max_vram_gb, else on
    CUDA the device's capacity; none on a CPU "device"), or the one MEGATRAIN_NB_VISION_PLACEMENT
    forces (compute/vision_stream.forced_placement), said in plan.chosen_by (the run header's plan
    line). ``streams``: whether the engine can stream the tower (one rank, the master weights in RAM:
    each block's load gathers it from the embed unit's), else by blocks."""
    work, cuda = workload or Workload(), torch.device(device).type == "cuda"
    budget = int(config.max_vram_gb * 2 ** 30) if config.max_vram_gb else None
    if budget is None and cuda:
        budget = device_capacity(torch.device(device))
    specs = [UnitSpec(u.name, u.numel, u.kind, u.tied_output) for u in units]
    total = make_plan(specs, ModelShape.of(model_config), config.replace(checkpoint_interval=plan.checkpoint_interval),
                      cuda=cuda, workload=work).device["total"] if work.image_tokens else plan.device["total"]
    placed = vision_placement(model_config, specs, work, device_total=total, device_budget=budget,
                              precision=config.precision, cuda=cuda)
    runs = placed.runs if placed is not None else None
    forced = forced_placement() if VisionShape.of(model_config) is not None else None
    if forced is not None:
        runs = forced
        plan.chosen_by = f"{plan.chosen_by}; vision tower: {forced} (forced by {PLACEMENT_ENV})"
    elif placed is not None:
        plan.chosen_by = f"{plan.chosen_by}; {placed.words()}"
    if runs == "streamed" and not streams:
        runs = "blocks"
        plan.chosen_by += " (streamed needs one rank and the master weights in RAM: by blocks)"
    by_blocks = runs in ("blocks", "streamed")
    return graphs_kept(model_config, work, device_total=total, device_budget=budget, precision=config.precision,
                       by_blocks=by_blocks), by_blocks, runs == "streamed"


def _tower_stream(model: nn.Module, units, vision, side: dict, **wiring):
    """(the streamed vision tower's blocks: compute/vision_stream.TowerStream, the units the device
    sees) where the placement is "streamed" (``vision[2]``): the device sees the embed unit without
    the tower's blocks (the tower's trunk), and ``side`` (:func:`_host_side`) is rewired through the
    tower, which hands the host side the embed unit; else (None, ``units``)."""
    blocks = tower_blocks(locate(model)[1]) if vision[2] else []
    if not blocks or {id(b) for b in blocks} & {id(u.module) for u in units[1:-1]}:   # (the layers found: the tower's)
        return None, units
    names = {id(m): n for n, m in model.named_modules()}
    tower = TowerStream(units[0], blocks, [names.get(id(b), f"vision.{i}") for i, b in enumerate(blocks)],
                        first_index=len(units), source=side["source"], source_done=side["source_done"],
                        grad_sink=side["grad_sink"], reached=side["reached"], **wiring)
    side.update(source=tower.source, source_done=tower.source_done, grad_sink=tower.grad_sink, reached=tower.reached,
                plan_reads=tower.plan_reads(side["plan_reads"]), lend=None)   # (a lent buffer is adopted whole)
    return tower, [tower.trunk] + units[1:]


def _disk_tier(units, config: EngineConfig, plan: Plan, params_on_disk: bool, counters, state_units=None):
    """The disk tier (with host RAM as a schedule-driven cache of it), or None. Under a host
    budget the cache gets what the plan leaves, less the compressed states' reads ahead that a
    cache brings (the plan counts them read range by range: states.read_ahead_allowance)."""
    store = open_disk_tier(units, config, params_on_disk)
    if store is None:
        return None

    need = stored_state_bytes(units, config.optimizer_compression)
    need += sum(u.numel for u in units) * 4 if params_on_disk else 0
    extra = 0
    if config.max_host_gb and config.optimizer_compression != "none":
        extra = read_ahead_allowance(state_units or units, config.optimizer_compression)
    budget = cache_budget(config.host_cache_gb, config.max_host_gb, plan.host["total"] + extra, need)
    return HostCache(store, budget, counters=counters)


def held_weight_units(units, config: EngineConfig, plan: Plan, disk) -> int:
    """Master weights on the disk tier with no host cache of it: how many more units' backward
    reads a clipped step may hold for their updates (``weight_store.DiskWeights``): the
    override, else as many of the units as the room the host budget leaves would hold (the
    room a cache would have had: ``max_host_gb`` less the plan's host needs, else the available
    RAM less the safety margin, ``disk_cache.cache_budget``)."""
    if disk is None or getattr(disk, "capacity", 0) > 0 or plan.placement["master_weights"] != "disk":
        return 0
    if config.overrides.held_weight_units is not None:
        return min(config.overrides.held_weight_units, len(units))
    unit_bytes = max(u.numel for u in units) * 4
    room = cache_budget(None, config.max_host_gb, plan.host["total"], len(units) * unit_bytes)
    return min(len(units), room // max(unit_bytes, 1))


def _move_buffers(model: nn.Module, layer_units: List[Unit], device: torch.device) -> None:
    for mod in list(model.modules()) + [u.module for u in layer_units]:
        for name, b in list(mod._buffers.items()):
            if b is not None and b.device != device:
                mod._buffers[name] = b.to(device)
