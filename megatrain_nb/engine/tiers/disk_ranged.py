"""A key's new version written range by range beside its old one (``DiskStore.ranged``):
neither version is ever whole in RAM; or a key read range by range (``DiskStore.read_ranged``).
The file format is :mod:`.disk_format`'s; the ordering against the key's other operations, the
counters and the write-behind worker are the store's (through its public methods)."""

from __future__ import annotations

import errno
import os
import shutil
import threading
import time
import uuid
from concurrent.futures import Future
from typing import TYPE_CHECKING, Optional

import torch

from .disk_format import (ALIGN, BUFFERED_SYNC_EVERY, CHECKSUM, WIDEST_CHECKSUM, OffloadError, RunningChecksum,
                          as_numpy, bytes_view, drop_cache, header_bytes, layout, pread_all, pwrite_all)

if TYPE_CHECKING:
    from .disk_store import DiskStore

__all__ = ["RangedRead", "RangedRewrite"]


class RangedRewrite:
    """A key's new version written range by range, its old version read range by range beside
    it (``DiskStore.ranged``). Each tensor's ranges are read, and written, in order from its
    start (its crc32 is taken as they pass: a read of the old version's last range checks its
    checksum; the new header carries the new ones). The new file has a temporary name until
    :meth:`commit` (fdatasync, then ``os.replace``): an :meth:`abort` or a crash leaves the old
    version as it was. A range of whole aligned blocks from aligned memory is written with direct
    I/O where the store uses it (the chunks of a large tensor); others buffered, each range's
    pages dropped as it goes, synced every ``BUFFERED_SYNC_EVERY`` bytes; reads buffered."""

    def __init__(self, store: DiskStore, key: str, specs: dict, read_old: bool, outer: Future):
        self.store, self.key, self.outer = store, key, outer
        self.t0 = time.perf_counter()
        self.final = store.key_path(key)
        self.reader = RangedRead(store, key) if read_old else None
        items = [(n, torch.empty(shape, dtype=dtype, device="meta")) for n, (dtype, shape) in specs.items()]
        self.items = items
        _, offsets, self.file_size = layout(key, items, crcs=[WIDEST_CHECKSUM] * len(items))   # the widest header
        self.new = {n: (off, t.numel() * t.element_size()) for (n, t), off in zip(items, offsets)}
        self.write_pos = {n: [0, RunningChecksum()] for n in self.new}
        self.tmp = f"{self.final}.tmp-{uuid.uuid4().hex[:8]}"
        self.fd = None
        free = shutil.disk_usage(store.path).free
        if free < self.file_size:
            self._close_old()
            raise store.no_space(key, self.final, self.file_size, free)
        self.dfd = None   # the same file opened for direct I/O (aligned ranges), where the store uses it
        try:
            self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            if store.direct_io:
                self.dfd = os.open(self.tmp, os.O_WRONLY | os.O_DIRECT)
        except OSError as e:
            self._close_new()
            self._close_old()
            raise self._failed(e) from e
        self.since_sync = 0
        self.lock = threading.Lock()

    def read(self, name: str, start: int, out: torch.Tensor) -> torch.Tensor:
        """Elements ``[start, start + out.numel())`` of the old version's ``name`` into ``out``."""
        return self.reader.read(name, start, out)

    def write(self, name: str, start: int, src: torch.Tensor) -> None:
        """Elements ``[start, start + src.numel())`` of the new version's ``name``."""
        off, nbytes = self.new[name]
        pos = self.write_pos[name]
        src = src.contiguous()
        a, n = start * src.element_size(), src.numel() * src.element_size()
        if a != pos[0] or a + n > nbytes:
            raise ValueError(f"RangedRewrite.write({self.key!r}, {name!r}): bytes [{a}, {a + n}) out of order "
                             f"(next {pos[0]} of {nbytes})")
        arr = as_numpy(bytes_view(src))
        with self.lock:
            try:
                if self.dfd is not None and (off + a) % ALIGN == 0 and n % ALIGN == 0 and src.data_ptr() % ALIGN == 0:
                    pwrite_all(self.dfd, arr, off + a)   # whole aligned blocks: straight to the disk
                else:
                    self._buffered(arr, off + a, n)
            except OSError as err:
                raise self._failed(err) from err
        pos[0] = a + n
        pos[1].update(arr)

    def _buffered(self, arr, offset: int, n: int) -> None:
        """A range through the page cache (not aligned to direct I/O's blocks), its pages dropped
        as they are written back; synced every ``BUFFERED_SYNC_EVERY`` bytes."""
        pwrite_all(self.fd, arr, offset)
        drop_cache(self.fd, offset, n)   # starts its writeback (the pages stay until clean)
        self.since_sync += n
        if self.since_sync >= BUFFERED_SYNC_EVERY:
            os.fdatasync(self.fd)
            drop_cache(self.fd)
            self.since_sync = 0

    def commit(self, behind: bool = False):
        """The new version replaces the old one (every tensor must be written whole). Returns
        the file size; ``behind``: the header is written now, the sync and rename in a worker
        of the store (write-behind: operations on the key wait for it, a failure is reported
        by ``flush`` as a write's) -- returns the Future."""
        try:
            short = [n for n, (_, nbytes) in self.new.items() if self.write_pos[n][0] != nbytes]
            if short:
                raise ValueError(f"RangedRewrite.commit({self.key!r}): {short} not written whole")
            pwrite_all(self.fd, header_at(self.key, self.items, self.new, self.write_pos, self.file_size), 0)
        except OSError as e:
            self.abort(self._failed(e))
            raise self.outer.exception() from e
        except BaseException as e:
            self.abort(e)
            raise
        if not behind:
            self._finish()
            return self.outer.result()
        try:
            self.store.run_behind(self._finish_behind)
        except RuntimeError:   # the store's workers are stopping: here, then
            self._finish_behind()
        return self.outer

    def _finish_behind(self) -> None:
        try:
            self._finish()
        except BaseException as e:  # noqa: BLE001 - delivered through the future and flush()
            self.store.record_error(e)

    def _finish(self) -> None:
        """Sync, rename, count; the key's next operations may start."""
        try:
            os.ftruncate(self.fd, self.file_size)
            os.fdatasync(self.fd)   # (the inode's: the direct writes' allocations too)
            drop_cache(self.fd)
            self._close_new()
            os.replace(self.tmp, self.final)
        except OSError as e:
            self.abort(self._failed(e))
            raise self.outer.exception() from e
        self._close_old()
        self.store.committed(self.key, self.file_size)
        if self.reader is not None and self.reader.read_bytes:
            self.store.count("read", self.reader.read_bytes, 0.0)
        self.store.count("write", self.file_size, time.perf_counter() - self.t0)
        self.store.op_done(self.key, self.outer)
        self.outer.set_result(self.file_size)

    def abort(self, error: Optional[BaseException]) -> None:
        """Drop the new version (the old one stays); operations waiting on this one go ahead
        (``error`` None: nothing went wrong, the key is left as it was)."""
        self._close_new()
        try:
            os.unlink(self.tmp)
        except OSError:
            pass
        self._close_old()
        if not self.outer.done():
            self.store.op_done(self.key, self.outer)
            if error is None:
                self.outer.set_result(0)
            else:
                self.outer.set_exception(error)

    def _failed(self, err: OSError) -> OffloadError:
        """The error to raise for a failed write of the new version (ENOSPC: the space needed)."""
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            return self.store.no_space(self.key, self.final, self.file_size, None, err)
        return OffloadError(f"writing {self.key!r} to {self.final} failed: {err.strerror or err}. Check the "
                            f"disk behind the offload directory {self.store.root}")

    def _close_new(self) -> None:
        _close_fds(self)

    def _close_old(self) -> None:
        if self.reader is not None:
            self.reader.close()


class RangedRead:
    """A key's file read range by range, each tensor in order from its start (its checksum
    taken as the ranges pass and checked at its last one), in the caller's threads: the file is
    never whole in RAM. A range of whole aligned blocks into aligned memory is read with direct
    I/O where the store uses it; others buffered, each range's pages dropped. The caller orders
    it against the key's writes (``DiskStore.read_ranged``; a rewrite's old version is read
    while the rewrite holds the key)."""

    def __init__(self, store: DiskStore, key: str, outer: Optional[Future] = None):
        self.store, self.outer, self.fd, self.dfd = store, outer, None, None
        self.key, self.path, self.read_bytes = key, store.key_path(key), 0
        try:
            self.fd = os.open(self.path, os.O_RDONLY)
            if store.direct_io:
                self.dfd = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
        except OSError as e:
            self.close()
            raise OffloadError(f"cannot open {self.path} for {key!r}: {e.strerror or e}") from e
        try:
            meta = store.read_header(self.fd, key, self.path)
        except BaseException:
            self.close()
            raise
        self.entries = {e["name"]: e for e in meta["tensors"]}
        self.pos = {n: [0, RunningChecksum(CHECKSUM if CHECKSUM in e else "crc32")]   # name ->
                    for n, e in self.entries.items()}                                # [bytes read, checksum]

    def read(self, name: str, start: int, out: torch.Tensor) -> torch.Tensor:
        """Elements ``[start, start + out.numel())`` of ``name`` into ``out`` (in order)."""
        e = self.entries[name]
        pos = self.pos[name]
        esize = out.element_size()
        a, n = start * esize, out.numel() * esize
        if a != pos[0] or a + n > e["nbytes"]:
            raise ValueError(f"ranged read of {self.key!r}, {name!r}: bytes [{a}, {a + n}) out of order "
                             f"(next {pos[0]} of {e['nbytes']})")
        arr = as_numpy(bytes_view(out))
        direct = self.dfd is not None and (e["offset"] + a) % ALIGN == 0 and n % ALIGN == 0 \
            and out.data_ptr() % ALIGN == 0
        try:
            pread_all(self.dfd if direct else self.fd, arr, e["offset"] + a)
        except OSError as err:
            raise OffloadError(f"reading {self.key!r} from {self.path} failed: {err.strerror or err}") from err
        if not direct:
            drop_cache(self.fd, e["offset"] + a, n)
        pos[0] = a + n
        pos[1].update(arr)
        self.read_bytes += n
        field = pos[1].field
        if pos[0] == e["nbytes"] and field in e and pos[1].value() != e[field]:
            raise OffloadError(f"{self.path} (key {self.key!r}): the payload of {name!r} does not match its "
                               f"checksum (the file was corrupted on disk). The run cannot continue from this "
                               f"state: resume from the last checkpoint")
        return out

    def close(self) -> None:
        """Done reading (whole or not): the key's later writes may go ahead."""
        _close_fds(self)
        if self.outer is not None and not self.outer.done():
            self.store.op_done(self.key, self.outer)
            if self.read_bytes:
                self.store.count("read", self.read_bytes, 0.0)
            self.outer.set_result(self.read_bytes)


def _close_fds(obj) -> None:
    """Close ``obj.fd`` and ``obj.dfd`` (its direct-I/O descriptor) where open."""
    for name in ("fd", "dfd"):
        fd = getattr(obj, name, None)
        if fd is not None:
            os.close(fd)
            setattr(obj, name, None)


def header_at(key: str, items, new: dict, write_pos: dict, file_size: int) -> bytes:
    """The header of a file whose tensors sit at ``new``'s offsets (room for the widest header)."""
    entries = [{"name": n, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                "offset": new[n][0], "nbytes": new[n][1], CHECKSUM: write_pos[n][1].value()} for n, t in items]
    return header_bytes(key, file_size, entries)
