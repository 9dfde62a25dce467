"""UpdateScheduler: everything from "a unit's gradient is final" to "its update is written".

The step's path, top to bottom in this file:

1. :meth:`UpdateScheduler.begin` — the step's :class:`StepContext` (lr, clip) is set.
2. :meth:`UpdateScheduler.plan_reads` — the disk tier reads weights and optimizer states
   ahead, in the order the updates will want them.
3. :meth:`UpdateScheduler.gradient_arrived` — the pager's gradient-return thread hands over a
   unit's gradient of this micro-batch. On the step's last micro-batch it is *final*:
4. :meth:`UpdateScheduler.reduce` — the reduce point (a no-op for one process; where a
   distributed gradient reduce-scatter goes).
5. Without clipping the unit's AdamW update is queued at once (:meth:`_submit`), overlapped
   with the backward of the units below it. With clipping only its share of the global norm
   is taken (the gradient waits in RAM, or with ``StepContext.hold == "disk"`` on the disk
   tier: :meth:`_hold_on_disk`); :meth:`finish` then queues every update, in
   :attr:`update_order`, scaled by the clip coefficient.
6. :meth:`_apply` — one unit's update in the AdamW worker thread: optimizer states loaded,
   weights taken, AdamW, weights and states written (behind, on the disk tier).
7. :meth:`ready_weights` — the next forward waits for exactly that unit's update before its
   weights go to the device. A failed update is delivered there once (:attr:`failed`), the
   disk tier is settled, and the engine refuses to train until a checkpoint is loaded.
"""
from __future__ import annotations

import math
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

from . import finite
from .host_store import BufferPool
from .sharded import ShardUnit
from .units import Unit, forward_order


@dataclass(frozen=True)
class StepContext:
    """What one training micro-batch does with its gradients.

    ``lr`` None: they accumulate (not the step's last micro-batch). ``lr`` set: this is the
    step's last micro-batch and each unit is updated once its gradient is final. ``clip``
    (max_grad_norm, with ``lr``): global-norm clipping, so updates wait for the whole backward.
    """
    lr: Optional[float] = None
    clip: Optional[float] = None
    #: With clipping: where a gradient that arrives final in one piece (a layer-major window's,
    #: or a single micro-batch's) waits for the norm: "host" RAM, or "disk" (the disk tier,
    #: when there is one): written at once, read back by its update.
    hold: str = "host"

    @property
    def updates(self) -> bool:
        return self.lr is not None

    @property
    def clipped(self) -> bool:
        return self.lr is not None and self.clip is not None


_ACCUMULATE = StepContext()
_HOLD_WRITES = 2   # disk writes of held final gradients in flight at once (hold="disk")


class UpdateScheduler:
    """Owns the AdamW worker thread (``mtnb-adamw``) and every pending update.

    Collaborators: ``grads`` (HostStore: gradient accumulators), ``weights`` (WeightStore),
    ``states`` (OptimizerStates), ``adam`` (UnitAdamW), ``disk`` (DiskStore or None, settled
    after a failure). ``depth``: units queued for an update at once (back-pressure on RAM).
    """

    def __init__(self, units: List[Unit], *, grads, weights, states, adam, counters, disk=None, depth: int = 1,
                 sharded=None):
        self.units = units
        # Data parallel (engine.sharded.ShardedUnits): ``units`` are this rank's shards; the
        # reduce point reduce-scatters each micro-batch's gradient, the norm is all-reduced.
        self.sharded = sharded
        self.grads = grads
        self.weights = weights
        self.states = states
        self.adam = adam
        self.counters = counters
        self.disk = disk
        #: The order updates run in when they wait for the whole backward (clipping): the next
        #: forward's order, so that forward waits for each unit's update as late as possible.
        self.update_order: List[Unit] = forward_order(units)
        #: The order gradients become final in the backward (and unclipped updates run).
        self.gradient_order: List[Unit] = [units[-1]] + list(reversed(units[1:-1])) + [units[0]]
        self.failed: Optional[BaseException] = None   # an update that failed, delivered once
        self.policy = "stop"                          # on_nonfinite (finite.py)
        self.nonfinite: Optional[BaseException] = None  # a stopped non-finite step not yet reported
        self._guard: Optional[finite.StepGuard] = None  # the unclipped step's per-unit NaN/inf check
        self._votes: Dict[int, bool] = {}             # unit index -> finite on every rank (data parallel, _vote)
        self._step = _ACCUMULATE
        self._norm_sq = 0.0                           # sum of the final gradients' squared norms
        self._norm_lock = threading.Lock()
        self._unit_norm: Dict[int, float] = {}        # unit index -> its final gradient's norm (clipping)
        self._pending: Dict[int, Future] = {}         # unit index -> its update of the last step
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="mtnb-adamw")
        self._slots = threading.BoundedSemaphore(depth)
        # Recycled final-gradient buffers: at most what the pipeline has in flight at once
        # (_pool_bytes), so a layer-major step keeps no whole-model's worth of gradients in RAM
        # between steps. A gradient that goes straight to its update takes a slot-sized buffer
        # (the largest unit's; BufferPool.take_slot), so every unit reuses the same few.
        self._depth = depth
        self._largest = max((u.numel for u in units), default=0)
        self._grad_pool = BufferPool(max_bytes=self._pool_bytes(None), slot_numel=self._largest)
        self._rs_buf: Optional[torch.Tensor] = None   # sharded: the reduce-scatter's whole-unit input
        # Pool buffers lent out (lend_buffer) that a final gradient may come back in, adopted
        # without a copy; weak: one that never comes back is simply freed.
        self._lent: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()
        self._held_ram: Dict[int, torch.Tensor] = {}  # unit index -> final gradient held for the norm (hold="host")
        self._held: Dict[int, Future] = {}            # unit index -> write of its final gradient (hold="disk")
        self._held_keys: set = set()

    # ------------------------------------------------------------------ 1-2: a step begins
    def context(self, lr: Optional[float], clip: Optional[float], hold: str) -> StepContext:
        """The StepContext of a micro-batch. Data parallel, unclipped: each rank would check
        only its own shards before updating them, so a NaN/inf confined to one rank's shard would
        stop or skip the step on that rank alone. Under ``on_nonfinite="skip"`` the step's
        updates wait for the global norm (``clip`` inf: the hold path, no scaling), so every rank
        skips the whole step; under "stop" the ranks vote per unit as each gradient becomes
        final (:meth:`_vote`), so the updates still overlap the backward and every rank stops
        at the same unit with the same error, as one process would."""
        if self.sharded is not None and lr is not None and clip is None and self.policy == "skip":
            clip = math.inf
        return StepContext(lr=lr, clip=clip, hold=hold)

    def _pool_bytes(self, step: Optional[StepContext]) -> int:
        """The final-gradient buffers worth keeping for ``step`` (None: any step). A gradient
        that goes straight to its update is in one of ``depth + 1`` buffers: the units being
        updated and the one gradient next in line (a window's sum being formed on a CPU
        "device", or one copied off the device while the update before it runs). A clipping
        step's come back from the norm's hold one by one (and ``hold="disk"`` has a few
        writes in flight). A tied embedding's sum (CPU "device": a lent buffer) is formed
        through the whole backward beside them."""
        n = self._depth + 1 + sum(1 for u in self.units[:1] if getattr(u, "tied_output", False))
        if step is None or step.clipped:
            n += _HOLD_WRITES
        return n * self._largest * 4

    def straight(self) -> bool:
        """Whether this micro-batch's final gradients go straight to their updates (the step's
        last, unclipped): their buffers are the slot-sized ones (BufferPool.take_slot)."""
        return self._step.updates and not self._step.clipped

    def begin(self, step: StepContext) -> None:
        """A training micro-batch starts. (A unit's pending update from the last step finishes
        before its forward reads it, so before its new gradient reaches the accumulator.)"""
        self._step = step
        if step.updates:   # free buffers beyond what this step can have in flight
            self._grad_pool.trim(self._pool_bytes(step))
        with self._norm_lock:
            self._norm_sq = 0.0
        # Without clipping the updates start during the backward, before the global norm is
        # known: each checks its own gradient first (finite.StepGuard).
        self._guard = finite.StepGuard(self.next_step(), self.policy) if step.updates and not step.clipped else None

    def next_step(self) -> int:
        """The number of the optimizer step about to be applied (1-based, survives a resume)."""
        # tuple() copies in one step: the AdamW worker may be adding the last step's counts
        return 1 + max((int(s) for s in tuple(self.adam.steps.values())), default=0)

    def plan_reads(self, compute_order: Sequence[Unit], step: Optional[StepContext]) -> None:
        """Disk read-ahead for the coming micro-batch (``step`` None: evaluation). The weights
        follow ``compute_order``; the optimizer's reads go in the order its updates will run."""
        if step is not None and step.updates:
            self._plan_cache(compute_order, step)
        if step is None or not step.updates:
            self.weights.schedule(compute_order)
        elif step.clipped:
            # The updates run after the backward, in the next forward's order; their reads
            # start now, as deep as the optimizer's buffers allow.
            self.weights.schedule(compute_order, self.update_order, updates_after_backward=True)
            self.states.schedule(self.update_order)
        else:
            self.weights.schedule(compute_order, self.gradient_order)
            self.states.schedule(self.gradient_order)

    def _plan_cache(self, compute_order: Sequence[Unit], step: StepContext) -> None:
        """The host cache of the disk tier (disk_cache.HostCache) learns this step's accesses:
        the same orders the reads below are scheduled in."""
        set_schedule = getattr(self.disk, "set_schedule", None)
        if set_schedule is None:
            return
        from .disk_cache import step_accesses

        order = self.update_order if step.clipped else self.gradient_order
        set_schedule(step_accesses(compute_order, order, clipped=step.clipped,
                                   params_on_disk=getattr(self.weights, "disk", None) is not None,
                                   state_key=self.states.key, state_nbytes=self.states.stored_nbytes))

    # ------------------------------------------------------------------ 3-5: gradients become final
    def gradient_arrived(self, unit: Unit, grad) -> None:
        """Runs in the pager's gradient-return thread once a unit's gradient reached the host
        (a flat fp32 tensor, or on a CPU "device" the per-parameter gradients)."""
        step = self._step
        unit, grad = self.shard_gradient(unit, grad)
        if self.sharded is not None and step.updates and not step.clipped:
            self._vote(unit, grad)   # every rank, empty shard or not: a collective
        if unit.numel == 0:   # a small unit's shard of this rank is empty: nothing to update
            return
        # (updates of the last step may still be running: they pop their own held gradients; an
        # entry left by a failed step is dropped when this unit's gradient goes elsewhere)
        if not step.updates:                    # not the step's last micro-batch
            self._held_ram.pop(unit.index, None)
            self.grads.accumulate(unit, grad)
            return
        if not step.clipped:
            self._unit_norm.pop(unit.index, None)   # left by a failed clipped step
        if not step.clipped and not self.grads.has_grad(unit):
            # Single micro-batch: the incoming gradient is final as it is; no accumulator needed.
            flat = self._copy_final(unit, grad, slot=True)
            self.reduce(unit, flat)
            self._submit(unit, step.lr, flat, zero=False, recycle=True)
            return
        if step.clipped and not self.grads.has_grad(unit):
            # Final in one piece (a layer-major window, a single micro-batch): held for the norm
            # outside the accumulator, which is then never allocated.
            if step.hold == "disk" and self.disk is not None:
                self._hold_on_disk(unit, self._copy_final(unit, grad))
            else:
                self._hold_in_ram(unit, self._copy_final(unit, grad))
            return
        self._held_ram.pop(unit.index, None)
        self.grads.accumulate(unit, grad)       # the last micro-batch: final in the accumulator
        self.reduce(unit, self.grads.grad(unit))
        if step.clipped:
            # Every update needs the global norm, so the gradient stays in its accumulator;
            # its share of the norm is taken now, while the backward goes on.
            self._add_norm_share(unit, self.grads.grad(unit))
            return
        self._submit(unit, step.lr, None, zero=True)

    def lend_buffer(self, numel: int) -> torch.Tensor:
        """A flat fp32 buffer (not zeroed) from the final-gradient pool. On a CPU "device" a
        layer-major window sums a unit's gradient in it and returns it whole (``[buf]``): a
        final gradient arriving in it is adopted, not copied (:meth:`_copy_final`), and goes
        back to the pool after its update, so no per-step allocation and no copy."""
        t = self._grad_pool.take_slot(numel) if self.straight() else self._grad_pool.take(numel)
        self._lent[id(t)] = t
        return t

    def _copy_final(self, unit: Unit, grad, slot: bool = False) -> torch.Tensor:
        """A final gradient copied out of the transfer's staging buffer (reused by the next
        transfer) into a recycled flat fp32 buffer (``slot``: a slot-sized one, for a gradient
        going straight to its update); a lent buffer (:meth:`lend_buffer`) coming back whole
        is adopted as it is."""
        t = grad[0] if isinstance(grad, (list, tuple)) and len(grad) == 1 else grad
        if torch.is_tensor(t) and t.numel() == unit.numel and self._lent.get(id(t)) is t:
            self._lent.pop(id(t), None)
            return t
        flat = self._grad_pool.take_slot(unit.numel) if slot else self._grad_pool.take(unit.numel)
        if torch.is_tensor(grad):
            flat.copy_(grad)
        else:
            torch.cat([g.reshape(-1).float() for g in grad], out=flat)
        return flat

    def _hold_key(self, unit: Unit) -> str:
        return f"final-grad-{unit.index:05d}"

    def _add_norm_share(self, unit: Unit, flat: torch.Tensor) -> None:
        norm = float(torch.linalg.vector_norm(flat))
        with self._norm_lock:
            self._norm_sq += norm ** 2
            self._unit_norm[unit.index] = norm   # the layer statistics' grad norm (no second pass)

    def _hold_in_ram(self, unit: Unit, flat: torch.Tensor) -> None:
        """Clipping, hold="host": reduce, take the norm share, keep the final gradient until its
        update (which hands the buffer back to the pool, bounded: the rest is freed)."""
        self.reduce(unit, flat)
        self._add_norm_share(unit, flat)
        self._held_ram[unit.index] = flat

    def held_ram_bytes(self) -> int:
        """Bytes of final gradients held in RAM for a clipping norm (freed by their updates)."""
        return sum(t.numel() * 4 for t in list(self._held_ram.values()))

    def _hold_on_disk(self, unit: Unit, flat: torch.Tensor) -> None:
        """Clipping, hold="disk": reduce, take the norm share, write the final gradient to the
        disk tier (its update reads it back once the norm is known); RAM holds only the writes
        in flight (at most a few units)."""
        self.reduce(unit, flat)
        self._add_norm_share(unit, flat)
        key = self._hold_key(unit)
        fut = self.disk.write(key, {"g": flat})
        fut.add_done_callback(lambda _f, flat=flat: self._grad_pool.give(flat))
        self._held[unit.index] = fut
        self._held_keys.add(key)
        inflight = [f for f in self._held.values() if not f.done()]
        if len(inflight) > _HOLD_WRITES:   # back-pressure on the gradient thread (errors surface in the update)
            futures_wait(inflight[:-_HOLD_WRITES])

    def held_cached_bytes(self) -> int:
        """Bytes of those final gradients the disk tier's host cache holds in RAM."""
        if self.disk is None or not hasattr(self.disk, "resident_bytes"):
            return 0
        return self.disk.resident_bytes(list(self._held_keys))

    def held_disk_bytes(self) -> int:
        """Bytes of final gradients kept on the disk tier for clipping (hold="disk")."""
        return sum(self.disk.nbytes_of(k) for k in self._held_keys) if self.disk is not None else 0

    def reduce(self, unit: Unit, flat: torch.Tensor) -> None:
        """The reduce point: ``flat`` is this process's final gradient of ``unit`` (fp32, in
        place), before its norm share is taken and its update queued. Nothing to do in one
        process, nor with sharded state: there each micro-batch's gradient was already
        reduce-scattered on arrival (:meth:`shard_gradient`), so the accumulated shard is the
        sum over ranks. (A hook for tests and for reductions of the final gradient.)"""

    def _vote(self, unit: Unit, grad) -> None:
        """Data parallel, unclipped: is this unit's final gradient finite on every rank? One
        all-reduce of a flag on the reduce-scatter's channel, in the same thread and order as
        the reduce-scatters (so every rank issues it alike); the unit's update reads the answer."""
        bad = 0.0 if unit.numel == 0 or bool(torch.isfinite(grad).all()) else 1.0
        t = torch.tensor([bad], dtype=torch.float64)
        self.sharded.reduce_dist.all_reduce_(t)
        self._votes[unit.index] = float(t.item()) == 0.0

    def shard_gradient(self, unit: Unit, grad):
        """Data parallel, on each micro-batch's arrival: (unit, its gradient) -> (this rank's
        shard of the unit, the gradient of the shard summed over ranks), by a reduce-scatter.
        Every micro-batch's is reduced (as FSDP does), so the host only ever holds shard-sized
        gradients. Runs in the gradient-return thread, in the backward's order on every rank,
        overlapping the backward of the units below. One process: unchanged. A CUDA pager has
        already reduce-scattered on the device and hands over the shard (a ShardUnit)."""
        sh = self.sharded
        if sh is None or isinstance(unit, ShardUnit):
            return unit, grad
        # One whole-unit buffer for the reduce-scatter's input, reused (this runs in the one
        # gradient thread and the collective is synchronous): handed back to the pool, such
        # buffers took the pool's room (sized for shards) and stayed in RAM at world size N.
        if self._rs_buf is None:
            from .disk_store import aligned_empty

            self._rs_buf = aligned_empty(max(sh.padded_numel(u) for u in sh.units))
        padded = self._rs_buf[:sh.padded_numel(unit)]
        if torch.is_tensor(grad):
            padded[:unit.numel].copy_(grad.reshape(-1))
        else:
            torch.cat([g.reshape(-1).float() for g in grad], out=padded[:unit.numel])
        padded[unit.numel:].zero_()
        return sh.shard(unit), sh.reduce_grad(unit, padded)

    def _submit(self, unit: Unit, lr: float, grad, zero: bool, recycle: bool = False) -> None:
        self.weights.mark_updating(unit)
        self._slots.acquire()  # back-pressure: RAM holds only a few pending updates
        guard = self._guard

        def run():
            try:
                self._apply(unit, lr, grad, zero, guard=guard)
            except BaseException:
                self.weights.update_failed(unit)  # readers must not wait forever for it
                raise
            finally:
                if recycle:
                    self._grad_pool.give(grad)
                self._slots.release()
        self._pending[unit.index] = self._worker.submit(run)

    def finish(self, step: StepContext, loss: Optional[float] = None) -> tuple[Optional[float], bool]:
        """After the micro-batch's gradients all arrived. With clipping: the loss and the global
        norm are checked (finite.py), every unit's update is queued, in :attr:`update_order`,
        and (the norm before clipping, skipped) returned; the next forward waits per unit. A
        non-finite step still queues its updates, as no-ops (the reads planned for them are
        consumed, the gradients zeroed); under 'stop' it then raises."""
        if not step.clipped:
            return None, False
        with self._norm_lock:
            sq, self._norm_sq = self._norm_sq, 0.0
        if self.sharded is not None:
            # The global norm: one all-reduce of the shards' squares. A rank whose own loss is
            # NaN/inf adds a NaN, so every rank sees a non-finite norm and takes the same
            # decision (skip or stop) -- ranks must never disagree on applying a step.
            if loss is not None and not math.isfinite(loss):
                sq = float("nan")
            sq = self.sharded.global_norm_sq(sq)
            loss = None   # this rank's share only: the error names the global norm, alike on every rank
        total = sq ** 0.5
        try:
            skip, stop = not finite.apply_step(loss, total, self.next_step(), self.policy), None
        except finite.NonFiniteError as e:
            skip, stop = True, e
        if skip and stop is None:
            self.counters.add("skipped_steps", 1)
        coef = step.clip / (total + 1e-6)   # as torch.nn.utils.clip_grad_norm_
        coef = coef if coef < 1.0 else None   # (clip inf, or a NaN norm: no scaling)
        order = [u for u in self.update_order if u.numel > 0]
        futures = {}
        for u in order:
            self.weights.mark_updating(u)
            futures[u.index] = self._pending[u.index] = Future()

        def run():
            for i, u in enumerate(order):
                try:
                    self._apply(u, step.lr, None, True, grad_coef=coef, skip=skip)
                except BaseException as e:  # noqa: BLE001 - delivered to whoever waits on the units
                    for v in order[i:]:
                        futures[v.index].set_exception(e)
                        self.weights.update_failed(v)
                    return
                futures[u.index].set_result(None)
        self._worker.submit(run)
        if stop is not None:
            raise stop
        return total, skip

    def end(self) -> None:
        """The micro-batch is over (or failed): gradients accumulate again."""
        self._step = _ACCUMULATE

    # ------------------------------------------------------------------ 6: one update
    def _apply(self, unit: Unit, lr: float, grad: Optional[torch.Tensor] = None, zero: bool = False,
               grad_coef: Optional[float] = None, skip: bool = False,
               guard: Optional[finite.StepGuard] = None) -> None:
        """``skip``: a non-finite step -- weights and states go back as they came."""
        t0 = time.perf_counter()
        self.weights.mark_updating(unit)
        held = self._held.pop(unit.index, None)
        in_ram = self._held_ram.pop(unit.index, None)
        own = False   # grad is a pool buffer this update hands back
        if grad is None and in_ram is not None:   # hold="host": kept since it arrived
            grad, own = in_ram, True
        elif grad is None and held is not None:   # hold="disk": the final gradient comes back
            held.result()
            grad = self._grad_pool.take(unit.numel)
            try:
                self.disk.read(self._hold_key(unit), {"g": grad}, urgent=True).result()
            except BaseException:
                self._grad_pool.give(grad)
                raise
            own = True
        error = None
        try:
            m, v = self.states.load(unit)
            params = self.weights.for_update(unit)
            grad = grad if grad is not None else self.grads.grad(unit)
            if guard is not None:
                skip, error = guard.check(unit.name, grad, finite=self._votes.pop(unit.index, None))
                if error is not None and not error.partial and guard.policy == "skip":
                    self.counters.add("skipped_steps", 1)
                    error = None
            norm = self._unit_norm.pop(unit.index, None)   # set by a clipped step only
            if not skip:
                if grad_coef is not None:
                    grad.mul_(grad_coef)
                    norm = None if norm is None else norm * grad_coef   # (equal up to rounding)
                self.adam.step_unit(unit, params, grad, m, v, lr, grad_norm=norm)
            self.weights.update_done(unit, params)
            self.states.store(unit, m, v)
        except BaseException:
            self.states.update_failed(unit)   # its state reads may go ahead again
            raise
        finally:
            if own:
                self._grad_pool.give(grad)
        if zero:
            self.grads.zero_unit(unit)
        self.counters.add("optimizer_seconds", time.perf_counter() - t0)
        if error is not None:
            raise error

    def update_all(self, lr: float, grad_norm: Optional[float] = None) -> bool:
        """Every unit's update now, in this thread (``optimizer_step``); ``grad_norm`` (the
        global one) is checked first. Returns False when the step was skipped (non-finite)."""
        self.wait_all()
        if not finite.apply_step(None, grad_norm, self.next_step(), self.policy):
            self.counters.add("skipped_steps", 1)
            return False
        t0 = time.perf_counter()
        self.weights.schedule([], self.units)
        self.states.schedule(self.units)  # disk reads ahead of the updates
        try:
            for u in self.units:
                if u.numel > 0:
                    self._apply(u, lr)
            self.states.flush()
        except BaseException as e:
            self.failed = e  # some units may be updated and others not
            self._settle_disk()
            raise
        self.counters.add("optimizer_exposed_seconds", time.perf_counter() - t0)
        return True

    # ------------------------------------------------------------------ 7: waiting for updates
    def ready_weights(self, unit: Unit) -> torch.Tensor:
        """A unit's fp32 master weights for the device (the pager's source); waits for that
        unit's pending update only."""
        self.wait(unit)
        return self.weights.for_transfer(unit)

    def wait(self, unit: Unit) -> None:
        fut = self._pending.get(unit.index)
        if fut is None:
            return
        t0 = time.perf_counter()
        try:
            fut.result()
        except BaseException as e:
            # Delivered once; the engine then refuses to train on (see check()) -- except after
            # a non-finite step none of whose updates was applied: reported by the next call.
            self._pending.pop(unit.index, None)
            if isinstance(e, finite.NonFiniteError) and not e.partial:
                self.nonfinite = e
            else:
                self.failed = e
                self._settle_disk()
            raise
        self._pending.pop(unit.index, None)
        self.counters.add("optimizer_exposed_seconds", time.perf_counter() - t0)

    def wait_all(self) -> None:
        try:
            for u in self.units:
                self.wait(u)
        except finite.NonFiniteError:
            self.nonfinite = None  # reported here, to this caller
            raise
        try:
            self.states.wait_encodes()   # compressed states: encoded and written behind
        except BaseException as e:
            self.failed = e   # that unit's states were not written
            self._settle_disk()
            raise

    def raise_nonfinite(self) -> None:
        """A stopped non-finite step met in a worker or another thread: reported once."""
        e, self.nonfinite = self.nonfinite, None
        if e is not None:
            raise e

    def _settle_disk(self) -> None:
        """After a failed update: let the disk operations still in flight finish (a failed
        write removes its own temporary file), so the error leaves the offload folder settled."""
        if self.disk is not None:
            try:
                self.disk.flush()
            except BaseException:  # noqa: BLE001 - the first error is the one being raised
                pass

    def check(self) -> None:
        """Raise if an update failed earlier (weights and states may be out of step), or a
        stopped non-finite step is not reported yet."""
        self.raise_nonfinite()
        failed = self.failed
        if failed is not None:
            raise RuntimeError(f"an optimizer update failed earlier ({type(failed).__name__}: {failed}); weights and "
                               "optimizer states may be out of step. Fix the cause, then load_checkpoint() a saved "
                               "checkpoint or build a new engine.") from failed

    def check_intact(self, what: str) -> None:
        """After a failed update some units hold the new step and others the old one: reading
        or saving the weights would hand out a mixture, so it is refused until a load."""
        try:
            self.wait_all()
        except finite.NonFiniteError:
            raise  # a stopped step: nothing was applied, but the caller must hear of it
        except BaseException:  # noqa: BLE001 - recorded in self.failed and reported below
            pass
        self.raise_nonfinite()
        failed = self.failed
        if failed is not None:
            raise RuntimeError(f"{what} refused: an optimizer update failed ({type(failed).__name__}: {failed}), so "
                               "the weights hold a half-applied step. load_checkpoint() a saved checkpoint (or "
                               "build a new engine) first.") from failed

    def settle(self) -> None:
        """Before weights and states are replaced (loading a checkpoint): wait for every
        update; a failure stays recorded until :meth:`clear_failure`."""
        try:
            self.wait_all()
        except BaseException:  # noqa: BLE001 - a failed update is what loading repairs
            pass

    def clear_failure(self) -> None:
        """Weights and states were replaced consistently: training may go on."""
        self.failed = self.nonfinite = None

    def buffer_bytes(self) -> int:
        """Recycled final-gradient buffers held in RAM (and, sharded, the reduce-scatter's input)."""
        rs = self._rs_buf.numel() * 4 if self._rs_buf is not None else 0
        return self._grad_pool.nbytes() + rs

    def drain(self) -> None:
        """Wait for every update; an error already delivered is not raised again."""
        delivered = self.failed is not None
        try:
            self.wait_all()
        except BaseException:  # noqa: BLE001
            if not delivered:
                raise

    def close(self) -> None:
        """Stop the worker (after the updates queued on it)."""
        self._worker.shutdown(wait=True)
