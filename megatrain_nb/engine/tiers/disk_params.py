"""Master weights on the disk tier, paged through small pools of host staging buffers.

Two read streams share the disk store: the *compute* stream (the pager's host->device
transfers, in forward-then-backward order) and the *optimizer* stream (updates, in the order
gradients become final). Each has its own staging pool and its own read-ahead schedule, so
neither can starve the other of buffers. A unit whose update is pending is *dirty*: the
compute stream does not read it ahead until the update's write has been submitted (the store
orders a read after a write of the same key), so a read never sees stale weights.

A compute read can be marked *kept*: the unit's backward load is its last compute access of
the step, and the weights it read are exactly what that unit's update needs, so the staging
buffer is handed to the optimizer instead of reading the same bytes a third time. And a unit
read again within ``CARRY_GAP`` reads of the compute stream (the last layer: its forward, the head,
its backward) is read once: the first read's buffer is held and carried to the second.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Callable, Dict, List, Optional, Sequence

import torch

from .disk_store import aligned_empty
from ..transport.pinned import held_bytes, pinned_empty
from ..units import Unit


#: A unit read again within this many reads of the compute stream (the last layer: its forward,
#: the head, its backward) is served by its first read's buffer, held meanwhile (no disk read).
CARRY_GAP = 2


def weights_key(unit: Unit) -> str:
    return f"weights-{unit.index:05d}"


def shadow_key(unit: Unit) -> str:
    """The key of a unit's compute-dtype copy on the disk tier (tensor ``"c"``), written by its
    update beside the fp32 masters (``weight_store.DiskWeights`` with ``shadow``): what a load reads."""
    return f"shadow-{unit.index:05d}"


def handed_units(compute_order: Sequence[Unit], updated: Sequence[Unit]) -> set:
    """Units whose last compute read of a step (the backward's) hands its buffer to their
    update: those loaded more than once and updated. Unit indices."""
    want = {u.index for u in updated}
    first: Dict[int, int] = {}
    last: Dict[int, int] = {}
    for i, u in enumerate(compute_order):
        first.setdefault(u.index, i)
        last[u.index] = i
    return {idx for idx, i in last.items() if idx in want and i > first[idx]}


def handed_after_backward(compute_order: Sequence[Unit], updated: Sequence[Unit], n: int) -> set:
    """Updates that wait for the whole backward (clipping) run in the next forward's order, so
    the first ones want the units the backward reads last: the last ``n`` units the backward
    reads (loaded more than once, updated) keep that read's buffer for their update. Unit
    indices."""
    twice = handed_units(compute_order, updated)
    last = {u.index: i for i, u in enumerate(compute_order)}
    return set(sorted(twice, key=last.__getitem__)[-n:]) if n > 0 else set()


class DirtyUnits:
    """Units whose weights are being updated; readers wait until the new write is submitted."""

    def __init__(self):
        self._cv = threading.Condition()
        self._dirty = set()
        self._cleans: Dict[int, int] = {}   # unit -> updates written (or dropped) so far
        self.listeners = []

    def mark(self, unit: Unit) -> None:
        with self._cv:
            self._dirty.add(unit.index)

    def clean(self, unit: Unit) -> None:
        with self._cv:
            self._dirty.discard(unit.index)
            self._cleans[unit.index] = self._cleans.get(unit.index, 0) + 1
            self._cv.notify_all()
        for fn in self.listeners:
            fn()

    def written_after_pending(self, unit: Unit) -> int:
        """What :meth:`cleaned` will be once the update of ``unit`` now pending (if any) is written:
        a read that must not pass it waits for that count. (An update may be marked more than once
        as it is queued and started: the pending one counts once.)"""
        with self._cv:
            return self._cleans.get(unit.index, 0) + (unit.index in self._dirty)

    def cleaned(self, unit: Unit) -> int:
        """Updates of ``unit`` whose write was submitted (or that will not run) so far."""
        with self._cv:
            return self._cleans.get(unit.index, 0)

    def is_dirty(self, unit: Unit) -> bool:
        with self._cv:
            return unit.index in self._dirty

    def wait_clean(self, unit: Unit) -> None:
        with self._cv:
            while unit.index in self._dirty:
                self._cv.wait(0.05)


class DiskReadStream:
    def __init__(self, disk, units: List[Unit], dirty: DirtyUnits, *, buffers: int, pin: bool, counters,
                 after_updates: bool, urgent: bool = False, fresh_source: Optional[Callable] = None,
                 reclaim: Optional[Callable] = None, key: Callable[[Unit], str] = weights_key,
                 name: str = "w", dtype: torch.dtype = torch.float32, carry: bool = False):
        self.disk = disk
        self.key, self.name, self.dtype = key, name, dtype   # what it reads: a unit's masters, or its shadow
        self.dirty = dirty
        # The compute stream reads a unit only after its pending update is written; the
        # optimizer stream is the one doing the update, so it must not wait for itself.
        self.after_updates = after_updates
        self.urgent = urgent  # compute waits on these reads: they go ahead of queued disk work
        self.counters = counters
        self._numel = max(u.numel for u in units)
        self._pin = pin
        self._free: List[torch.Tensor] = [self._new_buffer() for _ in range(max(1, buffers))]
        self._by_ptr = {t.data_ptr(): t for t in self._free}  # a view handed out -> its buffer
        # Fresh copies: a just-updated unit's weights, still in the optimizer's buffer, served
        # without a disk read. ``fresh_source(unit)`` -> (buffer, release callback) or None.
        self.fresh_source = fresh_source
        self.reclaim = reclaim                 # reclaim(stream): drop fresh copies holding its buffers
        self._foreign: Dict[int, object] = {}  # data_ptr of a fresh buffer -> its release callback
        self.staging_bytes = len(self._free) * self._buffer_bytes()
        self._cv = threading.Condition()
        self._order: List[Unit] = []
        # per position in the order: the updates of its unit that must be written before its read
        # starts (the optimizer stream: the one pending when it was scheduled -- an earlier step's,
        # still running while the next step schedules its reads -- so the read cannot pass it)
        self._need: List[int] = []
        self._issued = 0
        self._inflight: Dict[int, List[tuple]] = {}
        self._keep_at: set = set()        # positions in the order whose buffer is kept (handed off)
        # Positions that read a unit read at most CARRY_GAP positions before (the last layer's
        # forward, the head, then that layer's backward): served by that read's buffer, handed on
        # when released, not by a second disk read (:meth:`_carry`).
        self._carry_at: set = set()
        self._out: Dict[int, int] = {}   # unit -> data_ptr of its own buffer out of get(), not yet released
        self.carry = carry   # (off behind a host cache: its plan counts every read by phase)
        self._carry_src: Dict[int, Future] = {}   # data_ptr of a buffer out of get() -> the carry it feeds
        self._kept: Dict[int, bool] = {}  # data_ptr of a buffer returned by get() -> kept?
        dirty.listeners.append(self._top_up)

    def _new_buffer(self) -> torch.Tensor:
        # Page-aligned (pinned memory is too), so direct I/O needs no bounce copy.
        return pinned_empty(self._numel, self.dtype) if self._pin else aligned_empty(self._numel, self.dtype)

    def _buffer_bytes(self) -> int:
        """What one staging buffer holds (pinned: as ``pinned.held_bytes`` counts it)."""
        return held_bytes(self._numel * self.dtype.itemsize, self._pin)

    def grow(self, n: int) -> None:
        """At least ``n`` staging buffers from now on (more units' reads may be kept)."""
        with self._cv:
            while len(self._by_ptr) < n:
                t = self._new_buffer()
                self._by_ptr[t.data_ptr()] = t
                self._free.append(t)
                self.staging_bytes += self._buffer_bytes()
            self._cv.notify_all()
        self._top_up()

    def schedule(self, order: Sequence[Unit], *, append: bool = False, keep: Sequence[int] = ()) -> None:
        """The order in which :meth:`get` will be called; reads start ahead of need.

        ``append`` queues the order behind what is still to come (the optimizer stream: the
        updates of one step may still run when the next step schedules its own). ``keep``:
        positions in ``order`` whose buffer :meth:`is_kept` reports as handed off.
        """
        with self._cv:
            positions = [i for i, u in enumerate(order) if u.numel > 0]
            new = [order[i] for i in positions]
            need = [self.dirty.written_after_pending(u) for u in new]
            if append:
                self._order = self._order[self._issued:] + new
                self._need = self._need[self._issued:] + need
                self._keep_at = set()
                self._carry_at = set()
            else:
                self._order, self._need = new, need
                keep = set(keep)
                self._keep_at = {j for j, i in enumerate(positions) if i in keep}
                self._carry_at = {j for j in range(1, len(new))
                                  if any(new[j] is new[i] for i in range(max(0, j - CARRY_GAP), j))}
            self._issued = 0
        self._top_up()

    def _top_up(self) -> None:
        with self._cv:
            while self._issued < len(self._order):
                u = self._order[self._issued]
                if self.after_updates and self.dirty.is_dirty(u):
                    break  # strict order: wait for its update's write
                if not self.after_updates and self.dirty.cleaned(u) < self._need[self._issued]:
                    break  # its unit's previous update is not written yet: the read would pass it
                keep = self._issued in self._keep_at
                if not (self._issued in self._carry_at and self._carry(u, keep)) and not self._start(u, keep=keep):
                    break
                self._issued += 1

    def _start(self, unit: Unit, keep: bool = False) -> bool:
        fresh = self.fresh_source(unit) if self.fresh_source is not None else None
        if fresh is not None:
            buf, on_release = fresh
            self._foreign[buf.data_ptr()] = on_release
            fut = Future()
            fut.set_result(None)
        elif self._free:
            buf = self._free.pop()
            fut = self.disk.read(self.key(unit), out={self.name: buf[:unit.numel]}, urgent=self.urgent)  # the pool's buffers bound these
        else:
            return False
        self._inflight.setdefault(unit.index, []).append((buf, fut, keep))
        self._cv.notify_all()
        return True

    def _carry(self, unit: Unit, keep: bool) -> bool:
        """(lock held) Serve this read of ``unit`` with the buffer of its read just before (still in
        flight, one of this stream's own, not a fresh copy), handed on when :meth:`release` gets it."""
        if not self.carry:
            return False
        before = self._inflight.get(unit.index)
        if before:   # that read is still in flight: get() binds its buffer to this one
            if before[-1][0] is None or before[-1][2] or before[-1][0].data_ptr() in self._foreign:
                return False
            before.append((None, Future(), keep))
            return True
        ptr = self._out.get(unit.index)   # or its buffer is out of get(), not yet released
        if ptr is None or ptr in self._carry_src:
            return False
        fut = Future()
        self._carry_src[ptr] = fut
        self._inflight[unit.index] = [(None, fut, keep)]
        return True

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
                    if self.reclaim is not None:
                        self.reclaim(self)  # fresh copies must never starve a reader of buffers
                    self._cv.wait(0.05)
                if not self._inflight.get(unit.index):  # not read ahead: read on demand (late)
                    on_demand = True
                    keep = False
                    for i in range(self._issued, len(self._order)):
                        if self._order[i] is unit:
                            del self._order[i]
                            del self._need[i]
                            keep = i in self._keep_at
                            self._keep_at = {j - (j > i) for j in self._keep_at if j != i}
                            self._carry_at = {j - (j > i) for j in self._carry_at if j != i}
                            break
                    self._start(unit, keep=keep)  # a buffer is free: always starts
        with self._cv:
            entries = self._inflight[unit.index]
            buf, fut, keep = entries.pop(0)
            if not entries:
                del self._inflight[unit.index]
        carried = buf is None
        if carried:   # the buffer of this unit's read just before, once released (_carry)
            buf = fut.result()
        with self._cv:
            after = self._inflight.get(unit.index)
            if after and after[0][0] is None:   # the next read of it is carried: this buffer feeds it
                self._carry_src[buf.data_ptr()] = after[0][1]
            self._kept[buf.data_ptr()] = keep
            fresh = buf.data_ptr() in self._foreign
            if not keep and not fresh:
                self._out[unit.index] = buf.data_ptr()
        if carried:
            self.counters.add("weight_reads_saved", 1)
        elif not fresh:
            self.counters.wait(fut, "disk")   # the disk, or the host cache that served it
            self.counters.prefetch_result("disk", not on_demand)  # issued ahead of need, or late
        return buf[:unit.numel]

    @property
    def pinned(self) -> bool:
        """Whether its staging buffers are pinned."""
        return self._pin

    @property
    def buffers(self) -> int:
        """How many staging buffers the stream has."""
        return len(self._by_ptr)

    def owns(self, buf: torch.Tensor) -> bool:
        """Whether ``buf`` (or a view of it) is one of this stream's staging buffers."""
        return buf.data_ptr() in self._by_ptr

    def was_fresh(self, buf: torch.Tensor) -> bool:
        """Whether :meth:`get` served this buffer from a fresh copy (no disk read)."""
        with self._cv:
            return buf.data_ptr() in self._foreign

    def is_kept(self, buf: torch.Tensor) -> bool:
        """Whether this buffer (from :meth:`get`) is to be handed on rather than released."""
        with self._cv:
            return self._kept.get(buf.data_ptr(), False)

    def release(self, buf: torch.Tensor) -> None:
        with self._cv:
            self._kept.pop(buf.data_ptr(), None)
            for idx in [i for i, p in self._out.items() if p == buf.data_ptr()]:
                del self._out[idx]
            carry = self._carry_src.pop(buf.data_ptr(), None)
            on_release = None if carry is not None else self._foreign.pop(buf.data_ptr(), None)
            if carry is None and on_release is None:
                self._free.append(self._by_ptr[buf.data_ptr()])
        if carry is not None:   # the same unit's next read takes it as it is
            carry.set_result(self._by_ptr[buf.data_ptr()])
            return
        if on_release is not None:
            on_release()
            return
        with self._cv:
            self._cv.notify_all()
        self._top_up()

    def reset(self) -> None:
        callbacks = []
        with self._cv:
            for entries in self._inflight.values():
                for buf, fut, _ in entries:
                    if buf is None:   # a carried read: its buffer, if already handed on, goes back
                        if fut.done():
                            self._free.append(fut.result())
                        continue
                    try:
                        fut.result()
                    except Exception:
                        pass
                    on_release = self._foreign.pop(buf.data_ptr(), None)
                    if on_release is not None:
                        callbacks.append(on_release)
                    else:
                        self._free.append(buf)
            self._inflight.clear()
            self._carry_src.clear()   # a buffer still out comes back to the pool when released
            self._out.clear()
            self._keep_at, self._carry_at = set(), set()
            self._order, self._need = [], []
            self._issued = 0
        for fn in callbacks:
            fn()
