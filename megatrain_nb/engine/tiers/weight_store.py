"""WeightStore: the one place that knows where each unit's fp32 master weights live.

Two strategies behind one protocol (:class:`WeightStore`): :class:`RamWeights` (the
HostStore's flat buffers, used in place) and :class:`DiskWeights` (the disk tier, paged
through staging buffers by two read streams: compute and optimizer). The engine asks for a
unit's weights "for transfer" (to the device) or "for update" (the optimizer), and hands them
back; :func:`make_weight_store` picks the strategy.

On the disk tier a layer's weights are read twice per training step, not three times: the
backward's read (the unit's last compute access) keeps its staging buffer after the copy to
the device and hands it to that unit's update, which writes it back and only then frees it.
And the last units a step updates, which the next step's forward needs first (the embedding
above all), stay in their buffer as a *fresh copy* that the next forward reads instead of
waiting for the write and reading it back.

A clipped step's updates wait for the whole backward, so a backward read can be handed to its
update only if its buffer is held that long: beyond the compute stream's own buffers (all but
one of which it may hand over), up to ``held_units`` more are made on the first clipped step
(one per unit read twice; the embedding and head are read once) -- as many units as the host
budget leaves room for when the disk tier has no host cache (``parts.held_weight_units``).
Each update then starts without a read and its buffer is kept as the fresh copy the next
forward reads: the step reads each weight once, not a second time for its update.

With ``ranged`` (updates in chunks, no host cache of the disk tier) the optimizer stream has no
staging buffers: an update that is not handed a compute buffer reads and writes the unit's
weights range by range (:meth:`DiskWeights.ranged_update`, ``DiskStore.ranged``), a chunk at a
time in the AdamW worker, so no unit-sized buffer exists for it. (Layer statistics need a whole
unit: with them on, such an update reads its weights into a buffer made for it.)
"""
from __future__ import annotations

import threading
from typing import Dict, List, Optional, Protocol, Sequence

import torch

from .disk_params import DirtyUnits, DiskReadStream, handed_after_backward, handed_units, shadow_key, weights_key
from .disk_store import WriteWindow, aligned_empty
from .host_store import HostStore
from ..units import Unit


#: Fresh copies are kept only for units among the first accesses of a step's compute order
#: (embedding, head, the first layers): the next forward reads those before anything else.
NEXT_FORWARD_FIRST = 4
#: How many of a step's last updates may stay as fresh copies: the embedding's (an optimizer
#: stream buffer) and the first layers' (the compute stream's buffers their backward handed over,
#: all but one: :func:`fresh_after_step`). The third: without it the next forward's third unit
#: waited for its update's write and then its read, at the very start of the step.
LAST_UPDATES_KEPT = 3


def fresh_after_step(optimizer_order: Sequence[Unit], early: set, handed: set, compute_buffers: int) -> set:
    """Unit indices whose updated buffer stays as a fresh copy for the next forward: among the last
    :data:`LAST_UPDATES_KEPT` updates, those the next forward reads among its first (``early``),
    the later updates first; a unit whose buffer is a handed compute buffer (``handed``) only
    while one of the compute stream's ``compute_buffers`` stays free for the forward's reads."""
    fresh, held = set(), 0
    for u in reversed(list(optimizer_order)[-LAST_UPDATES_KEPT:]):
        if u.index not in early:
            continue
        if u.index in handed:
            if held >= compute_buffers - 1:
                continue
            held += 1
        fresh.add(u.index)
    return fresh


class WeightStore(Protocol):
    """Where a unit's fp32 master weights live; every method takes the unit."""

    def put_initial(self, unit: Unit, flat: torch.Tensor) -> None: ...      # construction, unit by unit
    def finish_initial(self) -> None: ...
    def schedule(self, compute_order: Sequence[Unit], optimizer_order: Optional[Sequence[Unit]] = None,
                 *, updates_after_backward: bool = False) -> None: ...    # read-ahead of a step
    def for_transfer(self, unit: Unit) -> torch.Tensor: ...               # to the device ...
    def transfer_done(self, unit: Unit, t: torch.Tensor) -> None: ...     # ... and back
    def mark_updating(self, unit: Unit) -> None: ...                      # an update is queued
    def update_failed(self, unit: Unit) -> None: ...                      # ... and will not run
    def for_update(self, unit: Unit) -> torch.Tensor: ...                 # to the optimizer ...
    def update_done(self, unit: Unit, t: torch.Tensor) -> None: ...       # ... and written
    def read_now(self, unit: Unit) -> torch.Tensor: ...                   # outside a step
    def overwrite(self, unit: Unit, flat: torch.Tensor) -> None: ...      # loading a checkpoint
    def ranged_update(self, unit: Unit): ...                              # None, or a ranged rewrite
    def reset(self) -> None: ...
    def nbytes(self) -> Dict[str, int]: ...


def make_weight_store(units: List[Unit], host: HostStore, *, disk=None, pin: bool, counters,
                      compute_buffers: int = 3, optimizer_buffers: int = 1, ranged: bool = False,
                      held_units: int = 0) -> WeightStore:
    """Weights in RAM, or on ``disk`` (a DiskStore) when given (``ranged``: updates in chunks
    may read and write them range by range; ``held_units``: see :class:`DiskWeights`)."""
    if disk is None:
        return RamWeights(units, host)
    # A narrower compute dtype with shadows (CUDA) and no host cache of the tier: the updates write
    # each unit's compute-dtype copy beside its masters and the loads read that (DiskWeights'
    # ``shadow``). The compute stream's staging buffers are a load's source -- pinned -- in fp32
    # compute and with the copy; else (a host cache serves the fp32 masters from RAM) the
    # transport's pinned cast buffer is, and the staging buffers stay pageable.
    dtype = getattr(host, "compute_dtype", torch.float32)
    shadow = dtype if getattr(host, "shadowed", False) and not getattr(disk, "capacity", 0) else None
    pin = pin and (dtype == torch.float32 or shadow is not None)
    return DiskWeights(units, disk, pin=pin, counters=counters, compute_buffers=compute_buffers,
                       optimizer_buffers=optimizer_buffers, ranged=ranged, held_units=held_units, shadow=shadow)


class RamWeights:
    """Weights in the HostStore's flat buffers, used in place: every hand-out is the buffer
    itself, updated where it lies, so there is nothing to schedule, release or read. A load
    copies the unit's compute-dtype shadow where the store keeps one (``HostStore.source``),
    which its update rewrites (:meth:`update_done`), once."""

    def __init__(self, units: List[Unit], host: HostStore):
        self.units = units
        self.host = host

    def put_initial(self, unit: Unit, flat: torch.Tensor) -> None:
        self.host.set_params(unit, flat)

    def for_transfer(self, unit: Unit) -> torch.Tensor:
        return self.host.source(unit)

    def for_update(self, unit: Unit) -> torch.Tensor:
        return self.host.params[unit.index]

    read_now = for_update

    def overwrite(self, unit: Unit, flat: torch.Tensor) -> None:
        self.host.params[unit.index].copy_(flat)
        self.host.refresh_shadow(unit)

    def ranged_update(self, unit: Unit):
        return None   # (in place: never ranged)

    def nbytes(self) -> Dict[str, int]:
        return {"host": self.host.nbytes()["weights"], "disk": 0}

    def schedule(self, compute_order, optimizer_order=None, *, updates_after_backward: bool = False) -> None:
        pass

    def finish_initial(self) -> None:
        pass

    def transfer_done(self, unit: Unit, t: torch.Tensor) -> None:
        pass

    def update_done(self, unit: Unit, t: torch.Tensor) -> None:
        """The update wrote the masters: the load's shadow follows (before the unit is ready)."""
        self.host.refresh_shadow(unit)

    def mark_updating(self, unit: Unit) -> None:
        pass

    def update_failed(self, unit: Unit) -> None:
        pass

    def reset(self) -> None:
        pass


class ShadowedRewrite:
    """A ranged rewrite of a unit's masters (``"w"``) that writes its compute-dtype copy too: each
    range of ``"w"`` written is cast (in the writer's thread: the update's encoder) and written to
    a ranged rewrite of the unit's shadow key; committed and aborted together (the copy first)."""

    def __init__(self, weights, shadow, dtype: torch.dtype):
        self.weights, self.shadow, self.dtype = weights, shadow, dtype

    def read(self, name: str, start: int, out: torch.Tensor) -> torch.Tensor:
        return self.weights.read(name, start, out)

    def write(self, name: str, start: int, src: torch.Tensor) -> None:
        self.weights.write(name, start, src)
        self.shadow.write("c", start, src.to(self.dtype))   # (a chunk: the update's cast of it)

    def commit(self, behind: bool = False):
        self.shadow.commit(behind=behind)
        return self.weights.commit(behind=behind)

    def abort(self, error) -> None:
        try:
            self.shadow.abort(error)
        finally:
            self.weights.abort(error)


class DiskWeights:
    """Weights on the disk tier (see the module docstring). ``shadow`` (a compute dtype narrower
    than fp32, no host cache of the tier): each update writes the unit's compute-dtype copy
    beside its masters (key ``shadow-*``; a ranged update range by range: :class:`ShadowedRewrite`)
    and the compute stream reads that copy into staging buffers of that dtype, so a load reads half
    the bytes and nothing casts it; a load's buffer then serves no update (another dtype): every
    update reads its fp32 masters (the optimizer stream, or range by range) and none is kept as a
    fresh copy."""

    def __init__(self, units: List[Unit], disk, *, pin: bool, counters, compute_buffers: int = 3,
                 optimizer_buffers: int = 1, ranged: bool = False, held_units: int = 0,
                 shadow: Optional[torch.dtype] = None):
        self.units = units
        self.disk = disk
        self.shadow = shadow
        self.counters = counters
        self.dirty = DirtyUnits()
        self._initial_writes = WriteWindow(2)  # bounded: at most a few units in RAM at once
        self._handed: Dict[int, torch.Tensor] = {}    # unit -> staging buffer kept for its update
        self._lock = threading.Lock()
        self._fresh: Dict[int, dict] = {}             # unit -> updated buffer the next read may use
        self._fresh_wanted: set = set()
        self._last_compute: List[Unit] = []           # the recorded compute order of a training step
        read = dict(key=shadow_key, name="c", dtype=shadow) if shadow is not None else {}
        #: A host cache of the disk tier decides what stays in RAM (disk_cache.HostCache): the
        #: fresh copies, whose survival depends on timing, are then not kept.
        self.cached = getattr(disk, "capacity", 0) > 0
        # (without a cache, a unit read twice in a row -- the last layer's forward, then its
        # backward -- is read once: the stream carries the first read's buffer on)
        self._fetch = DiskReadStream(disk, units, self.dirty, buffers=compute_buffers, pin=pin, counters=counters,
                                     after_updates=True, urgent=True, fresh_source=self._take_fresh,
                                     reclaim=self._reclaim, carry=not self.cached, **read)
        #: A clipped step holds this many more backward reads for their updates (module docstring;
        #: without a cache only: with one, nothing is handed after the backward).
        self.held_units = held_units
        self._compute_buffers = max(1, compute_buffers)
        #: Updates not handed a compute buffer read and write range by range (no optimizer stream).
        self.ranged = ranged and not self.cached and hasattr(disk, "ranged")
        # (the optimizer stream's buffers are no load's source with a shadow: pageable)
        self._opt_args = dict(buffers=optimizer_buffers, pin=pin and shadow is None, counters=counters,
                              after_updates=False)
        self._opt = None if self.ranged else self._opt_stream()

    def _opt_stream(self) -> DiskReadStream:
        """The optimizer stream (made on first need when updates are ranged: layer statistics)."""
        return DiskReadStream(self.disk, self.units, self.dirty, reclaim=self._reclaim, **self._opt_args)

    # ------------------------------------------------------------------ construction
    def put_initial(self, unit: Unit, flat: torch.Tensor) -> None:
        self._initial_writes.add(self.disk.write(weights_key(unit), {"w": flat}))
        if self.shadow is not None:
            self._initial_writes.add(self.disk.write(shadow_key(unit), {"c": flat.to(self.shadow)}))

    def finish_initial(self) -> None:
        self._initial_writes.drain()

    # ------------------------------------------------------------------ schedules
    def schedule(self, compute_order: Sequence[Unit], optimizer_order: Optional[Sequence[Unit]] = None,
                 *, updates_after_backward: bool = False) -> None:
        """``updates_after_backward``: the updates wait for the whole backward (clipping) and run
        in the next forward's order, so every updated buffer is kept fresh for that forward."""
        keep, handed = [], set()
        if optimizer_order is not None and self.shadow is not None:
            with self._lock:   # a load's buffer holds the copy: no update takes it, none is kept fresh
                self._fresh_wanted = set()
        elif optimizer_order is not None:
            if compute_order:
                self._last_compute = list(compute_order)
            last = {u.index: i for i, u in enumerate(compute_order)}
            if updates_after_backward:
                fresh = {u.index for u in optimizer_order}
                if not self.cached:
                    # The first updates want the units the backward read last: those buffers are
                    # handed over (all the compute stream's own but one, which the backward's
                    # reads and the next forward's go on using, and the held ones), so the
                    # updates start without a read while the optimizer stream reads ahead for
                    # the ones after them.
                    own = self._compute_buffers - 1
                    handed = handed_after_backward(compute_order, optimizer_order, own + self.held_units)
                    self._fetch.grow(self._compute_buffers + max(0, len(handed) - own))
                    keep = [last[idx] for idx in handed]
            else:
                # A unit loaded twice (forward, then backward) hands its backward read to its update.
                handed = handed_units(compute_order, optimizer_order)
                keep = [last[idx] for idx in handed]
                # The step's access order repeats: the last units updated that the next forward
                # reads among its first stay fresh in their buffers.
                early = {u.index for u in self._last_compute[:NEXT_FORWARD_FIRST]}
                fresh = fresh_after_step(optimizer_order, early, handed, self._compute_buffers)
            if self.cached:
                fresh = set()  # the host cache keeps what the plan says, deterministically
            with self._lock:
                self._fresh_wanted = fresh
        wanted = {u.index for u in compute_order}
        self._drop_fresh(lambda idx, e: idx not in wanted)  # not read by this schedule
        self._fetch.schedule(compute_order, keep=keep)
        if optimizer_order is not None and self._opt is not None and not self.ranged:
            self._opt.schedule([u for u in optimizer_order if u.index not in handed], append=True)

    # ------------------------------------------------------------------ compute stream
    def for_transfer(self, unit: Unit) -> torch.Tensor:
        t = self._fetch.get(unit)
        if self._fetch.was_fresh(t):
            self.counters.add("weight_reads_saved", 1)
        return t

    def transfer_done(self, unit: Unit, t: torch.Tensor) -> None:
        if self._fetch.is_kept(t):
            with self._lock:
                self._handed[unit.index] = t
        else:
            self._fetch.release(t)

    # ------------------------------------------------------------------ optimizer stream
    def mark_updating(self, unit: Unit) -> None:
        self.dirty.mark(unit)

    def update_failed(self, unit: Unit) -> None:
        self.dirty.clean(unit)  # its queued update will not run: readers stop waiting

    def for_update(self, unit: Unit) -> torch.Tensor:
        with self._lock:
            t = self._handed.pop(unit.index, None)
        if t is not None:
            self.counters.add("weight_reads_saved", 1)
            return t
        if self._opt is None:   # ranged updates, and a caller needs the whole unit (layer statistics)
            self._opt = self._opt_stream()
        return self._opt.get(unit)

    def handed(self, unit: Unit) -> bool:
        """Whether a compute buffer waits for this unit's update (its backward's read)."""
        with self._lock:
            return unit.index in self._handed

    def ranged_update(self, unit: Unit):
        """For an update with no buffer handed to it (``ranged``): a ranged rewrite of the unit's
        weights (``"w"``: read with ``read``, written with ``write``, range by range, in order),
        to ``commit`` (then :meth:`update_done` with None) or ``abort``; else None."""
        if not self.ranged or self.handed(unit):
            return None
        rw = self.disk.ranged(weights_key(unit), {"w": (torch.float32, (unit.numel,))}, read_old=True)
        if self.shadow is None:
            return rw
        try:
            copy = self.disk.ranged(shadow_key(unit), {"c": (self.shadow, (unit.numel,))}, read_old=False)
        except BaseException as e:
            rw.abort(e)
            raise
        return ShadowedRewrite(rw, copy, self.shadow)

    def update_done(self, unit: Unit, t: Optional[torch.Tensor]) -> None:
        """``t`` None: a ranged update, already committed (or aborted: the weights stay)."""
        if t is None:
            self.dirty.clean(unit)
            return
        with self._lock:
            fresh = unit.index in self._fresh_wanted
        fut = self.disk.write(weights_key(unit), {"w": t})  # the pools bound these
        if self.shadow is not None:   # the update's cast: the copy the loads read (before the unit is clean)
            self.disk.write(shadow_key(unit), {"c": t.to(self.shadow)})
        if fresh:
            # Two users: the write, and the next compute read (or the schedule that drops it).
            entry = {"buf": t, "users": 2}
            with self._lock:
                self._fresh[unit.index] = entry
            fut.add_done_callback(lambda f, e=entry: self._unref(e))
        else:
            fut.add_done_callback(lambda f, b=t: self._release(b))
        self.dirty.clean(unit)  # the compute stream may now read it (or take the fresh copy)

    def _take_fresh(self, unit: Unit):
        """For the compute stream: (buffer, release callback) of a fresh copy, or None."""
        with self._lock:
            entry = self._fresh.pop(unit.index, None)
        if entry is None:
            return None
        return entry["buf"], lambda e=entry: self._unref(e)

    def _reclaim(self, stream) -> None:
        """A reader of ``stream`` has no buffer: its buffers held as fresh copies go back (once
        written); the next forward reads those units from disk instead."""
        self._drop_fresh(lambda idx, e: stream.owns(e["buf"]))

    def _release(self, buf: torch.Tensor) -> None:
        """Back to the stream whose staging buffer it is (a layer's update may hold a compute one)."""
        (self._fetch if self._fetch.owns(buf) or self._opt is None else self._opt).release(buf)

    def _unref(self, entry: dict) -> None:
        with self._lock:
            entry["users"] -= 1
            done = entry["users"] == 0
        if done:
            self._release(entry["buf"])

    def _drop_fresh(self, which=lambda idx, entry: True) -> None:
        """Drop the fresh copies ``which(unit index, entry)`` selects (each back once written)."""
        with self._lock:
            entries = [self._fresh.pop(i) for i, e in list(self._fresh.items()) if which(i, e)]
        for e in entries:
            self._unref(e)

    # ------------------------------------------------------------------ direct access
    def read_now(self, unit: Unit) -> torch.Tensor:
        """A unit's current weights (a copy) for reading outside a step."""
        self.dirty.wait_clean(unit)
        return self.disk.read(weights_key(unit), outside_plan=True).result()["w"]

    def overwrite(self, unit: Unit, flat: torch.Tensor) -> None:
        """New weights for a unit (loading a checkpoint)."""
        self._drop_fresh(lambda idx, e: idx == unit.index)  # its fresh copy would be stale
        self.disk.write(weights_key(unit), {"w": flat}).result()  # waited: no copy needed
        if self.shadow is not None:
            self.disk.write(shadow_key(unit), {"c": flat.to(self.shadow)}).result()

    def reset(self) -> None:
        with self._lock:
            handed, self._handed = list(self._handed.values()), {}
        for t in handed:  # the step failed before those updates ran
            self._fetch.release(t)
        self._drop_fresh()
        self._fetch.reset()
        if self._opt is not None:
            self._opt.reset()

    def pinned_bytes(self) -> int:
        """Bytes of the compute stream's staging buffers where they are pinned (the loads' source:
        fp32 compute, or the compute-dtype copy); 0 otherwise."""
        return self._fetch.staging_bytes if self._fetch.pinned else 0

    def nbytes(self) -> Dict[str, int]:
        staging = self._fetch.staging_bytes + (self._opt.staging_bytes if self._opt is not None else 0)
        cached = self.disk.resident_bytes([weights_key(u) for u in self.units]) \
            if hasattr(self.disk, "resident_bytes") else 0   # in the disk tier's host cache
        keys = [weights_key(u) for u in self.units] + ([shadow_key(u) for u in self.units] if self.shadow else [])
        return {"host": staging, "disk": sum(self.disk.nbytes_of(k) for k in keys), "cached": cached}
