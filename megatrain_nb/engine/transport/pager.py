"""Pager: device slots, host<->device transfers and schedule-driven prefetch.

The engine tells the pager the step's unit access order (forward, then backward); the pager
keeps as many of the upcoming units in flight as free slots allow, so a unit's weights are
usually on the device before the compute thread asks for them.

Every copy goes through the transport (engine/transport/transport.py): a slot is filled by
``copy_in`` (its ready handle is waited on when the compute acquires the unit), handed back
by ``release`` (the next fill waits for that point), and a unit's gradient leaves by
``copy_out`` (the gradient thread waits for it, then hands the host tensor to the sink). The
copies are issued from two worker threads (``mtnb-h2d``, ``mtnb-d2h``), so transfers overlap
compute on a CPU "device" exactly as on a GPU. Data parallel, the transport gathers a unit's
shards into its slot and reduce-scatters its gradient (``transport.ShardedTransport``): the
pager sees whole units. Those collectives run in the two worker threads, but the pager
announces each one from the program's thread when it decides on it (a fetch scheduled, a
gradient handed over: ``announce_in`` / ``announce_out``), and they are issued in that order
on every rank (engine/transport/issuer.py); a ticket whose copy never ran is cancelled.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from typing import Callable, Dict, List, Optional, Sequence

import torch

from .landing import landing_buffers as staging_buffers  # (the name planning and tests import)
from .landing import landing_host_bytes
from ..telemetry import Telemetry
from ...threads import D2H, H2D, executor
from ..units import Unit, train_numel


def _wait_kept(fut: Optional[Future]) -> None:
    """Wait for a gradient's trip to the host and, when its sink kept the host buffer (the
    trip returned a Future), for the sink to be done with it (its error is the update's, reported there)."""
    if fut is None:
        return
    kept = fut.result()
    if isinstance(kept, Future):
        futures_wait([kept])


def _submit(pool, tickets, fn, *args) -> Future:
    """``pool.submit(fn, *args)``; ``tickets`` (announced for ``fn``'s collectives) cancelled if it
    cannot be submitted (a closed pool), so the collectives after them go on."""
    try:
        return pool.submit(fn, *args)
    except BaseException:
        for t in tickets:
            t.cancel()
        raise


class Slot:
    def __init__(self, pool: str, buf: torch.Tensor):
        self.pool = pool
        self.buf = buf
        self.unit: Optional[Unit] = None
        self.ready: Optional[Future] = None   # -> the transport's ready handle of the slot's fill
        self.busy = False             # holds (or is being filled with) a unit


class Pager:
    def __init__(self, units: List[Unit], *, device: torch.device, dtype: torch.dtype,
                 layer_slots: int, source: Callable[[Unit], torch.Tensor],
                 source_done: Callable[[Unit, torch.Tensor], None], telemetry: Telemetry,
                 grad_sink: Callable[[Unit, torch.Tensor], None], transport, max_grads_in_flight: int = 1,
                 votes: Optional[Callable[[], bool]] = None):
        self.device = device
        self.dtype = dtype
        self.source = source          # unit -> fp32 host flat params (may wait on the disk tier)
        self.source_done = source_done  # (unit, that tensor): the copy no longer needs it
        self.grad_sink = grad_sink    # (unit, fp32 host flat grad) -> accumulate
        self.votes = votes            # () -> whether a gradient's arrival now votes on its finiteness (sharded)
        # data parallel: the transport's collectives, announced in the program's order
        self._announce_in = getattr(transport, "announce_in", None)
        self._announce_out = getattr(transport, "announce_out", None)
        self.telemetry = telemetry
        self.transport = transport
        self._lock = threading.Condition()
        self._h2d, self._d2h = executor(H2D), executor(D2H)
        self._grad_futures: List[Future] = []
        self.max_grads_in_flight = max_grads_in_flight
        esize = torch.tensor([], dtype=dtype).element_size()
        self.pools: Dict[str, List[Slot]] = {}
        sizes = {"embed": 0, "layer": 0, "head": 0}
        for u in units:
            sizes[u.kind] = max(sizes[u.kind], transport.slot_numel(u))
        counts = {"embed": 1, "layer": layer_slots, "head": 1}
        for kind, n in counts.items():
            if sizes[kind] > 0:
                self.pools[kind] = [Slot(kind, torch.empty(sizes[kind], dtype=dtype, device=device))
                                    for _ in range(n)]
        self.slot_bytes = sum(s.buf.numel() * esize for pool in self.pools.values() for s in pool)
        for pool in self.pools.values():   # a new slot starts released (the adversarial transport: NaN)
            for s in pool:
                transport.release(s.buf)
        # Gradient staging (a transport that stages: CUDA): two device flat fp32 buffers, used in
        # turn, and ``max_grads_in_flight + 1`` (at least two) host landing buffers: a unit's gradient
        # sum is copied into a device one and leaves into a host one, where its update may run
        # (the sink keeps the host buffer until the future it returns is done): the units being
        # updated and the one next in line, with no unit-sized copy besides. Pinned, or pageable
        # and landed into through a small ring of pinned chunks where that pins less
        # (engine/transport/landing.py: a 7B's two landing layers would lock 1.6 GB).
        max_unit = max(transport.slot_numel(u) for u in units)
        self.grad_buf_bytes = self.grad_host_bytes = 0
        self.lands_in_chunks = False
        if transport.stages:
            self.lands_in_chunks = transport.lands_in_chunks(max_unit, max_grads_in_flight)
            self._grad_dev = [torch.empty(max_unit, dtype=torch.float32, device=device) for _ in range(2)]
            self._grad_host = [transport.landing_buffer(max_unit, self.lands_in_chunks)
                               for _ in range(staging_buffers(max_grads_in_flight))]
            self._dev_free: List[Optional[Future]] = [None, None]
            self._grad_free: List[Optional[Future]] = [None] * len(self._grad_host)
            self._grad_turn = self._host_turn = 0
            self.grad_buf_bytes = 2 * max_unit * 4                      # device
            # host: the landing buffers and the ring, pinned ones as the transport's pool counts
            # each (``pinned.held_bytes``)
            pinned = getattr(getattr(transport, "pinned", None), "pin", False)
            self.grad_host_bytes = landing_host_bytes(max_unit, max_grads_in_flight, pinned)
        self._order: List[Unit] = []
        self._issued = 0              # order[:_issued] have been fetched (or consumed)
        self._consumed = 0
        self._resident: Dict[int, Slot] = {}

    def slot_storages(self) -> set:
        """The data pointers of the slots' storages (weights bound from a slot are not activations)."""
        return {s.buf.untyped_storage().data_ptr() for pool in self.pools.values() for s in pool}

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
        slot.ready = Future()
        tickets = self._announce_in(unit) if self._announce_in is not None else ()
        _submit(self._h2d, tickets, self._copy_in, unit, slot, slot.ready, tickets)

    def _copy_in(self, unit: Unit, slot: Slot, issued: Future, tickets=()) -> None:
        """In the copy thread: the unit's host weights into its slot. ``issued`` gets the
        transport's ready handle as soon as the copy is issued (the compute waits on that
        handle, not on this thread); this thread then waits for the copy itself before the
        host buffer is handed back (``source_done``). ``tickets``: the copy's announced
        collectives, cancelled if it never issued them."""
        try:
            try:
                src = self.source(unit)
                t0 = time.perf_counter()
                ready = self.transport.copy_in(unit, src, slot.buf)
            except BaseException as e:  # noqa: BLE001 - delivered to the compute's acquire
                issued.set_exception(e)
                return
            issued.set_result(ready)
            try:
                ready.result()
            finally:
                self.source_done(unit, src)
        finally:
            for t in tickets:
                t.cancel()
        self.telemetry.add_bytes("host_to_device", src.numel() * 4, time.perf_counter() - t0)
        self.telemetry.load(unit.name)

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
        probe = self.transport.probe()   # CUDA: the compute stream's position before the wait
        ready = slot.ready.result()      # (the copy issued: on CUDA the host waits no longer than that)
        ready.wait()
        if probe is None:   # a CPU "device": the compute is this thread, its wait the stall
            self.telemetry.stall("device", time.perf_counter() - t0)
        else:               # CUDA: the compute stream's idle time, read from events once they are done
            self.transport.watch(probe, ready)
            self.count_idle()
        self.telemetry.prefetch_result("device", ahead)
        return slot.buf[:unit.numel]

    def count_idle(self) -> None:
        """CUDA: the compute stream's idle time for copies in, as far as their events are done,
        into the "device" stall (nothing elsewhere: there the waits are timed as they happen)."""
        if self.device.type != "cuda":
            return
        idle = self.transport.compute_idle_seconds()
        if idle:
            self.telemetry.stall("device", idle)

    def release(self, unit: Unit) -> None:
        with self._lock:
            slot = self._resident.pop(unit.index, None)
            if slot is None:
                return
            self.transport.release(slot.buf)
            slot.busy = False
            slot.unit = None
            self._lock.notify_all()
        self._top_up()

    # ------------------------------------------------------------------ gradients
    def return_grads(self, unit: Unit, grads: Sequence[torch.Tensor]) -> None:
        """Send a unit's weight gradient (one flat fp32 tensor, or per-parameter tensors in
        unit.params order) to the host, asynchronously: the gradient thread waits for the
        transport's copy out and hands the host tensor to the sink."""
        grads = [g.detach() if g.requires_grad else g for g in grads]   # (the same object: see updates.lend_buffer)
        if self.transport.stages:
            turn, hturn = self._grad_turn, self._host_turn
            self._grad_turn ^= 1
            self._host_turn = (hturn + 1) % len(self._grad_host)
            dev, host = self._grad_dev[turn], self._grad_host[hturn]
            if self._dev_free[turn] is not None:
                self._dev_free[turn].result()      # the device buffer's copy out is done
            _wait_kept(self._grad_free[hturn])     # the host buffer's last user (an update) is done
            # (a frozen tail's gradient stays behind: Unit.train_numel; shards are never split so)
            n_slot = self.transport.slot_numel(unit) if train_numel(unit) == unit.numel else train_numel(unit)
            if n_slot > unit.numel:   # padded to whole shards; the tail must be zero
                dev[unit.numel:n_slot].zero_()
            off = 0
            for g in grads:   # cast in the copy (no fp32 temporary per parameter, as .float() made)
                dev[off:off + g.numel()].copy_(g.reshape(-1))
                off += g.numel()
            src = dev[:n_slot]
        else:   # the gradient already is host memory: it leaves as it is
            # (a lent buffer must arrive as the same object: the update adopts it by identity)
            src = grads[0] if len(grads) == 1 and grads[0].dim() == 1 else \
                torch.cat([g.reshape(-1).float() for g in grads])
            host = None
        after = self.transport.record()   # the compute that made the gradient
        tickets = () if self._announce_out is None else \
            self._announce_out(unit, vote=self.votes is not None and self.votes())

        def finish():
            try:
                t0 = time.perf_counter()
                out = self.transport.land(unit, src, host, after=after).result()
                self.telemetry.add_bytes("device_to_host", out.numel() * 4, time.perf_counter() - t0)
                return self.grad_sink(unit, out)   # a Future: the sink keeps the host buffer until it is done
            finally:
                for t in tickets:
                    t.cancel()
        fut = _submit(self._d2h, tickets, finish)
        if self.transport.stages:
            self._dev_free[turn] = self._grad_free[hturn] = fut
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
        self.count_idle()

    def reset(self) -> None:
        """Drop every residency (after an error mid-step)."""
        with self._lock:
            for s in list(self._resident.values()):
                if s.ready is not None:
                    try:
                        s.ready.result().result()
                    except Exception:
                        pass
                self.transport.release(s.buf)
                s.busy = False
                s.unit = None
            self._resident.clear()
            self._order = []
            self._issued = self._consumed = 0
        try:
            self.wait_grads()
        except Exception:
            pass

    def close(self, transport: bool = True) -> None:
        """Slots, threads and staging dropped; ``transport``: the transport closed too (False: a
        second pager on a transport the engine's pager owns -- compute/vision_stream.py)."""
        self.reset()
        self._h2d.shutdown(wait=True)
        self._d2h.shutdown(wait=True)
        self.pools.clear()
        if self.transport.stages:
            self._grad_dev.clear()
            self._grad_host.clear()
        if transport:
            self.transport.close()   # last: its pinned pool hands back the blocks dropped above
