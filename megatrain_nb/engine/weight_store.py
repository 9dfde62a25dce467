"""WeightStore: the one place that knows where each unit's fp32 master weights live.

In RAM (the HostStore's flat buffers, used in place) or on the disk tier (paged through
staging buffers by two read streams: compute and optimizer). The engine asks for a unit's
weights "for transfer" (to the device) or "for update" (the optimizer), and hands them back.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch

from .disk_params import DirtyUnits, DiskReadStream, weights_key
from .host_store import HostStore
from .units import Unit


class WeightStore:
    def __init__(self, units: List[Unit], host: HostStore, *, disk=None, pin: bool, counters,
                 compute_buffers: int = 3, optimizer_buffers: int = 2):
        self.units = units
        self.host = host
        self.disk = disk
        self.on_disk = disk is not None
        self.counters = counters
        self.dirty = DirtyUnits()
        self._pending_writes = []
        if self.on_disk:
            self._fetch = DiskReadStream(disk, units, self.dirty, buffers=compute_buffers, pin=pin, counters=counters,
                                         after_updates=True)
            self._opt = DiskReadStream(disk, units, self.dirty, buffers=optimizer_buffers, pin=pin, counters=counters,
                                       after_updates=False)

    # ------------------------------------------------------------------ construction
    def put_initial(self, unit: Unit, flat: torch.Tensor) -> None:
        if not self.on_disk:
            self.host.set_params(unit, flat)
            return
        self._pending_writes.append(self.disk.write(weights_key(unit), {"w": flat}))
        self.counters.add_bytes("host_to_disk", unit.numel * 4)
        while len(self._pending_writes) > 2:  # bounded: at most a few units in RAM at once
            self._pending_writes.pop(0).result()

    def finish_initial(self) -> None:
        for f in self._pending_writes:
            f.result()
        self._pending_writes = []

    # ------------------------------------------------------------------ schedules
    def schedule(self, compute_order: Sequence[Unit], optimizer_order: Optional[Sequence[Unit]] = None) -> None:
        if not self.on_disk:
            return
        self._fetch.schedule(compute_order)
        if optimizer_order is not None:
            self._opt.schedule(optimizer_order, append=True)

    # ------------------------------------------------------------------ compute stream
    def for_transfer(self, unit: Unit) -> torch.Tensor:
        if not self.on_disk:
            return self.host.params[unit.index]
        t = self._fetch.get(unit)
        self.counters.add_bytes("disk_to_host", unit.numel * 4)
        return t

    def transfer_done(self, unit: Unit, t: torch.Tensor) -> None:
        if self.on_disk:
            self._fetch.release(t)

    # ------------------------------------------------------------------ optimizer stream
    def mark_updating(self, unit: Unit) -> None:
        if self.on_disk:
            self.dirty.mark(unit)

    def for_update(self, unit: Unit) -> torch.Tensor:
        if not self.on_disk:
            return self.host.params[unit.index]
        t = self._opt.get(unit)
        self.counters.add_bytes("disk_to_host", unit.numel * 4)
        return t

    def update_done(self, unit: Unit, t: torch.Tensor) -> None:
        if not self.on_disk:
            return
        fut = self.disk.write(weights_key(unit), {"w": t})
        self.counters.add_bytes("host_to_disk", unit.numel * 4)
        fut.add_done_callback(lambda f, b=t: self._opt.release(b))
        self.dirty.clean(unit)

    # ------------------------------------------------------------------ direct access
    def read_now(self, unit: Unit) -> torch.Tensor:
        """A unit's current weights (a copy when on disk) for reading outside a step."""
        if not self.on_disk:
            return self.host.params[unit.index]
        self.dirty.wait_clean(unit)
        return self.disk.read(weights_key(unit)).result()["w"]

    def overwrite(self, unit: Unit, flat: torch.Tensor) -> None:
        """New weights for a unit (loading a checkpoint)."""
        if not self.on_disk:
            self.host.params[unit.index].copy_(flat)
            return
        self.disk.write(weights_key(unit), {"w": flat}).result()  # waited: no copy needed

    def reset(self) -> None:
        if self.on_disk:
            self._fetch.reset()
            self._opt.reset()

    def nbytes(self) -> Dict[str, int]:
        if not self.on_disk:
            return {"host": self.host.nbytes()["weights"], "disk": 0}
        staging = self._fetch.staging_bytes + self._opt.staging_bytes
        return {"host": staging, "disk": sum(self.disk.nbytes_of(weights_key(u)) for u in self.units)}
