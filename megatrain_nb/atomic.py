"""The package's one atomic-save helper: weights, checkpoints, reports and the JupyterLab
heartbeats are written to a temporary sibling, fsynced, then renamed into place, so a reader
(or a crash) sees the old version or the new one, never half of one.

Standard library only: the engine, the trainer, the notebook and the Jupyter server side
(``channel/``) all use it without importing each other (or torch).

Example::

    with atomic_file("run.html") as f:                 # umask applies, like open(path, "w")
        f.write(text)
    atomic_dir("out/checkpoint-4", lambda tmp: write_everything_into(tmp))
"""
from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator, Union

from megatrain_nb.processes import pid_alive

PathLike = Union[str, os.PathLike]


def temp_name(final: PathLike) -> str:
    """A sibling of ``final`` for its next version: ``<name>.tmp-<pid>-<random>`` (the pid lets a
    cleaner tell a dead writer's leftovers from a live one's)."""
    return f"{os.fspath(final).rstrip(os.sep)}.tmp-{os.getpid()}-{secrets.token_hex(4)}"


def fsync_path(path: PathLike) -> None:
    """Flush a file's or a folder's entry to disk (best effort: some filesystems refuse)."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def fsync_tree(path: PathLike) -> None:
    """fsync every file under ``path``, then the folders themselves."""
    for folder, _, files in os.walk(path):
        for f in files:
            fsync_path(os.path.join(folder, f))
        fsync_path(folder)


def atomic_dir(final: PathLike, write: Callable[[str], None]) -> str:
    """Call ``write(tmp)`` on a fresh temporary folder beside ``final`` (``<name>.tmp-<pid>-<hex>``),
    then :func:`commit_dir` it. Whatever stops it (an error here, or a kill: see
    :func:`recover_interrupted`), ``final`` ends up as the complete old folder or the complete
    new one. Returns ``final``."""
    final = os.path.abspath(os.fspath(final))
    os.makedirs(os.path.dirname(final), exist_ok=True)
    tmp = temp_name(final)
    os.mkdir(tmp)
    try:
        write(tmp)
        commit_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def commit_dir(tmp: PathLike, final: PathLike) -> str:
    """fsync the written folder ``tmp`` (made by :func:`temp_name` beside ``final``) and rename it
    to ``final``. An older ``final`` is first moved aside (``<name>.old-<pid>-<hex>``) and deleted
    only once the new one is in place; on an error the old one is put back."""
    tmp, final = os.fspath(tmp), os.path.abspath(os.fspath(final))
    parent = os.path.dirname(final)
    old = f"{final}.old-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        fsync_tree(tmp)
        if os.path.isdir(final):
            os.replace(final, old)
        os.replace(tmp, final)
        fsync_path(parent)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        # judge by what is on disk, not by how far this got: a rename may just have happened
        if os.path.exists(old):
            if os.path.exists(final):
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(old, final)  # the previous folder is back
        raise
    return final


#: what atomic_dir leaves beside ``<name>`` while it works
_SIDE = re.compile(r"^(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)-[0-9a-f]{8}$")


def recover_interrupted(folder: PathLike) -> list[str]:
    """Finish the :func:`atomic_dir` saves in ``folder`` whose writer died (or is this
    process): a moved-aside old folder whose replacement never arrived is renamed back, one
    whose replacement is in place is deleted, and partial new folders are deleted. Returns
    what was done, one line each."""
    root = Path(folder)
    if not root.is_dir():
        return []
    done = []
    for child in sorted(root.iterdir()):
        m = _SIDE.match(child.name)
        if not m or not child.is_dir():
            continue
        pid = int(m.group("pid"))
        if pid != os.getpid() and pid_alive(pid) is not False:
            continue  # a live writer's, or one we cannot judge
        final = root / m.group("name")
        if m.group("kind") == "old" and not final.exists():
            os.replace(child, final)
            done.append(f"restored {final}")
        else:
            shutil.rmtree(child, ignore_errors=True)
            done.append(f"removed {child}")
    if done:
        fsync_path(root)
    return done


@contextlib.contextmanager
def atomic_file(final: PathLike, mode: str = "w", *, encoding: Union[str, None] = "utf-8",
                private: bool = False, fsync: bool = True) -> Iterator:
    """``with atomic_file(path) as f: f.write(...)``: written to a temporary sibling and renamed
    over ``path`` when the block ends without an error (removed if it raises). ``mode`` "w"
    (text) or "wb" (bytes). The file gets the usual permissions (umask applied), or 0600 with
    ``private``. ``fsync=False`` skips flushing to disk, for files rewritten every second
    whose loss in a power cut does not matter (heartbeats)."""
    final = os.path.abspath(os.fspath(final))
    os.makedirs(os.path.dirname(final), exist_ok=True)
    tmp = temp_name(final)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o666)
        with open(fd, mode, encoding=None if "b" in mode else encoding) as f:
            yield f
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, final)
        if fsync:
            fsync_path(os.path.dirname(final))
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def staging_dir(parent: PathLike, prefix: str) -> Iterator[Path]:
    """A new empty folder in ``parent`` to build something in before moving it (or its files)
    into place yourself; whatever is still there when the block ends is removed. For the
    cases :func:`atomic_dir` does not cover: files merged into a folder that holds other
    things, or a cache folder another process may have created first."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
