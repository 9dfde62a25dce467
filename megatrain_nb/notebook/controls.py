"""What each command of the table asks of a Session before its run's step-boundary controller
(``trainer/boundary.py``) applies it: the Session's state allows it (a stop of a run that never
started ends it here, a resume of a rewound finished run starts it again), then the command is
queued for the next step boundary, or applied now when nothing trains, and waited for when the
caller asked for its result. ``Session.command`` (every door: the methods, ``%megatrain``, the
inbox) checks the value by the table and calls the one method here for the command's name.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FuturesTimeout
from typing import Any, Callable, Optional

from megatrain_nb.commands import as_step

from .branches import check_changes
from .lifecycle import ENDED
from .run_state import Order, RunState


class SessionControls:
    """One Session's side of every command (see the module docstring); ``by_name``: the method
    for each name of the table, each taking ``(checked value, source, **options)``."""

    def __init__(self, session: Any, status: RunState, run: Any, explore: Any, *, end: Callable[[str], None],
                 release: Callable[[], None]):
        self.session, self.status, self.run, self.explore = session, status, run, explore
        self.end, self.release = end, release
        self.by_name: dict[str, Callable[..., Any]] = {
            "pause": self.pause, "resume": self.resume, "stop": self.stop, "lr": self.set_lr,
            "checkpoint": self.save_checkpoint, "snapshot": self.snapshot, "rewind": self.rewind,
            "fork": self.fork}

    def stop(self, checkpoint: Any, source: str, wait: Optional[bool] = None, timeout: Optional[float] = None):
        st = self.status
        if wait is None:
            wait = threading.current_thread() is threading.main_thread()
        if st.state == "idle":  # never started: nothing runs, end it here
            try:
                if checkpoint:
                    self.run.apply_now("checkpoint", None if checkpoint is True else str(checkpoint), source)
                st.log.add_event("stop", st.step, source=source)
            finally:
                self.end("stopped")
            return
        if st.state in ENDED:
            self.release()
            return
        self.run.deliver(Order("stop", checkpoint, source))
        if wait and not st.on_background():
            st.thread.join(timeout)
            if st.state == "finished":  # it finished before reaching the stop: release anyway
                self.release()

    def pause(self, value: None, source: str) -> None:
        self.status.refuse_if_ended("pause")
        self.run.deliver(Order("pause", source=source))

    def resume(self, value: None, source: str) -> None:
        st = self.status
        if st.state == "idle":
            if st.started_at is None:
                raise RuntimeError(f"session {self.session.name!r} has not started: nothing to resume; train() starts it")
            # (from the sidebar's thread: no display there; the notebook's dashboard follows the run)
            self.session.train(dashboard=None if threading.current_thread() is threading.main_thread() else False)
            return
        if st.state == "finished" and not st.released:
            raise RuntimeError(f"session {self.session.name!r} has finished: nothing to resume. rewind(<step>) then "
                               f"resume() goes on from a snapshot; reading its weights (generate(), engine, "
                               f"trainer.save_model()) is always of this branch")
        st.refuse_if_ended("resume")
        self.run.deliver(Order("resume", source=source))

    def set_lr(self, value: float, source: str) -> None:
        st = self.status
        st.refuse_if_ended("change the learning rate of")
        st.lr_request.ask(value)  # before the command: it may apply at once
        self.run.deliver(Order("lr", value, source=source))

    def save_checkpoint(self, path: Optional[str], source: str, wait: bool = False) -> Optional[str]:
        self.status.refuse_if_released("checkpoint")
        return self.at_boundary("checkpoint", path, source, wait=wait)

    def snapshot(self, value: None, source: str, wait: bool = False):
        return self.at_boundary("snapshot", None, source, wait=wait)

    def rewind(self, step: int, source: str, wait: bool = False):
        st = self.status
        self.run.check("rewind")
        if st.released:
            raise RuntimeError(f"session {self.session.name!r} {st.state} and released its model: nothing to rewind. "
                               "mt.Session.from_checkpoint(<a snapshot folder>) starts from one")
        self.explore.find(step)   # a step without a snapshot fails here, listing those that have one
        info = self.at_boundary("rewind", step, source, wait=wait)
        if st.state in ENDED + ("idle",):   # finished (it kept its model) or not started: train() goes on from it
            restart = self.explore.take_restart()   # (ranks in worker processes: their controller has it)
            if restart is not None:
                self.run.resume_from = restart
            st.ended_at = None
            st.set_state("idle")
        return info

    def fork(self, value: tuple, source: str) -> Any:
        step, name, changes = value
        self.run.check("fork")
        changes = check_changes(changes, self.session.trainer)
        step = None if step is None else as_step(step, "fork(step)")
        if self.status.released:
            raise RuntimeError(f"session {self.session.name!r} released its model: nothing to fork")
        if step is not None:
            self.explore.find(step)   # no snapshot there: the error lists the steps that have one
        if hasattr(self.run, "fork"):   # ranks in worker processes: new ranks from the snapshot
            return self.run.fork(self.session, step, name, changes)
        return self.at_boundary("fork", (step, name, changes), source)

    def at_boundary(self, kind: str, value: Any, source: str = "notebook", *, wait: bool = True):
        """Apply a command at the next step boundary (now, if nothing trains); its result."""
        st = self.status
        if not st.in_background():   # nothing else is training: here
            return self.run.apply_now(kind, value, source)
        fut: Future = Future()
        self.run.deliver(Order(kind, value, source, fut))
        if not wait:
            return None
        while True:
            try:
                return fut.result(timeout=0.25)
            except FuturesTimeout:
                if not st.thread.is_alive() and not fut.done():   # the run ended before reaching it
                    if st.released:
                        raise RuntimeError(f"session {self.session.name!r} {st.state} before the {kind} was "
                                           "applied, and released its model") from None
                    return self.run.apply_now(kind, value, source)
