"""What a Session and its run controller share: the state, the log, the command queue (of
:class:`~megatrain_nb.trainer.boundary.Order`, applied by the one step-boundary controller).

The Session (the notebook's thread) reads it and queues commands; its run controller
(``thread_run.ThreadRun`` or ``remote.ProcessRun``, on the background thread) applies the
commands, appends to the log and moves the state. Every field is public: the two sides are
different objects, and neither reaches into the other's private attributes.
"""
from __future__ import annotations

import queue
import threading
import time
import traceback
from typing import Any, Callable, Optional, Protocol, runtime_checkable

from megatrain_nb.learning_rate import LearningRate, LearningRateRequest
from megatrain_nb.trainer.boundary import Order
from .lifecycle import ENDED
from .run_log import RunLog


@runtime_checkable
class TrainerLike(Protocol):
    """All a Session needs from a trainer (``megatrain_nb.trainer.Trainer`` provides it)."""

    total_steps: Any
    engine: Any

    def iter_steps(self, resume_from_checkpoint: Any = None): ...
    def set_lr(self, lr: float) -> None: ...
    def save_checkpoint(self, path: Optional[str] = None) -> str: ...
    def request_stop(self) -> None: ...


class RunController(Protocol):
    """How a Session's run goes on: in a thread of this kernel (``ThreadRun``) or in worker
    processes (``ProcessRun``). The Session owns the background thread and the controls; the
    controller is what that thread does and what only it knows."""

    #: names of the controller's own public attributes the Session shows as its own
    #: (a run in worker processes: ``nproc_per_node``, ``output_dir``, ``ranks``...)
    public: tuple
    #: this kernel announces the run to JupyterLab (a run of ranks: rank 0 announces it)
    announces: bool
    #: the checkpoint or snapshot folder the next ``train()`` starts from
    resume_from: Any

    def body(self, on_end: Callable[[str], None]) -> None:
        """The background thread: train (or follow the ranks), apply the queued commands at
        each step boundary; ``on_end(outcome)`` last."""

    def deliver(self, cmd: Order) -> None:
        """Queue ``cmd`` for the next step boundary (refused if this run cannot apply it)."""

    def apply_now(self, kind: str, value: Any, source: str) -> Any:
        """Nothing trains: apply a checkpoint / snapshot / rewind / fork here (or refuse)."""

    def check(self, what: str) -> None:
        """Raise a clear error if this run cannot do ``what`` (a command, or "inspect",
        "generate": what needs the weights in this process)."""

    def total_steps(self) -> Optional[int]: ...
    def configured_lr(self) -> Optional[float]: ...

    def release(self) -> None:
        """Free what the run holds (device memory, threads, disk files; a launch folder)."""


class RunState:
    """The shared record of one run (see the module docstring)."""

    def __init__(self, name: str):
        self.name = name
        self.log = RunLog()
        self.commands: "queue.Queue[Order]" = queue.Queue()
        self.cv = threading.Condition()
        self.state = "idle"
        self.thread: Optional[threading.Thread] = None
        self.error: Optional[BaseException] = None
        self.error_traceback: Optional[str] = None
        self.error_tb: Any = None
        self.started_at: Optional[float] = None
        self.ended_at: Optional[float] = None
        #: a set_lr no step has used yet (learning_rate.LearningRateRequest); read it through
        #: :meth:`learning_rate`
        self.lr_request = LearningRateRequest()
        self.released = False

    def learning_rate(self, configured: Optional[float] = None) -> LearningRate:
        """The run's learning rate as every view shows it: the latest step's (``configured``
        before the first step) and a request no step has used yet."""
        last = self.log.last_record()
        lr = last.get("lr", configured)
        return self.lr_request.view(lr, int(last.get("step", 0) or 0))

    @property
    def requested_lr(self) -> Optional[float]:
        """A set_lr no step has used yet (None once one has)."""
        return self.learning_rate().requested

    @property
    def step(self) -> int:
        """Optimizer steps done."""
        return int(self.log.last_record().get("step", 0) or 0)

    def set_state(self, state: str) -> None:
        with self.cv:
            self.state = state
            self.cv.notify_all()
        self.log.touch()

    def notify(self) -> None:
        with self.cv:
            self.cv.notify_all()

    def in_background(self) -> bool:
        """Whether the background thread runs, and the caller is not it (a command then waits
        for the next step boundary)."""
        t = self.thread
        return t is not None and t.is_alive() and t is not threading.current_thread()

    def on_background(self) -> bool:
        return self.thread is threading.current_thread()

    def refuse_if_ended(self, what: str) -> None:
        if self.state in ENDED:
            raise RuntimeError(f"session {self.name!r} has {self.state}: nothing to {what}")

    def refuse_if_released(self, what: str) -> None:
        if self.released:
            raise RuntimeError(f"session {self.name!r} released its model when it {self.state}; "
                               f"nothing left to {what}")

    def fail(self, e: BaseException) -> None:
        self.error, self.error_tb = e, e.__traceback__
        self.error_traceback = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        self.log.add_event("error", self.step, error=f"{type(e).__name__}: {e}", traceback=self.error_traceback)

    def next_command(self, block: bool) -> Optional[Order]:
        """The next queued command (None if there is none); ``block`` waits for one, the wait
        counted as paused time."""
        t0 = time.monotonic()
        try:
            cmd = self.commands.get() if block else self.commands.get_nowait()
        except queue.Empty:
            return None
        if block:
            self.log.add_paused_time(time.monotonic() - t0)
        return cmd

    def drain(self, outcome: str) -> None:
        """Whoever waits on a command that will never be applied hears about it."""
        while True:
            try:
                cmd = self.commands.get_nowait()
            except queue.Empty:
                return
            if cmd.future is not None and not cmd.future.done():
                cmd.future.set_exception(RuntimeError(f"the run {outcome} before the {cmd.kind} was applied"))
