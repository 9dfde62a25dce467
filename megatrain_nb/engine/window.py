"""An accumulation window's layout (:func:`plan_for`) and where its layer-boundary
activations wait (:class:`BoundaryStore`): the input of every k-th layer, per micro-batch,
between the forward and the backward of a layer-major step (step.py).
"""
from __future__ import annotations

import math
import threading
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from typing import Dict, List, Optional, Tuple

import torch

from .planning.planner import WindowPlan, engine_window_plan
from .transport.transport import all_of
from .planning.planner import GiB, LayerDims
from .memory import device_capacity
from .tiers.disk_store import aligned_empty  # page-aligned: direct I/O


class BoundaryStore:
    """Layer-boundary activations of a window, keyed (layer index, micro-batch), on one tier:

    * "device": kept as they are;
    * "host": copied out to a recycled host buffer (pinned on CUDA) by the transport
      (engine/transport/transport.py) after the compute that made them, and copied back in by the
      backward, which waits for the copy before it reads the activation;
    * "disk": copied out to a recycled host buffer and written behind through the engine's
      :class:`DiskStore`; the backward pops them in its order (layers descending, micro-batches
      ascending), so each pop starts the reads of the next ``READ_AHEAD`` keys, and a read key's
      file is deleted (the disk holds only what the backward has still to read). RAM holds only
      the writes and reads in flight.

    A host buffer goes back to the free list with the transport's free handle of its last read
    (``release``): its next copy out is ordered after it.
    """

    READ_AHEAD = 4       # disk reads started ahead of the backward
    WRITES_IN_FLIGHT = 4  # disk writes behind the forward before it waits
    KEEP_PASSES = 2       # a shape's recycled buffers are kept while one of the last passes used it

    def __init__(self, device: torch.device, transport, disk=None):
        self.device = device
        self.transport = transport
        self.disk = disk
        self.tier = "device"
        self._t: Dict[Tuple[int, int], object] = {}
        # Host buffers recycled across steps (pinning is slow), each with the handle of its
        # last use (None: never used).
        self._free: Dict[tuple, List[tuple]] = {}
        self._passes = 0                       # start() calls so far
        self._used: Dict[tuple, int] = {}      # (shape, dtype) -> the pass that last took a buffer of it
        self._lock = threading.Lock()
        self.bytes = {"device": 0, "host": 0, "disk": 0}
        self.peak = {"device": 0, "host": 0, "disk": 0}
        self.disk_ops = {"writes": 0, "reads": 0}   # of the last window
        self._writes: List[Future] = []
        self._order: Optional[List[Tuple[int, int]]] = None   # the backward's pop order (disk)
        self._reads: Dict[Tuple[int, int], Tuple[Future, torch.Tensor]] = {}

    def start(self, tier: str) -> None:
        if tier == "disk" and self.disk is None:
            raise ValueError("boundary activations on the disk tier need an offload_dir (the engine's disk tier)")
        self.clear()
        self._drop_stale()
        self.tier = tier
        self.peak = {"device": 0, "host": 0, "disk": 0}
        self.disk_ops = {"writes": 0, "reads": 0}

    def expect(self, activations, count: int) -> None:
        """The window will :meth:`put` ``count`` activations like each of ``activations`` (one per
        micro-batch; tensors or (shape, dtype)): on the host tier, the buffers the free list
        lacks are registered ahead in the transport's registrar, so the puts' first use of a size
        class does not register on the compute thread (issue 45 item 4)."""
        if self.tier != "host" or count <= 0:
            return
        need: Dict[tuple, int] = {}
        for a in activations:
            shape, dtype = (tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else (tuple(a[0]), a[1])
            need[(shape, dtype)] = need.get((shape, dtype), 0) + count
        for (shape, dtype), n in need.items():
            with self._lock:
                n -= len(self._free.get((shape, dtype), ()))
            if n > 0:
                self.transport.reserve_host(math.prod(shape), dtype, n)

    def _drop_stale(self) -> None:
        """A new pass: recycled buffers of shapes none of the last KEEP_PASSES passes used are
        freed (variable sequence lengths would otherwise keep a pinned set per length for good).
        Their last transfers are done: clear() waited for the disk's, and a pinned block freed
        while a copy still reads it is held back by the caching host allocator (a registered
        one, ``pinned.pinned_empty``, waits for its device before it is unregistered and freed)."""
        with self._lock:
            self._passes += 1
            for key in [k for k in self._free if self._passes - self._used.get(k, 0) > self.KEEP_PASSES]:
                del self._free[key]

    def _buffer(self, shape, dtype) -> Tuple[torch.Tensor, object]:
        """A host buffer and the handle of its last use (None: new)."""
        with self._lock:
            self._used[(tuple(shape), dtype)] = self._passes
            free = self._free.get((tuple(shape), dtype))
            if free:   # the oldest: its last transfer is the likeliest to be done (a disk read waits for it)
                return free.pop(0)
        if self.tier == "disk":
            return aligned_empty(tuple(shape), dtype), None
        return self.transport.host_buffer(math.prod(shape), dtype).view(tuple(shape)), None

    def _recycle(self, t: torch.Tensor, last=None) -> None:
        with self._lock:   # also from the disk workers (a write's buffer, once written)
            self._free.setdefault((tuple(t.shape), t.dtype), []).append((t, last))

    def _out(self, t: torch.Tensor, h: torch.Tensor, last):
        """Copy the activation ``t`` out into host buffer ``h`` (after ``h``'s last use and the
        compute so far): the transport's done handle."""
        if last is not None:
            last.wait()
        return self.transport.copy_out(None, t, h, after=self.transport.record())

    def _in(self, h: torch.Tensor, after=None) -> torch.Tensor:
        """``h`` copied back to the device, waited for; ``h`` is released and recycled.

        ``out`` is allocated on the compute stream: the caching allocator may hand back a block
        that tensors freed a moment ago still have kernels queued on. The copy runs on the
        host->device stream, so it is ordered after the compute so far (``record()`` taken once
        ``out`` exists), not only after ``after``; the compute waits for the copy at once anyway."""
        out = self.transport.device_empty(h.shape, h.dtype)
        ready = self.transport.copy_in(None, h, out, after=all_of(after, self.transport.record()))
        ready.wait()
        self._recycle(h, self.transport.release(h))
        return out

    @staticmethod
    def _key(key) -> str:
        return f"boundary-{key[0]:05d}-{key[1]:05d}"

    def put(self, key, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        if self.tier == "host":
            h, last = self._buffer(t.shape, t.dtype)
            t = (h, self._out(t, h, last))
        elif self.tier == "disk":
            h, last = self._buffer(t.shape, t.dtype)
            self._out(t, h, last).result()   # written by another thread: done first
            fut = self.disk.write(self._key(key), {"h": h})
            fut.add_done_callback(lambda _f, h=h: self._recycle(h))
            self._writes = [f for f in self._writes if not f.done()] + [fut]
            if len(self._writes) > self.WRITES_IN_FLIGHT:   # back-pressure: RAM holds a few writes
                futures_wait(self._writes[:-self.WRITES_IN_FLIGHT])
            self.disk_ops["writes"] += 1
            t = (tuple(t.shape), t.dtype, fut)
        self._t[key] = t
        self.bytes[self.tier] += n
        self.peak[self.tier] = max(self.peak[self.tier], self.bytes[self.tier])

    def _read(self, k, urgent: bool = False) -> None:
        shape, dtype, _ = self._t[k]
        buf, last = self._buffer(shape, dtype)
        if last is not None:   # the disk read writes it from the host: its last transfer is done first
            last.result()
        self._reads[k] = (self.disk.read(self._key(k), {"h": buf}, urgent=urgent), buf)
        self.disk_ops["reads"] += 1

    def _read_ahead(self) -> None:
        """Keep READ_AHEAD reads going, in the backward's order."""
        if self._order is None:
            self._order, self._pos = sorted(self._t, key=lambda k: (-k[0], k[1])), 0
        while self._pos < len(self._order) and len(self._reads) < self.READ_AHEAD:
            k = self._order[self._pos]
            self._pos += 1
            if k in self._t and k not in self._reads:
                self._read(k)

    def pop(self, key) -> torch.Tensor:
        if self.tier == "disk":
            self._read_ahead()
            if key not in self._reads:   # out of the backward's order: read it now
                self._read(key, urgent=True)
            fut, buf = self._reads.pop(key)
            self._t.pop(key)
            fut.result()
            self.disk.delete(self._key(key))
            self.bytes["disk"] -= buf.numel() * buf.element_size()
            out = self._in(buf)
            self._read_ahead()
            return out
        t = self._t.pop(key)
        if self.tier == "host":
            h, done = t
            self.bytes["host"] -= h.numel() * h.element_size()
            return self._in(h, after=done)
        self.bytes[self.tier] -= t.numel() * t.element_size()
        return t

    def close(self) -> None:
        """The engine closes: the window's activations and every recycled host buffer dropped
        (before the transport hands its pinned blocks back)."""
        self.clear()
        with self._lock:
            self._free.clear()

    def free_bytes(self) -> int:
        """Recycled host buffers kept for the next window."""
        with self._lock:
            return sum(t.numel() * t.element_size() for ts in self._free.values() for t, _ in ts)

    def clear(self) -> None:
        """Drop the window's activations (after a window, or a failed one): disk operations in
        flight finish and the tier's files are removed."""
        if self.tier == "disk" and self.disk is not None:
            futures_wait(self._writes + [f for f, _ in self._reads.values()])
            for f, buf in self._reads.values():
                self._recycle(buf)
            for k in list(self._t):
                try:
                    self.disk.delete(self._key(k))
                except Exception:  # noqa: BLE001 - a failed write left no file
                    pass
        if self.tier == "host":   # (a failed window) each copy out done before its buffer is reused
            for h, done in list(self._t.values()):
                try:
                    done.result()
                except Exception:  # noqa: BLE001 - the window's error is the one reported
                    pass
                self._recycle(h)
        self._writes, self._reads, self._order = [], {}, None
        self._t.clear()
        self.bytes = {"device": 0, "host": 0, "disk": 0}


def plan_for(batches, *, plan, model_config, config, num_layers: int, device: torch.device) -> WindowPlan:
    """The layout a window of prepared ``(ids, am, labels)`` micro-batches gets: layer-major
    when their boundary activations fit the device budget, else host RAM, else split."""
    tokens = max(int(b[0].numel()) for b in batches)
    if plan.longest_seq is not None and config.max_vram_gb and tokens > plan.longest_seq:
        raise ValueError(_length_refusal(plan, config, model_config, tokens))
    cap = None
    if device.type == "cuda" and not config.max_vram_gb:   # what is free (mem_get_info), less a headroom

        cap = device_capacity(device)
    return engine_window_plan(plan, model_config, config, num_layers,
                              tokens=tokens, micro_batches=len(batches),
                              device_capacity=cap)


def _length_refusal(plan, config, model_config, tokens: int) -> str:
    """A micro-batch longer than the device budget holds (``plan.longest_seq``), with the numbers."""

    cb = 2 if config.precision == "bf16" else 4
    mlp = min(tokens, plan.tile_tokens) if plan.tile_tokens else tokens
    per_token = LayerDims.of(model_config).work_bytes(tokens, mlp, cb) / tokens   # (the planner's count)
    tile = f"in tiles of {plan.tile_tokens:,} tokens" if plan.tile_tokens else "untiled"
    slots = (f"keep 2 layer slots (it holds {plan.layer_slots}: overrides={{'device_slots': 2}} leaves the "
             "activations more room), " if plan.layer_slots > 2 else "")
    return (f"a micro-batch of {tokens:,} tokens does not fit max_vram_gb={config.max_vram_gb}: the device "
            f"holds weights slots {plan.device['weights'] / GiB:.2f} GiB ({plan.layer_slots} layer slots) and "
            f"gradient buffers {plan.device['grads'] / GiB:.2f} GiB, and one layer's working set takes about "
            f"{per_token / 1024:.1f} KiB per token (its MLP {tile}; boundary activations may wait in host RAM or on "
            f"disk), so the longest that fits is {plan.longest_seq:,} tokens: shorten the rows (or the batch), "
            f"{slots}or raise max_vram_gb")
