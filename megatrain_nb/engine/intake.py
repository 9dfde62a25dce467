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
and an update that works in chunks reads it back a chunk at a time (:class:`HeldGradient`,
``DiskStore.read_ranged``): no unit-sized buffer holds it on either side of the wait.

Final-gradient buffers come from one :class:`~.host_store.BufferPool`; a layer-major window
on a CPU "device" borrows one per unit (:meth:`GradientIntake.lend_buffer`), sums into it and
hands it back whole: the pool knows what it lent (``BufferPool.lend`` / ``take_back``), so it
is adopted as the final gradient without a copy.
"""
from __future__ import annotations

import math
import threading
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from . import finite
from .host_store import BufferPool
from .units import Unit

HOLD_WRITES = 2   # disk writes of held final gradients in flight at once (hold="disk")


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


class HeldGradient:
    """A final gradient held on the disk tier, read back range by range in order
    (``read(start, out)``: ``out.numel()`` elements from element ``start``), scaled by ``coef``
    (the clip coefficient, set before the first read) as each range arrives: the same products
    as the whole gradient scaled at once. ``close()`` ends the read (the key may be written again)."""

    def __init__(self, reader, numel: int):
        self.reader, self.numel, self.coef = reader, numel, None

    def read(self, start: int, out: torch.Tensor) -> torch.Tensor:
        self.reader.read("g", start, out)
        if self.coef is not None:
            out.mul_(self.coef)
        return out

    def close(self, _grad=None) -> None:
        self.reader.close()


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
    accumulators), ``submit(unit, lr, grad, zero, release, reserved)`` and ``reserve(unit)`` (the
    update runner: queue an update, wait for a free update slot), ``pool`` (the
    final-gradient buffers), ``disk`` (hold="disk"), ``sharded`` (data parallel), ``staged``
    (gradients arrive in the transport's staging buffers, kept by straight updates)."""

    def __init__(self, units: List[Unit], *, grads, policy: IntakePolicy, pool: BufferPool,
                 submit: Callable, reserve: Callable, counters, disk=None, sharded=None, staged: bool = False):
        self.units = units
        self.grads = grads
        self.policy = policy
        self.pool = pool
        self.submit = submit
        self.reserve = reserve
        self.counters = counters
        self.disk = disk
        self.sharded = sharded
        self.staged = staged
        self.step = ACCUMULATE_ONLY
        self._norm_sq = 0.0                           # sum of the final gradients' squared norms
        self._norm_lock = threading.Lock()
        self._unit_norm: Dict[int, float] = {}        # unit index -> its final gradient's norm (clipping)
        self._votes: Dict[int, bool] = {}             # unit index -> finite on every rank (data parallel)
        self._held_ram: Dict[int, torch.Tensor] = {}  # unit index -> final gradient held for the norm (hold="host")
        self._held: Dict[int, Future] = {}            # unit index -> write of its final gradient (hold="disk")
        self._held_keys: set = set()
        self._held_lock = threading.Lock()

    # ------------------------------------------------------------------ a micro-batch
    def begin(self, step: StepContext) -> None:
        self.step = step
        with self._norm_lock:
            self._norm_sq = 0.0

    def end(self) -> None:
        self.step = ACCUMULATE_ONLY

    def arrived(self, unit: Unit, grad) -> Optional[Future]:
        """A unit's gradient of this micro-batch reached the host (a flat fp32 tensor, or on a
        CPU "device" the per-parameter gradients). Returns a Future when the gradient's staging
        buffer is kept by its update (done when the buffer may be reused), else None."""
        step = self.step
        if self.policy.votes(step):
            self._vote(unit, grad)   # every rank, empty shard or not: a collective
        if unit.numel == 0:   # a small unit's shard of this rank is empty: nothing to update
            return None
        route = self.policy.route(step, self.grads.has_grad(unit))
        # (updates of the last step may still be running: they claim their own held gradients;
        # an entry left by a failed step is dropped when this unit's gradient goes elsewhere)
        if route != Route.HOLD:
            with self._held_lock:
                self._held_ram.pop(unit.index, None)
        if route == Route.ACCUMULATE:
            self.grads.accumulate(unit, grad)
        elif route == Route.STRAIGHT:
            return self._straight(unit, grad, step)
        elif route == Route.HOLD:
            if self.policy.hold_on_disk(step) and self.staged and torch.is_tensor(grad) \
                    and grad.numel() == unit.numel:
                return self._hold_staged(unit, grad)
            flat = self._final_buffer(unit, grad)
            self.reduce(unit, flat)
            self._add_norm_share(unit, flat)
            if self.policy.hold_on_disk(step):
                self._hold_on_disk(unit, flat)
            else:
                with self._held_lock:
                    self._held_ram[unit.index] = flat
        else:   # Route.LAST: final in the accumulator
            self.grads.accumulate(unit, grad)
            acc = self.grads.grad(unit)
            self.reduce(unit, acc)
            if step.clipped:
                self._add_norm_share(unit, acc)   # taken now, while the backward goes on
            else:
                with self._norm_lock:
                    self._unit_norm.pop(unit.index, None)
                self.submit(unit, step.lr, None, zero=True, release=None)
        return None

    def _straight(self, unit: Unit, grad, step: StepContext) -> Optional[Future]:
        """A final gradient straight to its update. The update slot first: while the update
        before it runs, the gradient waits in its transfer buffer (pinned staging, or on a CPU
        "device" autograd's own), not in a copy. A staging buffer is updated in place (the
        returned Future: done when the update hands it back); else the gradient is copied into
        (or adopted as) a pool buffer."""
        with self._norm_lock:
            self._unit_norm.pop(unit.index, None)   # left by a failed clipped step
        cancel = self.reserve(unit)
        kept = None
        try:
            if self.staged and torch.is_tensor(grad) and grad.numel() == unit.numel:
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
        self.submit(unit, step.lr, flat, zero=False, release=release, reserved=True)
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
        with self._norm_lock:
            sq, self._norm_sq = self._norm_sq, 0.0
        if self.sharded is not None:
            if loss is not None and not math.isfinite(loss):
                sq = float("nan")
            sq = self.sharded.global_norm_sq(sq)
            loss = None
        return sq ** 0.5, loss

    # ------------------------------------------------------------------ what the updates claim
    def claim(self, unit: Unit, ranged: bool = False) -> Tuple[Optional[object], Optional[Callable]]:
        """For a unit's update that waited for the norm: (its held final gradient, how to hand
        the buffer back), or (None, None) when it is in the accumulator. ``ranged``: the update
        works in chunks, so a gradient held on the disk tier comes as a :class:`HeldGradient`
        (read a chunk at a time) where the disk tier reads ranges (``read_ranged``)."""
        with self._held_lock:
            held = self._held.pop(unit.index, None)
            in_ram = self._held_ram.pop(unit.index, None)
        if in_ram is not None:   # hold="host": kept since it arrived
            return in_ram, self.pool.give
        if held is None:
            return None, None
        held.result()            # hold="disk": the final gradient comes back
        if ranged and getattr(self.disk, "capacity", 0) <= 0:   # (a host cache's copies are whole units)
            got = HeldGradient(self.disk.read_ranged(self._hold_key(unit)), unit.numel)
            return got, got.close
        grad = self.pool.take(unit.numel)
        try:
            self.disk.read(self._hold_key(unit), {"g": grad}, urgent=True).result()
        except BaseException:
            self.pool.give(grad)
            raise
        return grad, self.pool.give

    def unit_norm(self, unit: Unit) -> Optional[float]:
        """The norm of a unit's final gradient, taken for the global norm (clipped steps only)."""
        with self._norm_lock:
            return self._unit_norm.pop(unit.index, None)

    def vote(self, unit: Unit) -> Optional[bool]:
        """Whether every rank found this unit's final gradient finite (None: no vote taken)."""
        return self._votes.pop(unit.index, None)

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
        if torch.is_tensor(t) and t.numel() == unit.numel and self.pool.take_back(t):
            return t
        flat = self.pool.take_slot(unit.numel) if slot else self.pool.take(unit.numel)
        if torch.is_tensor(grad):
            flat.copy_(grad)
        else:
            torch.cat([g.reshape(-1).float() for g in grad], out=flat)
        return flat

    def buffer_bytes(self) -> int:
        """Recycled final-gradient buffers held in RAM."""
        return self.pool.nbytes()

    def held_ram_bytes(self) -> int:
        """Bytes of final gradients held in RAM for a clipping norm (freed by their updates)."""
        with self._held_lock:
            return sum(t.numel() * 4 for t in self._held_ram.values())

    def held_disk_bytes(self) -> int:
        """Bytes of final gradients kept on the disk tier for clipping (hold="disk")."""
        return sum(self.disk.nbytes_of(k) for k in self._held_keys) if self.disk is not None else 0

    def held_cached_bytes(self) -> int:
        """Bytes of those final gradients the disk tier's host cache holds in RAM."""
        if self.disk is None or not hasattr(self.disk, "resident_bytes"):
            return 0
        return self.disk.resident_bytes(list(self._held_keys))

    # ------------------------------------------------------------------ internals
    def _add_norm_share(self, unit: Unit, flat: torch.Tensor) -> None:
        norm = float(torch.linalg.vector_norm(flat))
        with self._norm_lock:
            self._norm_sq += norm ** 2
            self._unit_norm[unit.index] = norm   # the layer statistics' grad norm (no second pass)

    def _hold_key(self, unit: Unit) -> str:
        return f"final-grad-{unit.index:05d}"

    def _hold_staged(self, unit: Unit, grad: torch.Tensor) -> Future:
        """hold="disk", a gradient in its transfer's staging buffer: its norm share taken and
        the buffer written to the disk tier as it is; the returned write keeps the buffer from
        the pager until it is done (the staging buffers bound the writes in flight)."""
        self.reduce(unit, grad)
        self._add_norm_share(unit, grad)
        return self._write_held(unit, grad)

    def _write_held(self, unit: Unit, flat: torch.Tensor) -> Future:
        key = self._hold_key(unit)
        fut = self.disk.write(key, {"g": flat})
        with self._held_lock:
            self._held[unit.index] = fut
            self._held_keys.add(key)
        return fut

    def _hold_on_disk(self, unit: Unit, flat: torch.Tensor) -> None:
        """hold="disk": the final gradient is written to the disk tier (its update reads it
        back once the norm is known); RAM holds only the writes in flight (a few units)."""
        fut = self._write_held(unit, flat)
        fut.add_done_callback(lambda _f, flat=flat: self.pool.give(flat))
        with self._held_lock:
            inflight = [f for f in self._held.values() if not f.done()]
        if len(inflight) > HOLD_WRITES:   # back-pressure on the gradient thread (errors surface in the update)
            futures_wait(inflight[:-HOLD_WRITES])

    def _vote(self, unit: Unit, grad) -> None:
        """Data parallel, straight: is this unit's final gradient finite on every rank? One
        all-reduce of a flag on the reduce-scatter's channel, announced with the reduce-scatter
        by the program thread (engine/issuer.py: every rank issues it at the same place); the
        unit's update reads the answer."""
        bad = not (unit.numel == 0 or bool(torch.isfinite(grad).all()))
        self._votes[unit.index] = self.sharded.vote(unit, bad)
