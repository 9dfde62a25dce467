"""Every host <-> device movement of a step goes through one small interface, a *transport*:

* ``copy_in(unit, src, dst) -> Handle``: host ``src`` into the device buffer ``dst`` (weights
  into a slot, a boundary activation back to the device), ordered after ``dst``'s last
  :meth:`release`; the handle is *ready* once ``dst`` holds the data;
* ``release(dst) -> Handle``: the compute is done with ``dst`` (the next copy into it waits
  for this point); the handle is *free*;
* ``copy_out(unit, src, dst, after) -> Handle``: device ``src`` into host ``dst`` (a unit's
  gradient, a boundary activation), once the work ``after`` stands for is done; the handle is
  *done* when ``result()`` may read the host tensor.

A :class:`Handle` is consumed in one of two ways: ``wait()`` orders the calling thread's
compute after it (a stream wait on CUDA: the host does not block), ``result()`` blocks the
calling thread until the transfer is done and returns what it made.

:class:`CudaTransport` maps this onto a host->device and a device->host stream, events and
pinned host buffers. :class:`CpuTransport` (the CPU "device") copies in the calling worker
thread; with ``adversarial=True`` (tests: ``EngineConfig.adversarial_transport`` or the
environment variable ``MEGATRAIN_ADVERSARIAL_TRANSPORT=1``) it follows the same discipline
with teeth: each copy runs late, in a thread of its own, after a random delay; a buffer is
filled with NaN the moment it is released; and a copy into a buffer not yet released raises.
A missing ``wait`` / ``result`` / ``release`` then shows on CPU as a wrong (NaN) gradient or
an error, as it would on a GPU as a race.

:class:`ShardedTransport` (data parallel, engine/sharded.py) wraps either: a unit's copy in
all-gathers the ranks' shards into the slot, its gradient's copy out reduce-scatters it and
sends only this rank's shard to the host. Nothing else of the step knows about ranks.
"""
from __future__ import annotations

import os
import random
import threading
import time
from concurrent.futures import Future
from typing import Callable, Dict, Optional

import torch

from ..threads import TRANSPORT_IN, TRANSPORT_OUT, executor
from .units import Unit

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


class CudaTransport:
    """Streams, events and pinned buffers. ``copy_in`` is issued from the pager's copy thread
    or the compute thread, ``copy_out`` from the gradient thread or the compute thread; each
    enqueues on its own stream and records an event after the copy."""

    stages = True   # a unit's gradient is staged in a device buffer of the pager's before it leaves

    def __init__(self, device: torch.device):
        self.device = device
        self.h2d = torch.cuda.Stream(device)
        self.d2h = torch.cuda.Stream(device)
        self._free: Dict[int, object] = {}   # buffer -> event recorded on the compute stream at its release
        self._lock = threading.Lock()

    def slot_numel(self, unit: Unit) -> int:
        return unit.numel

    def host_buffer(self, numel: int, dtype=torch.float32) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype).pin_memory()

    def record(self) -> Handle:
        """The compute stream's work so far (what a copy out must come after)."""
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return EventHandle(ev, self.device)

    def copy_in(self, unit: Optional[Unit], src: torch.Tensor, dst: torch.Tensor, *, after: Optional[Handle] = None,
                fill: Optional[Callable[[torch.Tensor], None]] = None) -> Handle:
        """``dst[:src.numel()] <- src`` on the host->device stream (``fill(dst)`` instead: a gather
        into ``dst``), after ``dst``'s release and ``after``. ``src`` may be reused once the
        handle's ``result()`` returned."""
        with self._lock:
            free = self._free.pop(_key(dst), None)
        with torch.cuda.stream(self.h2d):
            if free is not None:
                self.h2d.wait_event(free)
            if after is not None:
                after.wait()
            if fill is not None:
                fill(dst)
            else:
                _prefix(dst, src).copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.h2d)
        return EventHandle(ev, self.device, dst)

    def release(self, dst: torch.Tensor) -> Handle:
        ev = torch.cuda.Event()
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
        with torch.cuda.stream(self.d2h):
            after.wait()
            if reduce is not None:
                src = reduce(src)
            else:
                src.record_stream(self.d2h)
            out = _prefix(dst, src)
            out.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.d2h)
        return EventHandle(ev, self.device, out)

    def close(self) -> None:
        with self._lock:
            self._free.clear()


#: The adversarial mode's latest landing of a copy (seconds, uniform from 0): small, so the
#: parity suites under it stay quick; a test that must see a missing wait sets it larger.
ADVERSARIAL_MAX_DELAY_S = 0.003


class CpuTransport:
    """The CPU "device": slots are host tensors and a copy is a memcpy. Ordinary mode: each copy
    runs inline in the calling (worker) thread and its handle is complete. Adversarial mode:
    see the module's docstring."""

    stages = False   # a unit's gradient sum already is host memory: it leaves as it is

    def __init__(self, *, adversarial: bool = False, seed: int = 0, max_delay_s: Optional[float] = None):
        self.device = torch.device("cpu")
        self.adversarial = adversarial
        self.max_delay_s = ADVERSARIAL_MAX_DELAY_S if max_delay_s is None else max_delay_s
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._state: Dict[int, str] = {}   # buffer -> "filling" | "filled" (absent: free)
        self._in = self._out = None
        if adversarial:   # one thread per direction: each keeps its order (collectives in order)
            self._in = executor(TRANSPORT_IN)
            self._out = executor(TRANSPORT_OUT)
        self.poisoned = 0   # buffers poisoned at their release (adversarial)

    def slot_numel(self, unit: Unit) -> int:
        return unit.numel

    def host_buffer(self, numel: int, dtype=torch.float32) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def record(self) -> Handle:
        return Handle()

    def _delay(self) -> None:
        with self._lock:
            d = self._rng.uniform(0.0, self.max_delay_s)
        time.sleep(d)

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
            finally:
                if tracked:
                    with self._lock:
                        self._state[_key(dst)] = "filled"
            return dst

        if not self.adversarial:
            return Handle(run())
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
            if state == "filling":
                raise TransportError("release of a buffer whose copy in is still running: a missing wait()")
            if dst.is_floating_point():
                dst.fill_(float("nan"))   # whatever reads it after its release reads NaN
                self.poisoned += 1
        return Handle()

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
        return FutureHandle(self._out.submit(run))

    def close(self) -> None:
        for ex in (self._in, self._out):
            if ex is not None:
                ex.shutdown(wait=True)


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

    def slot_numel(self, unit: Unit) -> int:
        return self.sharded.padded_numel(unit)

    def host_buffer(self, numel: int, dtype=torch.float32) -> torch.Tensor:
        return self.inner.host_buffer(numel, dtype)

    def record(self) -> Handle:
        return self.inner.record()

    def release(self, dst: torch.Tensor) -> Handle:
        return self.inner.release(dst)

    def copy_in(self, unit: Optional[Unit], src: torch.Tensor, dst: torch.Tensor, *, after: Optional[Handle] = None,
                fill=None) -> Handle:
        if unit is None:   # not a unit's weights (an activation): rank-local
            return self.inner.copy_in(unit, src, dst, after=after, fill=fill)
        return self.inner.copy_in(unit, src, dst, after=after,
                                  fill=lambda d: self.sharded.gather(unit, src, out=d))

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
                from .disk_store import aligned_empty

                self._pad = aligned_empty(max(self.sharded.padded_numel(u) for u in self.sharded.units))
            buf = self._pad[:padded]
            buf[:unit.numel].copy_(flat[:unit.numel])
            buf[unit.numel:].zero_()
            flat = buf
        return self.sharded.reduce_grad(unit, flat)

    def close(self) -> None:
        self.inner.close()


def make_transport(device: torch.device, *, adversarial: Optional[bool] = None, sharded=None):
    """The transport for ``device`` (``adversarial`` None: from MEGATRAIN_ADVERSARIAL_TRANSPORT;
    CPU only); wrapped by a :class:`ShardedTransport` with ``sharded`` (engine/sharded.py)."""
    if adversarial is None:
        adversarial = os.environ.get(ADVERSARIAL_ENV, "") not in ("", "0")
    base = CudaTransport(device) if device.type == "cuda" else CpuTransport(adversarial=adversarial)
    return ShardedTransport(base, sharded) if sharded is not None else base
