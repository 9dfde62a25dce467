"""What a Session shows of its run, read-only (``Session`` is a ``SessionReadout`` plus its
controls): the state and step, the run's log, its learning rate, its trainer, engine, branches
and prediction. Each attribute is a property with its own help (``help(Session.state)``)."""
from __future__ import annotations

import threading
from typing import Any, Optional

from megatrain_nb.learning_rate import LearningRate
from megatrain_nb.engine.updates.finite import NonFiniteError
from megatrain_nb.trainer.recovery import RecoveryError

from .snapshot_table import SnapshotTable


class SessionReadout:
    """The read-only half of a Session (see the module); the parts it reads (``_status``,
    ``_run``, ``_trainer``, ``_explore``, ``_view``, ``_samples``, ``_tokenizer``) are the
    Session's own."""

    # ---- the run's record ------------------------------------------------------------------------
    @property
    def state(self) -> str:
        """"idle" | "running" | "paused" | "stopped" | "finished" | "failed"."""
        return self._status.state

    @property
    def step(self) -> int:
        """Optimizer steps done."""
        return self._status.step

    @property
    def history(self) -> list[dict]:
        """One record per optimizer step (step, loss, lr, tokens_per_s, memory, ...)."""
        return self._status.log.records()

    @property
    def events(self) -> list[dict]:
        """Interventions in order: pause, resume, lr, checkpoint, stop, error (each with its step)."""
        return self._status.log.events()

    @property
    def run_log(self) -> Any:
        """The thread-safe log of records and events the dashboard and reports read."""
        return self._status.log

    @property
    def error(self) -> Optional[BaseException]:
        """The exception that ended a failed run (None otherwise); ``wait()`` re-raises it."""
        return self._status.error

    @property
    def error_traceback(self) -> Optional[str]:
        """The training thread's formatted traceback when the run failed, else None."""
        return self._status.error_traceback

    @property
    def released(self) -> bool:
        """True once the engine is released (device memory, threads, disk files): nothing left to
        checkpoint, sample or inspect."""
        return self._status.released

    @property
    def diverged(self) -> bool:
        """True when the run stopped on a NaN/inf loss or gradient (see ``on_nonfinite``)."""
        return isinstance(self._status.error, (NonFiniteError, RecoveryError))

    @property
    def total_steps(self) -> Optional[int]:
        """Optimizer steps the run plans (None when the trainer cannot tell)."""
        return self._run.total_steps()

    @property
    def wall_time_s(self) -> Optional[float]:
        """Seconds from ``train()`` to the end of the run (to its latest step while it runs);
        None before ``train()``."""
        st = self._status
        if st.started_at is None:
            return None
        end = st.ended_at or st.log.last_record().get("time", st.started_at)
        return end - st.started_at

    # ---- the learning rate -----------------------------------------------------------------------
    @property
    def learning_rate(self) -> LearningRate:
        """The run's learning rate, the one value every view reads: ``.last`` (the latest step's;
        the configured rate before the first step), ``.requested`` (a set_lr no step has used
        yet, or None), ``.applies_at`` (the step it applies to); ``.shown`` is the first of
        ``requested`` and ``last`` (what ``session.lr`` returns)."""
        return self._status.learning_rate(self._run.configured_lr())

    @property
    def lr(self) -> Optional[float]:
        """The learning rate the dashboard's field shows: a pending ``set_lr``, else the latest
        step's (``learning_rate.shown``)."""
        return self.learning_rate.shown

    @property
    def requested_lr(self) -> Optional[float]:
        """A value given to ``set_lr`` (by code, magic, widget, inbox or sidebar) that no step has
        used yet, or None (``learning_rate.requested``)."""
        return self.learning_rate.requested

    # ---- what it trains with ---------------------------------------------------------------------
    @property
    def trainer(self) -> Any:
        """The trainer the session drives (an ``mt.Trainer`` unless built ``from_trainer``; None when
        the ranks train in worker processes). Its ``save_model()``/``save_checkpoint()`` save this
        branch's weights: a shared engine holding another branch's is switched back first."""
        return self._trainer

    @property
    def engine(self) -> Any:
        """The trainer's StreamingEngine (None for a trainer without one). Read from the notebook,
        it holds this branch's weights (see ``trainer``)."""
        self._own_weights("session.engine")
        return getattr(self._trainer, "engine", None)

    def _own_weights(self, what: str, strict: bool = False) -> None:
        """(Notebook thread) this branch's weights in the engine before ``what`` reads them
        (``Explorer.hold_weights``); other threads (dashboard, training) never switch."""
        if threading.current_thread() is threading.main_thread() and "_explore" in self.__dict__:
            self._explore.hold_weights(what, strict=strict)

    @property
    def prediction(self) -> Any:
        """The predicted step of the trainer's plan (``mt.Trainer.prediction``: a StepPrediction, or
        None without measured rates)."""
        return self._trainer.prediction

    @property
    def tokenizer(self) -> Any:
        """The tokenizer ``generate`` and text datasets use (None if there is none)."""
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, value: Any) -> None:
        self._tokenizer = value

    @property
    def samples(self) -> list[dict]:
        """What ``generate`` produced: {"step", "prompt", "text"}."""
        return list(self._samples.drawn)

    # ---- its display and branches ----------------------------------------------------------------
    @property
    def publisher(self) -> Any:
        """The publisher pushing this run to the notebook display, while one is shown (else None)."""
        return self._view.live

    @publisher.setter
    def publisher(self, value: Any) -> None:
        self._view.live = value

    @property
    def explorer(self) -> Any:
        """This run's snapshots and branches (``branches.Explorer``)."""
        return self._explore

    @property
    def snapshots(self) -> SnapshotTable:
        """The snapshots this run can rewind to (checkpoints count): step, time, branch, path, bytes
        unique / shared."""
        return SnapshotTable(self._explore.snapshots())
