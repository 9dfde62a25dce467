"""Runs that recover by themselves: ``on_nonfinite="rewind"``.

A long unattended run that diverges does what a person watching would do: go back, lower the
learning rate, step over the data that blew up, and go on.

- **When**: a step's loss or gradient is NaN/inf (the engine refuses it before any update, as
  under "stop"), or, with ``loss_spike=z``, a step's loss is more than ``z`` robust standard
  deviations (1.4826 x the median absolute deviation) above the median of the last
  ``loss_spike_window`` steps' losses (tested once at least 8 are known; only upward).
- **Where to**: the newest snapshot of this run's lineage before the step that diverged that
  checks whole (``saving.verify_whole``; a damaged one is listed as damaged and the next older
  tried). A non-finite step with no snapshot before it goes on from where it is (nothing of it
  was applied); a spike without one stops.
- **Then**: the learning rate from there on is the schedule's times ``recover_lr_factor`` per
  recovery (cumulative: two recoveries, x0.25), the data window of the step that diverged is
  stepped over (named in the event: its step, epoch and batch numbers) and the run goes on as a
  branch (a new run id whose parent is the abandoned one, so the abandoned steps stay in the run
  tree). After ``max_recoveries`` the run stops with :class:`RecoveryError` listing every attempt.
- **Snapshots**: with this policy and no ``snapshot_steps`` elsewhere (a Session's, torchrun's
  ``MEGATRAIN_NB_SNAPSHOT_STEPS``), the Trainer takes one every :func:`default_every` steps and
  keeps the newest 3 (never one a recovery went back to). The interval is a function of the run's
  length only: a run recovers at the same step to the same weights on any machine (a default
  from measured step times would not).
- **Several ranks**: the loss is the global one and a non-finite step is refused on every rank,
  so every rank recovers at the same boundary; rank 0 picks the snapshot and every rank takes
  its answer; loading is collective.

Every recovery is a ``{"event": "recovery", ...}`` line in metrics.jsonl, a ``recovery`` event
in a Session (its dashboard markers, ``%megatrain status``, the report) and a branch in its tree.
"""
from __future__ import annotations

import math
import statistics
import time
from pathlib import Path
from typing import Optional

from .saving import verify_whole
from .snapshot import BranchStart, SnapshotStore, apply_branch_start

#: snapshots the Trainer keeps for recovery (its own ones, besides those a recovery went back to)
KEEP = 3
MIN_SPIKE_HISTORY = 8


class RecoveryError(FloatingPointError):
    """A run with on_nonfinite='rewind' could not recover (the message lists every attempt);
    ``step``: the step that diverged last (the weights are those of the step before)."""

    def __init__(self, message: str, step: Optional[int] = None):
        super().__init__(message)
        self.step = step


class Diverged(Exception):
    """A step to recover from: its number, why, and whether its update went in (a spike)."""

    def __init__(self, step: int, reason: str, applied: bool):
        super().__init__(reason)
        self.step, self.reason, self.applied = step, reason, applied


def reason_of(error: BaseException) -> str:
    """What diverged, in one line (a NonFiniteError's values, a spike's z-score)."""
    if isinstance(error, Diverged):
        return error.reason
    values = ", ".join(f"{k}={v}" for k, v in (("loss", getattr(error, "loss", None)),
                                               ("gradient norm", getattr(error, "grad_norm", None))) if v is not None)
    unit = getattr(error, "unit", None)
    where = f" in the gradient of {unit}" if unit else (f" ({values})" if values else "")
    return f"non-finite loss/gradient at step {getattr(error, 'step', '?')}{where}"


def default_every(total: int) -> int:
    """Automatic snapshot interval: about 20 per run, at least every step, at most every 200."""
    return max(1, min(200, int(total) // 20 or 1))


def robust_z(loss: float, history: list) -> Optional[float]:
    """How many robust standard deviations ``loss`` lies above the median of ``history`` (None:
    too few values, or no spread to measure against)."""
    if len(history) < MIN_SPIKE_HISTORY:
        return None
    med = statistics.median(history)
    mad = statistics.median(abs(x - med) for x in history)
    if mad <= 0:
        return None
    return (loss - med) / (1.4826 * mad)


class Recovery:
    """The on_nonfinite='rewind' policy of one Trainer (see the module docstring)."""

    def __init__(self, trainer, config):
        self.trainer = trainer
        self.spike = config.loss_spike
        self.window = int(config.loss_spike_window)
        self.factor = float(config.recover_lr_factor)
        self.limit = int(config.max_recoveries)
        self.attempts: list = []
        self.skip: set = set()          # (epoch, consumed) positions whose window is stepped over
        self.losses: dict = {}          # step -> loss of the steps kept
        self.positions: dict = {}       # step -> (epoch, consumed, batches) of its window
        self.scale_of_run: dict = {}    # run id -> the LR scale in force while it trained
        self.protected: set = set()
        self.every: Optional[int] = None
        self._snapshot_run: Optional[str] = None

    # ---- during the run -----------------------------------------------------------------------
    def start(self, total: int, external_every: Optional[int]) -> None:
        """At a run's start: automatic snapshots unless someone else takes them."""
        self.every = None if external_every else default_every(total)
        self.scale_of_run.setdefault(self.trainer.run_id, self.scale())

    def scale(self) -> float:
        return self.factor ** len(self.attempts)

    def window_at(self, step: int, stream) -> None:
        """Before step ``step`` takes its window: remember where it starts; step over a window
        a recovery marked."""
        pos = (stream.epoch, stream.consumed)
        while pos in self.skip:
            self.skip.discard(pos)
            _, ended = stream.next_window(self.trainer.args.gradient_accumulation_steps)
            if ended:
                stream.start_next_epoch()
            pos = (stream.epoch, stream.consumed)
        self.positions[step] = pos
        for old in [s for s in self.positions if s < step - 4 * self.window]:
            del self.positions[old]

    def check(self, record: dict) -> None:
        """A step just applied: raise :class:`Diverged` when its loss is not finite or spiked,
        else its loss joins the window."""
        step, loss = int(record["step"]), float(record["loss"])
        if not math.isfinite(loss):
            raise Diverged(step, f"non-finite loss {loss} at step {step}", applied=True)
        if self.spike is not None:
            recent = [self.losses[s] for s in sorted(self.losses)[-self.window:]]
            z = robust_z(loss, recent)
            if z is not None and z > self.spike:
                raise Diverged(step, f"loss spike at step {step}: {loss:.6g} is {z:.1f} robust standard deviations "
                                     f"above the median {statistics.median(recent):.6g} of the last {len(recent)} "
                                     f"steps (loss_spike={self.spike:g})", applied=True)
        self.losses[step] = loss
        for old in sorted(self.losses)[:-self.window]:
            del self.losses[old]

    def after_step(self, step: int) -> None:
        """Automatic snapshots (every rank, the same steps)."""
        if not self.every or step % self.every:
            return
        t = self.trainer
        store = SnapshotStore(t.args.output_dir)
        store.take(t)
        if t.dist.is_main:
            store.prune(KEEP, protect=self.protected, run_ids=list(self.scale_of_run))

    # ---- a recovery -----------------------------------------------------------------------------
    def recover(self, step: int, reason: str, applied: bool, total: int):
        """Go back from step ``step`` (``applied``: its update went in, a spike) and return the
        data stream to go on with. Raises :class:`RecoveryError` when it cannot."""
        t = self.trainer
        old_run, old_step = t.run_id, int(t.state.global_step)
        if len(self.attempts) >= self.limit:
            raise RecoveryError(self._exhausted(step, reason), step)
        pos = self.positions.get(step)
        target = self._load_newest(step, total)
        if target is None and applied:
            raise RecoveryError(f"{reason}: no snapshot before step {step} to go back to (with on_nonfinite="
                                "'rewind' the Trainer takes them; set snapshot_steps lower). " + self._listing(), step)
        stream = t.data_stream
        if target is None:   # nothing of the step was applied: go on from here as a branch
            t.engine.zero_grad()
            t.schedule = apply_branch_start(t, BranchStart(new_run=True), stream, total)
            _one_run_id(t)
            to_step, path = old_step, None
        else:
            path, stream = target
            to_step = int(t.state.global_step)
        scale_before = self.scale_of_run.get(old_run if target is None else self._snapshot_run, 1.0)
        self.attempts.append({"step": step, "reason": reason})
        t.schedule.set_lr(t.schedule.current() * self.scale() / scale_before)
        self.scale_of_run[t.run_id] = self.scale()
        if pos is not None:
            self.skip.add(pos)
        self.losses = {s: v for s, v in self.losses.items() if s <= to_step}
        event = {"event": "recovery", "step": step, "reason": reason, "from_step": old_step, "to_step": to_step,
                 "snapshot": path, "abandoned_run_id": old_run, "attempt": len(self.attempts),
                 "max_recoveries": self.limit, "lr_factor": self.scale(), "lr": t.schedule.current(),
                 "skipped_window": _window_text(step, pos, t), "time": time.time()}
        self.attempts[-1].update(to_step=to_step, snapshot=path)
        t.metrics_log.run_id, t.metrics_log.lineage = t.run_id, t.lineage
        t.metrics_log.write(event)
        t.hooks.on_recovery(dict(event))
        return stream

    def _load_newest(self, step: int, total: int):
        """Load the newest snapshot before ``step`` that checks: (its path, a fresh stream), or None."""
        t = self.trainer
        for path in self._candidates(step):
            try:
                verify_whole(Path(path), t.engine, t.dist)
            except (ValueError, OSError):
                continue   # damaged: listed as such (saving.verify_whole); the next older one
            self._snapshot_run = SnapshotStore(t.args.output_dir).info(path).run_id
            stream = t.fresh_stream()
            t.load_state(Path(path), stream, quiet=True)
            t.schedule = apply_branch_start(t, BranchStart(new_run=True), stream, total)
            _one_run_id(t)
            self.protected.add(str(path))
            return str(path), stream
        return None

    def _candidates(self, step: int) -> list:
        """This lineage's snapshots before ``step``, newest first (rank 0 looks, every rank takes its list)."""
        t = self.trainer
        t.wait_snapshot()   # (one completing in the background is listed, whatever its timing)
        found = None
        if t.dist.is_main:
            reach = self._lineage()
            infos = [i for i in SnapshotStore(t.args.output_dir).list()
                     if i.run_id in reach and i.step < step and i.step <= reach[i.run_id]]
            found = [i.path for i in sorted(infos, key=lambda i: (i.step, i.time), reverse=True)]
        if t.dist.world > 1:
            found = t.dist.all_gather_json(found)[0]
        return found

    def _lineage(self) -> dict:
        """run id -> the last step of it this run descends from (the recoveries' branches and
        the run the trainer was forked from)."""
        t = self.trainer
        reach = {t.run_id: math.inf}
        for rid in self.scale_of_run:
            reach.setdefault(rid, math.inf)
        if t.parent_run_id is not None:
            reach.setdefault(t.parent_run_id, t.forked_at_step if t.forked_at_step is not None else math.inf)
        return reach

    def _listing(self) -> str:
        if not self.attempts:
            return "No recovery was attempted before."
        return "Recoveries: " + "; ".join(
            f"{i}. {a['reason']} -> back to step {a.get('to_step')}" for i, a in enumerate(self.attempts, 1))

    def _exhausted(self, step: int, reason: str) -> str:
        return (f"{reason}: the run diverged again after {len(self.attempts)} recoveries (max_recoveries="
                f"{self.limit}), so it stops here. {self._listing()}. Lower the learning rate, set max_grad_norm, "
                "or look at the data windows named in metrics.jsonl's recovery events")


def _one_run_id(trainer) -> None:
    """Every rank takes rank 0's new run id (one run, as at a run's start)."""
    if trainer.dist.world > 1:
        trainer.run_id = trainer.dist.all_gather_json(trainer.run_id)[0]


def _window_text(step: int, pos, trainer) -> Optional[dict]:
    if pos is None:
        return None
    n = trainer.args.gradient_accumulation_steps * trainer.dist.world
    return {"step": step, "epoch": int(pos[0]), "batches": list(range(int(pos[1]), int(pos[1]) + n))}
