"""Gradient intake: from "a unit's gradient reached the host" to "its update is queued".

Per micro-batch the :class:`IntakePolicy` (given at construction) makes the step's
:class:`StepContext`, and for each arriving gradient one :class:`Route`:

==============  =====================================================================
``ACCUMULATE``  not the step's last micro-batch: added into the host accumulator
``STRAIGHT``    final in one piece, no norm to wait for: straight to its update
``HOLD``        final in one piece, the update waits for the global norm: held in RAM
                (``hold="host"``) or on the disk tier (``hold="disk"``)
``LAST``        the last of several micro-batches: final in the accumulator, then
                straight to its update, or (waiting for the norm) its norm share taken
==============  =====================================================================

The updates wait for the global norm when the step clips, and -- data parallel under
``on_nonfinite="skip"`` -- when every rank must take the same decision on a NaN/inf before
any update (``StepContext.gate``). Each final gradient passes :meth:`GradientIntake.reduce`
(the reduce point) once. Data parallel, every micro-batch's gradient is reduce-scattered on
its way out of the device (``transport.ShardedTransport``), so the host holds only shard-sized ones.

A gradient that arrives final in a transport's staging buffer (CUDA: the pinned buffer of its
device->host copy; ``staged``) goes straight to its update there: :meth:`GradientIntake.arrived`
returns a Future that is done once the update is done with it, and the pager reuses that
buffer only then (no unit-sized copy beside the staging buffers).

A gradient held on the disk tier for the norm (``hold="disk"``) is written straight from its
staging buffer (the pager reuses it once the write is done: no copy beside the staging buffers),
and an update that works in chunks reads it back a chunk at a time (``final_grads.HeldGradient``,
``DiskStore.read_ranged``): no unit-sized buffer holds it on either side of the wait.

What is held, and each final gradient's norm and vote, is written into the
:class:`~.final_grads.FinalGradients` ledger, which the update runner reads (both take it).

Final-gradient buffers come from one :class:`~.host_store.BufferPool`; a layer-major window
on a CPU "device" borrows one per unit (:meth:`GradientIntake.lend_buffer`), sums into it and
hands it back whole: the pool knows what it lent (``BufferPool.lend`` / ``take_back``), so it
is adopted as the final gradient without a copy.
"""
from __future__ import annotations

import math
from concurrent.futures import Future
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from . import finite
from .final_grads import FinalGradients
from ..tiers.host_store import BufferPool
from ..units import Unit, train_numel
from .update_runner import UpdateRunner


@dataclass(frozen=True)
class StepContext:
    """What one training micro-batch does with its gradients.

    ``lr`` None: they accumulate (not the step's last micro-batch). ``lr`` set: this is the
    step's last micro-batch and each unit is updated once its gradient is final. ``clip``
    (max_grad_norm, with ``lr``): global-norm clipping, so updates wait for the whole backward.
    ``gate``: the updates wait for the global norm without clipping (data parallel,
    ``on_nonfinite="skip"``: every rank skips the whole step alike).
    """
    lr: Optional[float] = None
    clip: Optional[float] = None
    #: With clipping: where a gradient that arrives final in one piece (a layer-major window's,
    #: or a single micro-batch's) waits for the norm: "host" RAM, or "disk" (the disk tier,
    #: when there is one): written at once, read back by its update.
    hold: str = "host"
    gate: bool = False

    @property
    def updates(self) -> bool:
        return self.lr is not None

    @property
    def clipped(self) -> bool:
        """The updates wait for the global norm (clipping, or the data-parallel skip gate)."""
        return self.lr is not None and (self.clip is not None or self.gate)

    @property
    def straight(self) -> bool:
        """Final gradients go straight to their updates as they arrive (the step's last
        micro-batch, no norm to wait for)."""
        return self.updates and not self.clipped


ACCUMULATE_ONLY = StepContext()


class Route:
    ACCUMULATE, STRAIGHT, HOLD, LAST = "accumulate", "straight", "hold", "last"


class IntakePolicy:
    """The decisions of the intake, in one place: a micro-batch's :class:`StepContext` and the
    :class:`Route` of each arriving gradient. ``sharded``: data parallel; ``on_nonfinite``:
    "stop" | "skip"; ``hold_disk_ok``: a disk tier exists for ``hold="disk"``."""

    def __init__(self, *, sharded: bool, on_nonfinite: str, hold_disk_ok: bool):
        self.sharded = sharded
        self.on_nonfinite = finite.check_policy(on_nonfinite)
        self.hold_disk_ok = hold_disk_ok

    def context(self, lr: Optional[float], clip: Optional[float], hold: str) -> StepContext:
        """Data parallel, unclipped: each rank would check only its own shards before updating
        them, so a NaN/inf confined to one rank's shard would stop or skip the step on that rank
        alone. Under "skip" the updates wait for the global norm (``gate``), so every rank skips
        the whole step; under "stop" the ranks vote per unit as each gradient becomes final
        (``votes``), so the updates still overlap the backward and every rank stops at the same
        unit with the same error, as one process would."""
        gate = self.sharded and lr is not None and clip is None and self.on_nonfinite == "skip"
        return StepContext(lr=lr, clip=clip, hold=hold, gate=gate)

    def votes(self, step: StepContext) -> bool:
        """Whether the ranks vote on each final gradient's finiteness (data parallel, straight)."""
        return self.sharded and step.straight

    def route(self, step: StepContext, accumulated: bool) -> str:
        if not step.updates:
            return Route.ACCUMULATE
        if accumulated:
            return Route.LAST
        return Route.STRAIGHT if step.straight else Route.HOLD

    def hold_on_disk(self, step: StepContext) -> bool:
        return step.hold == "disk" and self.hold_disk_ok


class GradientIntake:
    """Runs in the pager's gradient-return thread. Collaborators: ``grads`` (HostStore: the
    accumulators), ``final`` (FinalGradients: where final gradients are held for the norm, their
    norms and votes recorded), ``runner`` (UpdateRunner: :meth:`~.UpdateRunner.reserve` an update
    slot, :meth:`~.UpdateRunner.submit` an update), ``pool`` (the final-gradient buffers),
    ``sharded`` (data parallel), ``staged`` (gradients arrive in the transport's staging
    buffers, kept by straight updates)."""

    def __init__(self, units: List[Unit], *, grads, policy: IntakePolicy, pool: BufferPool, final: FinalGradients,
                 runner: UpdateRunner, sharded=None, staged: bool = False):
        self.units = units
        self.grads = grads
        self.policy = policy
        self.pool = pool
        self.final = final
        self.runner = runner
        self.sharded = sharded
        self.staged = staged
        self.step = ACCUMULATE_ONLY

    # ------------------------------------------------------------------ a micro-batch
    def begin(self, step: StepContext) -> None:
        self.step = step
        self.final.reset_norm()

    def end(self) -> None:
        self.step = ACCUMULATE_ONLY

    def arrived(self, unit: Unit, grad) -> Optional[Future]:
        """A unit's gradient of this micro-batch reached the host (a flat fp32 tensor, or on a
        CPU "device" the per-parameter gradients). Returns a Future when the gradient's staging
        buffer is kept by its update (done when the buffer may be reused), else None."""
        step = self.step
        if self.policy.votes(step):
            self._vote(unit, grad)   # every rank, empty shard or not: a collective
        if train_numel(unit) == 0:   # a frozen unit, or a small unit's shard of this rank is empty: nothing to update
            return None
        route = self.policy.route(step, self.grads.has_grad(unit))
        # (updates of the last step may still be running: they claim their own held gradients;
        # an entry left by a failed step is dropped when this unit's gradient goes elsewhere)
        if route != Route.HOLD:
            self.final.drop_in_ram(unit)
        if route == Route.ACCUMULATE:
            self.grads.accumulate(unit, grad)
        elif route == Route.STRAIGHT:
            return self._straight(unit, grad, step)
        elif route == Route.HOLD:
            if self.policy.hold_on_disk(step) and self.staged and torch.is_tensor(grad) \
                    and grad.numel() == train_numel(unit):
                return self._hold_staged(unit, grad)
            flat = self._final_buffer(unit, grad)
            self.reduce(unit, flat)
            self.final.add_norm(unit, flat)
            if self.policy.hold_on_disk(step):
                self.final.hold_on_disk(unit, flat)
            else:
                self.final.hold_in_ram(unit, flat)
        else:   # Route.LAST: final in the accumulator
            self.grads.accumulate(unit, grad)
            acc = self.grads.grad(unit)
            self.reduce(unit, acc)
            if step.clipped:
                self.final.add_norm(unit, acc)   # taken now, while the backward goes on
            else:
                self.final.drop_norm(unit)
                self.runner.submit(unit, step.lr, None, zero=True, release=None)
        return None

    def _straight(self, unit: Unit, grad, step: StepContext) -> Optional[Future]:
        """A final gradient straight to its update. The update slot first: while the update
        before it runs, the gradient waits in its transfer buffer (pinned staging, or on a CPU
        "device" autograd's own), not in a copy. A staging buffer is updated in place (the
        returned Future: done when the update hands it back); else the gradient is copied into
        (or adopted as) a pool buffer."""
        self.final.drop_norm(unit)   # left by a failed clipped step
        cancel = self.runner.reserve(unit)
        kept = None
        try:
            if self.staged and torch.is_tensor(grad) and grad.numel() == train_numel(unit):
                flat, kept = grad, Future()
                release = lambda _g, kept=kept: kept.set_result(None)   # noqa: E731 - the pager may reuse it
            else:
                flat, release = self._final_buffer(unit, grad, slot=True), self.pool.give
            self.reduce(unit, flat)
        except BaseException:
            cancel()
            if kept is not None:
                kept.set_result(None)
            raise
        self.runner.submit(unit, step.lr, flat, zero=False, release=release, reserved=True)
        return kept

    def reduce(self, unit: Unit, flat: torch.Tensor) -> None:
        """The reduce point: ``flat`` is this process's final gradient of ``unit`` (fp32, in
        place), before its norm share is taken and its update queued. Nothing to do in one
        process, nor with sharded state: there each micro-batch's gradient was already
        reduce-scattered on its way out of the device (``transport.ShardedTransport``), so the accumulated shard is the
        sum over ranks. (A hook for tests and for reductions of the final gradient.)"""

    def global_norm(self, loss: Optional[float]) -> Tuple[float, Optional[float]]:
        """(the global norm of this step's final gradients, the loss to check beside it). Data
        parallel: one all-reduce of the shards' squares; a rank whose own loss is NaN/inf adds a
        NaN, so every rank sees a non-finite norm and takes the same decision -- ranks must never
        disagree on applying a step (the loss is then this rank's share only: not checked)."""
        sq = self.final.take_norm_sq()
        if self.sharded is not None:
            if loss is not None and not math.isfinite(loss):
                sq = float("nan")
            sq = self.sharded.global_norm_sq(sq)
            loss = None
        return sq ** 0.5, loss

    # ------------------------------------------------------------------ buffers
    def lend_buffer(self, numel: int) -> torch.Tensor:
        """A flat fp32 buffer (not zeroed) from the final-gradient pool. On a CPU "device" a
        layer-major window sums a unit's gradient in it and returns it whole (``[buf]``): it is
        adopted as the final gradient (no copy) and goes back to the pool after its update."""
        return self.pool.lend(numel, slot=self.step.straight)

    def _final_buffer(self, unit: Unit, grad, slot: bool = False) -> torch.Tensor:
        """A final gradient in a buffer of the pool: a lent buffer coming back whole is adopted;
        else copied out of the transfer's staging buffer (reused by the next transfer) into a
        recycled one (``slot``: a slot-sized one, for a gradient going straight to its update)."""
        t = grad[0] if isinstance(grad, (list, tuple)) and len(grad) == 1 else grad
        if torch.is_tensor(t) and t.numel() == train_numel(unit) and self.pool.take_back(t):
            return t
        flat = self.pool.take_slot(train_numel(unit)) if slot else self.pool.take(train_numel(unit))
        if torch.is_tensor(grad):
            flat.copy_(grad)
        else:
            torch.cat([g.reshape(-1).float() for g in grad], out=flat)
        return flat

    def buffer_bytes(self) -> int:
        """Recycled final-gradient buffers held in RAM."""
        return self.pool.nbytes()

    # ------------------------------------------------------------------ internals
    def _hold_staged(self, unit: Unit, grad: torch.Tensor) -> Future:
        """hold="disk", a gradient in its transfer's staging buffer: its norm share taken and
        the buffer written to the disk tier as it is; the returned write keeps the buffer from
        the pager until it is done (the staging buffers bound the writes in flight)."""
        self.reduce(unit, grad)
        self.final.add_norm(unit, grad)
        return self.final.write_held(unit, grad)

    def _vote(self, unit: Unit, grad) -> None:
        """Data parallel, straight: is this unit's final gradient finite on every rank? One
        all-reduce of a flag on the reduce-scatter's channel, announced with the reduce-scatter
        by the program thread (engine/transport/issuer.py: every rank issues it at the same place); the
        unit's update reads the answer."""
        bad = not (unit.numel == 0 or finite.all_finite(grad))
        self.final.record_vote(unit, self.sharded.vote(unit, bad))
