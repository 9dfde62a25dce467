"""UpdateScheduler: everything from "a unit's gradient is final" to "its update is written",
as four parts and the step's calls on them, each built after what it takes:

* :class:`~.outcome.StepOutcome` (``outcome.py``): the step's norm, whether it was skipped,
  a failure -- written by the scheduler and the runner, read by the engine.
* :class:`~.final_grads.FinalGradients` (``final_grads.py``): the final gradients held for
  the norm, their norms and the ranks' votes -- written by the intake, read by the runner.
* :class:`~.update_runner.UpdateRunner` (``update_runner.py``): the AdamW worker, the updates
  in chunks, fresh copies, the weights ready for the next forward.
* :class:`~.intake.GradientIntake` (``intake.py``): reduce, shard, hold for the norm -- each
  arriving gradient routed by the :class:`~.intake.IntakePolicy` given at construction, and
  handed to the runner.

A step, top to bottom:

1. :meth:`UpdateScheduler.context` and :meth:`begin` -- the micro-batch's :class:`StepContext`.
2. :meth:`plan_reads` -- the disk tier reads weights and optimizer states ahead, in the order
   the updates will want them.
3. :meth:`gradient_arrived` (the pager's gradient thread) -- the intake routes the gradient:
   accumulated, straight to its update (overlapping the backward of the units below), or
   held for the global norm.
4. :meth:`finish` -- with the norm to wait for: the loss and the norm are checked (finite.py),
   every update queued in :attr:`update_order`, scaled by the clip coefficient.
5. :meth:`ready_weights` -- the next forward waits for exactly that unit's update.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import List, Optional, Sequence

import torch

from . import finite
from .final_grads import HOLD_WRITES, FinalGradients
from ..tiers.host_store import BufferPool
from .intake import GradientIntake, IntakePolicy, StepContext
from ..outcome import StepOutcome
from .update_runner import UpdateRunner
from ..units import Unit, forward_order, train_numel
from ..tiers.disk_cache import step_accesses

__all__ = ["StepContext", "UpdateScheduler", "final_gradient_pool_bytes"]


def final_gradient_pool_bytes(units: Sequence[Unit], depth: int, clipped: Optional[bool],
                              held_in_ram: bool = False) -> int:
    """The final-gradient buffers worth keeping for a step (``clipped`` None: any step). A
    gradient that goes straight to its update is in one of ``depth + 1`` buffers: the units
    being updated and the one gradient next in line (a window's sum being formed on a CPU
    "device", or one copied off the device while the update before it runs). A clipping
    step's come back from the norm's hold one by one (and ``hold="disk"`` has a few writes in
    flight). A tied embedding's sum (CPU "device": a lent buffer) is formed through the whole
    backward beside them. The planner counts the same (``planner.host_in_flight``).

    ``held_in_ram``: a clipping step whose final gradients wait for the norm in host RAM
    (``hold="host"``) holds one buffer per unit at once, and the plan counts them (the host's
    ``grads``, every unit's fp32 gradient): the pool keeps them all for the next such step.
    Kept to the buffers above only, the units' beyond them were freed after their updates and
    made afresh by the next step's backward, each a new mapping faulted in and zeroed on the
    compute's threads (bench_overlap's clipped disk-tier step: 5 of 10 units' buffers, ~64 MiB
    a step)."""
    largest = max((train_numel(u) for u in units), default=0)
    n = depth + 1 + sum(1 for u in list(units)[:1] if getattr(u, "tied_output", False))
    if clipped is None or clipped:
        n += HOLD_WRITES
    held = sum(train_numel(u) for u in units) if clipped and held_in_ram else 0
    return (n * largest + held) * 4


class UpdateScheduler:
    """The engine's update parts, wired: ``outcome``, ``final``, ``runner``, ``intake``. Collaborators:
    ``grads`` (HostStore), ``weights`` (WeightStore), ``states`` (OptimizerStates), ``adam``
    (UnitAdamW), ``disk`` (the disk tier or None), ``sharded`` (data parallel), ``policy``
    (on_nonfinite), ``depth`` (units queued for an update at once), ``staged`` (gradients
    arrive in the transport's staging buffers: straight updates run there)."""

    def __init__(self, units: List[Unit], *, grads, weights, states, adam, counters, disk=None, depth: int = 1,
                 sharded=None, policy: str = "stop", staged: bool = False):
        self.units = units
        self.weights = weights
        self.states = states
        self.disk = disk
        self.depth = depth
        #: The order updates run in when they wait for the whole backward (clipping): the next
        #: forward's order, so that forward waits for each unit's update as late as possible.
        self.update_order: List[Unit] = forward_order(units)
        #: The order gradients become final in the backward (and straight updates run).
        self.gradient_order: List[Unit] = [units[-1]] + list(reversed(units[1:-1])) + [units[0]]
        self.outcome = StepOutcome()
        pool = BufferPool(max_bytes=final_gradient_pool_bytes(units, depth, None),
                          slot_numel=max((train_numel(u) for u in units), default=0))
        self.final = FinalGradients(pool, disk=disk)
        self.runner = UpdateRunner(units, grads=grads, weights=weights, states=states, adam=adam, counters=counters,
                                   outcome=self.outcome, final=self.final, policy=policy, disk=disk, depth=depth)
        self.intake = GradientIntake(units, grads=grads, pool=pool, final=self.final, runner=self.runner,
                                     sharded=sharded, staged=staged,
                                     policy=IntakePolicy(sharded=sharded is not None, on_nonfinite=policy,
                                                         hold_disk_ok=disk is not None))
        self.counters = counters

    # ------------------------------------------------------------------ a step
    def context(self, lr: Optional[float], clip: Optional[float], hold: str) -> StepContext:
        """The StepContext of a micro-batch (:meth:`.intake.IntakePolicy.context`)."""
        return self.intake.policy.context(lr, clip, hold)

    def begin(self, step: StepContext) -> None:
        """A training micro-batch starts. (A unit's pending update from the last step finishes
        before its forward reads it, so before its new gradient reaches the accumulator.)"""
        if step.updates:   # free buffers beyond what this step can have in flight
            held = step.clipped and not self.intake.policy.hold_on_disk(step)
            self.intake.pool.trim(final_gradient_pool_bytes(self.units, self.depth, step.clipped, held))
        self.intake.begin(step)
        self.runner.begin(step.straight)

    def votes(self) -> bool:
        """Whether a gradient arriving now is voted on by the ranks (its collective is
        announced when the gradient is handed to the gradient thread: engine/transport/issuer.py)."""
        return self.intake.policy.votes(self.intake.step)

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

        order = self.update_order if step.clipped else self.gradient_order
        set_schedule(step_accesses(compute_order, order, clipped=step.clipped,
                                   params_on_disk=getattr(self.weights, "disk", None) is not None,
                                   state_key=self.states.key, state_nbytes=self.states.stored_nbytes))

    def gradient_arrived(self, unit: Unit, grad):
        """The pager's gradient-return thread: a unit's gradient reached the host. Returns a
        Future when its update keeps the staging buffer (the pager reuses it once done)."""
        return self.intake.arrived(unit, grad)

    def finish(self, step: StepContext, loss: Optional[float] = None) -> tuple[Optional[float], bool]:
        """After the micro-batch's gradients all arrived. When the updates wait for the norm:
        the loss and the global norm are checked (finite.py), every unit's update is queued, in
        :attr:`update_order`, and (the norm before clipping, skipped) returned; the next forward
        waits per unit. A non-finite step still queues its updates, as no-ops (the reads planned
        for them are consumed, the gradients zeroed); under 'stop' it then raises."""
        if not step.clipped:
            self.outcome.record_step(None, False)
            return None, False
        total, loss = self.intake.global_norm(loss)
        try:
            skip, stop = not finite.apply_step(loss, total, self.runner.next_step(), self.runner.policy), None
        except finite.NonFiniteError as e:
            skip, stop = True, e
        if skip and stop is None:
            self.counters.add("skipped_steps", 1)
        coef = None
        if step.clip is not None:
            coef = step.clip / (total + 1e-6)   # as torch.nn.utils.clip_grad_norm_
            coef = coef if coef < 1.0 else None   # (a NaN norm: no scaling)
        self.runner.submit_after_norm([u for u in self.update_order if train_numel(u) > 0], step.lr, coef, skip)
        self.outcome.record_step(total, skip)
        if stop is not None:
            raise stop
        return total, skip

    def end(self) -> None:
        """The micro-batch is over (or failed): gradients accumulate again."""
        self.intake.end()

    def reported(self, error: Optional[BaseException] = None) -> None:
        """``error`` (None: any) raised by a step reached its caller: not reported again."""
        self.outcome.reported(error)

    # ------------------------------------------------------------------ the update runner's
    def ready_weights(self, unit: Unit) -> torch.Tensor:
        return self.runner.ready_weights(unit)

    def wait_all(self) -> None:
        self.runner.wait_all()

    def after_updates(self, fn) -> Future:
        """``fn()`` in the AdamW worker once the updates queued so far ran (UpdateRunner.after_updates)."""
        return self.runner.after_updates(fn)

    def update_all(self, lr: float, grad_norm: Optional[float] = None) -> bool:
        return self.runner.update_all(lr, grad_norm)

    # ------------------------------------------------------------------ the outcome's
    def check(self) -> None:
        self.outcome.check()

    def check_intact(self, what: str) -> None:
        """Wait for every update; refuse ``what`` after a failed one (StepOutcome.refuse_if_failed)."""
        try:
            self.runner.wait_all()
        except finite.NonFiniteError:
            raise  # a stopped step: nothing was applied, but the caller must hear of it
        except BaseException:  # noqa: BLE001 - recorded in the outcome and reported below
            pass
        self.outcome.refuse_if_failed(what)

    def settle(self) -> None:
        """Before weights and states are replaced (loading a checkpoint): wait for every
        update; a failure stays recorded until :meth:`clear_failure`."""
        try:
            self.runner.wait_all()
        except BaseException:  # noqa: BLE001 - a failed update is what loading repairs
            pass

    def clear_failure(self) -> None:
        """Weights and states were replaced consistently: training may go on."""
        self.outcome.clear()

    def drain(self) -> None:
        """Wait for every update; an error already delivered is not raised again."""
        delivered = self.outcome.failed is not None
        try:
            self.runner.wait_all()
        except BaseException:  # noqa: BLE001
            if not delivered:
                raise

    def close(self) -> None:
        self.runner.close()

    # ------------------------------------------------------------------ the intake's and the ledger's
    def lend_buffer(self, numel: int) -> torch.Tensor:
        return self.intake.lend_buffer(numel)

    def buffer_bytes(self) -> int:
        return self.intake.buffer_bytes()

    def held_ram_bytes(self) -> int:
        return self.final.held_ram_bytes()

    def held_disk_bytes(self) -> int:
        return self.final.held_disk_bytes()

    def held_cached_bytes(self) -> int:
        return self.final.held_cached_bytes()
