"""Master weights on the disk tier, paged through small pools of host staging buffers.

Two read streams share the disk store: the *compute* stream (the pager's host->device
transfers, in forward-then-backward order) and the *optimizer* stream (updates, in the order
gradients become final). Each has its own staging pool and its own read-ahead schedule, so
neither can starve the other of buffers. A unit whose update is pending is *dirty*: the
compute stream does not read it ahead until the update's write has been submitted (the store
orders a read after a write of the same key), so a read never sees stale weights.
"""
from __future__ import annotations

import threading
import time
from typing import Dict, List, Sequence

import torch

from .units import Unit


def weights_key(unit: Unit) -> str:
    return f"weights-{unit.index:05d}"


class DirtyUnits:
    """Units whose weights are being updated; readers wait until the new write is submitted."""

    def __init__(self):
        self._cv = threading.Condition()
        self._dirty = set()
        self.listeners = []

    def mark(self, unit: Unit) -> None:
        with self._cv:
            self._dirty.add(unit.index)

    def clean(self, unit: Unit) -> None:
        with self._cv:
            self._dirty.discard(unit.index)
            self._cv.notify_all()
        for fn in self.listeners:
            fn()

    def is_dirty(self, unit: Unit) -> bool:
        with self._cv:
            return unit.index in self._dirty

    def wait_clean(self, unit: Unit) -> None:
        with self._cv:
            while unit.index in self._dirty:
                self._cv.wait(0.05)


class DiskReadStream:
    def __init__(self, disk, units: List[Unit], dirty: DirtyUnits, *, buffers: int, pin: bool, counters,
                 after_updates: bool):
        self.disk = disk
        self.dirty = dirty
        # The compute stream reads a unit only after its pending update is written; the
        # optimizer stream is the one doing the update, so it must not wait for itself.
        self.after_updates = after_updates
        self.counters = counters
        max_numel = max(u.numel for u in units)
        self._free: List[torch.Tensor] = []
        for _ in range(max(1, buffers)):
            t = torch.empty(max_numel, dtype=torch.float32)
            self._free.append(t.pin_memory() if pin else t)
        self.staging_bytes = len(self._free) * max_numel * 4
        self._cv = threading.Condition()
        self._order: List[Unit] = []
        self._issued = 0
        self._inflight: Dict[int, List[tuple]] = {}
        dirty.listeners.append(self._top_up)

    def schedule(self, order: Sequence[Unit], *, append: bool = False) -> None:
        """The order in which :meth:`get` will be called; reads start ahead of need.

        ``append`` queues the order behind what is still to come (the optimizer stream: the
        updates of one step may still run when the next step schedules its own).
        """
        with self._cv:
            new = [u for u in order if u.numel > 0]
            if append:
                self._order = self._order[self._issued:] + new
            else:
                self._order = new
            self._issued = 0
        self._top_up()

    def _top_up(self) -> None:
        with self._cv:
            while self._issued < len(self._order) and self._free:
                u = self._order[self._issued]
                if self.after_updates and self.dirty.is_dirty(u):
                    break  # strict order: wait for its update's write
                self._issued += 1
                self._start(u)

    def _start(self, unit: Unit) -> None:
        buf = self._free.pop()
        fut = self.disk.read(weights_key(unit), out={"w": buf[:unit.numel]})
        self._inflight.setdefault(unit.index, []).append((buf, fut))
        self._cv.notify_all()

    def get(self, unit: Unit) -> torch.Tensor:
        """The unit's weights in a staging buffer; hand it back with :meth:`release`."""
        with self._cv:
            entries = self._inflight.get(unit.index)
        on_demand = False
        if not entries:
            if self.after_updates:
                self.dirty.wait_clean(unit)
            with self._cv:
                # Wait for the read-ahead to reach this unit, or for a buffer to read it now.
                while not self._inflight.get(unit.index) and not self._free:
                    self._cv.wait(0.05)
                if not self._inflight.get(unit.index):  # not read ahead: read on demand (late)
                    on_demand = True
                    self._start(unit)
                    for i in range(self._issued, len(self._order)):
                        if self._order[i] is unit:
                            del self._order[i]
                            break
        with self._cv:
            entries = self._inflight[unit.index]
            buf, fut = entries.pop(0)
            if not entries:
                del self._inflight[unit.index]
        t0 = time.perf_counter()
        fut.result()
        self.counters.stall("disk", time.perf_counter() - t0)
        self.counters.prefetch_result("disk", not on_demand)  # issued ahead of need, or late
        return buf[:unit.numel]

    def release(self, buf: torch.Tensor) -> None:
        base = buf if buf._base is None else buf._base
        with self._cv:
            self._free.append(base)
            self._cv.notify_all()
        self._top_up()

    def reset(self) -> None:
        with self._cv:
            for entries in self._inflight.values():
                for buf, fut in entries:
                    try:
                        fut.result()
                    except Exception:
                        pass
                    self._free.append(buf)
            self._inflight.clear()
            self._order = []
            self._issued = 0
