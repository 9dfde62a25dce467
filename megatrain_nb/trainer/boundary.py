"""The one step-boundary controller: every command of the table (``megatrain_nb/commands.py``)
is applied here, between two optimizer steps, by one method per command.

A command enters as an :class:`Order` through :meth:`BoundaryControl.request` (the inbox's
beacon, a run of ranks) or straight onto the queue (a Session's controls, checked by the
Session). At a step boundary the run's thread takes the queued orders and applies each:

- in one process (a Session's in-kernel run, ``notebook/thread_run.py``): :meth:`run_queued`
  takes them from the queue; while paused it waits there for the next one;
- across ranks (``trainer/control.py``): :meth:`exchange` hands rank 0's orders to every rank
  in one ``Dist.all_gather_json`` and every rank applies them in the same order at the same step.

What the commands do to the trainer (pause and resume move the run state; ``lr`` sets the
learning rate from the next step; ``checkpoint`` writes one; ``stop`` ends the run after this
step, a checkpoint first if asked) is here, once. What differs between the two kinds of run is
the :class:`BoundaryHost`'s: where an applied command is recorded (a Session's run log, the
ranks' ``metrics.jsonl``), and the exploration commands (snapshot, rewind, fork), which a
Session's branches (``notebook/branches.py``) or the ranks' snapshot store carry out. A failed
command is recorded as ``<kind>_failed`` and never ends the run (a failed stop still stops it).
"""
from __future__ import annotations

import queue
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

from megatrain_nb.commands import COMMANDS, check_command, state_after


@dataclass
class Order:
    """One command on its way to a step boundary: ``kind`` a name of the table, its checked
    ``value``, who sent it (``source``), the inbox file's ``id`` (comes back on the event that
    records it) and a ``future`` for a caller waiting on its result (one process only)."""

    kind: str
    value: Any = None
    source: str = "notebook"
    future: Optional[Future] = None
    id: Optional[str] = None

    def __post_init__(self):
        if self.kind not in COMMANDS:
            raise ValueError(f"unknown command {self.kind!r}: expected one of {', '.join(COMMANDS)}")

    def wire(self) -> dict:
        """The order as plain JSON data, as it travels to the other ranks."""
        return {"kind": self.kind, "value": self.value, "source": self.source, "id": self.id}


class BoundaryHost(Protocol):
    """What one kind of run supplies to its :class:`BoundaryControl`."""

    #: "running" or "paused" (and, once over, what the run ended as)
    state: str

    def set_state(self, state: str) -> None: ...

    def current_step(self) -> int:
        """Optimizer steps done (the step an applied command is recorded at)."""

    def lr_before(self) -> Optional[float]:
        """The learning rate an ``lr`` command replaces (recorded as its ``previous``)."""

    def record(self, kind: str, step: int, fields: dict) -> None:
        """An applied (or failed: ``kind`` ends in ``_failed``) command, at ``step``."""

    def explore(self, order: Order) -> tuple:
        """A snapshot, rewind or fork: ``(result, fields)``; ``fields`` None when the host
        recorded it itself, else what to record."""


class BoundaryControl:
    """Applies orders at step boundaries (see the module docstring); ``trainer``: the run's
    trainer (``set_lr``, ``save_checkpoint``, ``request_stop``); ``dist``: its ranks (None: one
    process)."""

    def __init__(self, trainer: Any, host: BoundaryHost, *, orders: Optional[queue.Queue] = None,
                 dist: Any = None):
        self.trainer, self.host, self.dist = trainer, host, dist
        self.orders: "queue.Queue[Order]" = orders if orders is not None else queue.Queue()
        self.stopped = False   # a stop was applied: the run ends after this step
        #: the one place each command is applied: a method per name of the table
        self.appliers: dict[str, Callable[[Order, dict], Any]] = {
            "pause": self._pause_or_resume, "resume": self._pause_or_resume, "stop": self._stop,
            "lr": self._lr, "checkpoint": self._checkpoint, "snapshot": self._explore,
            "rewind": self._explore, "fork": self._explore}

    # ---- in: checked once, queued -------------------------------------------------------------
    def request(self, kind: Any, value: Any = None, *, source: str = "lab",
                command_id: Optional[str] = None) -> Order:
        """Queue ``kind`` (one of what the ranks apply; ``value`` checked by the table) for the
        next step boundary; :class:`~megatrain_nb.commands.CommandError` if refused."""
        kind, value = check_command(kind, value, ranks=True)
        order = Order(kind, value, source, id=command_id)
        self.orders.put(order)
        return order

    def take(self, wait: float = 0.0) -> list:
        """The queued orders (``wait`` > 0: waiting that long for the first)."""
        out = []
        try:
            out.append(self.orders.get(timeout=wait) if wait > 0 else self.orders.get_nowait())
            while True:
                out.append(self.orders.get_nowait())
        except queue.Empty:
            return out

    # ---- at the boundary ----------------------------------------------------------------------
    def run_queued(self, next_order: Optional[Callable[[bool], Optional[Order]]] = None) -> bool:
        """One process: apply what is queued; while paused, wait for more. True: stop the run.
        ``next_order(block)``: how to take the next one (default: from :attr:`orders`)."""
        take = next_order or self._next
        while True:
            order = take(self.host.state == "paused")
            if order is None:
                return False
            if self.apply(order):
                return True

    def exchange(self, mine: dict, wait: float = 0.0) -> list:
        """Across ranks: rank 0's queued orders go to every rank with each rank's ``mine`` (one
        ``Dist.all_gather_json``); every rank applies rank 0's in order. What each rank sent."""
        orders = [o.wire() for o in self.take(wait)] if self.dist.is_main else []
        sent = dict(mine, orders=orders)
        gathered = self.dist.all_gather_json(sent) if self.dist.world > 1 else [sent]
        for wire in gathered[0]["orders"]:
            self.apply(Order(wire["kind"], wire.get("value"), wire.get("source") or "lab", id=wire.get("id")))
        return gathered

    def apply(self, order: Order) -> bool:
        """Apply one order now (the caller is at a step boundary); True: the run stops."""
        step = self.host.current_step()
        fields: dict = {"source": order.source}
        if order.id is not None:
            fields["id"] = order.id
        try:
            result = self.appliers[order.kind](order, fields)
        except Exception as e:  # noqa: BLE001 - a failed command must not end the run
            if order.future is not None and not order.future.done():
                order.future.set_exception(e)
            self.host.record(f"{order.kind}_failed", step, dict(fields, error=f"{type(e).__name__}: {e}"))
            if order.kind == "stop":
                self._end()
            return order.kind == "stop"
        if order.future is not None and not order.future.done():
            order.future.set_result(result)
        return order.kind == "stop"

    # ---- the commands: one method each ----------------------------------------------------------
    def _pause_or_resume(self, order: Order, fields: dict) -> None:
        state = state_after(order.kind, self.host.state)
        if state is None:   # already paused / not paused: nothing to do, no event
            return
        self.host.set_state(state)
        self.host.record(order.kind, self.host.current_step(), fields)

    def _lr(self, order: Order, fields: dict) -> float:
        previous = self.host.lr_before()
        self.trainer.set_lr(float(order.value))
        self.host.record("lr", self.host.current_step(), dict(fields, value=float(order.value), previous=previous))
        return float(order.value)

    def _checkpoint(self, order: Order, fields: dict) -> str:
        path = str(self.trainer.save_checkpoint(order.value or None))
        self.host.record("checkpoint", self.host.current_step(), dict(fields, path=path))
        return path

    def _stop(self, order: Order, fields: dict) -> None:
        if order.value:   # a checkpoint first, recorded as one
            self._checkpoint(Order("checkpoint", None if order.value is True else str(order.value),
                                   order.source, id=order.id), dict(fields))
        self._end()
        self.host.record("stop", self.host.current_step(), fields)

    def _end(self) -> None:
        self.trainer.request_stop()
        self.stopped = True

    def _explore(self, order: Order, fields: dict) -> Any:
        result, recorded = self.host.explore(order)
        if recorded is not None:
            self.host.record(order.kind, self.host.current_step(), dict(fields, **recorded))
        return result

    def _next(self, block: bool) -> Optional[Order]:
        try:
            return self.orders.get() if block else self.orders.get_nowait()
        except queue.Empty:
            return None
