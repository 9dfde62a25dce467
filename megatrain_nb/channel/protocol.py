"""The on-disk channel between training sessions and the Jupyter server.

Layout (see docs/INTERNALS.md, "Session beacon")::

    <root>/                                   0700, root = jupyter_runtime_dir()/megatrain_nb
      sessions/                               0700       (or $MEGATRAIN_NB_RUNTIME_DIR)
        <session_id>.json                     0600  heartbeat, rewritten atomically
        <session_id>.inbox/                   0700  command inbox
          <time_ns>-<pid>-<n>.json            0600  one command per file, deleted once applied

Only the user who runs Jupyter can read or write any of it. This module needs only the
standard library and jupyter_core, so both the kernel side (beacon) and the server side
(registry, handlers) import it cheaply.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import stat
import time
from pathlib import Path
from typing import Any

from megatrain_nb.atomic import atomic_file
from megatrain_nb.commands import COMMANDS as _TABLE
from megatrain_nb.commands import SIDEBAR, CommandError  # noqa: F401 - CommandError re-exported

ENV_RUNTIME_DIR = "MEGATRAIN_NB_RUNTIME_DIR"
SCHEMA_VERSION = 1

#: Session ids become file names, so they are restricted to a safe alphabet.
SESSION_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

#: command -> whether it takes a value, for what the sidebar sends (the table: megatrain_nb/commands.py)
COMMANDS: dict[str, bool] = {n: _TABLE[n].value not in ("none", "stop") for n in SIDEBAR}

_counter = itertools.count()


def runtime_root() -> Path:
    """The folder that holds everything: ``$MEGATRAIN_NB_RUNTIME_DIR`` or
    ``jupyter_runtime_dir()/megatrain_nb``.

    Kernels inherit the server's environment, so both sides resolve the same folder.
    """
    override = os.environ.get(ENV_RUNTIME_DIR)
    if override:
        return Path(override).expanduser()
    from jupyter_core.paths import jupyter_runtime_dir

    return Path(jupyter_runtime_dir()) / "megatrain_nb"


def sessions_dir(root: Path | str | None = None) -> Path:
    return Path(root if root is not None else runtime_root()) / "sessions"


def heartbeat_path(session_id: str, root: Path | str | None = None) -> Path:
    return sessions_dir(root) / f"{check_session_id(session_id)}.json"


def inbox_path(session_id: str, root: Path | str | None = None) -> Path:
    return sessions_dir(root) / f"{check_session_id(session_id)}.inbox"


def check_session_id(session_id: str) -> str:
    if not isinstance(session_id, str) or not SESSION_ID_RE.match(session_id):
        raise ValueError(f"invalid session id {session_id!r}: expected 1-64 of [A-Za-z0-9_-]")
    return session_id


class UnsafeFolderError(PermissionError):
    """A runtime folder that another user could control (the message says what to fix)."""


def check_private_dir(path: Path) -> Path:
    """``path`` must be a real folder (not a symlink), owned by this user, and writable by no
    one else: otherwise another local user could hide commands or plant fake sessions."""
    st = os.lstat(path)
    why = None
    if stat.S_ISLNK(st.st_mode):
        why = "is a symbolic link"
    elif not stat.S_ISDIR(st.st_mode):
        why = "is not a folder"
    elif st.st_uid != os.getuid():
        why = f"is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    elif st.st_mode & 0o022:
        why = f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    if why:
        raise UnsafeFolderError(f"megatrain_nb runtime folder {str(path)!r} {why}; refusing to use it. Remove it "
                                f"(or fix it: chmod 700, owned by you), or set ${ENV_RUNTIME_DIR} to a private folder")
    return path


def make_private_dir(path: Path) -> Path:
    """Create ``path`` (parents too) as 0700 and check it (:func:`check_private_dir`); an own
    folder readable by others is tightened to 0700."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = os.lstat(path)
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and st.st_mode & 0o055 and not st.st_mode & 0o022:
        os.chmod(path, 0o700)
    return check_private_dir(path)


def ensure_sessions_dir(root: Path | str | None = None) -> Path:
    """``<root>`` and ``<root>/sessions``, both 0700 (the umask is not trusted)."""
    root = Path(root if root is not None else runtime_root())
    make_private_dir(root)
    return make_private_dir(root / "sessions")


def atomic_write_json(path: Path, data: Any) -> None:
    """Write JSON to ``path`` (0600) through a temp file in the same folder and ``os.replace``.

    Readers therefore never see a half-written file. Temp names end in ``.tmp-<pid>-<random>``,
    not ``.json``, so directory scans skip them. Not fsynced: a heartbeat is rewritten every
    half second and means nothing after a power cut.
    """
    with atomic_file(path, private=True, fsync=False) as f:
        f.write(json.dumps(data, allow_nan=False, separators=(",", ":")))


def read_json(path: Path) -> Any | None:
    """The parsed file, or None if it vanished, is not valid JSON, or is not a regular file
    of this user's (opened with ``O_NOFOLLOW``: a symlink planted in its place is not read)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return None
        with os.fdopen(fd, encoding="utf-8") as f:
            fd = -1
            return json.load(f)
    except (OSError, ValueError):
        return None
    finally:
        if fd >= 0:
            os.close(fd)


#: A command file or request body is about 100 bytes; anything over this is refused unread.
MAX_COMMAND_BYTES = 4096
#: How deeply a command's JSON may nest (a command is one flat object).
MAX_COMMAND_DEPTH = 4


def too_big(nbytes: int | None) -> CommandError:
    """The refusal of a command over :data:`MAX_COMMAND_BYTES` (its size, when known)."""
    size = f" ({nbytes} bytes)" if nbytes is not None else ""
    return CommandError(f"a command is at most {MAX_COMMAND_BYTES} bytes: this one{size} is over the "
                        f"{MAX_COMMAND_BYTES}-byte limit; not read")


def parse_command_json(raw: bytes | str) -> Any:
    """A command's JSON (a request body or an inbox file), or :class:`CommandError` saying why
    not: over :data:`MAX_COMMAND_BYTES`, not valid JSON, or nested deeper than a command is
    (the check runs before the parser could recurse: a deeply nested body is an answer, not a
    crash)."""
    if len(raw) > MAX_COMMAND_BYTES:
        raise too_big(None)
    text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:   # bracket depth outside strings, so the parser never meets a deep document
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    if deepest > MAX_COMMAND_DEPTH:
        raise CommandError(f"a command is a flat JSON object; this one nests {deepest} levels deep")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise CommandError(f"not valid JSON ({e})") from None


def read_command_file(path: Path) -> Any:
    """The parsed command in inbox file ``path``; :class:`CommandError` when it is not one of
    this user's regular files (opened with ``O_NOFOLLOW``, never a FIFO read), is over
    :data:`MAX_COMMAND_BYTES` (refused from its size, unread) or not a command's JSON.
    FileNotFoundError when it vanished."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise
    except OSError as e:
        raise CommandError(f"command file cannot be opened ({e.strerror}; a symbolic link?)") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CommandError("command entry is not a regular file")
        if st.st_uid != os.getuid():
            raise CommandError(f"command file is owned by uid {st.st_uid}, not by this user")
        if st.st_size > MAX_COMMAND_BYTES:
            raise too_big(st.st_size)
        raw = os.read(fd, MAX_COMMAND_BYTES + 1)   # one past the limit: the parser refuses a file that grew
    finally:
        os.close(fd)
    return parse_command_json(raw)


def new_command_name() -> str:
    """Sortable, unique within the process: ``<time_ns>-<pid>-<n>``."""
    return f"{time.time_ns()}-{os.getpid()}-{next(_counter)}"


def write_command(session_id: str, command: str, value: Any = None, *, source: str = "lab",
                  root: Path | str | None = None) -> dict[str, Any]:
    """The one writer of the inbox: ``command`` (checked already by the caller's door: the
    server by the table's sidebar rows, a Session's controls by the whole table) as one file
    in ``session_id``'s inbox, written whole (temp name + rename). Returns what it wrote."""
    ensure_sessions_dir(root)
    inbox = make_private_dir(inbox_path(session_id, root))
    name = new_command_name()
    msg = {"id": name, "command": command, "value": value, "source": source, "time": time.time()}
    atomic_write_json(inbox / f"{name}.json", msg)
    return msg


def finite_or_none(x: Any) -> float | None:
    """A plain float, or None for None/NaN/inf/non-numbers (JSON has no NaN)."""
    if x is None or isinstance(x, bool):
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def clean_json(x: Any, depth: int = 0) -> Any:
    """Turn ``x`` into strictly JSON-safe data: NaN/inf -> None, tensors/numpy scalars ->
    float, unknown objects -> str. Bounded depth so a cycle cannot hang the beacon."""
    if depth > 6:
        return None
    if x is None or isinstance(x, (bool, str)):
        return x
    if isinstance(x, int):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): clean_json(v, depth + 1) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [clean_json(v, depth + 1) for v in x]
    if hasattr(x, "item"):  # numpy / torch scalars
        try:
            return clean_json(x.item(), depth + 1)
        except Exception:  # noqa: BLE001 - e.g. a multi-element tensor
            return None
    return str(x)
