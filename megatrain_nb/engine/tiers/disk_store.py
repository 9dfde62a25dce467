"""The disk tier: named groups of tensors in files under ``offload_dir``.

``DiskStore`` keeps one file per key (a unit's optimizer states, or its master weights when the
host budget cannot hold them). Writes are write-behind and reads are read-ahead: both run in
worker threads and return ``concurrent.futures.Future`` objects, so the pager can overlap disk
I/O with compute. Operations on the same key keep their order where it matters (a read issued
after a write of that key sees the new data; a write waits for the reads issued before it),
while reads of a key, and operations on different keys, run concurrently.

The file format (one ``<key>-<hash>.mtd`` file per key: a checksummed json header, then each
tensor's bytes with its checksum) and the raw I/O helpers are :mod:`.disk_format`'s; a reader
refuses a truncated, foreign or corrupted file with ``OffloadError``. ``ranged`` rewrites a key
range by range (:mod:`.disk_ranged`).

Durability: a file is written under a temporary name, flushed with ``fdatasync`` and then
``os.replace``'d onto the key's name, so an interrupted or failed write (ENOSPC, a crash) never
leaves a file that reads as valid; the previous version of the key stays readable.

Page cache: where the filesystem supports it, files are written and read with ``O_DIRECT``
(bypassing the page cache, so offloading does not turn into RAM use). Tensors whose memory is
4096-aligned (see :func:`aligned_empty`; ``read()`` allocates such tensors) move without a
copy; others go through a per-thread aligned staging buffer (large ones are read through the
page cache instead, straight into the tensor, dropping each chunk's pages as it goes: the
kernel's read-ahead then overlaps the copy). Where ``O_DIRECT`` is refused
(older tmpfs, some network filesystems) the store falls back to buffered I/O and drops the pages it
touched with ``posix_fadvise(POSIX_FADV_DONTNEED)``.

The offload folder: ``DiskStore(root)`` creates a private folder ``megatrain-<pid>-...``
(mode 0700, files 0600) under ``root`` and removes it on ``close()`` (or when the store is
garbage collected / the interpreter exits) unless ``keep=True``. Folders left by killed
processes are reclaimed when the next store opens under ``root`` (reclaim.py).

Example::

    >>> import torch, tempfile
    >>> from megatrain_nb.engine.tiers.disk_store import DiskStore
    >>> with DiskStore(tempfile.gettempdir()) as store:
    ...     fut = store.write("layers.0", {"exp_avg": torch.ones(1000)})
    ...     got = store.read("layers.0").result()       # ordered after the write
    ...     float(got["exp_avg"].sum())
    1000.0
"""

from __future__ import annotations

import errno
import hashlib
import heapq
import os
import re
import shutil
import tempfile
import threading
import time
import uuid
import weakref
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait

import torch

from megatrain_nb.formatting import fmt_bytes

from .disk_format import (ALIGN, SUFFIX, OffloadError, Staging, aligned_empty, as_numpy, buffered_read,
                          buffered_write, bytes_view, drop_cache, large_unaligned, layout, payload_ok, pread_all,
                          probe_dio_sector, probe_direct_io, read_header, transfer)
from .disk_ranged import RangedRead, RangedRewrite
from .diskspace import filesystem_of, filesystem_text
from .reclaim import folder_prefix, reclaim
from ... import threads as registry
from ...threads import DISK

__all__ = ["ALIGN", "DiskStore", "OffloadError", "RangedRewrite", "WriteWindow", "aligned_empty",
           "prepare_offload_dir"]


class _PriorityPool:
    """Worker threads that take the most urgent queued job first (FIFO within a priority),
    plus one that takes only urgent (priority 0) jobs, so an urgent read never waits for a
    long write already in progress."""

    def __init__(self, threads: int, name: str):
        # One lock, two conditions: a job wakes one idle worker, not all of them. Every wake is a
        # thread that takes the GIL and a core from the compute; with one shared condition each
        # job woke every idle worker, and all but one went back to sleep.
        lock = threading.Lock()
        self._cv = threading.Condition(lock)           # the general workers wait on it
        self._urgent_cv = threading.Condition(lock)    # the urgent-only worker waits on it
        self._urgent_idle = False   # (under the lock) the urgent-only worker waits, not yet woken
        self.wakeups = 0            # (under the lock) waits that ended, a timeout's included (tests count)
        self._heap: list = []
        self._seq = 0
        self._shutdown = False
        self.stopping = False   # set without the lock (finalizers): idle workers exit within a second

        self._device = registry.current_thread_device()   # (each worker starts on it: threads.py)
        self._threads = [threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True)
                         for i in range(threads)]
        self._threads.append(threading.Thread(target=self._work, args=(True,), name=f"{name}_urgent", daemon=True))
        for t in self._threads:
            t.start()

    def submit(self, fn, priority: int = 1) -> list:
        """Queue ``fn``; returns its job, which :meth:`hurry` may make urgent while it waits."""
        job = [fn]   # [fn] while queued, [] once a worker took it (it runs once)
        with self._cv:
            if self._shutdown:
                raise RuntimeError("cannot schedule new I/O after shutdown")
            self._push(priority, job)
        return job

    def hurry(self, job: list) -> None:
        """A queued job becomes urgent (someone urgent waits for it): queued again at priority
        0; whichever entry a worker takes first runs it."""
        with self._cv:
            if job and not self._shutdown:
                self._push(0, job)

    def _push(self, priority: int, job: list) -> None:
        """(Under the lock.) Queue the job and wake one idle worker for it: an urgent job the
        urgent-only worker if it waits, else a general one (a busy worker looks at the queue
        before it waits again, so a job nobody is woken for is taken when one is free)."""
        heapq.heappush(self._heap, (priority, self._seq, job))
        self._seq += 1
        if priority == 0 and self._urgent_idle:
            self._urgent_idle = False
            self._urgent_cv.notify()
        else:
            self._cv.notify()

    def _work(self, urgent_only: bool = False) -> None:
        registry.set_thread_device(self._device)

        def ready():
            while self._heap and not self._heap[0][2]:
                heapq.heappop(self._heap)   # an entry of a job already taken (hurried)
            return self._heap and (not urgent_only or self._heap[0][0] == 0)

        while True:
            with self._cv:
                while not ready() and not self._shutdown and not self.stopping:
                    if urgent_only:
                        self._urgent_idle = True
                        self._urgent_cv.wait(1.0)
                        self._urgent_idle = False
                    else:
                        self._cv.wait(1.0)
                    self.wakeups += 1
                if not ready():
                    return
                fn = heapq.heappop(self._heap)[2].pop()
            fn()
            del fn  # drop the job (and the tensors it holds) before waiting for the next one

    def shutdown(self, wait: bool = True) -> None:
        with self._cv:
            self._shutdown = True
            self._cv.notify_all()
            self._urgent_cv.notify_all()
        if wait:
            for t in self._threads:
                if t is not threading.current_thread():
                    t.join()


def prepare_offload_dir(path: str | os.PathLike, need_bytes: int = 0) -> str:
    """``offload_dir`` as an absolute path, created with its missing parents (each mode 0700,
    user only), as ``output_dir`` is. What guards against a disk that is not mounted is not the
    parent (its empty mount point usually stays behind) but the space: the run's header and
    ``memory_report()`` name the filesystem the tier is on and its free space, and
    :class:`DiskStore` refuses a tier that does not fit there, with the numbers."""
    root = os.path.abspath(os.path.expanduser(os.fspath(path)))
    if os.path.isdir(root):
        return root
    need = f"{need_bytes} bytes ({fmt_bytes(need_bytes)})"
    missing = []
    p = root
    while not os.path.exists(p) and os.path.dirname(p) != p:
        missing.append(p)
        p = os.path.dirname(p)
    if not os.path.isdir(p):
        raise OffloadError(f"offload_dir {root!r}: {p!r} exists but is not a folder; pass a folder "
                           f"(needs {need} free).")
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            if not os.path.isdir(d):
                raise OffloadError(f"offload_dir {root!r}: {d!r} exists but is not a folder; pass a folder "
                                   f"(needs {need} free).") from None
        except OSError as e:
            raise OffloadError(f"cannot create offload_dir {root!r} ({d}): {e.strerror or e}; create it yourself "
                               f"on a disk with at least {need} free, or pass another folder.") from e
    return root


def _remove_folder(folder: str) -> None:
    shutil.rmtree(folder, ignore_errors=True)


class WriteWindow:
    """Writes left in flight behind their caller, at most ``depth`` at once (the tensors they
    write stay in RAM until written): ``add`` waits for the oldest beyond that."""

    def __init__(self, depth: int = 2):
        self.depth = depth
        self._futures: list[Future] = []

    def add(self, fut: Future) -> None:
        self._futures.append(fut)
        while len(self._futures) > self.depth:
            self._futures.pop(0).result()

    def drain(self) -> None:
        futures, self._futures = self._futures, []
        for f in futures:
            f.result()


class DiskStore:
    """Named groups of tensors in files under ``root`` (see the module docstring).

    Args:
        root: folder for offloaded state; created if missing. The store works in a private
            subfolder ``megatrain-<pid>-<random>`` (mode 0700) inside it.
        reserve_bytes: bytes the caller plans to store; ``OffloadError`` up front if the disk
            has less free space.
        keep: leave the files on ``close()`` (for inspection); default removes them.
        io_threads: worker threads doing the I/O.

    ``write`` and ``read`` never block: callers bound the memory their pending operations hold
    (the engine's staging pools and read-ahead budgets do).

    All methods are thread-safe. The tensors given to ``write`` must stay unchanged until its
    future is done (the store writes them from their memory, without a snapshot).
    """

    def __init__(self, root: str | os.PathLike, *, reserve_bytes: int = 0, keep: bool = False,
                 io_threads: int = 2):
        if io_threads < 1:
            raise ValueError(f"io_threads ({io_threads}) must be at least 1")
        root = os.path.abspath(os.path.expanduser(os.fspath(root)))
        try:
            os.makedirs(root, exist_ok=True)
            self.reclaimed = reclaim(root)  # folders of killed processes, before the free-space check
            folder = tempfile.mkdtemp(prefix=folder_prefix(), dir=root)  # 0700
        except OSError as e:
            raise OffloadError(
                f"cannot use offload directory {root}: {e.strerror or e}. Choose a folder you "
                f"can write to (offload_dir=...) on a disk with enough free space") from e
        try:
            os.chmod(folder, 0o700)
            probe = os.path.join(folder, ".write-probe")
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.close(fd)
            os.unlink(probe)
            free = shutil.disk_usage(folder).free
        except OSError as e:
            _remove_folder(folder)
            raise OffloadError(f"offload directory {root} is not writable: {e.strerror or e}. "
                               f"Choose a folder you can write to (offload_dir=...)") from e
        if free < reserve_bytes:
            _remove_folder(folder)
            raise OffloadError(
                f"offload directory {root} ({filesystem_text(filesystem_of(root))}) has {free} bytes "
                f"({fmt_bytes(free)}) free but the disk tier needs {reserve_bytes} bytes "
                f"({fmt_bytes(reserve_bytes)}). Free space there, "
                f"point offload_dir at a larger disk, or lower what is offloaded (more host RAM, "
                f"optimizer_compression)")
        self.root = root
        self.path = folder
        self.keep = keep
        self.direct_io = probe_direct_io(folder)
        #: direct I/O's alignment here (512 or 4096): files move in vectored syscalls (disk_format.vectored)
        self.dio_sector = probe_dio_sector(folder) if self.direct_io else 0
        self._pool = _PriorityPool(io_threads, DISK.name)
        self._staging = Staging()
        self._lock = threading.Lock()
        # per key: the last write issued and the reads issued after it (still pending)
        self._ops: dict[str, dict] = {}
        self._pending: set[Future] = set()
        self._errors: list[BaseException] = []  # failed writes not yet reported by flush()
        self._sizes: dict[str, int] = {}        # committed file size per key
        self._stats = dict(bytes_read=0, bytes_written=0, read_seconds=0.0, write_seconds=0.0,
                           reads=0, writes=0, writes_hurried=0)
        self._closed = False
        self._finalizer = weakref.finalize(self, _remove_folder, folder) if not keep else None

    # ----------------------------------------------------------------------------- public
    def write(self, key: str, tensors: dict[str, torch.Tensor]) -> Future:
        """Write ``tensors`` as the new version of ``key`` in a worker (write-behind).

        Returns a Future that resolves to the number of bytes written, or raises
        ``OffloadError`` (ENOSPC, I/O error) -- then the previous version stays readable.
        """
        items = []
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                raise ValueError(f"DiskStore.write({key!r}): {name!r} must be a CPU tensor")
            items.append((str(name), t.detach().contiguous()))
        return self._submit(self._checked_key(key), True, self._write_file, key, items)

    def read(self, key: str, out: dict[str, torch.Tensor] | None = None, *, urgent: bool = False) -> Future:
        """Read ``key`` in a worker (read-ahead); ordered after earlier writes of ``key``.

        With ``out``, tensors are read into ``out[name]`` (same dtype and numel, contiguous; no
        allocation) and those tensors are returned; names missing from ``out`` are allocated
        (4096-aligned). The Future resolves to ``{name: tensor}``. An ``urgent`` read (compute
        waits on it) goes ahead of queued operations.
        """
        self._checked_key(key)
        if out is not None:
            for name, t in out.items():
                if not isinstance(t, torch.Tensor) or t.device.type != "cpu" \
                        or not t.is_contiguous():
                    raise ValueError(f"DiskStore.read({key!r}): out[{name!r}] must be a "
                                     f"contiguous CPU tensor")
        return self._submit(key, False, self._read_file, key, dict(out or {}), urgent=urgent)

    def ranged(self, key: str, specs: dict, *, read_old: bool) -> RangedRewrite:
        """A new version of ``key`` written range by range (``specs``: name -> (dtype, shape)),
        with the old version (``read_old``) read range by range beside it, in the caller's
        threads: neither version is ever whole in RAM. Ordered as a write: it starts (this call
        returns) after the operations issued on ``key`` before it; those issued after it wait
        for its :meth:`RangedRewrite.commit` (or ``abort``). See :class:`RangedRewrite`."""
        self._checked_key(key)
        outer: Future = Future()
        with self._lock:
            ops = self._key_ops(key)
            deps = ([ops["write"]] if ops["write"] is not None else []) + list(ops["reads"])
            # (it runs in the caller's threads: nothing in the pool to hurry)
            ops["write"], ops["reads"], ops["order"] = outer, set(), None
            self._pending.add(outer)
        futures_wait(deps)   # (their errors are their callers')
        try:
            return RangedRewrite(self, key, specs, read_old, outer)
        except BaseException as e:
            self.op_done(key, outer)
            outer.set_exception(e)
            raise

    def read_ranged(self, key: str) -> RangedRead:
        """``key`` read range by range in the caller's threads (:class:`RangedRead`): never whole
        in RAM. Ordered as a read: it starts after the key's last write (its error raised here);
        writes issued later wait for its ``close``."""
        self._checked_key(key)
        outer: Future = Future()
        with self._lock:
            ops = self._key_ops(key)
            dep = ops["write"]
            ops["reads"].add(outer)
            self._pending.add(outer)
        try:
            if dep is not None:
                dep.result()
            return RangedRead(self, key, outer)
        except BaseException as e:
            self.op_done(key, outer)
            outer.set_exception(e)
            raise

    def wait_key(self, key: str) -> None:
        """Wait until every operation issued so far on ``key`` is done; re-raise its error."""
        with self._lock:
            ops = self._ops.get(key)
            futs = ([ops["write"]] if ops and ops["write"] else []) + (list(ops["reads"]) if ops else [])
        for fut in futs:
            fut.result()

    def nbytes(self) -> int:
        """Bytes on disk of all committed files (writes still pending are not counted)."""
        with self._lock:
            return sum(self._sizes.values())

    def nbytes_of(self, key: str) -> int:
        """Bytes on disk of ``key``'s committed file (header and padding included), 0 if none."""
        with self._lock:
            return self._sizes.get(key, 0)

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._sizes)

    def file_of(self, key: str) -> str | None:
        """The path of ``key``'s committed file (None if it has none). A file is never rewritten
        in place (a new version is written and renamed over it), so a hard link to this path
        keeps this version's bytes whatever the store writes later (snapshots rely on it).
        Call after :meth:`flush` for the version holding every write issued so far."""
        with self._lock:
            return self.key_path(key) if key in self._sizes else None

    def link(self, key: str, folder: str | os.PathLike) -> Future:
        """Hard-link ``key``'s file into ``folder`` (which exists), in the key's order: after
        the writes of ``key`` issued before this call, before those issued after it (as a read
        is). So a snapshot can ask for the version current now while that version's write is
        still queued, without waiting for the other keys' writes. Copies the bytes where a link
        cannot be made (``folder`` on another filesystem). The Future resolves to ``(file name,
        bytes linked, bytes copied)``; ``OffloadError`` when the key has no file."""
        self._checked_key(key)
        return self._submit(key, False, self._link_file, key, os.fspath(folder))

    def _link_file(self, key: str, folder: str) -> tuple[str, int, int]:
        with self._lock:
            committed = key in self._sizes
        if not committed:
            raise OffloadError(f"the disk tier has no file for {key!r}: a snapshot needs every unit written once")
        src = self.key_path(key)
        name = os.path.basename(src)
        dest = os.path.join(folder, name)
        size = os.path.getsize(src)
        try:
            os.link(src, dest)
            return name, size, 0
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                raise
        shutil.copyfile(src, dest)   # another filesystem: the bytes must be copied
        return name, 0, size

    def read_file(self, path: str | os.PathLike, key: str) -> dict[str, torch.Tensor]:
        """Read a file in this store's format from ``path`` (a snapshot's hard link to a file of
        ``key``), at once, through the page cache, with every check a read makes."""
        return self._read_file(key, {}, path=os.fspath(path))

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._sizes

    def delete(self, key: str) -> None:
        """Remove ``key`` (after its pending operations)."""
        self.wait_key(key)
        with self._lock:
            self._sizes.pop(key, None)
        try:
            os.unlink(self.key_path(key))
        except FileNotFoundError:
            pass

    def stats(self) -> dict:
        """``bytes_read``, ``bytes_written``, ``read_seconds``, ``write_seconds`` (time spent in
        the workers), ``reads``, ``writes``, ``writes_hurried`` (writes an urgent read waited
        for, made urgent), plus ``direct_io`` and ``path``."""
        with self._lock:
            return dict(self._stats, direct_io=self.direct_io, path=self.path)

    def flush(self) -> None:
        """Wait for all pending operations; raise the first write error since the last flush."""
        while True:
            with self._lock:
                pending = list(self._pending)
            if not pending:
                break
            for fut in pending:
                try:
                    fut.result()
                except BaseException:
                    pass
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]

    def close(self) -> None:
        """Wait for pending operations, stop the workers, remove the folder unless ``keep``.

        Does not raise for failed writes (their futures and ``flush()`` report them): closing
        after an ``OffloadError`` must still clean up."""
        if self._closed:
            return
        try:
            self.flush()
        except BaseException:  # noqa: BLE001 - already delivered through the futures
            pass
        finally:
            self._closed = True
            self._pool.shutdown(wait=True)
            if self._finalizer is not None:
                self._finalizer()                 # removes the folder

    def abandon(self) -> None:
        """Let the workers exit once idle, without taking a lock or waiting (for a finalizer,
        where either could deadlock); the folder is removed when the store is collected."""
        self._closed = True
        self._pool.stopping = True

    def __enter__(self) -> DiskStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"DiskStore({self.path!r}, keys={len(self._sizes)}, nbytes={self.nbytes()}, "
                f"direct_io={self.direct_io})")

    # ---------------------------------------------------------------------------- helpers
    def _checked_key(self, key: str) -> str:
        if not isinstance(key, str) or not key:
            raise ValueError(f"DiskStore keys are non-empty strings, got {key!r}")
        if self._closed:
            raise RuntimeError("DiskStore is closed")
        return key

    def key_path(self, key: str) -> str:
        safe = re.sub(r"[^A-Za-z0-9._-]+", "_", key)[:80]
        digest = hashlib.sha1(key.encode()).hexdigest()[:16]
        return os.path.join(self.path, f"{safe}-{digest}{SUFFIX}")

    def _submit(self, key: str, is_write: bool, fn, *args, urgent: bool = False) -> Future:
        """Run ``fn(*args)`` in a worker once the operations on ``key`` it must follow are done:
        a read follows the last write of the key; a write follows that write and every read
        issued since (reads of a key do not wait for each other). An urgent read of a key whose
        write is still queued makes that write urgent too (:meth:`_hurry`): compute waits on
        the read, so the write must not wait behind the general queue."""
        outer: Future = Future()
        order = {"urgent": urgent, "job": None}   # its priority; its pool job once queued
        hurry = None
        with self._lock:
            ops = self._key_ops(key)
            deps = [ops["write"]] if ops["write"] is not None else []
            if is_write:
                deps += list(ops["reads"])
                ops["write"], ops["reads"], ops["order"] = outer, set(), order
            else:
                ops["reads"].add(outer)
                if urgent and ops["write"] is not None and ops["order"] is not None:
                    hurry = ops["order"]
            self._pending.add(outer)
        if hurry is not None:
            self._hurry(hurry)

        def finish() -> None:
            self.op_done(key, outer)

        def run() -> None:
            if not outer.set_running_or_notify_cancel():
                finish()
                return
            try:
                result = fn(*args)
            except BaseException as e:  # noqa: BLE001 - delivered through the future
                if is_write:
                    with self._lock:
                        self._errors.append(e)
                finish()
                outer.set_exception(e)
            else:
                finish()
                outer.set_result(result)

        def start(_=None) -> None:
            try:
                with self._lock:
                    order["job"] = self._pool.submit(run, 0 if order["urgent"] else 1)
            except RuntimeError as e:           # pool already shut down
                finish()
                outer.set_exception(OffloadError(f"DiskStore at {self.path} is closed: {e}"))

        if not deps:
            start()
        else:
            left = [len(deps)]
            left_lock = threading.Lock()

            def dep_done(_) -> None:
                with left_lock:
                    left[0] -= 1
                    ready = left[0] == 0
                if ready:
                    start()
            for d in deps:
                d.add_done_callback(dep_done)
        return outer

    def _key_ops(self, key: str) -> dict:
        """(Under the lock.) The pending operations on ``key``: its last write, the reads
        issued since, and that write's ``order`` (priority and pool job; None: not pooled)."""
        return self._ops.setdefault(key, {"write": None, "reads": set(), "order": None})

    def _hurry(self, order: dict) -> None:
        """A pending write an urgent read waits for: urgent from now on (queued again at
        priority 0 if already queued; queued urgent when its own dependencies are done)."""
        with self._lock:
            if order["urgent"]:
                return
            order["urgent"] = True
            job = order["job"]
            self._stats["writes_hurried"] += 1
        if job is not None:
            self._pool.hurry(job)

    def op_done(self, key: str, outer: Future) -> None:
        """An operation on ``key`` is over: operations ordered after it may start."""
        with self._lock:
            self._pending.discard(outer)
            ops = self._ops.get(key)
            if ops is not None:
                if ops["write"] is outer:
                    ops["write"] = None
                ops["reads"].discard(outer)
                if ops["write"] is None and not ops["reads"]:
                    del self._ops[key]

    def run_behind(self, fn) -> None:
        """Run ``fn()`` in a worker (a write's priority); RuntimeError once the workers stop."""
        self._pool.submit(fn)

    def record_error(self, error: BaseException) -> None:
        """A write-behind failure, for :meth:`flush` to raise."""
        with self._lock:
            self._errors.append(error)

    def committed(self, key: str, file_size: int) -> None:
        """``key``'s new file (``file_size`` bytes) is in place."""
        with self._lock:
            self._sizes[key] = file_size

    def count(self, kind: str, nbytes: int, seconds: float) -> None:
        """kind: "read" or "write"."""
        past = "read" if kind == "read" else "written"
        with self._lock:
            self._stats[f"bytes_{past}"] += nbytes
            self._stats[f"{kind}_seconds"] += seconds
            self._stats[f"{kind}s"] += 1

    # ------------------------------------------------------------------- file I/O
    def _write_file(self, key: str, items) -> int:
        t0 = time.perf_counter()
        final = self.key_path(key)
        header, offsets, file_size = layout(key, items)
        free = shutil.disk_usage(self.path).free
        if free < file_size:
            raise self.no_space(key, final, file_size, free)
        segments = [(0, torch.frombuffer(bytearray(header), dtype=torch.uint8))]
        segments += [(off, bytes_view(t)) for off, (_, t) in zip(offsets, items)]
        tmp = f"{final}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if self.direct_io else 0)
            fd = os.open(tmp, flags, 0o600)
            try:
                if self.direct_io:
                    transfer(fd, segments, file_size, self._staging.get(), write=True, sector=self.dio_sector)
                else:
                    buffered_write(fd, segments, file_size)
                os.fdatasync(fd)
                if not self.direct_io:
                    drop_cache(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final)
        except OSError as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise self.no_space(key, final, file_size, None, e) from e
            raise OffloadError(f"writing {file_size} bytes ({fmt_bytes(file_size)}) for {key!r} to "
                               f"{final} failed: {e.strerror or e}. Check the disk behind the "
                               f"offload directory {self.root}") from e
        with self._lock:
            self._sizes[key] = file_size
        self.count("write", file_size, time.perf_counter() - t0)
        return file_size

    def no_space(self, key, path, needed, free, err=None) -> OffloadError:
        if free is None:
            try:
                free = shutil.disk_usage(self.path).free
            except OSError:
                free = -1
        why = f"{err.strerror}: " if err is not None and err.strerror else ""
        return OffloadError(
            f"{why}offloading {key!r} needs {needed} bytes ({fmt_bytes(needed)}) at {path} but the "
            f"disk has {free} bytes ({fmt_bytes(max(free, 0))}) free. Free space there, point "
            f"offload_dir at a larger disk, or offload less (more host RAM, "
            f"optimizer_compression)")

    def _read_file(self, key: str, out: dict[str, torch.Tensor], path: str | None = None) -> dict[str, torch.Tensor]:
        t0 = time.perf_counter()
        direct = self.direct_io and path is None   # a file elsewhere may sit on another filesystem
        path = path or self.key_path(key)
        try:
            fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        except FileNotFoundError:
            raise KeyError(f"DiskStore has no key {key!r} (no file {path})") from None
        except OSError as e:
            raise OffloadError(f"cannot open {path} for {key!r}: {e.strerror or e}") from e
        try:
            meta = self.read_header(fd, key, path)
            unknown = set(out) - {e["name"] for e in meta["tensors"]}
            if unknown:
                raise ValueError(f"DiskStore.read({key!r}): out has names not stored: "
                                 f"{sorted(unknown)}")
            result, segments = {}, []
            for e in meta["tensors"]:
                dtype = getattr(torch, e["dtype"])
                dest = out.get(e["name"])
                if dest is None:
                    dest = aligned_empty(e["shape"], dtype)
                elif dest.dtype != dtype or dest.numel() * dest.element_size() != e["nbytes"]:
                    raise ValueError(
                        f"DiskStore.read({key!r}): out[{e['name']!r}] is {dest.dtype} "
                        f"{tuple(dest.shape)} but the stored tensor is {e['dtype']} "
                        f"{tuple(e['shape'])}")
                segments.append((e["offset"], bytes_view(dest)))
                result[e["name"]] = dest
            segments.sort(key=lambda seg: seg[0])
            if direct:
                # A large destination whose memory is not page-aligned cannot take direct I/O;
                # a buffered read straight into it (the kernel reads ahead while it copies),
                # with its pages dropped as it goes, beats bouncing through the staging buffer.
                bounce = [(o, d) for o, d in segments if large_unaligned(d)]
                if bounce:
                    buffered_read(path, bounce)
                    segments = [(o, d) for o, d in segments if not large_unaligned(d)]
                transfer(fd, segments, meta["file_size"], self._staging.get(), write=False,
                         sector=self.dio_sector)
            else:
                for off, dest in segments:
                    pread_all(fd, as_numpy(dest), off)
                drop_cache(fd)
            for e in meta["tensors"]:
                if not payload_ok(e, result[e["name"]]):
                    raise OffloadError(f"{path} (key {key!r}): the payload of {e['name']!r} does not match its "
                                       f"checksum (the file was corrupted on disk). The run cannot continue from "
                                       f"this state: resume from the last checkpoint")
        except OSError as e:
            raise OffloadError(f"reading {key!r} from {path} failed: {e.strerror or e}") from e
        finally:
            os.close(fd)
        self.count("read", meta["file_size"], time.perf_counter() - t0)
        return result

    def read_header(self, fd: int, key: str, path: str) -> dict:
        """The checked header of ``key``'s file open as ``fd`` (read through this thread's
        staging buffer): :func:`.disk_format.read_header`."""
        return read_header(fd, key, path, self._staging.get()[1])
