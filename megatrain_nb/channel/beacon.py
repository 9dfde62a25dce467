"""The kernel side of the JupyterLab channel: a session announces itself and takes commands.

``Session.train()`` starts one beacon per run and stops it when the run ends::

    beacon = SessionBeacon(session).start()
    ...
    beacon.stop()          # a run that ended: one last heartbeat, kept (marked "ended") until
                           # dismissed in the sidebar or this process exits; otherwise the
                           # heartbeat file goes

A daemon thread rewrites ``sessions/<id>.json`` every ``interval`` seconds from the
session's public attributes (``name, id, state, step, total_steps, history``) and polls
``sessions/<id>.inbox/`` every ``poll`` seconds. A command found there goes to the session's
one door, ``session.command(name, value, source=..., command_id=...)`` (a notebook Session,
or the ranks' run control, ``trainer/control.py``), which checks it by the command table and
queues it for the step-boundary controller (``trainer/boundary.py``), so that it is recorded
as an event exactly like a notebook control; the heartbeat is rewritten right after, so the
sidebar sees the result on its next poll.

``command`` must only *request* the change (it applies at the next step boundary); it is
called from this thread and must not block on the training thread.
"""

from __future__ import annotations

import atexit
import collections
import functools
import hashlib
import logging
import os
import re
import shutil
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from megatrain_nb.threads import BEACON, thread_name
from megatrain_nb.channel.registry import list_sessions
from megatrain_nb.channel.protocol import (
    SCHEMA_VERSION,
    SESSION_ID_RE,
    CommandError,
    atomic_write_json,
    check_private_dir,
    clean_json,
    ensure_sessions_dir,
    finite_or_none,
    make_private_dir,
    read_command_file,
    runtime_root,
)

log = logging.getLogger(__name__)

LOSS_TAIL = 100
#: states of a run that is over: its last heartbeat stays until dismissed
ENDED_STATES = ("finished", "stopped", "failed")
#: what the heartbeat says of each branch of the run (Explorer.sidebar_rows), and how many at most
BRANCH_FIELDS = ("run_id", "name", "parent_run_id", "forked_at_step", "state", "step", "loss", "changes", "current")
MAX_BRANCHES = 64
_MAX_COMMANDS_PER_POLL = 32
_REFUSED_KEPT = 20


class SessionBeacon:
    """Heartbeat writer and command inbox for one running session.

    >>> beacon = SessionBeacon(session, interval=0.5).start()   # doctest: +SKIP
    >>> beacon.stop()                                            # doctest: +SKIP
    """

    def __init__(
        self,
        session: Any,
        *,
        interval: float = 0.25,
        poll: float = 0.2,
        root: str | Path | None = None,
        kernel_id: str | None = None,
    ) -> None:
        if interval <= 0 or poll <= 0:
            raise ValueError("interval and poll must be > 0 seconds")
        self.session = session
        self.interval = float(interval)
        self.poll = float(poll)
        self.root = Path(root) if root is not None else runtime_root()
        self.id = _session_id(session)
        self.kernel_id = kernel_id or current_kernel_id()   # (ranks: the kernel that launched them)
        self.started = time.time()
        self.last_command: dict[str, Any] | None = None
        #: the latest refused commands (each also in the log), shown in the heartbeat
        self.refused: collections.deque = collections.deque(maxlen=_REFUSED_KEPT)
        self._memory: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # one writer of the heartbeat at a time
        self._at_exit: Any = None   # the removal of this session's files at exit, while registered

    # ---- paths ---------------------------------------------------------------------------
    @property
    def heartbeat_file(self) -> Path:
        return self.root / "sessions" / f"{self.id}.json"

    @property
    def inbox(self) -> Path:
        return self.root / "sessions" / f"{self.id}.inbox"

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> SessionBeacon:
        """Create the folders, write the first heartbeat and start the thread (idempotent)."""
        if self._thread is not None and self._thread.is_alive():
            return self
        ensure_sessions_dir(self.root)
        try:   # the files of sessions whose process is gone go now, not only when a Jupyter server lists them
            list_sessions(self.root)
        except Exception:  # noqa: BLE001 - a tidy-up: never in the way of the beacon
            log.debug("megatrain_nb: the sessions folder was not tidied", exc_info=True)
        make_private_dir(self.inbox)
        self._stop.clear()
        self.write_heartbeat()
        self._thread = threading.Thread(
            target=self._run, name=thread_name(BEACON, self.id), daemon=True
        )
        self._thread.start()
        if self._at_exit is None:   # (paths only: an ended run's registration must not hold the session)
            self._at_exit = functools.partial(_remove_paths, self.heartbeat_file, self.inbox)
            atexit.register(self._at_exit)
        return self

    def stop(self, timeout: float = 2.0) -> None:
        """Stop the thread and remove the inbox. A run that ended (finished, stopped, failed)
        leaves its last heartbeat, with ``ended`` set, so the sidebar keeps showing it with its
        final loss until the user dismisses it (``registry.dismiss_session``) or this process
        exits (the session is over then: the file is removed at exit, so ended sessions' files
        never pile up in the runtime folder); anything else removes the heartbeat too. Safe to call twice, and from the beacon thread itself (a
        ``stop`` command ending the run)."""
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)
        final = self.snapshot()
        if final["state"] in ENDED_STATES:
            final["ended"] = final["updated"]
            with self._lock:
                shutil.rmtree(self.inbox, ignore_errors=True)
                try:
                    make_private_dir(self.heartbeat_file.parent)
                    atomic_write_json(self.heartbeat_file, final)
                except OSError:
                    log.debug("megatrain_nb: final heartbeat not written", exc_info=True)
            return   # (still registered: removed when this process exits)
        self._remove_files()
        if self._at_exit is not None:
            atexit.unregister(self._at_exit)
            self._at_exit = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    def _run(self) -> None:
        next_beat = time.monotonic() + self.interval
        while not self._stop.is_set():
            try:
                applied = self.poll_inbox()
                if applied or time.monotonic() >= next_beat:
                    self.write_heartbeat()
                    next_beat = time.monotonic() + self.interval
            except Exception:  # noqa: BLE001 - the beacon must outlive any glitch
                log.debug("megatrain_nb beacon iteration failed", exc_info=True)
            self._stop.wait(self.poll)

    def _remove_files(self) -> None:
        with self._lock:
            try:
                self.heartbeat_file.unlink()
            except OSError:
                pass
            shutil.rmtree(self.inbox, ignore_errors=True)

    # ---- heartbeat -----------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """The heartbeat record, built only from the session's public attributes."""
        s = self.session
        tail = _tail(_attr(s, "history", None), LOSS_TAIL)
        last = tail[-1] if tail else {}
        losses = [finite_or_none(r.get("loss")) for r in tail if "loss" in r]
        # memory comes with every logging_steps-th record: keep the latest one seen
        memory = next((r["memory"] for r in reversed(tail) if r.get("memory")), None)
        if memory is not None:
            self._memory = memory
        step = _attr(s, "step", None)
        total = _attr(s, "total_steps", None)
        return {
            "schema": SCHEMA_VERSION,
            "id": self.id,
            "name": str(_attr(s, "name", None) or f"session-{self.id[:8]}"),
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "kernel_id": self.kernel_id,
            "origin": process_origin(),   # where the run comes from (a kernel, a script, torchrun, pytest)
            # jupyter_server sets JPY_SESSION_NAME to the notebook path for its kernels;
            # the server extension overrides it from its session manager when it can.
            "notebook": os.environ.get("JPY_SESSION_NAME") or None,
            "state": _text(_attr(s, "state", None)) or "unknown",
            "step": int(step) if isinstance(step, (int, float)) else None,
            "total_steps": int(total) if isinstance(total, (int, float)) else None,
            "loss": finite_or_none(last.get("loss")),
            "lr": finite_or_none(last.get("lr")),
            # a learning rate asked for and not yet applied (it applies at the next step)
            "requested_lr": finite_or_none(_attr(s, "requested_lr", None)),
            "tokens_per_s": finite_or_none(last.get("tokens_per_s")),
            "loss_tail": losses,
            **_reward_fields(last),   # a DPO run: the card's reward margin
            "memory": clean_json(_memory_summary(self._memory)),
            "last_command": self.last_command,
            "refused_commands": list(self.refused),
            "started": self.started,
            "updated": time.time(),
            "branches": self._branches(),
            **self._extra(),
        }

    def _branches(self) -> list[dict[str, Any]]:
        """The run's branches (rewinds, forks) for the sidebar to nest under it: one row per
        run of its tree (``Explorer.sidebar_rows``), [] without branches."""
        rows = getattr(_attr(self.session, "explorer", None), "sidebar_rows", None)
        try:
            got = rows() if callable(rows) else None
        except Exception:  # noqa: BLE001 - the heartbeat must go on
            got = None
        if not isinstance(got, list):
            return []
        return [clean_json({k: r.get(k) for k in BRANCH_FIELDS}) for r in got[:MAX_BRANCHES] if isinstance(r, dict)]

    def _extra(self) -> dict[str, Any]:
        # a run of several ranks adds what a follower needs (its metrics log, world size...)
        fn = _attr(self.session, "heartbeat_extra", None)
        try:
            extra = fn() if callable(fn) else None
        except Exception:  # noqa: BLE001 - the heartbeat must go on
            extra = None
        return clean_json(extra) if isinstance(extra, dict) else {}

    def write_heartbeat(self) -> None:
        data = self.snapshot()
        with self._lock:
            if self._stop.is_set() and self._thread is not None:
                return  # stopping: never resurrect a removed file
            make_private_dir(self.heartbeat_file.parent)  # checked each time: never a swapped-in folder
            atomic_write_json(self.heartbeat_file, data)

    # ---- commands ------------------------------------------------------------------------
    def poll_inbox(self) -> int:
        """Apply every pending command in arrival order; returns how many were seen.

        The inbox is bounded: a file over ``MAX_COMMAND_BYTES`` is refused from its size,
        unread; an entry that is not a regular file (a folder, a FIFO, a symlink named like a
        command) is moved aside to a hidden name once and reported once; JSON that is not a
        command (invalid, nested) is refused. Every refusal is recorded (``last_command``, the
        heartbeat's ``refused_commands``, the log)."""
        try:
            check_private_dir(self.inbox)
            entries = sorted(
                (e for e in os.scandir(self.inbox) if e.name.endswith(".json") and not e.name.startswith(".")),
                key=lambda e: e.name,
            )
        except FileNotFoundError:
            make_private_dir(self.inbox)
            return 0
        for entry in entries[:_MAX_COMMANDS_PER_POLL]:
            path = self.inbox / entry.name
            command_id = entry.name[: -len(".json")]
            if not entry.is_file(follow_symlinks=False):
                self._set_aside(path, command_id)
                continue
            try:
                msg = read_command_file(path)
            except FileNotFoundError:
                continue
            except CommandError as e:
                msg = e
            finally:
                _unlink(path)  # first, so that a failing command is never retried forever
            self._apply(command_id, msg)
        return min(len(entries), _MAX_COMMANDS_PER_POLL)

    def _set_aside(self, path: Path, command_id: str) -> None:
        """A non-regular entry named like a command: renamed to a hidden name the scan skips
        (so it is reported once, not on every poll), and recorded as refused."""
        try:
            os.rename(path, path.with_name(f".refused-{path.name}"))
        except OSError:
            pass
        self._apply(command_id, CommandError("command entry is not a regular file (a folder, FIFO or link "
                                             "named like a command); moved aside, not read"))

    def _apply(self, command_id: str, msg: Any) -> None:
        """Run one command file's command; its outcome goes to the heartbeat (``last_command``).
        ``msg`` is the parsed file, or the :class:`CommandError` that refused it."""
        record: dict[str, Any] = {"id": command_id, "time": time.time(), "ok": False}
        try:
            if isinstance(msg, CommandError):
                raise msg
            if not isinstance(msg, dict):
                raise CommandError("command file is not a JSON object")
            record["source"] = str(msg.get("source", "lab"))
            self._call(command_id, msg.get("command"), msg.get("value"), record)
            record.update(ok=True, error=None)
        except Exception as e:  # noqa: BLE001 - reported back through the heartbeat
            record["error"] = f"{type(e).__name__}: {e}"
            log.warning("megatrain_nb: command %s refused: %s", command_id, record["error"])
            self.refused.append({"id": command_id, "time": record["time"], "error": record["error"]})
        self.last_command = clean_json(record)

    def _call(self, command_id: str, command: Any, value: Any, record: dict) -> None:
        record.update(command=command, value=value)
        self.session.command(command, value, source=record["source"], command_id=command_id)


# ---- helpers ---------------------------------------------------------------------------
def process_origin() -> dict[str, Any]:
    """Where this process comes from, for the sidebar's "from elsewhere" group: ``kind``
    ("kernel": a Jupyter kernel; "process": anything else), its ``pid`` and ``parent_pid``, the
    kernel's ``connection_file`` (a kernel of which server: its runtime folder), and ``command``:
    how it was started, in a few words ("python train.py", "torchrun --nproc_per_node 2 ...",
    "pytest tests/x.py")."""
    conn = None
    if current_kernel_id() is not None:
        try:
            from ipykernel import get_connection_file

            conn = get_connection_file()
        except Exception:  # noqa: BLE001 - not in a kernel after all
            conn = None
    argv = [os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv or [])]
    launcher = os.environ.get("TORCHELASTIC_RUN_ID") and "torchrun"
    head = "pytest" if "pytest" in sys.modules and any("pytest" in a for a in argv[:3]) else launcher
    words = [head] + argv[1:4] if head else [os.path.basename(sys.executable or "python")] + argv[:3]
    command = " ".join(w for w in words if w)[:120]
    return {"kind": "kernel" if conn else "process", "pid": os.getpid(), "parent_pid": os.getppid(),
            "connection_file": conn, "command": command}


def current_kernel_id() -> str | None:
    """The Jupyter kernel id of this process (from its connection file), or None."""
    if "ipykernel" not in sys.modules:
        return None
    try:
        from ipykernel import get_connection_file
        from ipykernel.kernelapp import IPKernelApp

        if not IPKernelApp.initialized():
            return None
        name = os.path.basename(get_connection_file())
    except Exception:  # noqa: BLE001 - not in a kernel
        return None
    m = re.match(r"^kernel-(.+)\.json$", name)
    return m.group(1) if m else None


def _session_id(session: Any) -> str:
    raw = _attr(session, "id", None)
    if isinstance(raw, str) and SESSION_ID_RE.match(raw):
        return raw
    if raw is not None:  # usable but not file-name safe: a stable digest of it
        return hashlib.sha1(str(raw).encode()).hexdigest()[:16]
    return uuid.uuid4().hex[:12]


def _attr(obj: Any, name: str, default: Any) -> Any:
    try:
        return getattr(obj, name, default)
    except Exception:  # noqa: BLE001 - a property raising must not stop the heartbeat
        return default


def _tail(history: Any, n: int) -> list[dict[str, Any]]:
    """The last ``n`` dict records of ``history``, read without locking the trainer: one
    slice of a list is atomic under the GIL; other sequences are copied, retried once."""
    if not history:
        return []
    for _ in range(2):
        try:
            try:
                recs = history[-n:]
            except TypeError:  # e.g. a deque
                recs = list(history)[-n:]
            return [r for r in recs if isinstance(r, dict)]
        except (RuntimeError, IndexError):  # mutated while copying
            continue
        except Exception:  # noqa: BLE001
            break
    return []


def _text(x: Any) -> str | None:
    """A state as plain text, also when it is an Enum."""
    if x is None:
        return None
    return str(getattr(x, "value", x))


def _memory_summary(memory: Any) -> dict[str, Any] | None:
    """Per tier, the scalar fields (used/peak/capacity bytes, names) and one level of
    breakdown: enough for the sidebar, small enough to rewrite every half second."""
    if not isinstance(memory, dict):
        return None
    out: dict[str, Any] = {}
    for tier in ("device", "host", "disk"):
        t = memory.get(tier)
        if not isinstance(t, dict):
            continue
        out[tier] = {
            k: (
                {kk: vv for kk, vv in v.items() if isinstance(vv, (int, float))}
                if isinstance(v, dict)
                else v
            )
            for k, v in t.items()
            if isinstance(v, (int, float, str, dict)) or v is None
        }
    return out or None


def _remove_paths(heartbeat: Path, inbox: Path) -> None:
    """At exit: the heartbeat and inbox of a session of this process (running, or ended and not dismissed)."""
    _unlink(heartbeat)
    shutil.rmtree(inbox, ignore_errors=True)


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def _reward_fields(last: dict[str, Any]) -> dict[str, Any]:
    """A DPO run's reward margin and accuracy for the sidebar's card (absent otherwise: the
    same names as ``notebook/preference_view.beacon_fields``)."""
    margin = finite_or_none(last.get("rewards/margins"))
    if margin is None:
        return {}
    return {"reward_margin": margin, "reward_accuracy": finite_or_none(last.get("rewards/accuracies"))}
