"""The estimator for a run over several nodes and GPUs (``megatrain-nb estimate ... --nodes M
--gpus-per-node N``): the training state sharded over the M·N ranks (ZeRO-3, see
``docs/ARCHITECTURE-NOTES.md``), so each node's RAM and disk hold 1/M of it across its N ranks'
shards, while each GPU's working set is the one-process one (whole units are gathered onto it).

Example::

    from megatrain_nb.engine.planning.estimator_dist import estimate_scale_out
    print(estimate_scale_out("llama-70b", nodes=2, gpus_per_node=8, vram_gb=80, ram_gb=512, disk_gb=4096))

Budgets: ``vram_gb`` per GPU, ``ram_gb`` and ``disk_gb`` per node (``"auto"``: this machine's, as
a node); a rank gets 1/N of its node's. The per-GPU table is :func:`megatrain_nb.engine.planning.estimator.estimate`
with ``world=M·N`` and those per-rank budgets, so it is the planner's own arithmetic (host and
disk figures of rank 0, which holds the largest shards). One node with one GPU is the plain
estimate.
"""
from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Optional

from megatrain_nb.engine.planning.planner import loads_per_layer, unit_specs_from_config
from megatrain_nb.values import check
from megatrain_nb.engine.planning.estimator import (GiB, Budget, resolve_budget, format_bytes, free_disk, machine_ram, estimate,
                                    resolve_config)


def wire_bytes_per_rank(units, world: int, plan, *, accumulation: int = 1, layer_major: bool = True,
                        precision: str = "fp32") -> dict:
    """Bytes one rank sends per optimizer step at the floor for sharded data parallelism (what
    ``Dist.traffic.minimum`` counts): (N-1)/N of each unit's weights per gather (in the compute
    precision; forward, and the layers again for the recompute) and of its fp32 gradient per
    reduce-scatter. Micro-batch-major: per micro-batch; a layer-major window: per group (each
    unit crosses once per pass, its gradient summed on the device first). ``units``: the whole
    model's UnitSpecs; ``plan``: the estimate's (per-rank) plan; ``accumulation``: per rank."""

    if world <= 1:
        return {"gather": 0, "reduce_scatter": 0, "total": 0}
    cb = 2 if precision == "bf16" else 4
    f = (world - 1) / world
    layers = [u for u in units if u.kind == "layer"]
    layer_numel = sum(u.numel for u in layers)
    other = sum(u.numel for u in units) - layer_numel
    window = plan.window if (layer_major and accumulation > 1) else None
    if window:   # one pass per group: embed and head once, the layers loads_per_layer times in all
        passes = window["groups"]
        gathered = other * passes + layer_numel * window["loads_per_layer"]
    else:        # every micro-batch is a pass of its own
        passes = accumulation
        gathered = passes * (other + layer_numel * loads_per_layer(len(layers), plan.checkpoint_interval))
    total = sum(u.numel for u in units)
    out = {"gather": int(f * gathered * cb), "reduce_scatter": int(f * total * passes * 4)}
    out["total"] = out["gather"] + out["reduce_scatter"]
    return out


@dataclass
class ScaleOutEstimate:
    """:func:`estimate_scale_out`'s result: ``per_rank`` (an :class:`~megatrain_nb.engine.planning.estimator.Estimate`
    for one GPU's rank), per-node and whole-run bytes, and the bytes on the wire per rank per step."""

    per_rank: object
    nodes: int
    gpus_per_node: int
    node_budgets: dict          # {"host": bytes | None, "disk": bytes | None} per node
    wire: dict                  # wire_bytes_per_rank(...)
    accumulation: int = 1

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def feasible(self) -> bool:
        return self.per_rank.feasible

    @property
    def limiting_tier(self) -> Optional[str]:
        return self.per_rank.limiting_tier

    def per_node(self) -> dict:
        """RAM and disk one node needs: its N ranks' host and disk tiers."""
        t = self.per_rank.tiers()
        return {"host": t["host"]["total"] * self.gpus_per_node, "disk": t["disk"]["total"] * self.gpus_per_node}

    def whole_run(self) -> dict:
        n = self.per_node()
        return {k: v * self.nodes for k, v in n.items()}

    def to_dict(self) -> dict:
        return {"nodes": self.nodes, "gpus_per_node": self.gpus_per_node, "world": self.world,
                "per_gpu": self.per_rank.to_dict(), "per_node": self.per_node(), "node_budgets": self.node_budgets,
                "whole_run": self.whole_run(), "wire_bytes_per_rank_per_step": self.wire,
                "feasible": self.feasible, "limiting_tier": self.limiting_tier}

    def _lines(self) -> list:
        r, n, w = self.per_rank, self.per_node(), self.whole_run()
        tokens = r.batch * r.seq * self.accumulation * self.world
        nb = self.node_budgets
        return [
            f"scale-out: {self.nodes} node(s) x {self.gpus_per_node} GPU(s) = {self.world} ranks, state sharded "
            f"(ZeRO-3): each rank holds 1/{self.world} of every unit's master weights, gradients and optimizer "
            f"states; global batch {r.batch} x {r.seq} x accumulation {self.accumulation} x {self.world} ranks = "
            f"{tokens:,} tokens per step",
            f"per node ({self.gpus_per_node} ranks): RAM {format_bytes(n['host'])} of {format_bytes(nb.get('host'))}, disk "
            f"{format_bytes(n['disk'])} of {format_bytes(nb.get('disk'))}",
            f"whole run ({self.nodes} node(s)): RAM {format_bytes(w['host'])}, disk {format_bytes(w['disk'])}",
            f"on the wire per rank per step: {format_bytes(self.wire['total'])} sent (ZeRO-3 floor: weights gathered "
            f"{format_bytes(self.wire['gather'])}, gradients reduce-scattered {format_bytes(self.wire['reduce_scatter'])}; "
            f"{self.world - 1}/{self.world} of each)",
            f"per GPU (one rank; budgets: the GPU's device, 1/{self.gpus_per_node} of its node's RAM and disk):",
        ]

    def __str__(self) -> str:
        if self.world == 1:
            return str(self.per_rank)
        return "\n".join(self._lines() + [str(self.per_rank)])

    def _repr_html_(self) -> str:
        if self.world == 1:
            return self.per_rank._repr_html_()
        lines = "".join(f"<p>{html.escape(x)}</p>" for x in self._lines())
        return f"<div>{lines}{self.per_rank._repr_html_()}</div>"


def estimate_scale_out(model, *, nodes: int = 1, gpus_per_node: int = 1, vram_gb: Budget = 80,
                       ram_gb: Budget = "auto", disk_gb: Budget = "auto", offload_dir=True,
                       accumulation: int = 1, layer_major: bool = True, precision: str = "fp32",
                       **options) -> ScaleOutEstimate:
    """The estimate of a run on ``nodes`` x ``gpus_per_node`` GPUs with the state sharded over all
    of them. ``ram_gb`` / ``disk_gb``: per node (GiB, ``"auto"`` = this machine's, ``None`` = no
    limit); ``vram_gb``: per GPU; ``accumulation``: micro-batches per rank per optimizer step.
    Other keywords as :func:`~megatrain_nb.engine.planning.estimator.estimate`."""

    for name, v in (("nodes", nodes), ("gpus_per_node", gpus_per_node)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise ValueError(f"{name}={v!r} must be a whole number >= 1")
        check(f"estimate_{name}", v, name)
    world = nodes * gpus_per_node
    disk_path = offload_dir if isinstance(offload_dir, str) else None
    node = {"host": resolve_budget(ram_gb, machine_ram),
            "disk": resolve_budget(disk_gb, lambda: free_disk(disk_path)) if offload_dir else None}
    if world == 1:   # the plain estimate, budgets as given ("auto" notes included)
        per_rank = estimate(model, vram_gb=vram_gb, ram_gb=ram_gb, disk_gb=disk_gb, offload_dir=offload_dir,
                            accumulation=accumulation, layer_major=layer_major, precision=precision, **options)
    else:
        share = {k: (None if v is None else v / gpus_per_node / GiB) for k, v in node.items()}
        per_rank = estimate(model, vram_gb=vram_gb, ram_gb=share["host"], disk_gb=share["disk"],
                            offload_dir=offload_dir, accumulation=accumulation, layer_major=layer_major,
                            precision=precision, world=world, **options)
    config, _ = resolve_config(model)
    wire = wire_bytes_per_rank(unit_specs_from_config(config), world, per_rank.plan, accumulation=accumulation,
                               layer_major=layer_major, precision=precision)
    return ScaleOutEstimate(per_rank=per_rank, nodes=nodes, gpus_per_node=gpus_per_node, node_budgets=node,
                            wire=wire, accumulation=accumulation)
