"""The reader side of the channel: which sessions are alive, and how to send one a command.

Used by the Jupyter server extension (``handlers.py``); plain functions, no Jupyter imports::

    for s in list_sessions():
        print(s["name"], s["state"], s["step"], s["total_steps"])
    enqueue_command(s["id"], "lr", 1e-4)

A heartbeat older than ``stale_after`` seconds (5) or whose process is gone is not listed.
Files of dead processes, and of anything silent for ``ABANDONED_AFTER`` seconds, are removed.
A run that ended leaves a last heartbeat with ``ended`` set: it is listed (its process may be
gone) until :func:`dismiss_session` removes it, for ``ENDED_KEPT`` seconds at most, and for
``DEAD_ENDED_KEPT`` seconds once its process has exited.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import time
from pathlib import Path
from typing import Any

from megatrain_nb.channel.protocol import (
    SESSION_ID_RE,
    UnsafeFolderError,
    check_private_dir,
    heartbeat_path,
    inbox_path,
    read_json,
    sessions_dir,
    write_command,
)
from megatrain_nb.commands import check_command
from megatrain_nb.processes import pid_alive

log = logging.getLogger(__name__)

STALE_AFTER = 5.0
ABANDONED_AFTER = 60.0
ENDED_KEPT = 24 * 3600.0
DEAD_ENDED_KEPT = 600.0   # a run that ended in a process that has exited since: listed this long after its end


class StillRunning(ValueError):
    """Dismissing a session that has not ended."""


class UnknownSession(KeyError):
    """No live session with this id."""

    def __str__(self) -> str:
        return f"no running megatrain_nb session with id {self.args[0]!r}"


def list_sessions(
    root: str | Path | None = None,
    *,
    stale_after: float = STALE_AFTER,
    now: float | None = None,
    clean: bool = True,
) -> list[dict[str, Any]]:
    """The heartbeats of live sessions, oldest first, each with ``age`` (seconds) added."""
    d = sessions_dir(root)
    now = time.time() if now is None else now
    try:
        check_private_dir(d.parent)
        check_private_dir(d)
        entries = list(os.scandir(d))
    except FileNotFoundError:
        return []
    except UnsafeFolderError as e:  # another user could plant sessions there: list none
        log.warning("%s", e)
        return []
    live: list[dict[str, Any]] = []
    heartbeats = set()
    for e in entries:
        if e.name.startswith(".") or not e.name.endswith(".json"):
            continue
        sid = e.name[: -len(".json")]
        heartbeats.add(sid)
        data = read_json(Path(e.path))
        if not SESSION_ID_RE.match(sid) or not _owned(e) or not isinstance(data, dict):
            continue
        updated = data.get("updated")
        age = now - updated if isinstance(updated, (int, float)) else float("inf")
        if isinstance(data.get("ended"), (int, float)):  # over: kept until dismissed
            gone = now - data["ended"] > DEAD_ENDED_KEPT and pid_alive(data.get("pid"), data.get("host")) is False
            if now - data["ended"] > ENDED_KEPT or gone:   # (an afternoon left 44 cards of exited kernels)
                if clean:
                    remove_session_files(sid, root)
                continue
            data["id"] = sid
            data["age"] = max(0.0, age)
            live.append(data)
            continue
        alive = pid_alive(data.get("pid"), data.get("host"))
        if alive is False or age > ABANDONED_AFTER:
            if clean:
                remove_session_files(sid, root)
            continue
        if age > stale_after:
            continue  # silent but not gone (a busy or suspended process): hide, keep files
        data["id"] = sid
        data["age"] = max(0.0, age)
        live.append(data)
    if clean:
        _remove_orphan_inboxes(d, heartbeats, now)
    live.sort(key=lambda s: (s.get("started") or 0, s["id"]))
    return live


def get_session(session_id: str, root: str | Path | None = None, **kw: Any) -> dict[str, Any]:
    """The live session with this id, or raise UnknownSession."""
    if not isinstance(session_id, str) or not SESSION_ID_RE.match(session_id):
        raise UnknownSession(session_id)
    for s in list_sessions(root, clean=False, **kw):
        if s["id"] == session_id:
            return s
    raise UnknownSession(session_id)


def enqueue_command(
    session_id: str,
    command: str,
    value: Any = None,
    *,
    source: str = "lab",
    root: str | Path | None = None,
) -> dict[str, Any]:
    """Check one command the sidebar sent (by the command table) and drop it into the live
    session's inbox (:func:`~megatrain_nb.channel.protocol.write_command`); the beacon hands it on
    within its poll interval. Raises CommandError (bad command/value) or UnknownSession."""
    command, value = check_command(command, value, sidebar=True)   # the server's check: the sidebar's rows
    if isinstance(get_session(session_id, root).get("ended"), (int, float)):
        raise UnknownSession(session_id)  # over: nothing reads its inbox any more
    return {"session_id": session_id, **write_command(session_id, command, value, source=source, root=root)}


def dismiss_session(session_id: str, root: str | Path | None = None) -> None:
    """Remove an ended run from the list (the sidebar's Dismiss). Raises UnknownSession, or
    StillRunning for a run that has not ended (stop it first)."""
    s = get_session(session_id, root)
    if not isinstance(s.get("ended"), (int, float)):
        raise StillRunning(f"session {session_id!r} is {s.get('state')}: stop it before dismissing it")
    remove_session_files(session_id, root)


def remove_session_files(session_id: str, root: str | Path | None = None) -> None:
    try:
        heartbeat_path(session_id, root).unlink()
    except OSError:
        pass
    shutil.rmtree(inbox_path(session_id, root), ignore_errors=True)


def _owned(entry: os.DirEntry) -> bool:
    """A regular file of this user's (a symlink is never followed)."""
    try:
        st = entry.stat(follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid()


def _remove_orphan_inboxes(d: Path, heartbeats: set[str], now: float) -> None:
    for e in os.scandir(d):
        if e.name.endswith(".inbox") and e.name[: -len(".inbox")] not in heartbeats:
            try:
                if now - e.stat().st_mtime > ABANDONED_AFTER:
                    shutil.rmtree(e.path, ignore_errors=True)
            except OSError:
                pass
