"""The export's two overlaps, each bounded: :func:`read_ahead` pulls the source's tensors in a
thread of its own (the disk tier's next unit is read while this one is written), holding at most
``max_bytes`` of tensors beyond the one being written; :class:`DirectFile` writes a file
sequentially through two page-aligned staging buffers with direct I/O (a writer thread writes one
while the other fills), so the page cache neither slows the export nor fills with its bytes.
Where the filesystem refuses direct I/O it writes through the page cache, synced at the end.
"""
from __future__ import annotations

import mmap
import os
import queue
import threading
from typing import Iterator, Optional, Tuple

import torch

from megatrain_nb.engine.tiers.disk_format import ALIGN, align_up, probe_direct_io

#: bytes of each of the two staging buffers (a multiple of ALIGN)
CHUNK = 32 << 20
#: tensors read ahead of the one being written, at most this many bytes (one more tensor always)
READ_AHEAD_BYTES = 256 << 20
_END = object()


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
    """Sequential writes of a new file at ``path`` (``write(bytes-like)``, ``close()``)."""

    def __init__(self, path: str, direct: Optional[bool] = None):
        self.path = path
        self.direct = probe_direct_io(os.path.dirname(path) or ".") if direct is None else direct
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if self.direct else 0)
        self.fd = os.open(path, flags, 0o644)
        self.size = 0        # bytes handed in
        self.written = 0     # file offset of the next staging buffer
        self.bufs = [mmap.mmap(-1, CHUNK), mmap.mmap(-1, CHUNK)]   # anonymous: page aligned
        self.fill, self.used, self.holding = 0, 0, False
        self.jobs: "queue.Queue" = queue.Queue(maxsize=1)
        self.free = [threading.Semaphore(1), threading.Semaphore(1)]
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._writer, name="mtnb-export-write", daemon=True)
        self.thread.start()

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
        self.fill, self.used, self.holding = 1 - self.fill, 0, False

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
            self.jobs.put(None)
            self.thread.join()
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
