"""A Session's run in one background thread of this kernel (the default run controller).

The thread drives ``trainer.iter_steps()`` and, between two steps, has the one step-boundary
controller (``trainer/boundary.py``) apply the commands the controls queued; as its host it
records each as an event of the :class:`RunLog` at that step and carries out snapshots, rewinds
and forks through the Session's branches. It never touches widgets; a publisher
(``publisher.py``) reads the log.
"""
from __future__ import annotations

import sys
import weakref
from concurrent.futures import Future
from typing import Any, Callable, Optional

from megatrain_nb.trainer.boundary import BoundaryControl, Order

from .run_state import RunState


class SessionHooks:
    """The RunHooks (trainer/run.py) a Session gives its trainer: its training thread's commands
    between the batches of a pass before step 1, and its branches (recoveries join the tree,
    automatic snapshots are theirs, a save holds this branch's weights in a shared engine). Held
    weakly: the trainer must not keep its Session's parts alive (a dropped fork goes whole)."""

    def __init__(self, explorer: Any, run: "ThreadRun"):
        self._explorer, self._run = weakref.ref(explorer), weakref.ref(run)

    def between_batches(self) -> bool:
        run = self._run()
        return run.between_batches() if run is not None else False

    def on_recovery(self, event: dict) -> None:
        explorer = self._explorer()
        if explorer is not None:
            explorer.on_recovery(event)

    def snapshot_steps(self) -> Optional[int]:
        explorer = self._explorer()
        return explorer.snapshot_steps if explorer is not None else None

    def hold_weights(self, what: str) -> None:
        explorer = self._explorer()
        if explorer is not None:
            explorer.hold_weights(what)


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
        self.control = BoundaryControl(trainer, self, orders=status.commands)
        self._stopped_early = False   # a stop reached the run before its first step (between_batches)
        if hasattr(trainer, "use_hooks"):   # (a duck-typed trainer of from_trainer may have none)
            trainer.use_hooks(SessionHooks(explorer, self))

    @property
    def engine(self) -> Any:
        return getattr(self.trainer, "engine", None)

    # ---- what the Session asks ---------------------------------------------------------------
    def deliver(self, cmd: Order) -> None:
        self.status.commands.put(cmd)

    def apply_now(self, kind: str, value: Any, source: str) -> Any:
        """Nothing trains: the controller applies ``kind`` here, on the caller's thread."""
        if kind != "checkpoint":   # (the branches record a failed snapshot, rewind or fork themselves)
            return self.explorer.apply(kind, value, source)
        order = Order(kind, value, source, Future())
        self.control.apply(order)
        return order.future.result()

    def check(self, what: str) -> None:
        pass   # the weights are here: everything can be done

    def total_steps(self) -> Optional[int]:
        total = getattr(self.trainer, "total_steps", None)
        return int(total) if isinstance(total, (int, float)) and total > 0 else None

    def configured_lr(self) -> Optional[float]:
        return getattr(getattr(self.trainer, "args", None), "learning_rate", None)

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
            if hasattr(self.trainer, "gather_layer_stats"):   # the dashboard's layer statistics: each
                self.trainer.gather_layer_stats()               # step's record carries them, from step 1
            self.explorer.activate()   # branches sharing the engine: this one's state in it
            self._stopped_early = False
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
                    outcome = "stopped" if self._stopped_early else outcome
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

    def between_batches(self) -> bool:
        """(RunHooks) Between the batches of a DPO reference pass on the training thread: the
        queued commands apply there too (a pause holds the pass, a stop ends it); True once a stop
        came. Elsewhere (an evaluate() on the notebook's thread) nothing is applied."""
        if not self.status.on_background():
            return False
        if self._apply_commands():
            self._stopped_early = True
        return self._stopped_early

    def _on_record(self, record: dict) -> None:
        stats = record.pop("layer_stats", None)   # (the dashboard's; not a field of the step's record)
        self.status.log.add_record(record, layer_stats=list(stats) if stats else None)   # one view: both or neither
        self.explorer.on_record(record)
        for hook in self.after_record:
            hook(record)
        self.status.notify()

    def _apply_commands(self) -> bool:
        """Apply what is queued; while paused, wait here for more. True means stop."""
        return self.control.run_queued(self.status.next_command)

    # ---- the boundary controller's host (trainer/boundary.py) ------------------------------------
    @property
    def state(self) -> str:
        return self.status.state

    def set_state(self, state: str) -> None:
        if state == "running":
            self.explorer.activate()   # another branch trained meanwhile: switch back
        self.status.set_state(state)

    def current_step(self) -> int:
        return self.status.step

    def lr_before(self) -> Optional[float]:
        return self.status.log.last_record().get("lr")

    def record(self, kind: str, step: int, fields: dict) -> None:
        self.status.log.add_event(kind, step, **fields)
        if kind == "lr":
            self.status.lr_request.taken(fields.get("value"), step)

    def explore(self, order: Order) -> tuple:
        st = self.status
        result = self.explorer.apply(order.kind, order.value, order.source)
        if order.kind == "rewind" and st.state == "running":   # rewound while running: paused there
            st.set_state("paused")
            st.log.add_event("pause", result.step, source="rewind")
        return result, None   # (the branches record it)
