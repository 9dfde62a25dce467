"""HostStore: the authoritative fp32 master weights and gradient accumulators, one flat buffer per
unit, and -- in a narrower compute dtype -- each unit's compute-dtype *shadow*: the copy a load
sends to the device, written once by the unit's update (as DeepSpeed's CPU Adam writes its fp16
copy), so a load is one pinned copy with no cast on the host.

What is pinned (on CUDA) is what crosses the link (:func:`pinned_layout`): the shadows (or, in
fp32 compute, the masters themselves: they are the copy's source); never the gradient
accumulators (a gradient lands in the pager's pinned staging buffers and is added into its
accumulator on the host) nor, with shadows, the fp32 masters (only the AdamW worker reads them)."""
from __future__ import annotations

import threading
import weakref
from typing import Dict, List, Optional

import torch

from ..transport.landing import landing_pinned_bytes
from ..transport.pinned import held_bytes, pinned_empty
from ..units import Unit, train_numel
from .disk_format import aligned_storage_bytes
from .disk_store import aligned_empty
from .staging import disk_staging_buffers

#: Shadows on a CPU "device" too (tests: the same code path as CUDA's; off by default, where the
#: CPU transport's memcpy casts as it copies and the planner counts no shadow RAM).
SHADOWS_ON_CPU = False


def wants_shadows(pin: bool, compute_dtype: torch.dtype) -> bool:
    """Whether units get a compute-dtype shadow: a compute dtype narrower than fp32, on CUDA
    (``pin``) or where :data:`SHADOWS_ON_CPU` asks for it."""
    return compute_dtype != torch.float32 and (pin or SHADOWS_ON_CPU)


def pinned_layout(unit_numels, *, compute_bytes: int = 4, grads_in_flight: int = 1, params_on_disk: bool = False,
                  disk_buffers: Optional[int] = None, held_units: int = 0,
                  window_host_bytes: int = 0) -> Dict[str, int]:
    """Bytes the engine pins on CUDA for units of ``unit_numels`` (whole pages each, as
    ``pinned.held_bytes`` counts registered buffers): what crosses the link, and nothing else.

    * ``weights``: each unit's copy source -- in fp32 compute the master itself (4 B/param),
      narrower the shadow (``compute_bytes`` B/param); with the masters on the disk tier its
      ``disk_buffers`` unit-sized staging buffers (default: as the engine makes them,
      ``staging.disk_staging_buffers`` with ``grads_in_flight`` as its depth), plus ``held_units`` more
      where a clipped step holds backward reads for their updates (``parts.held_weight_units``),
      in the compute dtype (narrower: they hold the tier's compute-dtype copy, so there is no cast
      buffer; that is without a host cache of the tier -- with one, the fp32 masters are served
      from RAM and cast into one pinned buffer);
    * ``grad_landing``: what the gradients land through (``landing.landing_pinned_bytes``): a ring
      of pinned fp32 chunks in front of pageable landing buffers, or where that pins no less
      (small units) the landing buffers themselves (``pager.staging_buffers``, the largest unit each);
    * ``activations``: a layer-major window's host activations (``window_host_bytes``);
    * ``grad_accumulators`` and ``masters_fp32`` (narrower compute): 0, never copied."""
    numels = [int(n) for n in unit_numels]
    big = max(numels, default=0)
    page = lambda n: held_bytes(n, True)   # noqa: E731
    if params_on_disk:   # (narrower: the disk tier's compute-dtype copy, weight_store.DiskWeights' shadow)
        if disk_buffers is None:
            disk_buffers = disk_staging_buffers(big, grads_in_flight)[0]
        weights = (disk_buffers + held_units) * page(big * compute_bytes)
    else:
        weights = sum(page(n * compute_bytes) for n in numels)
    out = {"weights": weights, "grad_landing": landing_pinned_bytes(big, grads_in_flight),
           "activations": int(window_host_bytes), "grad_accumulators": 0,
           "masters_fp32": 0 if compute_bytes != 4 or params_on_disk else weights}
    out["total"] = out["weights"] + out["grad_landing"] + out["activations"]
    return out


class BufferPool:
    """Recycled page-aligned fp32 buffers, by size, for per-step temporaries of a unit (Adam
    moments read from disk, a final gradient): reusing them saves faulting in and zeroing fresh
    pages every step (each buffer of 1 MiB or more is a mapping of its own, :func:`aligned_empty`,
    given back to the OS when freed).
    Keeps at most ``max_bytes`` of free buffers.

    ``slot_numel`` (optional): :meth:`take_slot` hands out a prefix of a buffer of that many
    elements (the largest unit's), so one set of buffers serves every unit in turn: a
    pipeline with N gradients in flight holds N buffers, not one per unit size besides (the
    head's and the embedding's idle through the layers' backward)."""

    def __init__(self, max_bytes: int = 256 << 20, slot_numel: int = 0):
        self.max_bytes = max_bytes
        self.slot_numel = slot_numel
        self._free: Dict[int, List[torch.Tensor]] = {}
        self._free_bytes = 0
        self._lock = threading.Lock()
        # Buffers lent out (lend) that may come back as they are (take_back), by data pointer;
        # weak: one that never comes back is simply freed.
        self._lent: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()
        #: buffers made (not served from the free ones) and dropped (given back beyond
        #: ``max_bytes``) so far: each one made is a fresh mapping faulted in (tests count them)
        self.allocations = 0
        self.dropped = 0

    def take(self, numel: int) -> torch.Tensor:
        with self._lock:
            bufs = self._free.get(numel)
            if bufs:
                self._free_bytes -= numel * 4
                return bufs.pop()
            self.allocations += 1
        return aligned_empty(numel)

    def take_slot(self, numel: int) -> torch.Tensor:
        """A buffer for ``numel`` elements: the first ``numel`` of a slot-sized one (``numel``
        above ``slot_numel``: a buffer of its own size). :meth:`give` takes the prefix back."""
        if numel > self.slot_numel:
            return self.take(numel)
        return self.take(self.slot_numel)[:numel]

    def _whole(self, t: torch.Tensor) -> torch.Tensor:
        """A slot's prefix -> the whole slot buffer (its storage is a slot's: aligned_empty's)."""

        n = self.slot_numel
        if n and t.numel() < n and t.untyped_storage().nbytes() == aligned_storage_bytes(n * 4):
            return t.as_strided((n,), (1,), t.storage_offset())
        return t

    def lend(self, numel: int, slot: bool = False) -> torch.Tensor:
        """A buffer (:meth:`take`, or ``slot``: :meth:`take_slot`) that the borrower may hand
        back whole to whoever holds this pool: :meth:`take_back` recognises it."""
        t = self.take_slot(numel) if slot else self.take(numel)
        with self._lock:
            self._lent[t.data_ptr()] = t
        return t

    def take_back(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a buffer :meth:`lend` handed out (the same storage and size): it is
        then the caller's, to :meth:`give` back when done."""
        with self._lock:
            lent = self._lent.get(t.data_ptr())
            if lent is None or lent.numel() != t.numel() or \
                    lent.untyped_storage().data_ptr() != t.untyped_storage().data_ptr():
                return False
            del self._lent[t.data_ptr()]
            return True

    def lent_count(self) -> int:
        """Buffers lent and not taken back (alive)."""
        with self._lock:
            return len(self._lent)

    def nbytes(self) -> int:
        """Bytes of the free buffers kept for reuse."""
        with self._lock:
            return self._free_bytes

    def give(self, *tensors: torch.Tensor) -> None:
        with self._lock:
            for t in tensors:
                t = self._whole(t)
                n = t.numel()
                if t.dtype == torch.float32 and self._free_bytes + n * 4 <= self.max_bytes:
                    self._free.setdefault(n, []).append(t)
                    self._free_bytes += n * 4
                else:
                    self.dropped += 1

    def trim(self, max_bytes: int) -> None:
        """Keep at most ``max_bytes`` of free buffers from now on (the rest is freed now)."""
        with self._lock:
            self.max_bytes = max_bytes
            for n in sorted(self._free, reverse=True):
                bufs = self._free[n]
                while bufs and self._free_bytes > max_bytes:
                    bufs.pop()
                    self._free_bytes -= n * 4


class HostStore:
    """Flat fp32 buffers per unit in host RAM, pinned on CUDA (``pin``) where they cross the link.

    Parameters may be ``None`` for units whose master weights live on the disk tier; the
    engine then pages them through a host staging buffer. ``shadows`` (None: :func:`wants_shadows`):
    each unit whose masters are here gets a ``compute_dtype`` copy, the load's source, rewritten
    by :meth:`refresh_shadow` after each update.
    """

    def __init__(self, units: List[Unit], *, pin: bool, compute_dtype: torch.dtype = torch.float32,
                 shadows: Optional[bool] = None):
        self.units = units
        self.pin = pin
        self.compute_dtype = compute_dtype
        self.shadowed = wants_shadows(pin, compute_dtype) if shadows is None else bool(shadows)
        self.pin_params = pin and not self.shadowed   # the masters are the copy's source
        self.params: Dict[int, Optional[torch.Tensor]] = {}
        self.shadows: Dict[int, torch.Tensor] = {}
        self.grads: Dict[int, Optional[torch.Tensor]] = {}
        self._grad_locks = {u.index: threading.Lock() for u in units}
        self._has_grad = set()  # units whose accumulator holds a gradient since the last zero
        #: per unit whose gradients are told apart (the embedding's and the head's, outside the
        #: layers: a vision tower a text-only batch never runs): the indices in ``unit.params``
        #: of the parameters a backward reached since its last update or zero
        self._reached: Dict[int, set] = {}

    def alloc(self, numel: int) -> torch.Tensor:
        """A master-weights buffer: pinned in place where it is the copy's source (``.pin_memory()``
        would make a pageable tensor first and copy it), registered at its exact size where CUDA
        allows (``pinned.pinned_empty``); else page-aligned, from 1 MiB up a mapping of its own
        (``aligned_empty``): a unit built and written to the disk tier leaves nothing in the heap."""
        return pinned_empty(numel) if self.pin_params else aligned_empty(numel)

    def set_params(self, unit: Unit, flat: Optional[torch.Tensor]) -> None:
        self.params[unit.index] = flat
        if flat is not None and self.shadowed:
            if unit.index not in self.shadows:
                n = flat.numel()
                self.shadows[unit.index] = pinned_empty(n, self.compute_dtype) if self.pin \
                    else torch.empty(n, dtype=self.compute_dtype)
            self.refresh_shadow(unit)

    def refresh_shadow(self, unit: Unit) -> None:
        """The unit's compute-dtype copy from its masters (after an update, a load of new
        weights): the one cast a step makes per unit. The caller orders it after the copies that
        read the old shadow (an update runs after the unit's last load of its step)."""
        sh = self.shadows.get(unit.index)
        if sh is not None:
            sh.copy_(self.params[unit.index])

    def source(self, unit: Unit) -> Optional[torch.Tensor]:
        """What a load of ``unit`` copies: its shadow, else its fp32 masters."""
        sh = self.shadows.get(unit.index)
        return sh if sh is not None else self.params.get(unit.index)

    def grad(self, unit: Unit) -> torch.Tensor:
        g = self.grads.get(unit.index)
        if g is None:   # pageable: never a copy's source or target
            g = torch.zeros(train_numel(unit), dtype=torch.float32)
            self.grads[unit.index] = g
        return g

    def accumulate(self, unit: Unit, grad) -> None:
        """Add a unit's gradient into its fp32 accumulator (thread-safe per unit).

        ``grad`` is one flat tensor, or a list of per-parameter tensors in ``unit.params`` order
        (added in place into the accumulator's views: no concatenation copy), or a list of one
        flat tensor of the whole unit.
        """
        if not torch.is_tensor(grad) and len(grad) == 1:
            grad = grad[0].reshape(-1)
        with self._grad_locks[unit.index]:
            self._has_grad.add(unit.index)
            acc = self.grad(unit)
            if torch.is_tensor(grad):
                acc.add_(grad)
                return
            for p, g in zip(unit.params, grad):
                if not p.frozen:   # (no room for it where the frozen tail is split off: Unit.train_numel)
                    acc[p.offset:p.offset + p.numel].add_(g.reshape(-1))

    def mark_reached(self, unit: Unit, indices) -> None:
        """A backward reached these parameters of ``unit`` (indices in ``unit.params``)."""
        with self._grad_locks[unit.index]:
            self._reached.setdefault(unit.index, set()).update(indices)

    def take_reached(self, unit: Unit) -> Optional[frozenset]:
        """The parameters of ``unit`` a backward reached since the last take (None: not told
        apart, all of them); an update takes them."""
        with self._grad_locks[unit.index]:
            got = self._reached.pop(unit.index, None)
        return None if got is None else frozenset(got)

    def has_grad(self, unit: Unit) -> bool:
        return unit.index in self._has_grad

    def zero_unit(self, unit: Unit) -> None:
        g = self.grads.get(unit.index)
        if g is not None:
            g.zero_()
        self._has_grad.discard(unit.index)
        self._reached.pop(unit.index, None)

    def zero_grad(self) -> None:
        for u in self.units:
            self.zero_unit(u)

    def nbytes(self) -> Dict[str, int]:
        """Bytes held, pinned buffers as ``pinned.held_bytes`` counts them (as planned); the
        shadows are weights."""
        w = sum(held_bytes(t.numel() * 4, self.pin_params) for t in self.params.values() if t is not None)
        w += sum(held_bytes(t.numel() * t.element_size(), self.pin) for t in self.shadows.values())
        g = sum(t.numel() * 4 for t in self.grads.values() if t is not None)
        return {"weights": w, "grads": g}

    def pinned_bytes(self) -> Dict[str, int]:
        """What of it is pinned (on CUDA): the load's sources only."""
        if not self.pin:
            return {"weights": 0, "grads": 0}
        if self.shadowed:
            w = sum(held_bytes(t.numel() * t.element_size(), True) for t in self.shadows.values())
        else:
            w = sum(held_bytes(t.numel() * 4, True) for t in self.params.values() if t is not None)
        return {"weights": w, "grads": 0}
