"""A Session's run in one background thread of this kernel (the default run controller).

The thread drives ``trainer.iter_steps()`` and, between two steps, applies the commands the
controls queued (each recorded as an event at that step). It never touches widgets; it appends
to the :class:`RunLog` that a publisher (``publisher.py``) reads.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Optional

from megatrain_nb.commands import state_after

from .run_state import QueuedCommand, RunState


class ThreadRun:
    """Trains ``trainer`` on the Session's background thread (see the module docstring);
    ``explorer``: the Session's snapshots and branches (``branches.Explorer``)."""

    public: tuple = ()
    announces = True

    def __init__(self, status: RunState, trainer: Any, explorer: Any, resume_from: Any = None):
        self.status = status
        self.trainer = trainer
        self.explorer = explorer
        self.resume_from = resume_from
        self.after_record: list[Callable[[dict], None]] = []   # the Session's watchers of each step

    @property
    def engine(self) -> Any:
        return getattr(self.trainer, "engine", None)

    # ---- what the Session asks ---------------------------------------------------------------
    def deliver(self, cmd: QueuedCommand) -> None:
        self.status.commands.put(cmd)

    def apply_now(self, kind: str, value: Any, source: str) -> Any:
        if kind == "checkpoint":
            return self.checkpoint(value, source)
        return self.explorer.apply(kind, value, source)

    def check(self, what: str) -> None:
        pass   # the weights are here: everything can be done

    def total_steps(self) -> Optional[int]:
        total = getattr(self.trainer, "total_steps", None)
        return int(total) if isinstance(total, (int, float)) and total > 0 else None

    def configured_lr(self) -> Optional[float]:
        return getattr(getattr(self.trainer, "args", None), "learning_rate", None)

    def checkpoint(self, path: Optional[str], source: str) -> str:
        st = self.status
        try:
            written = str(self.trainer.save_checkpoint(path))
        except Exception as e:
            if not st.on_background():   # (on it, the failed command records the event)
                st.log.add_event("checkpoint_failed", st.step, error=f"{type(e).__name__}: {e}", source=source)
            raise
        st.log.add_event("checkpoint", st.step, path=written, source=source)
        return written

    def release(self) -> None:
        if self.explorer.engine_shared():   # branches still use the engine: the last one closes it
            return
        closer = getattr(self.trainer, "close", None)
        if not callable(closer):
            closer = getattr(self.engine, "close", None)
        if callable(closer):
            try:
                closer()
            except Exception as e:  # noqa: BLE001 - report, but finish ending the run
                print(f"megatrain_nb: releasing session {self.status.name!r} failed: {e}", file=sys.stderr)

    # ---- the training thread -------------------------------------------------------------------
    def body(self, on_end: Callable[[str], None]) -> None:
        it = None
        outcome = "finished"
        try:
            if self.engine is not None:   # the dashboard reads layer statistics after every step:
                self.engine.layer_stats()  # the engine gathers them once asked, so from step 1
            self.explorer.activate()   # branches sharing the engine: this one's state in it
            if hasattr(self.trainer, "recovery_hooks"):   # on_nonfinite="rewind": the tree hears of each
                if self.explorer.on_recovery not in self.trainer.recovery_hooks:
                    self.trainer.recovery_hooks.append(self.explorer.on_recovery)
                self.trainer.snapshot_steps_elsewhere = self.explorer.snapshot_steps
            it = iter(self.trainer.iter_steps(resume_from_checkpoint=self.resume_from))
            while True:
                if self._apply_commands():
                    outcome = "stopped"
                    break
                restart = self.explorer.take_restart()   # rewound, or back from another branch
                if restart is not None:
                    it.close()
                    it = iter(self.trainer.iter_steps(resume_from_checkpoint=restart))
                try:
                    record = next(it)
                except StopIteration:
                    break
                self._on_record(record)
        except BaseException as e:  # noqa: BLE001 - surfaces in wait() and the dashboard
            outcome = "failed"
            self.status.fail(e)
        finally:
            if it is not None and hasattr(it, "close"):
                try:
                    it.close()
                except Exception:  # noqa: BLE001 - already ending
                    pass
            self.explorer.settle()   # an automatic snapshot completing in the background: logged
            self.status.drain(outcome)
            on_end(outcome)

    def _on_record(self, record: dict) -> None:
        engine = self.engine
        stats = engine.layer_stats() if engine is not None else None
        if stats:
            self.status.log.add_layer_stats(int(record.get("step", 0) or 0), list(stats))
        self.status.log.add_record(record)
        self.explorer.on_record(record)
        for hook in self.after_record:
            hook(record)
        self.status.notify()

    def _apply_commands(self) -> bool:
        """Apply what is queued; while paused, wait here for more. True means stop."""
        while True:
            cmd = self.status.next_command(block=self.status.state == "paused")
            if cmd is None:
                return False
            if self._apply(cmd):
                return True

    def _apply(self, cmd: QueuedCommand) -> bool:
        st, log = self.status, self.status.log
        step = st.step
        try:
            if cmd.kind in ("pause", "resume"):
                state = state_after(cmd.kind, st.state)
                if state is None:   # already paused / not paused: nothing to do
                    return False
                if cmd.kind == "resume":
                    self.explorer.activate()   # another branch trained meanwhile: switch back
                st.set_state(state)
                log.add_event(cmd.kind, step, source=cmd.source)
            elif cmd.kind == "lr":
                previous = log.last_record().get("lr")
                self.trainer.set_lr(cmd.value)
                log.add_event("lr", step, value=cmd.value, previous=previous, source=cmd.source)
                if st.pending_lr == cmd.value:
                    st.pending_lr = None
            elif cmd.kind == "stop":
                if cmd.value:
                    self.checkpoint(None if cmd.value is True else str(cmd.value), cmd.source)
                self.trainer.request_stop()
                log.add_event("stop", step, source=cmd.source)
                return True
            else:   # checkpoint, snapshot, rewind, fork: a result someone waits for
                result = self.apply_now(cmd.kind, cmd.value, cmd.source)
                if cmd.kind == "rewind" and st.state == "running":
                    st.set_state("paused")
                    log.add_event("pause", result.step, source="rewind")
                if cmd.future is not None:
                    cmd.future.set_result(result)
        except Exception as e:  # noqa: BLE001 - a failed control must not kill the run
            if cmd.future is not None and not cmd.future.done():
                cmd.future.set_exception(e)
            log.add_event(f"{cmd.kind}_failed", step, error=f"{type(e).__name__}: {e}", source=cmd.source)
            if cmd.kind == "stop":
                return True
        return False
