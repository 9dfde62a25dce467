"""Every host <-> device movement of a step goes through one small interface, a *transport*:

* ``copy_in(unit, src, dst) -> Handle``: host ``src`` into the device buffer ``dst`` (weights
  into a slot, a boundary activation back to the device), ordered after ``dst``'s last
  :meth:`release`; the handle is *ready* once ``dst`` holds the data;
* ``release(dst) -> Handle``: the compute is done with ``dst`` (the next copy into it waits
  for this point); the handle is *free*;
* ``copy_out(unit, src, dst, after) -> Handle``: device ``src`` into host ``dst`` (a unit's
  gradient, a boundary activation), once the work ``after`` stands for is done; the handle is
  *done* when ``result()`` may read the host tensor;
* ``device_empty(shape, dtype)``: a fresh device buffer from the caching allocator, allocated
  on the compute stream. Its memory may be a block just freed by tensors whose kernels are
  still queued there: a copy into it must be ordered after ``record()`` taken once it exists
  (``after=all_of(..., transport.record())``), or the copy can land before those kernels run
  and be overwritten by them.

A :class:`Handle` is consumed in one of two ways: ``wait()`` orders the calling thread's
compute after it (a stream wait on CUDA: the host does not block), ``result()`` blocks the
calling thread until the transfer is done and returns what it made.

:class:`CudaTransport` maps this onto a host->device and a device->host stream, events and
pinned host buffers. :class:`CpuTransport` (the CPU "device") copies in the calling worker
thread; with ``adversarial=True`` (tests: ``EngineConfig.adversarial_transport`` or the
environment variable ``MEGATRAIN_ADVERSARIAL_TRANSPORT=1``) it follows the same discipline
with teeth: each copy runs late, in a thread of its own, after a random delay; a buffer is
filled with NaN the moment it is released; and a copy into a buffer not yet released raises.
It also plays the GPU's two other actors at their worst: the compute stream runs late (a
``device_empty`` buffer comes with the previous owner's kernels still queued: they write NaN
into it when the compute is next waited for through ``record()``, or, if nothing ordered the
copy after them, just after the copy lands); and a transfer from a host buffer stays in flight
until the handle its ``release`` returned is waited for (a host buffer written before that:
the next transfer from it raises, since on a GPU the copy engine could have read the new bytes).
A missing ``wait`` / ``result`` / ``release`` then shows on CPU as a wrong (NaN) gradient or
an error, as it would on a GPU as a race.

:class:`ShardedTransport` (data parallel, engine/ranks/sharded.py) wraps either: a unit's copy in
all-gathers the ranks' shards into the slot, its gradient's copy out reduce-scatters it and
sends only this rank's shard to the host. Nothing else of the step knows about ranks.
"""
from __future__ import annotations

import contextlib
import os
import random
import threading
import time
from concurrent.futures import Future
from typing import Callable, Dict, Optional

import torch

from ...threads import TRANSPORT_IN, TRANSPORT_OUT, executor
from . import landing
from .landing import LandingRing, chunk_numel, lands_in_chunks
from .pinned import PinnedPool, note_use
from ..units import Unit
from ..tiers.disk_store import aligned_empty

ADVERSARIAL_ENV = "MEGATRAIN_ADVERSARIAL_TRANSPORT"


class TransportError(RuntimeError):
    """A transfer broke the transport's discipline (adversarial mode): a buffer reused before it
    was released."""


class Handle:
    """A transfer that is complete (the CPU transport's ordinary copies: done inline)."""

    def __init__(self, value=None):
        self.value = value

    def wait(self) -> None:
        """Order the calling thread's compute after the transfer."""

    def result(self):
        """Block until the transfer is done; what it made (the host tensor of a copy out)."""
        return self.value

    def done(self) -> bool:
        return True


class FutureHandle(Handle):
    """A transfer running in a worker thread."""

    def __init__(self, future: Future):
        super().__init__()
        self.future = future

    def wait(self) -> None:
        self.future.result()

    def result(self):
        return self.future.result()

    def done(self) -> bool:
        return self.future.done()


class AllOf(Handle):
    """Several transfers: ``wait()`` orders after each, ``result()`` waits for each (the value:
    the first's)."""

    def __init__(self, *handles: Optional[Handle]):
        super().__init__()
        self.handles = [h for h in handles if h is not None]

    def wait(self) -> None:
        for h in self.handles:
            h.wait()

    def result(self):
        out = [h.result() for h in self.handles]
        return out[0] if out else None

    def done(self) -> bool:
        return all(h.done() for h in self.handles)


def all_of(*handles: Optional[Handle]) -> Handle:
    """One handle for ``handles`` (None ones left out)."""
    return AllOf(*handles)


class EventHandle(Handle):
    """A transfer enqueued on a CUDA stream, marked by an event recorded after it."""

    def __init__(self, event, device: torch.device, value=None):
        super().__init__(value)
        self.event = event
        self.device = device

    def wait(self) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.event)

    def result(self):
        self.event.synchronize()
        return self.value

    def done(self) -> bool:
        return self.event.query()


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _prefix(buf: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The first ``like.numel()`` elements of the contiguous ``buf``, in ``like``'s shape."""
    return buf.view(-1)[:like.numel()].view(like.shape)


def _event(timing: bool = False):
    """An event the host may wait on: blocking, so ``synchronize()`` sleeps instead of spinning a
    core that the CPU AdamW wants (``wait_event`` on a stream is the same either way).
    ``timing``: it also takes a timestamp (a copy in's: the compute stream's idle time)."""
    return torch.cuda.Event(blocking=True, enable_timing=timing)


class _Landing:
    """A unit's gradient landing on the host (the pager's landing buffers, engine/transport/landing.py):
    straight into a pinned landing buffer, or -- where that pins less (:func:`.landing.lands_in_chunks`)
    -- into a pageable one through a ring of pinned chunks. Needs ``pinned`` (a PinnedPool),
    ``_pinned_landing``, ``_issue_chunk`` and ``_land_chunked``."""

    def lands_in_chunks(self, largest_numel: int, depth: int = 1) -> bool:
        """Whether gradients of units of up to ``largest_numel`` land in chunks (pinned hosts only)."""
        return bool(self.pinned.pin) and lands_in_chunks(largest_numel, depth)

    def landing_buffer(self, numel: int, chunked: bool = False) -> torch.Tensor:
        """A landing buffer of ``numel`` fp32 elements: pinned (``host_buffer``), or ``chunked``
        pageable and page-aligned, landed into through the ring (made with the first such buffer)."""
        if not chunked:
            return self._pinned_landing(numel)
        if self._ring is None:
            n = chunk_numel(numel)
            self._ring = LandingRing([self.pinned.empty(n) for _ in range(landing.LANDING_RING)], self._issue_chunk)
        buf = aligned_empty(numel)
        self._chunked_keys.add(_key(buf))
        return buf

    def land(self, unit: Optional[Unit], src: torch.Tensor, dst: Optional[torch.Tensor], *, after: Handle,
             reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> Handle:
        """A gradient's copy out into its landing buffer ``dst``: :meth:`copy_out` unless ``dst`` is
        landed into in chunks; then done when this returns (the caller is the gradient thread)."""
        if dst is None or _key(dst) not in self._chunked_keys:
            return self.copy_out(unit, src, dst, after=after, reduce=reduce)
        return Handle(self._land_chunked(src, dst, after, reduce))


class CudaTransport(_Landing):
    """Streams, events and pinned buffers. ``copy_in`` is issued from the pager's copy thread
    or the compute thread, ``copy_out`` from the gradient thread or the compute thread; each
    enqueues on its own stream and records an event after the copy. Host buffers come from a
    :class:`~.pinned.PinnedPool` (counted as the caching host allocator holds them, released on
    :meth:`close`)."""

    stages = True   # a unit's gradient is staged in a device buffer of the pager's before it leaves

    def __init__(self, device: torch.device):
        self.device = device
        self.h2d = torch.cuda.Stream(device)
        self.d2h = torch.cuda.Stream(device)
        self.pinned = PinnedPool(pin=True, device=device)
        self._free: Dict[int, object] = {}   # buffer -> event recorded on the compute stream at its release
        self._lock = threading.Lock()
        # dtype -> [pinned buffer, event after its last copy]: fp32 weights cast for a bf16 slot
        self._cast: Dict[torch.dtype, list] = {}
        self._cast_lock = threading.Lock()
        self._probes: list = []   # (compute stream at a wait for a copy in, the copy's event), not yet read
        self._chunked_keys: set = set()   # landing buffers landed into through the ring (_Landing)
        self._ring: Optional[LandingRing] = None

    # -- the compute stream's idle time (telemetry's "device" stall) ------------------------------
    def probe(self):
        """The compute stream's position now (a timed event), taken before the compute waits for a
        copy in: the stream sits idle from the later of this point and its backlog's end until
        the copy is done (``watch``). The host's own wait for the copy to be issued is in it."""
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def watch(self, probe, handle: Handle) -> None:
        """The compute waited at ``probe`` for ``handle``'s copy (read by :meth:`compute_idle_seconds`)."""
        if isinstance(handle, EventHandle):
            with self._lock:
                self._probes.append((probe, handle.event))

    def compute_idle_seconds(self) -> float:
        """Seconds the compute stream sat idle waiting for copies in, over the watched waits whose
        events are done (those are forgotten; the rest are read by a later call). The host does
        not wait for the GPU here."""
        with self._lock:
            probes, self._probes = self._probes, []
        idle, left = 0.0, []
        with torch.cuda.device(self.device):   # (a reader's thread may be on another device: no context there)
            for reached, done in probes:
                if reached.query() and done.query():
                    idle += max(0.0, reached.elapsed_time(done)) / 1000.0   # ms from the wait to the copy's end
                else:
                    left.append((reached, done))
        if left:
            with self._lock:
                self._probes[:0] = left
        return idle

    def slot_numel(self, unit: Unit) -> int:
        return unit.numel

    def host_buffer(self, numel: int, dtype=torch.float32) -> torch.Tensor:
        """A host buffer whose size varies with the batch (a window's activations): pinned on a
        block of its size class, registered once per class off this thread (``pinned.SizeClasses``)."""
        return self.pinned.recycled(numel, dtype)

    def reserve_host(self, numel: int, dtype, count: int) -> None:
        """``count`` :meth:`host_buffer` blocks of ``numel`` elements registered ahead, in the
        registrar, while the compute goes on (a window's first use of a size class)."""
        self.pinned.reserve(numel * torch.empty((), dtype=dtype).element_size(), count)

    def _pinned_landing(self, numel: int) -> torch.Tensor:
        return self.pinned.empty(numel)   # (exact: the plan counts whole pages)

    def device_empty(self, shape, dtype) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype, device=self.device)

    def record(self) -> Handle:
        """The compute stream's work so far (what a copy out must come after)."""
        ev = _event()
        ev.record(torch.cuda.current_stream(self.device))
        return EventHandle(ev, self.device)

    def copy_in(self, unit: Optional[Unit], src: torch.Tensor, dst: torch.Tensor, *, after: Optional[Handle] = None,
                fill: Optional[Callable[[torch.Tensor], None]] = None) -> Handle:
        """``dst[:src.numel()] <- src`` on the host->device stream (``fill(dst)`` instead: a gather
        into ``dst``), after ``dst``'s release and ``after``. ``src`` may be reused once the
        handle's ``result()`` returned."""
        with self._lock:
            free = self._free.pop(_key(dst), None)
        with torch.cuda.device(self.device), torch.cuda.stream(self.h2d):   # (no context on another GPU)
            if free is not None:
                self.h2d.wait_event(free)
            if after is not None:
                after.wait()
            if fill is not None:
                fill(dst)
            elif src.dtype != dst.dtype and not src.is_cuda:
                return self._cast_in(src, dst)
            else:
                _prefix(dst, src).copy_(src, non_blocking=True)
            ev = _event(timing=True)
            ev.record(self.h2d)
        if not src.is_cuda:   # a registered source is unregistered only after this copy
            note_use(src, ev, "h2d")
        return EventHandle(ev, self.device, dst)

    def _cast_in(self, src: torch.Tensor, dst: torch.Tensor) -> Handle:
        """fp32 host weights into a bf16 slot: cast on the host into a pinned buffer, then copied.
        Only the disk tier's loads come here (its staging buffers hold fp32): on the RAM tier a
        load copies the unit's bf16 shadow, written by its update (``host_store.HostStore``). (``copy_(fp32 host, non_blocking=True)`` into bf16 makes an fp32 unit-sized temporary on
        the device and sends 4 bytes a parameter over the link.) Called on the h2d stream; the
        buffer is rewritten only once its last copy is done (one per dtype: the pager's copy
        thread waits for each copy before the next)."""
        n = src.numel()
        with self._cast_lock:
            entry = self._cast.get(dst.dtype)
            if entry is not None and entry[1] is not None:
                entry[1].synchronize()   # the host writes it: its last copy must be done
            if entry is None or entry[0].numel() < n:
                entry = self._cast[dst.dtype] = [self.pinned.empty(n, dst.dtype), None]
            stage = entry[0][:n]
            stage.copy_(src.reshape(-1))
            _prefix(dst, src).copy_(stage.view(src.shape), non_blocking=True)
            ev = _event(timing=True)
            ev.record(self.h2d)
            entry[1] = ev
            note_use(entry[0], ev, "h2d")
        return EventHandle(ev, self.device, dst)

    def _issue_chunk(self, chunk: torch.Tensor, src: torch.Tensor):
        """One chunk's device->host copy on the d2h stream (the caller is in its context): the event after it."""
        chunk.copy_(src, non_blocking=True)
        ev = _event()
        ev.record(self.d2h)
        note_use(chunk, ev, "d2h")   # (the ring's chunks are unregistered only after their copies)
        return ev

    @contextlib.contextmanager
    def _on_d2h(self, src: torch.Tensor, after: Handle, reduce):
        """In the d2h stream's context (this device), after ``after``: the tensor to copy out --
        ``reduce(src)`` (a reduce-scatter, on this stream), or ``src`` kept alive until the
        stream's copies of it are done (the caching allocator is told the stream uses it)."""
        with torch.cuda.device(self.device), torch.cuda.stream(self.d2h):
            after.wait()
            if reduce is not None:
                src = reduce(src)
            else:
                src.record_stream(self.d2h)
            yield src

    def _land_chunked(self, src: torch.Tensor, dst: torch.Tensor, after: Handle, reduce) -> torch.Tensor:
        """``src`` into pageable ``dst`` through the ring: the chunks cross on the d2h stream, each
        copied out here once done."""
        with self._on_d2h(src, after, reduce) as src:
            return self._ring.land(src, dst)

    def release(self, dst: torch.Tensor) -> Handle:
        ev = _event()
        ev.record(torch.cuda.current_stream(self.device))
        if dst.is_cuda:   # (a host buffer's next copy out is ordered by the caller, with this handle)
            with self._lock:
                self._free[_key(dst)] = ev
        return EventHandle(ev, self.device)

    def copy_out(self, unit: Optional[Unit], src: torch.Tensor, dst: torch.Tensor, *, after: Handle,
                 reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> Handle:
        """``dst <- src`` (``reduce(src)`` first: a reduce-scatter, on this stream) on the
        device->host stream, after ``after``. ``src`` stays alive until the copy is done (the
        caching allocator is told the stream uses it)."""
        with self._on_d2h(src, after, reduce) as src:
            out = _prefix(dst, src)
            out.copy_(src, non_blocking=True)
            ev = _event()
            ev.record(self.d2h)
        note_use(dst, ev, "d2h")   # a registered target is unregistered only after this copy
        return EventHandle(ev, self.device, out)

    def close(self) -> None:
        with self._lock:
            self._free.clear()
        self._ring = None
        self._chunked_keys.clear()
        self.pinned.close()


#: The adversarial mode's latest landing of a copy (seconds, uniform from 0): small, so the
#: parity suites under it stay quick; a test that must see a missing wait sets it larger.
ADVERSARIAL_MAX_DELAY_S = 0.003


class _LateCompute(Handle):
    """The adversarial transport's compute stream at a ``record()``: the previous owners' kernels
    still queued on the ``device_empty`` buffers handed out so far run (write NaN) when this is
    waited for."""

    def __init__(self, transport: "CpuTransport", keys):
        super().__init__()
        self.transport, self.keys = transport, keys

    def wait(self) -> None:
        self.transport._run_late(self.keys)

    def result(self):
        self.wait()


class _InFlight(Handle):
    """A host buffer's release: the transfer that read it is in flight until this is waited for."""

    def __init__(self, transport: "CpuTransport", key: int):
        super().__init__()
        self.transport, self.key = transport, key

    def wait(self) -> None:
        with self.transport._lock:
            self.transport._in_flight.pop(self.key, None)

    def result(self):
        self.wait()

    def done(self) -> bool:
        return self.key not in self.transport._in_flight


class _DoneCopy:
    """A CPU chunk copy: done when issued."""

    @staticmethod
    def synchronize() -> None:
        pass


class CpuTransport(_Landing):
    """The CPU "device": slots are host tensors and a copy is a memcpy. Ordinary mode: each copy
    runs inline in the calling (worker) thread and its handle is complete. Adversarial mode:
    see the module's docstring. (Its gradients land in chunks only where its pool pins: tests
    with a fake registration, the CUDA path's logic on the CPU.)"""

    stages = False   # a unit's gradient sum already is host memory: it leaves as it is

    def __init__(self, *, adversarial: bool = False, seed: int = 0, max_delay_s: Optional[float] = None):
        self.device = torch.device("cpu")
        self.adversarial = adversarial
        self.max_delay_s = ADVERSARIAL_MAX_DELAY_S if max_delay_s is None else max_delay_s
        self.pinned = PinnedPool(pin=False)
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._state: Dict[int, str] = {}   # buffer -> "filling" | "filled" (absent: free)
        self._late: Dict[int, torch.Tensor] = {}   # device_empty buffer -> its previous owner's kernels pending
        self._sources: Dict[int, torch.Tensor] = {}   # host buffers copied in from (activations), held
        self._in_flight: Dict[int, torch.Tensor] = {}   # released host buffer -> itself, while a transfer reads it
        self._in = self._out = None
        if adversarial:   # one thread per direction: each keeps its order (collectives in order)
            self._in = executor(TRANSPORT_IN)
            self._out = executor(TRANSPORT_OUT)
        self._chunked_keys: set = set()   # landing buffers landed into through the ring (_Landing)
        self._ring: Optional[LandingRing] = None
        self.poisoned = 0   # buffers poisoned at their release (adversarial)
        self.late_writes = 0   # previous owners' kernels run into device_empty buffers (adversarial)

    def slot_numel(self, unit: Unit) -> int:
        return unit.numel

    def host_buffer(self, numel: int, dtype=torch.float32) -> torch.Tensor:
        return self.pinned.empty(numel, dtype)

    def reserve_host(self, numel: int, dtype, count: int) -> None:
        """Nothing to register ahead: host buffers here are plain memory."""

    def _pinned_landing(self, numel: int) -> torch.Tensor:
        return self.host_buffer(numel)

    def device_empty(self, shape, dtype) -> torch.Tensor:
        t = torch.empty(tuple(shape), dtype=dtype)
        if self.adversarial and t.is_floating_point():   # a block whose last owner's kernels are still queued
            with self._lock:
                self._late[_key(t)] = t
        return t

    def probe(self):
        """No stream: the compute is the waiting thread (its host wait is the stall)."""
        return None

    def record(self) -> Handle:
        if not self.adversarial:
            return Handle()
        with self._lock:
            return _LateCompute(self, list(self._late))

    def _run_late(self, keys) -> None:
        """The compute stream reaches the kernels queued on these buffers: they write NaN."""
        for k in keys:
            with self._lock:
                t = self._late.pop(k, None)
            if t is not None:
                t.fill_(float("nan"))
                self.late_writes += 1

    def _delay(self) -> None:
        with self._lock:
            d = self._rng.uniform(0.0, self.max_delay_s)
        time.sleep(d)

    def _check_source(self, src: torch.Tensor) -> None:
        """A host buffer released after a copy from it, written since, before its free handle was
        waited for: on a GPU that copy could have read the new bytes."""
        with self._lock:
            held = self._in_flight.get(_key(src))
        if held is not None and not torch.isnan(held).all():
            raise TransportError("a host buffer was written while the transfer that read it may still be in "
                                 "flight: wait for the handle its release() returned (result()) before reusing it")

    def copy_in(self, unit: Optional[Unit], src: torch.Tensor, dst: torch.Tensor, *, after: Optional[Handle] = None,
                fill: Optional[Callable[[torch.Tensor], None]] = None) -> Handle:
        # a slot has a life of fills and releases; an activation's device copy is fresh (its
        # address may be a freed one's): only the slots are tracked
        tracked = self.adversarial and unit is not None

        def run():
            try:
                if self.adversarial:
                    self._delay()
                if after is not None:
                    after.result()
                if fill is not None:
                    fill(dst)
                else:
                    _prefix(dst, src).copy_(src)
                if self.adversarial:   # kernels the copy was not ordered after run now, over it
                    self._run_late([_key(dst)])
            finally:
                if tracked:
                    with self._lock:
                        self._state[_key(dst)] = "filled"
            return dst

        if not self.adversarial:
            return Handle(run())
        if unit is None and fill is None:
            self._check_source(src)
            with self._lock:
                self._sources[_key(src)] = src
        with self._lock:
            if tracked and self._state.get(_key(dst)) is not None:
                raise TransportError(f"copy into a buffer not released yet ({self._state[_key(dst)]}, "
                                     f"{'unit ' + unit.name if unit is not None else 'an activation'}): a "
                                     "missing release(), or a release before its last use")
            if tracked:
                self._state[_key(dst)] = "filling"
        return FutureHandle(self._in.submit(run))

    def release(self, dst: torch.Tensor) -> Handle:
        if self.adversarial:
            with self._lock:
                state = self._state.pop(_key(dst), None)
                source = _key(dst) in self._sources
            if state == "filling":
                raise TransportError("release of a buffer whose copy in is still running: a missing wait()")
            if dst.is_floating_point():
                dst.fill_(float("nan"))   # whatever reads it after its release reads NaN
                self.poisoned += 1
            if source:   # a host buffer copied from: in flight until the handle is waited for
                with self._lock:
                    self._in_flight[_key(dst)] = dst
                return _InFlight(self, _key(dst))
        return Handle()

    @staticmethod
    def _issue_chunk(chunk: torch.Tensor, src: torch.Tensor) -> _DoneCopy:
        chunk.copy_(src)
        return _DoneCopy()

    def _land_chunked(self, src: torch.Tensor, dst: torch.Tensor, after: Handle, reduce) -> torch.Tensor:
        after.result()
        return self._ring.land(reduce(src) if reduce is not None else src, dst)

    def copy_out(self, unit: Optional[Unit], src: torch.Tensor, dst: Optional[torch.Tensor], *, after: Handle,
                 reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> Handle:
        """``dst`` None: ``src`` already is host memory and is handed over as it is."""
        def run():
            if self.adversarial:
                self._delay()
            after.result()
            s = reduce(src) if reduce is not None else src
            if dst is None:
                return s
            out = _prefix(dst, s)
            out.copy_(s)
            return out

        if not self.adversarial:
            return Handle(run())
        if dst is not None:
            with self._lock:
                reading = _key(dst) in self._in_flight
            if reading:
                raise TransportError("a copy out into a host buffer that a transfer may still be reading: wait "
                                     "for the handle its release() returned before the copy out")
        return FutureHandle(self._out.submit(run))

    def close(self) -> None:
        for ex in (self._in, self._out):
            if ex is not None:
                ex.shutdown(wait=True)
        with self._lock:
            self._late.clear()
            self._in_flight.clear()
            self._sources.clear()


class ShardedTransport:
    """Data parallel at the two ends of a unit's trip (as FSDP2's ``fully_shard``): its copy in
    all-gathers every rank's shard into the slot (on the copy stream), its gradient's copy out
    reduce-scatters the whole unit's gradient (padded) and sends this rank's shard to the host."""

    def __init__(self, inner, sharded):
        self.inner = inner
        self.sharded = sharded
        self.device = inner.device
        self.stages = inner.stages
        self._pad: Optional[torch.Tensor] = None   # the reduce-scatter's padded input (an unstaged gradient)
        d2h = getattr(inner, "d2h", None)
        if d2h is not None and sharded.reduce_dist is not sharded.dist:
            # the finiteness vote follows its gradient's reduce-scatter on the d2h stream (not the
            # legacy default stream, behind the compute backlog)
            sharded.reduce_dist.host_stream = d2h

    def announce_in(self, unit: Unit) -> list:
        """The program thread: ``unit``'s copy in (a gather) is coming; its tickets
        (engine/transport/issuer.py: the workers' collectives are issued in the program's order)."""
        return self.sharded.announce_gather(unit)

    def announce_out(self, unit: Unit, vote: bool = False) -> list:
        """The program thread: ``unit``'s gradient copy out (a reduce-scatter, and with ``vote``
        the finiteness vote its arrival makes) is coming; its tickets."""
        return self.sharded.announce_grad(unit, vote)

    def slot_numel(self, unit: Unit) -> int:
        return self.sharded.padded_numel(unit)

    def host_buffer(self, numel: int, dtype=torch.float32) -> torch.Tensor:
        return self.inner.host_buffer(numel, dtype)

    def reserve_host(self, numel: int, dtype, count: int) -> None:
        self.inner.reserve_host(numel, dtype, count)

    def lands_in_chunks(self, largest_numel: int, depth: int = 1) -> bool:
        return self.inner.lands_in_chunks(largest_numel, depth)

    def landing_buffer(self, numel: int, chunked: bool = False) -> torch.Tensor:
        return self.inner.landing_buffer(numel, chunked)

    def land(self, unit: Optional[Unit], src: torch.Tensor, dst: Optional[torch.Tensor], *, after: Handle,
             reduce=None) -> Handle:
        if unit is None:
            return self.inner.land(unit, src, dst, after=after, reduce=reduce)
        return self.inner.land(unit, src, dst, after=after, reduce=lambda g: self._reduce(unit, g))

    def record(self) -> Handle:
        return self.inner.record()

    def probe(self):
        return self.inner.probe()

    def watch(self, probe, handle: Handle) -> None:
        self.inner.watch(probe, handle)

    def compute_idle_seconds(self) -> float:
        return self.inner.compute_idle_seconds()

    def device_empty(self, shape, dtype) -> torch.Tensor:
        return self.inner.device_empty(shape, dtype)

    @property
    def pinned(self):
        return self.inner.pinned

    def release(self, dst: torch.Tensor) -> Handle:
        return self.inner.release(dst)

    def copy_in(self, unit: Optional[Unit], src: torch.Tensor, dst: torch.Tensor, *, after: Optional[Handle] = None,
                fill=None) -> Handle:
        if unit is None:   # not a unit's weights (an activation): rank-local
            return self.inner.copy_in(unit, src, dst, after=after, fill=fill)
        return self.inner.copy_in(unit, src, dst, after=after,
                                  fill=lambda d: self.sharded.gather(unit, src, out=d, announced=True))

    def copy_out(self, unit: Optional[Unit], src: torch.Tensor, dst: Optional[torch.Tensor], *, after: Handle,
                 reduce=None) -> Handle:
        if unit is None:
            return self.inner.copy_out(unit, src, dst, after=after, reduce=reduce)
        return self.inner.copy_out(unit, src, dst, after=after, reduce=lambda g: self._reduce(unit, g))

    def _reduce(self, unit: Unit, grad: torch.Tensor) -> torch.Tensor:
        padded = self.sharded.padded_numel(unit)
        flat = grad.view(-1)
        if flat.numel() != padded:   # not staged: padded here, in one reused buffer (one thread issues these)
            if self._pad is None:

                self._pad = aligned_empty(max(self.sharded.padded_numel(u) for u in self.sharded.units))
            buf = self._pad[:padded]
            buf[:unit.numel].copy_(flat[:unit.numel])
            buf[unit.numel:].zero_()
            flat = buf
        return self.sharded.reduce_grad(unit, flat, announced=True)

    def close(self) -> None:
        self.inner.close()


def make_transport(device: torch.device, *, adversarial: Optional[bool] = None, sharded=None):
    """The transport for ``device`` (``adversarial`` None: from MEGATRAIN_ADVERSARIAL_TRANSPORT;
    CPU only); wrapped by a :class:`ShardedTransport` with ``sharded`` (engine/ranks/sharded.py)."""
    if adversarial is None:
        adversarial = os.environ.get(ADVERSARIAL_ENV, "") not in ("", "0")
    base = CudaTransport(device) if device.type == "cuda" else CpuTransport(adversarial=adversarial)
    return ShardedTransport(base, sharded) if sharded is not None else base
