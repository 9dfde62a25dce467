"""The package's one atomic-save helper: weights, checkpoints, reports and the JupyterLab
heartbeats are written to a temporary sibling, fsynced, then renamed into place, so a reader
(or a crash) sees the old version or the new one, never half of one.

Standard library only: the engine, the trainer, the notebook and the Jupyter server side
(``lab/``) all use it without importing each other (or torch).

Example::

    with atomic_file("run.html") as f:                 # umask applies, like open(path, "w")
        f.write(text)
    atomic_dir("out/checkpoint-4", lambda tmp: write_everything_into(tmp))
"""
from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator, Union

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
    """Call ``write(tmp)`` on a fresh temporary folder beside ``final``, fsync it, then rename it
    to ``final`` (an older ``final`` is moved aside and removed). On any error the temporary
    folder is removed and ``final`` is left as it was. Returns ``final``."""
    final = os.path.abspath(os.fspath(final))
    parent = os.path.dirname(final)
    os.makedirs(parent, exist_ok=True)
    tmp = temp_name(final)
    os.mkdir(tmp)
    try:
        write(tmp)
        fsync_tree(tmp)
        if os.path.isdir(final):
            old = temp_name(final)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        fsync_path(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


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
