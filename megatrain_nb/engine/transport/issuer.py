"""The one ordered issuer of a run's collectives: every collective of a :class:`~.dist.Dist`
and of its channels is issued one at a time, in one order that is the same on every rank.

Why: the sharded engine issues collectives from several threads (the pager's copy thread
gathers units, the gradient thread reduce-scatters gradients and votes on their finiteness,
the program's thread all-reduces norms and token counts), each on a communicator of its own.
NCCL can deadlock when ranks launch collectives of different communicators in different
orders (a kernel of one waits for a peer that is still inside a kernel of another), and the
order in which two threads reach their calls depends on timing, which differs between ranks.

How: the order is the program's. The thread that runs the step (the program thread: the
engine's caller) decides every collective before any worker issues it, in an order that is the
same on every rank: the pager *announces* a unit's gather when it schedules the fetch and a
gradient's reduce-scatter (and its vote) when the gradient is handed to the gradient thread.
Each announcement takes the next ticket. A worker's collective names what it is (``kind`` and
``key``: a unit's index) and waits, inside :meth:`Issuer.issue`, until every earlier ticket
was issued or cancelled; a collective nobody announced (a norm, a token count, a control
message: always called by the program thread) takes the next ticket when it is called.

Waits are bounded by the group's timeout (:class:`~.dist.DistError` names the ticket waited
for). A ticket whose collective will not run (its fetch failed) is cancelled by its announcer,
so the ones after it go on. ``log``: set to a list to record ``(kind, key)`` in issue order
(the tests compare the ranks' logs).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple


class Ticket:
    """A place in the issue order, taken by :meth:`Issuer.announce` (or by an unannounced call)."""

    __slots__ = ("issuer", "number", "kind", "key", "claimed")

    def __init__(self, issuer: "Issuer", number: int, kind: str, key: Any):
        self.issuer, self.number, self.kind, self.key = issuer, number, kind, key
        self.claimed = False   # its collective has taken it (cancel does nothing then)

    def cancel(self) -> None:
        """Its collective will not run: the tickets after it go on. Nothing once claimed."""
        self.issuer._cancel(self)

    def __repr__(self) -> str:
        return f"Ticket({self.number}, {self.kind}, {self.key})"


class Issuer:
    """Tickets in program order; collectives issued in ticket order, one at a time."""

    def __init__(self, timeout_s: float, error: Callable[[str], Exception] = RuntimeError):
        self.timeout_s = float(timeout_s)
        self._error = error
        self._cond = threading.Condition()
        self._next = 0                  # the next ticket handed out
        self._turn = 0                  # the ticket whose collective may be issued now
        self._closed: set = set()       # tickets done (issued or cancelled) ahead of the turn
        self._waiting: Dict[Tuple[str, Any], Deque[Ticket]] = {}   # announced, not yet claimed
        self.log: Optional[List[Tuple[str, Any]]] = None
        self._local = threading.local()   # .inside: this thread is issuing (a nested call runs as part of it)

    def announce(self, kind: str, key: Any) -> Ticket:
        """The program thread: a collective ``(kind, key)`` a worker will issue; its ticket."""
        with self._cond:
            t = Ticket(self, self._next, kind, key)
            self._next += 1
            self._waiting.setdefault((kind, key), deque()).append(t)
            return t

    def issue(self, kind: str, key: Any, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` (which issues one collective) in its turn; its result. ``key`` None: not
        announced (the program thread's own call: it takes the next ticket now); else the
        oldest announcement of ``(kind, key)``, which must exist. A collective made of several
        (a control message: sizes, then bytes) is one: the inner calls run in the outer's turn."""
        if getattr(self._local, "inside", False):
            return fn()
        with self._cond:
            if key is None:
                t = Ticket(self, self._next, kind, key)
                self._next += 1
            else:
                queue = self._waiting.get((kind, key))
                if not queue:
                    raise self._error(f"a {kind} collective of {key!r} that the program did not announce: "
                                      "collectives issued from a worker thread must be announced by the program "
                                      "thread (engine/transport/issuer.py), or their order would differ between ranks")
                t = queue.popleft()
                if not queue:
                    del self._waiting[(kind, key)]
            t.claimed = True
            self._wait_turn(t)
        self._local.inside = True
        try:
            if self.log is not None:
                self.log.append((kind, key))
            return fn()
        finally:
            self._local.inside = False
            self._close(t.number)

    def _wait_turn(self, t: Ticket) -> None:
        """(Holding the condition.) Until every ticket before ``t`` is closed, bounded."""
        end = time.monotonic() + self.timeout_s
        while self._turn != t.number:
            left = end - time.monotonic()
            if left <= 0:
                raise self._error(f"the {t.kind} collective of {t.key!r} (ticket {t.number}) waited "
                                  f"{self.timeout_s:.0f}s for ticket {self._turn} to be issued; the ranks' "
                                  "program orders differ, or a worker stopped before its collective")
            self._cond.wait(min(left, 1.0))

    def _close(self, number: int) -> None:
        with self._cond:
            self._closed.add(number)
            while self._turn in self._closed:
                self._closed.discard(self._turn)
                self._turn += 1
            self._cond.notify_all()

    def _cancel(self, t: Ticket) -> None:
        with self._cond:
            if t.claimed:
                return
            t.claimed = True
            queue = self._waiting.get((t.kind, t.key))
            if queue is not None and t in queue:
                queue.remove(t)
                if not queue:
                    del self._waiting[(t.kind, t.key)]
        self._close(t.number)

    def pending(self) -> int:
        """Tickets handed out whose collective is not issued yet."""
        with self._cond:
            return self._next - self._turn - len(self._closed)
