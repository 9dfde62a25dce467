"""Sharded units (ZeRO-3 on the streaming engine): rank r keeps shard r of every unit.

A :class:`ShardUnit` is a :class:`~.units.Unit` whose flat buffer is this rank's shard: its
``numel`` is the shard's length and its ``decay_numel`` the part of the unit's weight-decayed
prefix that falls in the shard. The host stores (master weights, gradient accumulators,
optimizer states in any codec, RAM or disk) and the per-unit AdamW key everything on
``unit.index`` and ``unit.numel``, so they hold shards without knowing it; only the two ends
of a unit's trip to the device see whole units, both in the transport
(``transport.ShardedTransport``, as FSDP2's ``fully_shard`` wraps a module): the pager and
the step see whole units and nothing of the ranks.

* :meth:`ShardedUnits.gather` — before the unit runs (forward, backward recompute): every
  rank's shard -> the whole flat buffer on the device;
* :meth:`ShardedUnits.reduce_grad` — when a micro-batch's gradient of the unit is complete on
  the device: reduce-scatter, so this rank gets the summed gradient of its own shard, which then
  goes to the host and into the accumulator / update exactly as in one process.

A micro-batch's gradient is reduce-scattered as soon as it is complete (as FSDP does), so the
host only ever holds shard-sized gradients; with accumulation A a step sends A reduce-scatters.
Keeping whole-unit accumulators instead would cost every rank a full copy of the gradients.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional

import torch

from .dist import Dist, ShardLayout
from ..units import Unit


@dataclass
class ShardUnit(Unit):
    """This rank's shard of ``whole``: elements [start, start + numel) of its flat buffer."""

    whole: Optional[Unit] = None
    start: int = 0
    layout: Optional[ShardLayout] = None


def shard_unit(unit: Unit, layout: ShardLayout, rank: int) -> ShardUnit:
    s, e = layout.bounds(rank)
    _, decay_end = layout.local_range(rank, 0, unit.decay_numel)  # decay is a prefix of the unit
    return ShardUnit(name=unit.name, kind=unit.kind, index=unit.index, params=[], numel=e - s,
                     decay_numel=decay_end, layer_index=unit.layer_index, module=unit.module,
                     whole=unit, start=s, layout=layout)


class ShardedUnits:
    """The shards of a model's units on this rank, and the collectives that move whole units."""

    def __init__(self, units: Iterable[Unit], dist: Dist, *, gather_dist: Optional[Dist] = None,
                 reduce_dist: Optional[Dist] = None):
        # gathers and reduce-scatters may run in two worker threads: each on its own channel,
        # all issued in the program's order by the one issuer the channels share (dist.issuer)
        self.dist = dist
        self.gather_dist = gather_dist or dist
        self.reduce_dist = reduce_dist or dist
        self.units: List[Unit] = list(units)
        self.layouts: Dict[int, ShardLayout] = {u.index: dist.layout(u.numel) for u in self.units}
        self.shards: List[ShardUnit] = [shard_unit(u, self.layouts[u.index], dist.rank) for u in self.units]
        self._by_index = {s.index: s for s in self.shards}

    def shard(self, unit: Unit) -> ShardUnit:
        return self._by_index[unit.index]

    def layout(self, unit: Unit) -> ShardLayout:
        return self.layouts[unit.index]

    def take_own(self, unit: Unit, full: torch.Tensor) -> torch.Tensor:
        """This rank's copy of its shard of a whole flat buffer (initial weights from a model or
        a checkpoint: each rank keeps only its slice)."""
        return self.layout(unit).shard_of(full, self.dist.rank).clone()

    def gather(self, unit: Unit, shard: torch.Tensor, out: Optional[torch.Tensor] = None,
               async_op: bool = False, announced: bool = False):
        """The whole unit's flat weights on this rank's device, built from every rank's shard.
        ``out``: a device buffer of at least ``padded_numel(unit)`` elements to fill.
        ``announced``: a worker's gather, announced by the program (:meth:`announce_gather`)."""
        return self.gather_dist.gather(shard, self.layout(unit), out=out, async_op=async_op,
                                       key=unit.index if announced else None)

    def reduce_grad(self, unit: Unit, full_grad: torch.Tensor, async_op: bool = False, announced: bool = False):
        """This rank's shard of the gradient summed over ranks (on ``full_grad``'s device).
        ``announced``: a worker's reduce-scatter, announced by the program (:meth:`announce_grad`)."""
        return self.reduce_dist.reduce_scatter(full_grad, self.layout(unit), async_op=async_op,
                                               key=unit.index if announced else None)

    def vote(self, unit: Unit, bad: bool) -> bool:
        """Whether no rank found this unit's final gradient non-finite (announced by
        :meth:`announce_grad` with ``vote=True``; on the reduce channel: on CUDA the d2h stream)."""
        t = torch.tensor([1.0 if bad else 0.0], dtype=torch.float64)
        self.reduce_dist.all_reduce_(t, kind="vote", key=unit.index)
        return float(t.item()) == 0.0

    # -- the program's order of the workers' collectives (engine/transport/issuer.py) ---------------------
    def announce_gather(self, unit: Unit) -> list:
        """The program thread: ``unit`` will be gathered by a worker (the pager's fetch)."""
        return [self.dist.issuer.announce("gather", unit.index)]

    def announce_grad(self, unit: Unit, vote: bool) -> list:
        """The program thread: ``unit``'s gradient will be reduce-scattered by a worker and,
        with ``vote``, its finiteness voted on right after."""
        tickets = [self.dist.issuer.announce("reduce_scatter", unit.index)]
        if vote:
            tickets.append(self.dist.issuer.announce("vote", unit.index))
        return tickets

    def padded_numel(self, unit: Unit) -> int:
        """Elements a device buffer needs to receive a gathered unit (shards are padded)."""
        return self.layout(unit).padded

    def global_norm_sq(self, local_sq: float) -> float:
        """Squared global gradient norm from this rank's shards' share (one all-reduce)."""
        t = torch.tensor([float(local_sq)], dtype=torch.float64)
        return float(self.dist.all_reduce_(t, kind="norm").item())

    def assemble(self, unit: Unit, shard: torch.Tensor) -> torch.Tensor:
        """The whole unit on the CPU (``save_pretrained``, one unit at a time: never the whole
        model). Every rank must call it, in the same unit order."""
        return self.gather(unit, shard.to(self.dist.device)).cpu()

    def nbytes_per_rank(self) -> int:
        """fp32 bytes of this rank's shards of every unit."""
        return 4 * sum(s.numel for s in self.shards)
