"""Pager: device slots, host<->device transfers and schedule-driven prefetch.

The engine tells the pager the step's unit access order (forward, then backward); the pager
keeps as many of the upcoming units in flight as free slots allow, so a unit's weights are
usually on the device before the compute thread asks for them.

Two transports share one code path:
* CUDA: a host->device stream and a device->host stream, synchronised with events; the
  compute stream waits on a slot's ready event, a slot is refilled only after its free event.
* CPU: the "device" is the CPU; slots are plain tensors, copies are memcpy in worker threads
  (torch's copy releases the GIL), so transfers overlap compute exactly as on a GPU.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Callable, Dict, List, Optional, Sequence

import torch

from .telemetry import Telemetry
from ..threads import D2H, H2D, executor
from .units import Unit


class Slot:
    def __init__(self, pool: str, buf: torch.Tensor):
        self.pool = pool
        self.buf = buf
        self.unit: Optional[Unit] = None
        self.ready: Optional[Future] = None
        self.free_event = None        # CUDA event recorded when compute released the slot
        self.busy = False             # holds (or is being filled with) a unit


class Pager:
    def __init__(self, units: List[Unit], *, device: torch.device, dtype: torch.dtype,
                 layer_slots: int, source: Callable[[Unit], torch.Tensor],
                 source_done: Callable[[Unit, torch.Tensor], None], telemetry: Telemetry,
                 grad_sink: Callable[[Unit, torch.Tensor], None], sharded=None, max_grads_in_flight: int = 1):
        self.device = device
        self.dtype = dtype
        self.cuda = device.type == "cuda"
        self.source = source          # unit -> fp32 host flat params (may wait on the disk tier)
        self.source_done = source_done  # (unit, that tensor): the copy no longer needs it
        self.grad_sink = grad_sink    # (unit, fp32 host flat grad) -> accumulate
        self.telemetry = telemetry
        # Data parallel (engine.sharded.ShardedUnits): ``source`` gives this rank's shard of a
        # unit and a gather builds the whole unit in its slot; on CUDA a unit's gradient is
        # reduce-scattered on the device and only this rank's shard goes to the host.
        self.sharded = sharded
        self._lock = threading.Condition()
        self._h2d, self._d2h = executor(H2D), executor(D2H)
        self._grad_futures: List[Future] = []
        self.max_grads_in_flight = max_grads_in_flight
        esize = torch.tensor([], dtype=dtype).element_size()
        self.pools: Dict[str, List[Slot]] = {}
        sizes = {"embed": 0, "layer": 0, "head": 0}
        for u in units:
            sizes[u.kind] = max(sizes[u.kind], self._slot_numel(u))
        counts = {"embed": 1, "layer": layer_slots, "head": 1}
        for kind, n in counts.items():
            if sizes[kind] > 0:
                self.pools[kind] = [Slot(kind, torch.empty(sizes[kind], dtype=dtype, device=device))
                                    for _ in range(n)]
        self.slot_bytes = sum(s.buf.numel() * esize for pool in self.pools.values() for s in pool)
        # Gradient return buffers: device flat fp32 grads and (CUDA) pinned host staging.
        max_unit = max(self._slot_numel(u) for u in units)
        self.grad_buf_bytes = 0
        if self.cuda:
            self._h2d_stream = torch.cuda.Stream(device)
            self._d2h_stream = torch.cuda.Stream(device)
            self._grad_dev = [torch.empty(max_unit, dtype=torch.float32, device=device) for _ in range(2)]
            self._grad_host = [torch.empty(max_unit, dtype=torch.float32).pin_memory() for _ in range(2)]
            self._grad_free = [None, None]
            self._grad_turn = 0
            self.grad_buf_bytes = 2 * max_unit * 4
        self._order: List[Unit] = []
        self._issued = 0              # order[:_issued] have been fetched (or consumed)
        self._consumed = 0
        self._resident: Dict[int, Slot] = {}

    def _slot_numel(self, unit: Unit) -> int:
        """Elements a device buffer for ``unit`` needs (a gathered unit arrives padded)."""
        return self.sharded.padded_numel(unit) if self.sharded is not None else unit.numel

    # ------------------------------------------------------------------ schedule
    def set_schedule(self, order: Sequence[Unit]) -> None:
        """The access order of the coming step; prefetching starts immediately."""
        with self._lock:
            self._order = list(order)
            self._issued = 0
            self._consumed = 0
        self._top_up()

    def _free_slot(self, kind: str) -> Optional[Slot]:
        for s in self.pools.get(kind, []):
            if not s.busy:
                return s
        return None

    def _top_up(self) -> None:
        with self._lock:
            while self._issued < len(self._order):
                u = self._order[self._issued]
                if u.index in self._resident:  # the same unit twice in a row of the order
                    break
                slot = self._free_slot(u.kind)
                if slot is None:
                    break
                self._start_fetch(u, slot)
                self._issued += 1

    # ------------------------------------------------------------------ transfers
    def _start_fetch(self, unit: Unit, slot: Slot) -> None:
        slot.busy = True
        slot.unit = unit
        self._resident[unit.index] = slot
        slot.ready = self._h2d.submit(self._copy_in, unit, slot)

    def _copy_in(self, unit: Unit, slot: Slot):
        src = self.source(unit)
        t0 = time.perf_counter()
        dst = slot.buf[:unit.numel]
        if self.cuda:
            with torch.cuda.stream(self._h2d_stream):
                if slot.free_event is not None:
                    self._h2d_stream.wait_event(slot.free_event)
                if self.sharded is not None:   # NCCL all-gather on this (the h2d) stream
                    self.sharded.gather(unit, src, out=slot.buf)
                else:
                    dst.copy_(src, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self._h2d_stream)
            ev.synchronize()  # this worker only: the host buffer may be reused after this
            result = ev
        else:
            if self.sharded is not None:
                self.sharded.gather(unit, src, out=slot.buf)
            else:
                dst.copy_(src)
            result = None
        self.source_done(unit, src)
        self.telemetry.add_bytes("host_to_device", src.numel() * 4, time.perf_counter() - t0)
        self.telemetry.load(unit.name)
        return result

    def acquire(self, unit: Unit) -> torch.Tensor:
        """The unit's weights as a flat device tensor; waits for the transfer if needed."""
        with self._lock:
            slot = self._resident.get(unit.index)
            in_order = self._consumed < len(self._order) and self._order[self._consumed] is unit
            ahead = slot is not None   # issued by the schedule before it was needed
            if slot is None:
                # Not prefetched (no schedule, or out of order): fetch on demand.
                while (slot := self._free_slot(unit.kind)) is None:
                    self._lock.wait(0.05)
                self._start_fetch(unit, slot)
                if in_order and self._issued == self._consumed:
                    self._issued += 1
            if in_order:
                self._consumed += 1
        t0 = time.perf_counter()
        ev = slot.ready.result()
        if self.cuda and ev is not None:
            torch.cuda.current_stream(self.device).wait_event(ev)
        self.telemetry.stall("device", time.perf_counter() - t0)
        self.telemetry.prefetch_result("device", ahead)
        return slot.buf[:unit.numel]

    def release(self, unit: Unit) -> None:
        with self._lock:
            slot = self._resident.pop(unit.index, None)
            if slot is None:
                return
            if self.cuda:
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(self.device))
                slot.free_event = ev
            slot.busy = False
            slot.unit = None
            self._lock.notify_all()
        self._top_up()

    # ------------------------------------------------------------------ gradients
    def return_grads(self, unit: Unit, grads: Sequence[torch.Tensor]) -> None:
        """Send a unit's weight gradients (in unit.params order) to the host, asynchronously."""
        if self.cuda:
            turn = self._grad_turn
            self._grad_turn ^= 1
            dev, host = self._grad_dev[turn], self._grad_host[turn]
            if self._grad_free[turn] is not None:
                self._grad_free[turn].result()     # the staging buffer's last user is done
            if self.sharded is not None:   # padded to whole shards; the tail must be zero
                dev[unit.numel:self._slot_numel(unit)].zero_()
            torch.cat([g.reshape(-1).float() for g in grads], out=dev[:unit.numel])
            ev_c = torch.cuda.Event()
            ev_c.record(torch.cuda.current_stream(self.device))
            if self.sharded is None:
                with torch.cuda.stream(self._d2h_stream):
                    self._d2h_stream.wait_event(ev_c)
                    host[:unit.numel].copy_(dev[:unit.numel], non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(self._d2h_stream)
            sink_unit = unit if self.sharded is None else self.sharded.shard(unit)

            def finish():
                nonlocal ev
                t0 = time.perf_counter()
                if self.sharded is not None:
                    # NCCL reduce-scatter on the d2h stream (issued from this one thread, in the
                    # backward's order on every rank), then only this rank's shard to the host.
                    with torch.cuda.stream(self._d2h_stream):
                        self._d2h_stream.wait_event(ev_c)
                        mine = self.sharded.reduce_grad(unit, dev[:self._slot_numel(unit)])
                        host[:mine.numel()].copy_(mine, non_blocking=True)
                        ev = torch.cuda.Event()
                        ev.record(self._d2h_stream)
                ev.synchronize()
                self.telemetry.add_bytes("device_to_host", sink_unit.numel * 4, time.perf_counter() - t0)
                self.grad_sink(sink_unit, host[:sink_unit.numel])
            ev = None if self.sharded is not None else ev
            fut = self._d2h.submit(finish)
            self._grad_free[turn] = fut
        else:
            grads = [g.detach() if g.requires_grad else g for g in grads]   # (the same object: see updates.lend_buffer)

            def finish():
                # CPU "device": the gradients already are host memory; add them in place.
                self.telemetry.add_bytes("device_to_host", unit.numel * 4, 0.0)
                self.grad_sink(unit, grads)
            fut = self._d2h.submit(finish)
        self._grad_futures.append(fut)
        # Bounded: at most a few units' gradients in flight to the host (memory stays flat).
        pending = [f for f in self._grad_futures if not f.done()]
        self._grad_futures = pending
        if len(pending) > self.max_grads_in_flight:
            t0 = time.perf_counter()
            pending[0].result()
            self.telemetry.stall("grad_return", time.perf_counter() - t0)

    def wait_grads(self) -> None:
        t0 = time.perf_counter()
        futs, self._grad_futures = self._grad_futures, []
        for f in futs:
            f.result()
        self.telemetry.stall("grad_return", time.perf_counter() - t0)

    def reset(self) -> None:
        """Drop every residency (after an error mid-step)."""
        with self._lock:
            for s in list(self._resident.values()):
                if s.ready is not None:
                    try:
                        s.ready.result()
                    except Exception:
                        pass
                s.busy = False
                s.unit = None
            self._resident.clear()
            self._order = []
            self._issued = self._consumed = 0
        try:
            self.wait_grads()
        except Exception:
            pass

    def close(self) -> None:
        self.reset()
        self._h2d.shutdown(wait=True)
        self._d2h.shutdown(wait=True)
        self.pools.clear()
        if self.cuda:
            self._grad_dev.clear()
            self._grad_host.clear()
