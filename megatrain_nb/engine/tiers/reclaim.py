"""Reclaiming the offload folders of processes that died without cleaning up.

A killed process leaves its offload folder under ``offload_dir`` (tens of GiB at scale, after
which the next run's free-space check fails). The folder's name says whose it is:
``megatrain-<pid>-<host tag>-<process start time>-<random>`` (see :func:`folder_prefix`). On start,
under an exclusive ``flock`` on ``offload_dir`` itself, a folder is removed only when it is this
user's, a real folder (not a symlink), from this host, and its process is gone -- a pid now used
by a process started at another time counts as gone. Anything uncertain is left alone. Folders
named by older versions (``megatrain-<pid>-<random>``) are reclaimed when their pid is gone.

The same rule reclaims the launch folders of ``mt.Session(..., nproc_per_node=N)``
(``megatrain-launch-<pid>-...`` in the temporary folder, ``label="launch-"``), whose owner is
the notebook kernel; ``in_use`` then also keeps a folder a live process still names (its
worker processes finishing after the kernel died).
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import socket
import stat
import warnings


def _named(label: str):
    """``megatrain-<label><pid>-<host tag>-<start time>-<random>``."""
    return re.compile(rf"^megatrain-{re.escape(label)}(\d+)-([0-9a-f]{{6}})-([0-9a-f]+)-[A-Za-z0-9_]+$")


_NAMED = _named("")
_LEGACY = re.compile(r"^megatrain-(\d+)-[A-Za-z0-9_]{8}$")


def _host_tag() -> str:
    return hashlib.sha1(socket.gethostname().encode()).hexdigest()[:6]


def _start_time(pid: int):
    try:
        import psutil

        return int(psutil.Process(pid).create_time())
    except Exception:  # noqa: BLE001 - gone, or psutil cannot tell
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def folder_prefix(label: str = "") -> str:
    """The name prefix of this process's offload folder (``label="launch-"``: launch folder)."""
    return f"megatrain-{label}{os.getpid()}-{_host_tag()}-{_start_time(os.getpid()) or 0:x}-"


def _abandoned(path: str, name: str, label: str = "") -> bool:
    m = (_NAMED if not label else _named(label)).match(name)
    legacy = None if m or label else _LEGACY.match(name)
    if not m and not legacy:
        return False
    st = os.lstat(path)
    pid = int((m or legacy).group(1))
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or pid == os.getpid():
        return False
    if legacy:
        return not _alive(pid)
    if m.group(2) != _host_tag():
        return False  # another machine sharing this disk: its pids mean nothing here
    if not _alive(pid):
        return True
    now = _start_time(pid)
    return now is not None and int(m.group(3), 16) not in (0, now)  # the pid was reused


def _size(path: str) -> int:
    total = 0
    for top, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(top, f)).st_size
            except OSError:
                pass
    return total


def reclaim(root: str, *, label: str = "", in_use=None, what: str = "offload folder") -> list[tuple[str, int]]:
    """Remove the abandoned folders under ``root`` (offload folders; ``label="launch-"``: launch
    folders); returns (path, bytes) of each and warns with the total. Never touches a live
    process's folder, nor one ``in_use(path)`` says is still used."""
    try:
        lock = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return []  # cannot lock: reclaim nothing rather than race another process
    done = []
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for name in sorted(os.listdir(root)):
            path = os.path.join(root, name)
            try:
                if not _abandoned(path, name, label) or (in_use is not None and in_use(path)):
                    continue
                size = _size(path)
                shutil.rmtree(path)
                done.append((path, size))
            except OSError:
                continue
    finally:
        os.close(lock)  # releases the lock
    if done:
        total = sum(n for _, n in done)
        warnings.warn(f"megatrain_nb reclaimed {len(done)} {what}(s) of processes that no longer run "
                      f"({total} bytes): {', '.join(p for p, _ in done)}", stacklevel=3)
    return done
