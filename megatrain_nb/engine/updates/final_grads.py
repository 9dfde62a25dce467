"""FinalGradients: what a step knows of its final gradients between "final" and "updated" --
the ledger the gradient intake (``intake.py``) writes and the update runner
(``update_runner.py``) reads. It is built first and both take it (``updates.UpdateScheduler``):

* gradients held while a clipped step's updates wait for the global norm: in RAM
  (``hold="host"``) or written to the disk tier (``hold="disk"``); each update claims its own
  (:meth:`FinalGradients.claim`), one read back in chunks as a :class:`HeldGradient`;
* each unit's norm (clipped steps: the layer statistics' grad norm, no second pass) and the
  sum of their squares (the global norm);
* the ranks' votes on a unit's finiteness (data parallel, straight updates).
"""
from __future__ import annotations

import threading
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from typing import Callable, Dict, Optional, Tuple

import torch

from ..tiers.host_store import BufferPool
from ..units import Unit, train_numel

HOLD_WRITES = 2   # disk writes of held final gradients in flight at once (hold="disk")


class HeldGradient:
    """A final gradient held on the disk tier, read back range by range in order
    (``read(start, out)``: ``out.numel()`` elements from element ``start``), scaled by ``coef``
    (the clip coefficient, set before the first read) as each range arrives: the same products
    as the whole gradient scaled at once. ``close()`` ends the read (the key may be written again)."""

    def __init__(self, reader, numel: int):
        self.reader, self.numel, self.coef = reader, numel, None

    def read(self, start: int, out: torch.Tensor) -> torch.Tensor:
        self.reader.read("g", start, out)
        if self.coef is not None:
            out.mul_(self.coef)
        return out

    def close(self, _grad=None) -> None:
        self.reader.close()


class FinalGradients:
    """Collaborators: ``pool`` (the final-gradient buffers: a held gradient's goes back there),
    ``disk`` (the disk tier, for ``hold="disk"``; None: none). Written by the pager's gradient
    thread, read by the AdamW worker: each table under its lock."""

    def __init__(self, pool: BufferPool, disk=None):
        self.pool = pool
        self.disk = disk
        self._norm_sq = 0.0                           # sum of the final gradients' squared norms
        self._norm_lock = threading.Lock()
        self._unit_norm: Dict[int, float] = {}        # unit index -> its final gradient's norm (clipping)
        self._votes: Dict[int, bool] = {}             # unit index -> finite on every rank (data parallel)
        self._held_ram: Dict[int, torch.Tensor] = {}  # unit index -> final gradient held for the norm (hold="host")
        self._held: Dict[int, Future] = {}            # unit index -> write of its final gradient (hold="disk")
        self._held_keys: set = set()
        self._ahead: Dict[int, Tuple[torch.Tensor, Future]] = {}   # unit index -> its held gradient being read back
        self._held_lock = threading.Lock()

    # ------------------------------------------------------------------ norms
    def add_norm(self, unit: Unit, flat: torch.Tensor) -> None:
        """``unit``'s final gradient's share of the global norm (and its own norm, kept for its update)."""
        norm = float(torch.linalg.vector_norm(flat))
        with self._norm_lock:
            self._norm_sq += norm ** 2
            self._unit_norm[unit.index] = norm

    def take_norm_sq(self) -> float:
        """The squares summed since the last take (a micro-batch starts at zero)."""
        with self._norm_lock:
            sq, self._norm_sq = self._norm_sq, 0.0
        return sq

    def reset_norm(self) -> None:
        with self._norm_lock:
            self._norm_sq = 0.0

    def unit_norm(self, unit: Unit) -> Optional[float]:
        """The norm of a unit's final gradient, taken for the global norm (clipped steps only;
        read once, by its update)."""
        with self._norm_lock:
            return self._unit_norm.pop(unit.index, None)

    def drop_norm(self, unit: Unit) -> None:
        """``unit``'s update runs unclipped: a norm a failed clipped step left is dropped."""
        with self._norm_lock:
            self._unit_norm.pop(unit.index, None)

    # ------------------------------------------------------------------ votes
    def record_vote(self, unit: Unit, finite: bool) -> None:
        self._votes[unit.index] = finite

    def vote(self, unit: Unit) -> Optional[bool]:
        """Whether every rank found this unit's final gradient finite (None: no vote taken)."""
        return self._votes.pop(unit.index, None)

    # ------------------------------------------------------------------ held for the norm
    def hold_in_ram(self, unit: Unit, flat: torch.Tensor) -> None:
        """hold="host": ``flat`` (a pool buffer) kept until its update claims it."""
        with self._held_lock:
            self._held_ram[unit.index] = flat

    def drop_in_ram(self, unit: Unit) -> None:
        """``unit``'s gradient goes elsewhere this step: an entry a failed step left is dropped."""
        with self._held_lock:
            self._held_ram.pop(unit.index, None)

    def write_held(self, unit: Unit, flat: torch.Tensor) -> Future:
        """hold="disk": ``flat`` written to the disk tier; the write (done: ``flat`` may be reused)."""
        key = self._hold_key(unit)
        self._drop_ahead(unit)   # (a read back that a failed step left: done before the key is written again)
        fut = self.disk.write(key, {"g": flat})
        with self._held_lock:
            self._held[unit.index] = fut
            self._held_keys.add(key)
        return fut

    def hold_on_disk(self, unit: Unit, flat: torch.Tensor) -> None:
        """hold="disk", ``flat`` a pool buffer: written to the disk tier (its update reads it
        back once the norm is known) and given back to the pool once written; RAM holds only
        the writes in flight (a few units)."""
        fut = self.write_held(unit, flat)
        fut.add_done_callback(lambda _f, flat=flat: self.pool.give(flat))
        with self._held_lock:
            inflight = [f for f in self._held.values() if not f.done()]
        if len(inflight) > HOLD_WRITES:   # back-pressure on the gradient thread (errors surface in the update)
            futures_wait(inflight[:-HOLD_WRITES])

    def read_ahead(self, unit: Unit, ranged: bool = False) -> None:
        """Start reading ``unit``'s final gradient back from the disk tier now, while the update
        before it runs (its :meth:`claim` then waits only for what is left of the read): a read
        the update waited for whole took a fifth of a disk-tier step's updates. Only the whole
        reads (a host cache in front of the disk tier): a ranged one is read a chunk ahead of
        AdamW already. One buffer: the norm's hold has no writes in flight while the updates run."""
        if self.disk is None or (ranged and getattr(self.disk, "capacity", 0) <= 0):
            return
        with self._held_lock:
            held = self._held.get(unit.index)
            if held is None or not held.done() or held.exception() is not None or unit.index in self._ahead:
                return
            grad = self.pool.take(train_numel(unit))
            self._ahead[unit.index] = (grad, self.disk.read(self._hold_key(unit), {"g": grad}, urgent=True))

    def _drop_ahead(self, unit: Unit) -> None:
        with self._held_lock:
            ahead = self._ahead.pop(unit.index, None)
        if ahead is not None:
            futures_wait([ahead[1]])
            self.pool.give(ahead[0])

    def claim(self, unit: Unit, ranged: bool = False) -> Tuple[Optional[object], Optional[Callable]]:
        """For a unit's update that waited for the norm: (its held final gradient, how to hand
        the buffer back), or (None, None) when it is in the accumulator. ``ranged``: the update
        works in chunks, so a gradient held on the disk tier comes as a :class:`HeldGradient`
        (read a chunk at a time) where the disk tier reads ranges (``read_ranged``)."""
        with self._held_lock:
            held = self._held.pop(unit.index, None)
            in_ram = self._held_ram.pop(unit.index, None)
            ahead = self._ahead.pop(unit.index, None)
        if in_ram is not None:   # hold="host": kept since it arrived
            return in_ram, self.pool.give
        if held is None:
            return None, None
        held.result()            # hold="disk": the final gradient comes back
        if ahead is not None:    # (read_ahead started it)
            try:
                ahead[1].result()
            except BaseException:
                self.pool.give(ahead[0])
                raise
            return ahead[0], self.pool.give
        if ranged and getattr(self.disk, "capacity", 0) <= 0:   # (a host cache's copies are whole units)
            got = HeldGradient(self.disk.read_ranged(self._hold_key(unit)), train_numel(unit))
            return got, got.close
        grad = self.pool.take(train_numel(unit))
        try:
            self.disk.read(self._hold_key(unit), {"g": grad}, urgent=True).result()
        except BaseException:
            self.pool.give(grad)
            raise
        return grad, self.pool.give

    # ------------------------------------------------------------------ accounting
    def held_ram_bytes(self) -> int:
        """Bytes of final gradients held in RAM for a clipping norm (freed by their updates)."""
        with self._held_lock:
            return sum(t.numel() * 4 for t in self._held_ram.values())

    def held_disk_bytes(self) -> int:
        """Bytes of final gradients kept on the disk tier for clipping (hold="disk")."""
        return sum(self.disk.nbytes_of(k) for k in self._held_keys) if self.disk is not None else 0

    def held_cached_bytes(self) -> int:
        """Bytes of those final gradients the disk tier's host cache holds in RAM."""
        if self.disk is None or not hasattr(self.disk, "resident_bytes"):
            return 0
        return self.disk.resident_bytes(list(self._held_keys))

    def _hold_key(self, unit: Unit) -> str:
        return f"final-grad-{unit.index:05d}"
