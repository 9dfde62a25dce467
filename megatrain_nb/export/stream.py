"""The export's overlaps, each bounded:

- :func:`stream_pieces`: the weights unit by unit (:class:`Piece`), read by ``READERS`` threads
  at once -- a disk-tier unit chunk by chunk (``CHUNK`` bytes, direct I/O into a few reused
  page-aligned buffers per reader: never a unit's worth of fresh memory, which costs its page
  faults), a unit in RAM as it lies -- and handed to the writer in the file's order;
- :func:`read_ahead`: a source's tensors pulled in a thread of its own (the formats that convert
  tensor by tensor), at most ``max_bytes`` ahead of the one being written;
- :class:`DirectFile`: a file written sequentially through page-aligned staging buffers with
  direct I/O (a writer thread writes one while the next fills), so the page cache neither slows
  the export nor fills with its bytes. Where the filesystem refuses direct I/O it writes through
  the page cache, synced at the end.

Measured on the shared virtual disk (docs/EXPORT.md): one direct read in flight reads at
0.7 GB/s, two at 1.0 (its ``dd`` write rate is 0.8-1.3); reading into fresh memory each time
fell to 0.27, which is what the export did before it reused its buffers.
"""
from __future__ import annotations

import mmap
import os
import queue
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Tuple

import torch

from megatrain_nb.engine.tiers.disk_format import ALIGN, align_up, probe_direct_io

#: bytes of each staging buffer and each read chunk (a multiple of ALIGN)
CHUNK = 32 << 20
#: tensors read ahead of the one being written, at most this many bytes (one more tensor always)
READ_AHEAD_BYTES = 256 << 20
#: staging buffers of a :class:`DirectFile`, and its writes in flight at once
WRITE_BUFFERS = 3
WRITERS = 2
#: units read at once by :func:`stream_pieces` (two reads in flight: the disk's rate, above)
READERS = 2
#: chunk buffers of each reader (one being read, one waiting for the writer)
READER_BUFFERS = 2
_END = object()


@dataclass
class Piece:
    """One unit's bytes for :func:`stream_pieces`: ``spans`` [(start, end)] byte ranges of its
    flat buffer, increasing, written in that order; the buffer comes from ``load()`` (a tensor,
    e.g. the unit in RAM) or is read range by range through ``open()`` (an object with
    ``read(name, start, out)`` in order from the start, and ``close()``: the disk tier's
    ``RangedRead``) of its tensor ``name`` of ``dtype``."""

    spans: List[Tuple[int, int]]
    load: Optional[Callable[[], torch.Tensor]] = None
    open: Optional[Callable[[], object]] = None
    name: str = "w"
    dtype: torch.dtype = torch.float32

    @property
    def end(self) -> int:
        return self.spans[-1][1] if self.spans else 0


def _page_buffer(nbytes: int) -> torch.Tensor:
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)   # anonymous: page aligned


def _ranged(piece: Piece, pool: "queue.Queue", put, stop: threading.Event) -> None:
    """Read ``piece`` through its ranged reader chunk by chunk into ``pool``'s buffers."""
    esize = torch.empty((), dtype=piece.dtype).element_size()
    reader = piece.open()
    try:
        for start in range(0, piece.end, CHUNK):
            buf = None
            while buf is None:
                if stop.is_set():
                    return
                try:
                    buf = pool.get(timeout=0.5)
                except queue.Empty:
                    pass
            n = min(CHUNK, piece.end - start)
            reader.read(piece.name, start // esize, buf[:n].view(piece.dtype))
            put(("chunk", buf, start, n, pool))
    finally:
        reader.close()


class _Readers:
    """``readers`` threads taking the pieces in turn; piece k's items go to queue k (the piece
    first, then its data, then ``_END``)."""

    def __init__(self, pieces: Iterator[Piece], readers: int, buffers: int):
        self.pieces, self.stop = enumerate(pieces), threading.Event()
        self.lock, self.ready = threading.Lock(), threading.Condition()
        self.queues: dict = {}
        self.claimed, self.done, self.error = 0, False, None
        self.threads = [threading.Thread(target=self._run, args=(buffers,), name=f"mtnb-export-read-{i}",
                                         daemon=True) for i in range(readers)]
        for t in self.threads:
            t.start()

    def _claim(self):
        with self.lock:   # (the source's iterator runs here, one thread at a time)
            item = next(self.pieces, None)
            q: "queue.Queue" = queue.Queue()
            with self.ready:
                if item is None:
                    self.done = True
                else:
                    self.queues[item[0]] = q
                    self.claimed += 1
                    q.put(item[1])
                self.ready.notify_all()
            return None if item is None else (item[1], q)

    def _run(self, buffers: int) -> None:
        pool: "queue.Queue" = queue.Queue()
        made = 0
        try:
            while not self.stop.is_set():
                claimed = self._claim()
                if claimed is None:
                    return
                piece, q = claimed
                if piece.open is None:
                    taken = threading.Event()   # one unit in RAM per reader beyond the writer's
                    q.put(("tensor", piece.load(), taken))
                    q.put(_END)
                    while not (taken.wait(0.5) or self.stop.is_set()):
                        pass
                    continue
                for _ in range(buffers - made):
                    pool.put(_page_buffer(CHUNK))
                made = buffers
                _ranged(piece, pool, q.put, self.stop)
                q.put(_END)
        except BaseException as e:   # noqa: BLE001 - handed to the writer
            with self.ready:
                self.error = self.error or e
                self.ready.notify_all()
            self.stop.set()

    def queue_of(self, k: int) -> Optional["queue.Queue"]:
        """Piece k's queue (None past the last piece); raises a reader's error."""
        with self.ready:
            while k not in self.queues and not (self.done and k >= self.claimed) and self.error is None:
                self.ready.wait(0.5)
            if self.error is not None:
                raise self.error
            return self.queues.pop(k, None)

    def get(self, q: "queue.Queue"):
        """The next item of ``q``; raises a reader's error."""
        while True:
            try:
                return q.get(timeout=0.5)
            except queue.Empty:
                if self.error is not None:
                    raise self.error from None

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=60)


def _write_spans(write, spans, data: torch.Tensor, base: int) -> int:
    """Write the parts of ``spans`` that fall in ``data`` (bytes ``[base, base + len(data))``)."""
    end, n = base + data.numel(), 0
    for a, b in spans:
        a, b = max(a, base), min(b, end)
        if a < b:
            write(data[a - base:b - base].numpy())
            n += b - a
    return n


def stream_pieces(pieces: Iterator[Piece], write: Callable, readers: int = READERS,
                  buffers: int = READER_BUFFERS) -> int:
    """Write every piece's spans in order through ``write(bytes-like)``, the pieces read by
    ``readers`` threads at once (each with ``buffers`` chunk buffers); returns the bytes written.
    Memory: ``readers * buffers * CHUNK``, plus one unit per reader for pieces held in RAM."""
    rd = _Readers(iter(pieces), readers, buffers)
    total = 0
    try:
        k = 0
        while (q := rd.queue_of(k)) is not None:
            k += 1
            piece = q.get()
            while (item := rd.get(q)) is not _END:
                if item[0] == "tensor":
                    _, t, taken = item
                    total += _write_spans(write, piece.spans, t.detach().contiguous().view(-1).view(torch.uint8), 0)
                    del t
                    taken.set()
                else:
                    _, buf, start, n, pool = item
                    total += _write_spans(write, piece.spans, buf[:n], start)
                    pool.put(buf)
        return total
    finally:
        rd.close()


def read_ahead(it: Iterator[Tuple[str, torch.Tensor]], max_bytes: int = READ_AHEAD_BYTES):
    """Yield ``it``'s items, produced by a thread running ahead by at most ``max_bytes``."""
    cond = threading.Condition()
    items: "queue.SimpleQueue" = queue.SimpleQueue()
    state = {"bytes": 0, "stop": False, "error": None}

    def produce() -> None:
        try:
            for name, t in it:
                n = t.numel() * t.element_size()
                with cond:
                    while state["bytes"] > 0 and state["bytes"] + n > max_bytes and not state["stop"]:
                        cond.wait(1.0)
                    if state["stop"]:
                        return
                    state["bytes"] += n
                items.put((name, t, n))
        except BaseException as e:   # noqa: BLE001 - handed to the consumer
            state["error"] = e
        finally:
            items.put(_END)

    th = threading.Thread(target=produce, name="mtnb-export-read", daemon=True)
    th.start()
    try:
        while True:
            item = items.get()
            if item is _END:
                if state["error"] is not None:
                    raise state["error"]
                return
            name, t, n = item
            yield name, t
            del t, item
            with cond:
                state["bytes"] -= n
                cond.notify_all()
    finally:
        with cond:
            state["stop"] = True
            cond.notify_all()
        th.join(timeout=60)


class DirectFile:
    """Sequential writes of a new file at ``path`` (``write(bytes-like)``, ``close()``); ``size``:
    the file's final size when known (its blocks are allocated at once)."""

    def __init__(self, path: str, direct: Optional[bool] = None, size: int = 0):
        self.path = path
        self.direct = probe_direct_io(os.path.dirname(path) or ".") if direct is None else direct
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if self.direct else 0)
        self.fd = os.open(path, flags, 0o644)
        if size:   # the file's blocks at once (``size``: its final size), not extent by extent
            try:
                os.posix_fallocate(self.fd, 0, align_up(size))
            except OSError:   # a filesystem without it: allocated as written
                pass
        self.size = 0        # bytes handed in
        self.written = 0     # file offset of the next staging buffer
        self.bufs = [mmap.mmap(-1, CHUNK) for _ in range(WRITE_BUFFERS)]   # anonymous: page aligned
        self.fill, self.used, self.holding = 0, 0, False
        self.jobs: "queue.Queue" = queue.Queue()
        self.free = [threading.Semaphore(1) for _ in self.bufs]
        self.error: Optional[BaseException] = None
        self.threads = [threading.Thread(target=self._writer, name=f"mtnb-export-write-{i}", daemon=True)
                        for i in range(WRITERS)]
        for t in self.threads:
            t.start()

    def _writer(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            index, nbytes, offset = job
            try:
                if self.error is None:
                    mv = memoryview(self.bufs[index])[:nbytes]
                    while len(mv):
                        n = os.pwrite(self.fd, mv, offset)
                        mv, offset = mv[n:], offset + n
            except BaseException as e:   # noqa: BLE001 - raised by write() / close()
                self.error = e
            finally:
                self.free[index].release()

    def _claim(self) -> None:
        if not self.holding:   # the buffer to fill is free once its last write is done
            self.free[self.fill].acquire()
            self.holding = True
        if self.error is not None:
            raise self.error

    def _flush(self, nbytes: int) -> None:
        self.jobs.put((self.fill, nbytes, self.written))
        self.written += nbytes
        self.fill, self.used, self.holding = (self.fill + 1) % len(self.bufs), 0, False

    def write(self, data) -> None:
        mv = memoryview(data).cast("B")
        self.size += len(mv)
        while len(mv):
            self._claim()
            n = min(len(mv), CHUNK - self.used)
            self.bufs[self.fill][self.used:self.used + n] = mv[:n]
            self.used += n
            mv = mv[n:]
            if self.used == CHUNK:
                self._flush(CHUNK)

    def close(self, abort: bool = False) -> None:
        """Write what is left (the last block padded, then the file cut to its size) and fsync;
        ``abort``: stop the writer and close (the caller removes the file)."""
        try:
            if self.used and not abort:
                end = align_up(self.used) if self.direct else self.used
                self.bufs[self.fill][self.used:end] = bytes(end - self.used)
                self._flush(end)
            for t in self.threads:
                self.jobs.put(None)
            for t in self.threads:
                t.join()
            if self.error is not None and not abort:
                raise self.error
            if not abort:
                os.ftruncate(self.fd, self.size)
                os.fsync(self.fd)
        finally:
            os.close(self.fd)
            for b in self.bufs:
                b.close()


assert CHUNK % ALIGN == 0
