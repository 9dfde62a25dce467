"""Which sessions exist, so that ``%megatrain`` and the command line find "the current one".

The current session (the one most recently created or trained) is held strongly; the others
only weakly, so a session nobody references any more can be freed.
"""
from __future__ import annotations

import atexit
import threading
import weakref
from typing import TYPE_CHECKING, Optional

from .lifecycle import LIVE

if TYPE_CHECKING:  # pragma: no cover
    from .session import Session

_lock = threading.Lock()
_by_name: "weakref.WeakValueDictionary[str, Session]" = weakref.WeakValueDictionary()
_current: Optional["Session"] = None
_counter = 0


def next_default_name() -> str:
    global _counter
    with _lock:
        _counter += 1
        while f"session-{_counter}" in _by_name:
            _counter += 1
        return f"session-{_counter}"


def register(session: "Session") -> None:
    """Make ``session`` known under its name and the current one (a newer session with the
    same name replaces the older in the name table)."""
    global _current
    with _lock:
        _by_name[session.name] = session
        _current = session


def make_current(session: "Session") -> None:
    global _current
    with _lock:
        _current = session


def get(name: Optional[str] = None) -> Optional["Session"]:
    """The named session, or the current one when ``name`` is None (None if there is none)."""
    with _lock:
        if name is None:
            return _current
        return _by_name.get(name)


def all_sessions() -> list["Session"]:
    with _lock:
        return list(_by_name.values())


def forget(session: "Session") -> None:
    global _current
    with _lock:
        if _by_name.get(session.name) is session:
            del _by_name[session.name]
        if _current is session:
            _current = None


@atexit.register
def _stop_running_sessions() -> None:
    # The training thread is a daemon: at interpreter exit stop each live run at a step
    # boundary so that engine files and threads are released rather than abandoned.
    for s in all_sessions():
        try:
            if s.state in LIVE:
                s.stop(wait=True, timeout=30, source="exit")
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
