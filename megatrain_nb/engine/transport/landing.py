"""Gradients landing on the host through a bounded ring of pinned chunks (issue 45 item 4).

A unit's fp32 gradient sum leaves the device into a host buffer where its update then runs (the
pager's landing buffers, ``pager.staging_buffers`` of them, each the largest unit's size). Pinned,
those buffers are 4 B/param of the largest unit each, locked for the life of the run: 1.6 GB for
Llama-2-7B's two 202M-parameter layers, 0.24 B/param over the model. Pinned is only what a DMA
copy must read or write; the landing buffers themselves need not be: the gradient crosses the
link ``LANDING_CHUNK_BYTES`` at a time into one of ``LANDING_RING`` pinned chunks, and each chunk,
once its copy is done, is copied on the host into its place in the (pageable) landing buffer while
the next chunks cross. That is what the CUDA driver does itself for a copy into pageable memory,
through its own small staging buffers and synchronously; here the chunks are the engine's (counted,
registered once), the copies pipelined on the d2h stream, and the host copies run in the gradient
thread (``mtnb-d2h``), never the compute thread.

What it costs: one host pass over the gradient (read the chunk, write the landing buffer: 8 B per
parameter of CPU memory traffic, in the gradient thread, overlapped with the backward) for
``LANDING_RING`` x ``LANDING_CHUNK_BYTES`` of pinned memory instead of the landing buffers' (96
MiB instead of 1.6 GB for a 7B). Where the ring would be larger than a unit (units under
``LANDING_RING`` chunks: 96 MiB, small models), the landing buffers are pinned and copied into
directly, as before (:func:`lands_in_chunks`).

The planner counts the same (``planner.host_in_flight``, ``host_store.pinned_layout``) through
:func:`landing_pinned_bytes`; torch is imported here, so planning imports this at plan time only.
"""
from __future__ import annotations

import threading
from collections import deque
from typing import Callable, List, Optional

import torch

from .pinned import held_bytes

#: Bytes of one pinned landing chunk (a power of two: whole pages, one size class).
LANDING_CHUNK_BYTES = 32 << 20
#: Chunks in the ring: one crossing, one being copied into its landing buffer, one queued.
LANDING_RING = 3


def landing_buffers(depth: int) -> int:
    """Host buffers a staging transport's gradients land in (and are updated in): the ``depth``
    units being updated and the one next in line, at least two (``pager.staging_buffers``)."""
    return max(2, depth + 1)


def chunk_numel(largest_numel: int, chunk_bytes: Optional[int] = None) -> int:
    """fp32 elements of one landing chunk: ``chunk_bytes`` (default :data:`LANDING_CHUNK_BYTES`)
    worth, at most the largest unit."""
    return max(1, min(int(largest_numel), (chunk_bytes or LANDING_CHUNK_BYTES) // 4))


def lands_in_chunks(largest_numel: int, depth: int = 1, *, chunk_bytes: Optional[int] = None,
                    ring: Optional[int] = None) -> bool:
    """Whether gradients land through the pinned ring (the landing buffers pageable): where the
    whole ring is at most one unit, so it pins less than half of what the (at least two) pinned
    landing buffers would and adds at most a unit of host RAM. (``depth``: as the landing
    buffers' count, which does not change the answer.)"""
    ring = ring or LANDING_RING
    return ring * chunk_numel(largest_numel, chunk_bytes) <= int(largest_numel) < landing_buffers(depth) * int(largest_numel)


def landing_pinned_bytes(largest_numel: int, depth: int = 1, pin: bool = True, *,
                         chunk_bytes: Optional[int] = None, ring: Optional[int] = None) -> int:
    """Pinned host bytes the gradients land through, as ``pinned.held_bytes`` counts them: the
    ring's chunks, or (:func:`lands_in_chunks` False) the landing buffers themselves."""
    if not pin:
        return 0
    if lands_in_chunks(largest_numel, depth, chunk_bytes=chunk_bytes, ring=ring):
        return (ring or LANDING_RING) * held_bytes(chunk_numel(largest_numel, chunk_bytes) * 4, True)
    return landing_buffers(depth) * held_bytes(int(largest_numel) * 4, True)


def landing_host_bytes(largest_numel: int, depth: int = 1, pin: bool = True, *,
                       chunk_bytes: Optional[int] = None, ring: Optional[int] = None) -> int:
    """All host bytes of the landing: the pinned ones (:func:`landing_pinned_bytes`) and, landing
    in chunks, the pageable landing buffers the updates run in."""
    out = landing_pinned_bytes(largest_numel, depth, pin, chunk_bytes=chunk_bytes, ring=ring)
    if not pin:
        return landing_buffers(depth) * int(largest_numel) * 4
    if lands_in_chunks(largest_numel, depth, chunk_bytes=chunk_bytes, ring=ring):
        out += landing_buffers(depth) * int(largest_numel) * 4
    return out


class LandingRing:
    """``ring`` pinned chunks of ``chunk`` elements, and :meth:`land`: a device tensor into a host
    one through them. Stream-agnostic (tests drive it on the CPU): ``issue(chunk_view, src_slice)``
    enqueues one device->host copy into a chunk and returns something with ``synchronize()``
    (CUDA: an event recorded after the copy); :meth:`land` copies each chunk out on the host once
    its event is done, and issues a chunk's next copy only after that."""

    def __init__(self, buffers: List[torch.Tensor], issue: Callable):
        self.buffers = buffers
        self.chunk = min(b.numel() for b in buffers)
        self.issue = issue
        self._lock = threading.Lock()   # one landing at a time: the chunks are shared
        self.landed = {"gradients": 0, "chunks": 0, "bytes": 0}   # counts (tests, reports)

    def land(self, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        """``dst[:src.numel()] <- src`` (fp32, flat), chunk by chunk; returns that prefix of ``dst``,
        complete."""
        n = src.numel()
        out = dst.view(-1)[:n]
        flat = src.reshape(-1)
        ring = len(self.buffers)
        pending: deque = deque()   # (chunk index, start, end, event), oldest first
        with self._lock:
            for i, a in enumerate(range(0, n, self.chunk)):
                if len(pending) == ring:   # its chunk is this one's: copied out before it is reused
                    self._drain(pending.popleft(), out)
                b = min(a + self.chunk, n)
                slot = i % ring
                pending.append((slot, a, b, self.issue(self.buffers[slot][:b - a], flat[a:b])))
            while pending:
                self._drain(pending.popleft(), out)
            self.landed["gradients"] += 1
            self.landed["bytes"] += n * src.element_size()
        return out

    def _drain(self, entry, out: torch.Tensor) -> None:
        slot, a, b, ev = entry
        ev.synchronize()
        out[a:b].copy_(self.buffers[slot][:b - a])
        self.landed["chunks"] += 1
