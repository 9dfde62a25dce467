"""A stand-in for megatrain_nb.notebook.Session with the public surface the beacon uses."""

from __future__ import annotations

import threading
import time
import uuid

from megatrain_nb.commands import COMMANDS, check_command


class FakeSession:
    """Records every control call as an event, like the real Session does."""

    def __init__(self, name: str = "fake-run", *, total_steps: int | None = 100, sid=None):
        self.name = name
        self.id = sid if sid is not None else uuid.uuid4().hex[:12]
        self.state = "running"
        self.step = 0
        self.total_steps = total_steps
        self.history: list[dict] = []
        self.events: list[dict] = []
        self.lr = 1e-3
        self.command_ids: list = []
        self._lock = threading.Lock()

    def advance(self, n: int = 1, loss: float = 2.0) -> None:
        for _ in range(n):
            self.step += 1
            rec = {"step": self.step, "loss": loss, "lr": self.lr, "tokens_per_s": 1000.0}
            if self.step % 2 == 0:
                rec["memory"] = {
                    "device": {"used_bytes": 2**30, "peak_bytes": 2**31, "capacity_bytes": 2**34,
                               "breakdown": {"weights": 2**29}},
                    "host": {"used_bytes": 3 * 2**30, "peak_bytes": None, "capacity_bytes": None},
                    "disk": {"used_bytes": 0, "peak_bytes": 0, "capacity_bytes": 2**40},
                }
            self.history.append(rec)
            loss *= 0.99

    def _event(self, kind: str, **kw) -> None:
        with self._lock:
            self.events.append({"kind": kind, "step": self.step, "time": time.time(), **kw})

    def command(self, name, value=None, *, source: str = "lab", command_id=None) -> None:
        """The beacon's one door, as Session.command: checked by the table, then the method."""
        name, value = check_command(name, value)
        self.command_ids.append(command_id)
        args = () if value is None else (value,)
        getattr(self, COMMANDS[name].method)(*args, source=source)

    def pause(self, source: str = "notebook") -> None:
        self.state = "paused"
        self._event("pause", source=source)

    def resume(self, source: str = "notebook") -> None:
        self.state = "running"
        self._event("resume", source=source)

    def stop(self, source: str = "notebook") -> None:
        self.state = "stopped"
        self._event("stop", source=source)

    def set_lr(self, lr: float, source: str = "notebook") -> None:
        self.lr = lr
        self.requested_lr = lr  # as Session: what was asked for; applies from the next step
        self._event("lr", value=lr, source=source)


class MinimalSession:
    """Only the documented attributes: no id, no total_steps; ``command`` the one door."""

    def __init__(self) -> None:
        self.name = "minimal"
        self.state = "running"
        self.step = 3
        self.history = [{"step": 3, "loss": float("nan"), "lr": 1e-4}]
        self.calls: list[tuple] = []

    def command(self, name, value=None, **kw) -> None:
        name, value = check_command(name, value)
        self.calls.append((name,) if value is None else (name, value))
        if name == "pause":
            self.state = "paused"
