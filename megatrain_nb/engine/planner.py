"""MemoryPlanner: budgets + model + batch shape -> placement and schedule, or a clear refusal.

One place knows the byte arithmetic of the tiers; the engine uses it to size device slots and
refuse impossible budgets, and the estimator (``mt.estimate``) prints the same numbers.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

GiB = 1024 ** 3


@dataclass
class UnitSpec:
    name: str
    numel: int
    kind: str  # "embed" | "layer" | "head"


def unit_specs_from_config(config) -> List[UnitSpec]:
    """Unit sizes of a transformers config, built on the meta device (no memory, no download)."""
    import torch
    from transformers import AutoModelForCausalLM

    from .units import build_units, find_layer_list

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    _, _, layers = find_layer_list(model)
    return [UnitSpec(u.name, u.numel, u.kind) for u in build_units(model, layers)]


def codec_bytes_per_param(compression: str) -> float:
    """Stored bytes per parameter for both Adam moments together."""
    from .codecs import ROLES, get_codec

    n = 1 << 20
    return sum(get_codec(compression, role).encoded_nbytes(n) for role in ROLES) / n


@dataclass
class Plan:
    device: Dict[str, int]
    host: Dict[str, int]
    disk: Dict[str, int]
    placement: Dict[str, str]
    layer_slots: int
    checkpoint_interval: int
    feasible: bool
    limiting_tier: Optional[str]
    reason: str
    capacity: Dict[str, Optional[int]] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def activation_bytes(*, hidden_size: int, intermediate_size: int, num_layers: int, vocab_size: int,
                     batch: int, seq: int, checkpoint_interval: int, compute_bytes: int,
                     loss_chunk_tokens: int = 1024, num_heads: int = 0, eager_attention: bool = False) -> int:
    """Device bytes for activations of one micro-batch (an estimate; the engine also measures)."""
    tok = batch * seq
    # One layer re-run under autograd: its saved activations and their gradients.
    layer_work = tok * (12 * hidden_size + 4 * intermediate_size) * compute_bytes
    if eager_attention and num_heads:
        layer_work += 2 * batch * num_heads * seq * seq * compute_bytes
    if checkpoint_interval == 0:  # every layer's autograd graph kept for the step
        saved_inputs, block_inputs = num_layers * layer_work // 2, 0
    else:
        k = max(1, checkpoint_interval)
        saved_inputs = math.ceil(num_layers / k) * tok * hidden_size * compute_bytes
        block_inputs = (k - 1) * tok * hidden_size * compute_bytes
    chunk = min(loss_chunk_tokens, seq)
    head_work = 3 * batch * chunk * vocab_size * 4 + 2 * tok * hidden_size * 4
    return saved_inputs + block_inputs + max(layer_work, head_work)


def make_plan(units: List[UnitSpec], *, hidden_size: int, num_layers: int, intermediate_size: Optional[int] = None,
              vocab_size: int = 0, vram_bytes: Optional[int] = None, host_bytes: Optional[int] = None,
              disk_bytes: Optional[int] = None, batch: int = 1, seq: int = 2048, compression: str = "none",
              precision: str = "fp32", checkpoint_interval: Optional[int] = 1, offload_dir: bool = True,
              layer_slots: Optional[int] = None, offload_params: Optional[bool] = None,
              cuda: bool = True, loss_chunk_tokens: int = 1024) -> Plan:
    """Place a model's training state on (device, host, disk) under the given budgets."""
    cb = 2 if precision == "bf16" else 4
    inter = intermediate_size or 4 * hidden_size
    by_kind = {k: max([u.numel for u in units if u.kind == k] or [0]) for k in ("embed", "layer", "head")}
    total = sum(u.numel for u in units)
    max_unit = max(u.numel for u in units)

    def device_need(slots: int, k: int) -> Dict[str, int]:
        w = (by_kind["embed"] + by_kind["head"] + slots * by_kind["layer"]) * cb
        grads = (2 * max_unit * 4) if cuda else max_unit * 4
        act = activation_bytes(hidden_size=hidden_size, intermediate_size=inter, num_layers=num_layers,
                               vocab_size=vocab_size, batch=batch, seq=seq, checkpoint_interval=k,
                               compute_bytes=cb, loss_chunk_tokens=loss_chunk_tokens)
        return {"weights": w, "grads": grads, "activations": act, "total": w + grads + act}

    # Schedule: the checkpoint interval and the number of layer slots.
    if checkpoint_interval == 0:  # no recompute: every layer resident for the step
        layer_slots = max(num_layers, 1)
    candidates = [checkpoint_interval] if checkpoint_interval is not None else sorted(
        {1, 2, 3, 4, max(1, int(math.sqrt(num_layers))), max(1, num_layers)})
    chosen_k, dev = None, None
    for k in candidates:
        need = device_need(layer_slots or 2, k)
        if vram_bytes is None or need["total"] <= vram_bytes:
            chosen_k, dev = k, need
            break
    feasible, limiting, reason = True, None, "fits"
    if chosen_k is None:
        chosen_k = candidates[0]
        dev = device_need(layer_slots or 2, chosen_k)
        minimal = device_need(2, max(candidates))
        feasible, limiting = False, "device"
        reason = (f"the device working set needs {dev['total'] / GiB:.2f} GiB (weights slots "
                  f"{dev['weights'] / GiB:.2f} GiB, gradient buffers {dev['grads'] / GiB:.2f} GiB, activations "
                  f"{dev['activations'] / GiB:.2f} GiB) but max_vram_gb allows {vram_bytes / GiB:.2f} GiB; the "
                  f"smallest plan (2 layer slots, checkpoint interval {max(candidates)}) needs "
                  f"{minimal['total'] / GiB:.2f} GiB: raise max_vram_gb or shorten the batch/sequence")
    slots = layer_slots or 2
    if layer_slots is None and vram_bytes is not None and feasible:
        while slots < 4 and dev["total"] + by_kind["layer"] * cb <= vram_bytes:
            slots += 1
            dev = device_need(slots, chosen_k)

    # Host and disk: gradients always on the host; optimizer states to disk when a disk tier
    # exists; master weights to disk when the host budget cannot hold them (or when forced).
    states = int(total * codec_bytes_per_param(compression))
    weights, grads = total * 4, total * 4
    staging = 4 * max_unit * 4  # paged units in flight through host memory
    placement = {"gradients": "host", "master_weights": "host",
                 "optimizer_states": "disk" if offload_dir else "host"}
    if offload_params or (offload_params is None and offload_dir and host_bytes is not None
                          and weights + grads + (0 if offload_dir else states) > host_bytes):
        placement["master_weights"] = "disk" if offload_dir else "host"
    host = {"weights": weights if placement["master_weights"] == "host" else staging,
            "grads": grads,
            "optimizer_states": states if placement["optimizer_states"] == "host" else staging // 2}
    host["total"] = sum(host.values())
    disk = {"weights": weights if placement["master_weights"] == "disk" else 0,
            "optimizer_states": states if placement["optimizer_states"] == "disk" else 0}
    disk["total"] = sum(disk.values())
    if feasible and host_bytes is not None and host["total"] > host_bytes:
        feasible, limiting = False, "host"
        reason = (f"host RAM needs {host['total'] / GiB:.2f} GiB (master weights {host['weights'] / GiB:.2f}, "
                  f"gradients {host['grads'] / GiB:.2f}, optimizer states {host['optimizer_states'] / GiB:.2f}) "
                  f"but {host_bytes / GiB:.2f} GiB are available: "
                  + ("give an offload_dir for the disk tier" if not offload_dir
                     else "use optimizer_compression or more RAM"))
    if feasible and disk_bytes is not None and disk["total"] > disk_bytes:
        feasible, limiting = False, "disk"
        reason = (f"the disk tier needs {disk['total'] / GiB:.2f} GiB but {disk_bytes / GiB:.2f} GiB are free: "
                  "free space, use a larger disk, or compress the optimizer states")
    return Plan(device=dev, host=host, disk=disk, placement=placement, layer_slots=slots,
                checkpoint_interval=chosen_k, feasible=feasible, limiting_tier=limiting, reason=reason,
                capacity={"device": vram_bytes, "host": host_bytes, "disk": disk_bytes})


def engine_plan(units, model_config, cfg, *, cuda: bool) -> Plan:
    """The engine's plan for its units under an EngineConfig ``cfg``, or a ValueError naming
    the budget to change."""
    from .family import hidden_size, intermediate_size

    specs = [UnitSpec(u.name, u.numel, u.kind) for u in units]
    plan = make_plan(specs, hidden_size=hidden_size(model_config), num_layers=len(units) - 2,
                     intermediate_size=intermediate_size(model_config), vocab_size=0,
                     vram_bytes=int(cfg.max_vram_gb * GiB) if cfg.max_vram_gb else None,
                     host_bytes=int(cfg.max_host_gb * GiB) if cfg.max_host_gb else None,
                     offload_params=cfg.offload_params, batch=1, seq=1, compression=cfg.optimizer_compression,
                     precision=cfg.precision, checkpoint_interval=cfg.checkpoint_interval,
                     offload_dir=bool(cfg.offload_dir), layer_slots=cfg.device_slots, cuda=cuda,
                     loss_chunk_tokens=cfg.loss_chunk_tokens)
    if not plan.feasible and plan.limiting_tier == "host":
        raise ValueError(f"max_host_gb={cfg.max_host_gb}: {plan.reason}.")
    if cfg.offload_params and not cfg.offload_dir:
        raise ValueError("offload_params=True needs an offload_dir for the disk tier.")
    if not plan.feasible:
        biggest = max(units, key=lambda u: u.numel)
        raise ValueError(
            f"max_vram_gb={cfg.max_vram_gb} is below what one training step needs: "
            f"{plan.reason}. The largest unit ({biggest.name}) alone holds "
            f"{biggest.numel * (2 if cfg.precision == 'bf16' else 4) / GiB:.3f} GiB; "
            f"set max_vram_gb to at least {plan.device['total'] / GiB:.3f}.")
    return plan
