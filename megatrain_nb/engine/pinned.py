"""Pinned host buffers, counted as the process really holds them.

``t.pin_memory()`` copies a pageable tensor into a block of PyTorch's caching host allocator:
a pageable allocation and a copy first, then a pinned block whose size is rounded up to a
power of two (an 810 MB layer holds 1 GiB, a 2.1 GB embedding 4 GiB), kept cached after the
tensor dies (``torch.empty(..., pin_memory=True)`` goes through the same allocator and is
rounded the same way). :class:`PinnedPool` allocates with ``torch.empty(..., pin_memory=True)`` (no
pageable copy), counts each block at the size the allocator gives it (:func:`pinned_bytes`),
and on :meth:`close` hands the cached blocks back to the driver. The planner counts pinned
buffers with the same rounding (:func:`held_bytes`: ``planner.host_in_flight`` and the master
weights and accumulators of ``host_store.HostStore``), and the engine's memory report counts
them so too, so the plan is what the process holds.
"""
from __future__ import annotations

import threading

import torch


def pinned_bytes(nbytes: int) -> int:
    """What the caching host allocator holds for a pinned request of ``nbytes`` (its power of two)."""
    n = max(int(nbytes), 1)
    return 1 << (n - 1).bit_length()


def held_bytes(nbytes: int, pinned: bool) -> int:
    """What a host buffer of ``nbytes`` holds: its power of two when pinned, else itself."""
    return pinned_bytes(nbytes) if pinned else int(nbytes)


class PinnedPool:
    """Host buffers for one engine: pinned (``pin=True``: CUDA) or plain; ``held`` bytes so far."""

    def __init__(self, *, pin: bool):
        self.pin = pin
        self.held = 0
        self._lock = threading.Lock()

    def empty(self, numel: int, dtype=torch.float32) -> torch.Tensor:
        t = torch.empty(numel, dtype=dtype, pin_memory=self.pin)
        n = numel * t.element_size()
        with self._lock:
            self.held += held_bytes(n, self.pin)
        return t

    def close(self) -> None:
        """Forget the count and release the cached pinned blocks no tensor uses any more (the
        caching host allocator keeps them otherwise for the life of the process)."""
        with self._lock:
            self.held = 0
        if self.pin:
            release_cached_pinned()


def release_cached_pinned() -> None:
    """Hand the caching host allocator's free pinned blocks back (a no-op where the build has no
    such call)."""
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()
