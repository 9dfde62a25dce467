"""Writing files and folders so that a reader (or a crash) never sees half of one.

A file is written to a temporary name in its own folder and ``os.replace``'d onto its name; a
folder is built whole under a temporary name and swapped in the same way. Weights
(``save_pretrained``), checkpoints, reports and the JupyterLab heartbeats all go through here.
This module imports only the standard library, so the engine may use it too.

Example::

    write_file_atomically("run.html", text)                  # an ordinary file (umask applies)
    write_file_atomically("beacon.json", data, private=True)  # 0600
    with staging_dir(parent, prefix=".save-tmp-") as tmp:
        ...write into tmp...
        replace_dir_atomically(tmp, parent / "model")
"""
from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Iterator, Optional, Union

PathLike = Union[str, os.PathLike]


def write_file_atomically(path: PathLike, data: Union[str, bytes], *, private: bool = False) -> None:
    """Write ``data`` to ``path`` through a temporary file beside it and ``os.replace``.

    The temporary name starts with a dot and ends in ``.tmp`` so folder scans skip it.
    ``private``: the file is 0600 (mkstemp's mode); otherwise 0666 less the umask, like
    ``open(path, "w")`` would make it.
    """
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w",
                       **({} if isinstance(data, bytes) else {"encoding": "utf-8"})) as f:
            f.write(data)
        if not private:
            os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def replace_dir_atomically(src: PathLike, dst: PathLike, *, aside: Optional[PathLike] = None) -> None:
    """Move the finished folder ``src`` to ``dst`` (same filesystem). An existing ``dst`` is
    renamed to ``aside`` first (default: a hidden name beside it) and removed only once ``src``
    stands in its place, so at every moment one complete folder exists under one of the names.
    A caller that cleans up after crashed writers passes an ``aside`` its clean-up recognises."""
    src, dst = Path(src), Path(dst)
    if dst.exists():
        old = Path(aside) if aside is not None else dst.parent / f".{dst.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
        os.replace(dst, old)
        os.replace(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dst)


@contextlib.contextmanager
def staging_dir(parent: PathLike, prefix: str) -> Iterator[Path]:
    """A new empty folder in ``parent`` to build something in; whatever is still there when
    the block ends (an error, or what was not moved out) is removed."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def fsync_tree(path: PathLike) -> None:
    """Flush every file below ``path`` and the folder itself to disk (best effort: a
    filesystem that cannot fsync a folder is not an error)."""
    root = Path(path)
    for f in root.rglob("*"):
        if f.is_file():
            _fsync(f)
    _fsync(root)


def fsync_dir(path: PathLike) -> None:
    """Flush a folder's entries (after a rename into it), best effort."""
    _fsync(path)


def _fsync(path: PathLike) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
