"""UpdateRunner: the AdamW worker (``mtnb-adamw``) and every pending update.

Each update runs on the AdamW worker and its team's helpers (``UnitAdamW.team``:
``EngineConfig.optimizer_threads``), the results one thread's bit for bit.

One unit's update (:meth:`UpdateRunner.apply`): its final gradient (handed over, claimed from
where it was held for the norm: ``final_grads.FinalGradients.claim``, or the accumulator), its
weights (``weights.for_update``), AdamW, the weights written (``weights.update_done``: on the
disk tier written behind, a fresh copy kept for the next forward) and the optimizer states. Compressed states are updated in chunks
(``OptimizerStates.update``: decode a slice of the moments, AdamW on that slice, encode it),
so only chunk-sized fp32 moments exist; fp32 states are updated where they lie.

The next forward waits for exactly the unit it needs (:meth:`ready_weights`); a failed update
is delivered there once and recorded in the :class:`~.outcome.StepOutcome`.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Callable, Deque, Dict, List, Optional, Sequence, Tuple

import torch

from . import finite
from .final_grads import FinalGradients
from ..outcome import StepOutcome
from ...threads import ADAMW, executor, torch_threads_here
from ..units import Unit, train_numel


class UpdateRunner:
    """Collaborators: ``grads`` (HostStore: accumulators, zeroed after their update),
    ``weights`` (WeightStore), ``states`` (OptimizerStates), ``adam`` (UnitAdamW),
    ``outcome`` (StepOutcome), ``final`` (FinalGradients: a unit's held final gradient, its
    norm, the ranks' vote on it), ``disk`` (settled after a failure). ``depth``: units queued
    for an update at once (back-pressure)."""

    def __init__(self, units: List[Unit], *, grads, weights, states, adam, counters, outcome: StepOutcome,
                 final: FinalGradients, policy: str, disk=None, depth: int = 1):
        self.units = units
        self.grads = grads
        self.weights = weights
        self.states = states
        self.adam = adam
        self.counters = counters
        self.outcome = outcome
        self.final = final
        self.policy = policy
        self.disk = disk
        self.guard: Optional[finite.StepGuard] = None   # the straight step's per-unit NaN/inf check
        self._pending: Dict[int, Future] = {}           # unit index -> its update of the last step
        self._worker = executor(ADAMW)
        # torch's ops in the worker (the compute-dtype shadow's cast) on the team's count, set for
        # this thread only. At 1 (a CPU device) the worker keeps torch's default OpenMP team: with
        # it and the copy threads' teams the process has more OpenMP threads than cores and
        # libgomp throttles its spin-wait; with the compute's team alone its idle thread spins
        # after every parallel region (measured: the compute's CPU 4.0-4.3 core-s a step against
        # 1.1, bench_overlap's model, disk tier, load 6-7; 1.1 with OMP_WAIT_POLICY=passive)
        if adam.team.threads > 1:
            self._worker.submit(torch_threads_here, adam.team.threads)
        self._slots = threading.BoundedSemaphore(depth)
        # the last updates' (start, end, seconds waited for the disk tier) in the worker, newest
        # last: the part of a forward's wait for them that was the disk's (exposed_disk)
        self._spans: Deque[Tuple[float, float, float]] = deque(maxlen=len(units) + 8)
        self._spans_lock = threading.Lock()

    def next_step(self) -> int:
        """The number of the optimizer step about to be applied (1-based, survives a resume)."""
        # tuple() copies in one step: the AdamW worker may be adding the last step's counts
        return 1 + max((int(s) for s in tuple(self.adam.steps.values())), default=0)

    def begin(self, straight: bool) -> None:
        """A training micro-batch starts. Straight updates start during the backward, before the
        global norm is known: each checks its own gradient first (finite.StepGuard)."""
        self.guard = finite.StepGuard(self.next_step(), self.policy) if straight else None

    # ------------------------------------------------------------------ queueing
    def reserve(self, unit: Unit) -> Callable[[], None]:
        """Wait for a free update slot for ``unit`` (back-pressure: RAM holds only ``depth``
        pending updates); returns how to give it up if the update is not submitted."""
        self.weights.mark_updating(unit)
        self._slots.acquire()

        def cancel():
            self._slots.release()
            self.weights.update_failed(unit)
        return cancel

    def submit(self, unit: Unit, lr: float, grad: Optional[torch.Tensor], zero: bool,
               release: Optional[Callable] = None, reserved: bool = False) -> None:
        """Queue one unit's update (the gradient thread, as its gradient becomes final);
        ``reserved``: its slot was taken by :meth:`reserve`."""
        if not reserved:
            self.reserve(unit)
        guard = self.guard

        def run():
            try:
                self.apply(unit, lr, grad, zero=zero, guard=guard, release=release)
            except BaseException:
                self.weights.update_failed(unit)  # readers must not wait forever for it
                raise
            finally:
                self._slots.release()
        self._pending[unit.index] = self._worker.submit(run)

    def submit_after_norm(self, order: Sequence[Unit], lr: float, coef: Optional[float], skip: bool) -> None:
        """Queue every unit's update, in ``order``, once the global norm is known (scaled by
        ``coef``; ``skip``: a non-finite step, every update a no-op)."""
        futures = {}
        for u in order:
            self.weights.mark_updating(u)
            futures[u.index] = self._pending[u.index] = Future()

        ranged = self.states.chunked and not self.adam.collect_stats

        def run():
            for i, u in enumerate(order):
                try:
                    if i + 1 < len(order):   # the next unit's held gradient read back meanwhile
                        self.final.read_ahead(order[i + 1], ranged)
                    self.apply(u, lr, None, zero=True, grad_coef=coef, skip=skip)
                except BaseException as e:  # noqa: BLE001 - delivered to whoever waits on the units
                    for v in order[i:]:
                        futures[v.index].set_exception(e)
                        self.weights.update_failed(v)
                    return
                futures[u.index].set_result(None)
        self._worker.submit(run)

    def after_updates(self, fn: Callable[[], object]) -> Future:
        """Run ``fn()`` in the AdamW worker after every update queued so far and before any
        queued later (a snapshot takes the step's state there without waiting for it). Raises
        through the Future, without calling ``fn``, when one of those updates failed."""
        queued = list(self._pending.values())

        def run():
            for f in queued:
                err = f.exception() if f.done() else None
                if err is not None:
                    raise RuntimeError(f"an update of the step failed ({type(err).__name__}: {err}); "
                                       "its state is not snapshotted") from err
            return fn()
        return self._worker.submit(run)

    # ------------------------------------------------------------------ one update
    def apply(self, unit: Unit, lr: float, grad: Optional[torch.Tensor] = None, *, zero: bool = False,
              grad_coef: Optional[float] = None, skip: bool = False, guard: Optional[finite.StepGuard] = None,
              release: Optional[Callable] = None) -> None:
        """``skip``: a non-finite step -- weights and states go back as they came. ``release``
        hands ``grad``'s buffer back when the update is done with it."""
        t0, disk0 = time.perf_counter(), self.states.disk_wait()
        self.weights.mark_updating(unit)
        if grad is None:   # (an update in chunks reads a gradient held on the disk tier chunk by chunk)
            grad, release = self.final.claim(unit, self.states.chunked and not self.adam.collect_stats)
        error = None
        try:
            grad = grad if grad is not None else self.grads.grad(unit)
            if guard is not None:
                skip, error = guard.check(unit.name, grad, finite=self.final.vote(unit))
                if error is not None and not error.partial and guard.policy == "skip":
                    self.counters.add("skipped_steps", 1)
                    error = None
            norm = self.final.unit_norm(unit)   # set by a clipped step only
            if not skip and grad_coef is not None:
                if torch.is_tensor(grad):
                    grad.mul_(grad_coef)
                else:   # a HeldGradient: each chunk scaled as it is read
                    grad.coef = grad_coef
                norm = None if norm is None else norm * grad_coef   # (equal up to rounding)
            self._step(unit, lr, grad, skip, norm)
        except BaseException:
            self.states.update_failed(unit)   # its state reads may go ahead again
            raise
        finally:
            if release is not None:
                release(grad)
        if zero:
            self.grads.zero_unit(unit)
        t1 = time.perf_counter()
        self.counters.add("optimizer_seconds", t1 - t0)
        with self._spans_lock:
            self._spans.append((t0, t1, self.states.disk_wait() - disk0))
        if error is not None:
            raise error

    def _step(self, unit: Unit, lr: float, grad: torch.Tensor, skip: bool, norm: Optional[float]) -> None:
        """AdamW on one unit: weights taken and written; the states whole or in chunks. ``grad``
        a tensor, or a HeldGradient (chunked states only) read with each chunk's moments."""
        held = not torch.is_tensor(grad)
        stats = self.adam.collect_stats and not held
        # (compressed states step every element: a codec's chunk is encoded whole)
        reached = self.grads.take_reached(unit)
        # (a unit with a frozen tail is rewritten whole: a ranged rewrite covers the part that trains only)
        whole = train_numel(unit) < unit.numel
        rw = self.weights.ranged_update(unit) if self.states.chunked and not stats and not whole else None
        if rw is not None:
            self._step_ranged(unit, lr, grad, skip, norm, rw)
            return
        params = self.weights.for_update(unit)
        if self.states.chunked:
            if skip:
                self.states.update(unit, None)
            else:
                run = self.adam.start_unit(unit, params, collect_stats=stats)
                self.states.update(unit, _chunk_step(run, grad, lr), grads=grad if held else None)
                run.finish(grad, grad_norm=norm)
        else:
            m, v = self.states.load(unit)
            if not skip:   # (what no backward reached stays as it is, as torch's AdamW leaves a grad of None)
                self.adam.step_unit(unit, params, grad, m, v, lr, grad_norm=norm, reached=reached)
            self.states.store(unit, m, v)
        self.weights.update_done(unit, params)

    def _step_ranged(self, unit: Unit, lr: float, grad: torch.Tensor, skip: bool, norm: Optional[float],
                     rw) -> None:
        """AdamW on one unit whose weights are read and written range by range on the disk tier
        (``weights.ranged_update``): the states' chunked update reads each chunk's slice of the
        weights with its moments (a chunk ahead, in ``mtnb-decode``), AdamW runs on it here and
        it is written to the weights' new version with the moments (a chunk behind, in
        ``mtnb-encode``); committed after the states. A skipped step leaves both files."""
        try:
            if skip:
                rw.abort(None)
                self.states.update(unit, None)
            else:
                run = self.adam.start_unit(unit, None, collect_stats=False)
                held = not torch.is_tensor(grad)
                self.states.update(unit, _chunk_step(run, grad, lr), weights=rw, grads=grad if held else None)
                run.finish(grad, grad_norm=norm)
                rw.commit(behind=True)   # synced and renamed behind: the next read of it waits
        except BaseException as e:
            rw.abort(e)
            raise
        self.weights.update_done(unit, None)

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
                if train_numel(u) > 0:
                    self.apply(u, lr)
            self.states.flush()
        except BaseException as e:
            self.outcome.record_failure(e)  # some units may be updated and others not
            self.settle_disk()
            raise
        self._exposed(t0)
        return True

    def _exposed(self, t0: float) -> None:
        """A wait for updates from ``t0`` to now: ``optimizer_exposed_seconds``, and of it
        ``optimizer_exposed_disk_seconds``: the disk tier's share of the updates it overlapped
        (each update's wait for the disk spread evenly over its span)."""
        t1 = time.perf_counter()
        with self._spans_lock:
            spans = list(self._spans)
        disk = sum(d * (min(e, t1) - max(s, t0)) / max(e - s, 1e-9) for s, e, d in spans if d > 0 and e > t0 and s < t1)
        self.counters.add("optimizer_exposed_seconds", t1 - t0)
        self.counters.add("optimizer_exposed_disk_seconds", min(disk, t1 - t0))

    # ------------------------------------------------------------------ waiting for updates
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
            # Delivered once; the engine then refuses to train on (StepOutcome.check) -- except
            # after a non-finite step none of whose updates was applied: reported by the next call.
            self._pending.pop(unit.index, None)
            self.outcome.record_failure(e)
            if self.outcome.failed is e:
                self.settle_disk()
            raise
        self._pending.pop(unit.index, None)
        self._exposed(t0)

    def wait_all(self) -> None:
        try:
            for u in self.units:
                self.wait(u)
        except finite.NonFiniteError as e:
            self.outcome.reported(e)  # reported here, to this caller
            raise
        try:
            self.states.wait_encodes()   # compressed states: encoded and written behind
        except BaseException as e:
            self.outcome.record_failure(e)   # that unit's states were not written
            self.settle_disk()
            raise

    def settle_disk(self) -> None:
        """After a failed update: let the disk operations still in flight finish (a failed
        write removes its own temporary file), so the error leaves the offload folder settled."""
        if self.disk is not None:
            try:
                self.disk.flush()
            except BaseException:  # noqa: BLE001 - the first error is the one being raised
                pass

    def close(self) -> None:
        """Stop the worker (after the updates queued on it) and the update's helper threads."""
        self._worker.shutdown(wait=True)
        self.adam.close()


def _chunk_step(run, grad, lr: float) -> Callable:
    """``apply(a, b, m, v[, p][, g])`` for ``ChunkRing.run``: AdamW on elements ``[a, b)`` with
    the chunk's weights ``p`` when they are read with it (a ranged rewrite), and its gradient
    ``g`` when ``grad`` is read chunk by chunk (a HeldGradient), else ``grad``'s slice."""
    if torch.is_tensor(grad):
        return lambda a, b, m, v, p=None: run.step(a, b, grad, m, v, lr, params=p)
    return lambda a, b, m, v, *pg: run.step(a, b, pg[-1], m, v, lr, params=pg[0] if len(pg) == 2 else None,
                                            grads_at=a)
