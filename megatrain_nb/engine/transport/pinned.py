"""Pinned host buffers, counted as the process really holds them.

Two ways to pin on CUDA. PyTorch's caching host allocator (``t.pin_memory()``,
``torch.empty(..., pin_memory=True)``) rounds each block up to a power of two (an 810 MB layer
holds 1 GiB, a 5.8 GiB unit 8 GiB) and keeps it cached after the tensor dies. Registration
(:func:`pinned_empty`, the engine's way) allocates ordinary page-aligned host memory of the exact
size (whole pages) and page-locks it with ``cudaHostRegister(ptr, nbytes, 0)``
(``torch.cuda.cudart()``). Registered memory is pinned to CUDA: ``t.is_pinned()`` is True and
``copy_(..., non_blocking=True)`` is a true asynchronous DMA, as with the allocator's blocks.

Only what crosses the link is pinned (issue 45): the copies' sources and targets -- a slot's
source (the fp32 master weights in fp32 compute, the compute-dtype shadow in bf16:
``host_store.HostStore``), the disk tier's staging buffers, the gradients' landing buffers and a
window's host activations (the transport's :class:`PinnedPool`). The fp32 gradient
accumulators and, in bf16 compute, the fp32 master weights are never copied to or from the
device and stay pageable. :func:`pinned_layout` is that accounting for a model on paper.

Each registered buffer is kept out of processes forked later (``madvise(MADV_DONTFORK)``: a
``datasets.map(num_proc=...)`` worker neither inherits the locked pages nor copies them), and
given back to them (``MADV_DOFORK``) before its memory returns to the allocator. It is
unregistered (``cudaHostUnregister``) just before the memory is freed, when the last tensor on
it dies (a finalizer on the array that owns it). A copy may still read or write it then: the
transport notes the event recorded after every copy that used a registered buffer
(:func:`note_use`), and the finalizer waits for those events only -- never for the whole device.
Registration is assumed to work (:func:`exact_pinned`; plans made on a machine without CUDA are
on paper for a CUDA machine with it) until one fails: then a one-time warning says so, and every
later pinned buffer of the process comes from the caching host allocator, counted at its power
of two (buffers already registered stay so). A failed registration also sets CUDA's sticky
"last error", which the next kernel launch on that thread would raise: it is read (and so
cleared) at once with ``cudaGetLastError``, from the CUDA runtime torch loaded, opened again
through ctypes (``torch.cuda.cudart()`` does not bind it).
:func:`held_bytes` counts pinned buffers accordingly: exact while registration works, the power
of two otherwise. The planner (``planner.host_in_flight``, ``_PlanInputs.pinned_units``),
``host_store.HostStore``, ``disk_params.DiskReadStream``, the pager's gradient staging and
:class:`PinnedPool` (the transport's host buffers) all count through it, so the plan is what the
process holds.
"""
from __future__ import annotations

import contextlib
import ctypes
import sys
import threading
import warnings
import weakref
from typing import Dict, Optional

import torch

from ...threads import PIN, executor

PAGE = 4096
_state = {"exact": None, "warned": False}   # exact: None none yet, True registered, False fell back
_lock = threading.RLock()   # (a finalizer may run in a collection while it is held)
registered = {"buffers": 0, "bytes": 0}     # live registrations (what tests and reports read)
_uses: Dict[int, dict] = {}   # registered pointer -> {stream key: event after the last copy that used it}
MADV_DOFORK, MADV_DONTFORK = 11, 10   # Linux <sys/mman.h>
_libc = {"lib": None, "tried": False}


def _cudart():
    return torch.cuda.cudart()


def _cuda_present() -> bool:
    return torch.cuda.is_available()


def _cached_pinned(shape, dtype) -> torch.Tensor:
    """A block of the caching host allocator (the fallback), pinned in place."""
    return torch.empty(shape, dtype=dtype, pin_memory=True)


def pinned_bytes(nbytes: int) -> int:
    """What the caching host allocator holds for a pinned request of ``nbytes`` (its power of two)."""
    n = max(int(nbytes), 1)
    return 1 << (n - 1).bit_length()


def exact_pinned() -> bool:
    """Whether pinned buffers are registered at their exact size: until a registration fails
    (see the module doc). Asking touches no device (a plan made before the engine picks its GPU
    creates no context)."""
    with _lock:
        return _state["exact"] is not False


def held_bytes(nbytes: int, pinned: bool) -> int:
    """What a host buffer of ``nbytes`` holds: itself; pinned, its whole pages where registration
    works (:func:`pinned_empty`), else its power of two (the caching host allocator)."""
    if not pinned:
        return int(nbytes)
    return -(-int(nbytes) // PAGE) * PAGE if exact_pinned() else pinned_bytes(nbytes)


def _clear_error() -> None:
    """Read CUDA's last error on this thread (a failed cudaHostRegister leaves it set; reading
    clears it), so that the next kernel launched here does not raise it."""
    lib = _runtime_library()
    if lib is not None:
        try:
            lib.cudaGetLastError()
        except Exception:  # noqa: BLE001 - nothing more to clear
            pass


_runtime = {"lib": None, "tried": False}
#: the CUDA runtime's names, newest first, after the paths of any the process has loaded
CUDART_NAMES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so")


def _runtime_library():
    """The CUDA runtime torch loaded, opened again through ctypes for ``cudaGetLastError``, which
    ``torch.cuda.cudart()`` does not bind (it binds cudaHostRegister, cudaHostUnregister and a few
    more); None where none is loaded (a CPU build, a statically linked runtime)."""
    with _lock:
        if not _runtime["tried"]:
            _runtime["tried"] = True
            _runtime["lib"] = open_loaded(_loaded_paths("libcudart") + list(CUDART_NAMES), "cudaGetLastError")
        return _runtime["lib"]


def _loaded_paths(stem: str) -> list:
    """The files of the libraries named ``stem...`` mapped into this process (Linux)."""
    try:
        with open("/proc/self/maps") as f:
            return sorted({ln.split()[-1] for ln in f if f"/{stem}" in ln})
    except OSError:
        return []


def open_loaded(names, symbol: str):
    """The first of ``names`` (paths or sonames) that this process has loaded already and that has
    ``symbol`` (an ``int f(void)``), through ctypes; None if none. Never loads a library
    (``RTLD_NOLOAD``): a second CUDA runtime would have errors of its own."""
    import os

    noload = getattr(os, "RTLD_NOLOAD", None)
    if noload is None:
        return None
    for name in names:
        try:
            lib = ctypes.CDLL(name, mode=noload | getattr(os, "RTLD_NOW", 2))
            fn = getattr(lib, symbol)
        except (OSError, AttributeError):
            continue
        fn.restype, fn.argtypes = ctypes.c_int, []
        return lib
    return None


def _fail(rc) -> bool:
    _clear_error()
    _state["exact"] = False
    if not _state["warned"]:
        _state["warned"] = True
        warnings.warn(f"cudaHostRegister failed (error {int(rc)}): pinned host buffers come from PyTorch's "
                      "caching host allocator instead, each held at its power of two (more host RAM; "
                      "the plan counts it so)", RuntimeWarning, stacklevel=3)
    return False


def _aligned(nbytes: int):
    """A numpy byte array of ``nbytes`` (whole pages) starting on a page boundary."""
    import numpy as np
    raw = np.empty(nbytes + PAGE, dtype=np.uint8)
    off = (-raw.ctypes.data) % PAGE
    return raw[off:off + nbytes]


def _madvise(ptr: int, nbytes: int, advice: int) -> bool:
    """``madvise(ptr, nbytes, advice)`` through libc (Linux); False where unavailable or refused."""
    if not sys.platform.startswith("linux"):
        return False
    with _lock:
        if not _libc["tried"]:
            _libc["tried"] = True
            try:
                lib = ctypes.CDLL("libc.so.6", use_errno=True)
                lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                lib.madvise.restype = ctypes.c_int
                _libc["lib"] = lib
            except (OSError, AttributeError):
                _libc["lib"] = None
    lib = _libc["lib"]
    return lib is not None and lib.madvise(ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes), advice) == 0


def note_use(t: torch.Tensor, event, stream_key=0) -> None:
    """A copy on stream ``stream_key`` that reads or writes host tensor ``t`` is done once
    ``event`` is: what the finalizer of ``t``'s registered buffer waits for (the last per stream;
    copies on one stream complete in order). A no-op for memory that is not registered here."""
    key = t.untyped_storage().data_ptr()
    with _lock:
        uses = _uses.get(key)
        if uses is not None:
            uses[stream_key] = event


def _unregister(ptr: int, nbytes: int, device: Optional[int]) -> None:
    # A copy may still read or write the memory: wait for the copies that used it (their
    # events, noted by the transport), not the device; then give the pages back to forks. On
    # whatever thread collects the buffer: under the device it was registered on (no context
    # made on another GPU), a failure's error read at once (not raised by this thread's next kernel).
    with _lock:
        events = list(_uses.pop(ptr, {}).values())
    for ev in events:
        ev.synchronize()
    _madvise(ptr, nbytes, MADV_DOFORK)
    with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
        if int(_cudart().cudaHostUnregister(ptr)) != 0:
            _clear_error()
    with _lock:
        registered["buffers"] -= 1
        registered["bytes"] -= nbytes


def _register_block(nbytes: int):
    """A numpy byte array of ``nbytes`` (whole pages, page-aligned), registered with CUDA and kept
    out of forks; unregistered just before its memory is freed. None where registration failed
    (warned once, CUDA's error cleared on this thread: every later buffer falls back)."""
    span = max(PAGE, -(-int(nbytes) // PAGE) * PAGE)   # whole pages: no page shared with other memory
    buf = _aligned(span)
    ptr = buf.ctypes.data
    forked = _madvise(ptr, span, MADV_DONTFORK)   # not inherited by processes forked later
    rc = int(_cudart().cudaHostRegister(ptr, span, 0))
    if rc != 0:
        if forked:
            _madvise(ptr, span, MADV_DOFORK)
        with _lock:
            _fail(rc)
        return None
    with _lock:
        if _state["exact"] is None:   # (a registration queued before one failed does not turn it back on)
            _state["exact"] = True
        registered["buffers"] += 1
        registered["bytes"] += span
        _uses[ptr] = {}
    device = torch.cuda.current_device() if torch.cuda.is_available() else None
    fin = weakref.finalize(buf.base, _unregister, ptr, span, device)   # just before the memory is freed
    fin.atexit = False   # (at exit the driver releases it with the process)
    return buf


def _numel(shape) -> int:
    numel = 1
    for s in shape:
        numel *= int(s)
    return numel


def pinned_empty(shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised pinned CPU tensor of ``shape`` (an int: 1-D) and ``dtype``: registered
    page-aligned memory of its exact size (whole pages) where registration works, else the
    caching host allocator's block (see the module doc). Page-aligned either way (direct I/O)."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if not exact_pinned() or not _cuda_present():
        return _cached_pinned(shape, dtype)
    nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
    buf = _register_block(nbytes)
    if buf is None:
        return _cached_pinned(shape, dtype)
    return torch.from_numpy(buf[:nbytes]).view(dtype).view(shape)


def size_class(nbytes: int) -> int:
    """The bytes of the registered block a host buffer of ``nbytes`` is served from: whole pages,
    up to 8 pages exact, above that rounded up to an eighth of its power of two (at most 12.5%
    more), so every length of a sequence dimension falls in one of a few classes."""
    pages = max(1, -(-int(nbytes) // PAGE))
    step = 1 << max(0, pages.bit_length() - 4)
    return -(-pages // step) * step * PAGE


class SizeClasses:
    """Registered host blocks by :func:`size_class`, registered once and reused: a buffer handed
    out (:meth:`take`) is a view of a block, and the block goes back to its class when the last
    tensor on that view dies (a finalizer), after the copies noted on it (:func:`note_use`) are
    done. Registration runs in ``run`` (a single-thread executor's ``submit``: the pool's
    registrar, ``mtnb-pin``), never the caller's thread once a class is warm: a take that empties
    its class queues one more block there (ahead of need), :meth:`reserve` queues blocks before
    they are asked for, and a take that finds its class empty waits for a registration in flight
    (``counts["waited"]``) or, none in flight, registers in line (``counts["inline"]``: a class's
    first take). ``counts["registered"]``: blocks registered; ``held``: their bytes."""

    def __init__(self, run):
        self.run = run
        self._lock = threading.RLock()   # (a block's finalizer may run in a collection while it is held)
        self._free: Dict[int, list] = {}      # class -> blocks not handed out
        self._pending: Dict[int, list] = {}   # class -> registrations in flight (Futures)
        self.counts = {"registered": 0, "inline": 0, "waited": 0, "reused": 0, "taken": 0}
        self.held = 0
        self.closed = False

    def _register(self, cls: int):
        buf = _register_block(cls)
        if buf is not None:
            with self._lock:
                self.counts["registered"] += 1
                self.held += cls
        return buf

    def _ahead(self, cls: int, count: int = 1) -> None:
        """Queue ``count`` registrations of ``cls`` in the registrar (the caller holds the lock)."""
        for _ in range(count):
            fut = self.run(self._register, cls)
            self._pending.setdefault(cls, []).append(fut)
            fut.add_done_callback(lambda f, c=cls: self._arrived(c, f))

    def _arrived(self, cls: int, fut) -> None:
        buf = None if fut.cancelled() or fut.exception() is not None else fut.result()
        with self._lock:
            pending = self._pending.get(cls, [])
            if fut in pending:
                pending.remove(fut)
                if buf is not None and not self.closed:
                    self._free.setdefault(cls, []).append(buf)

    def reserve(self, nbytes: int, count: int = 1) -> None:
        """Register ``count`` more blocks for buffers of ``nbytes`` ahead of need, in the registrar."""
        with self._lock:
            self._ahead(size_class(nbytes), count)

    def _block(self, cls: int):
        with self._lock:
            free = self._free.get(cls)
            if free:
                self.counts["reused"] += 1
                buf = free.pop(0)   # the longest free: its last copies the likeliest done (take waits for them)
            else:
                buf = None
                pending = list(self._pending.get(cls, ()))
            if buf is None and not pending:
                self.counts["inline"] += 1
        if buf is not None:
            return buf
        if not pending:
            return self._register(cls)
        fut = pending[0]
        with self._lock:   # claim the registration in flight (else its callback freed it, or a take got it)
            mine = fut in self._pending.get(cls, ())
            if mine:
                self._pending[cls].remove(fut)
                self.counts["waited"] += 1
        return fut.result() if mine else self._block(cls)

    def take(self, shape, dtype) -> Optional[torch.Tensor]:
        """A pinned tensor of ``shape`` and ``dtype`` on a block of its class; None where
        registration failed (the caller falls back)."""
        nbytes = _numel(shape) * torch.empty((), dtype=dtype).element_size()
        cls = size_class(nbytes)
        buf = self._block(cls)
        if buf is None:
            return None
        with self._lock:
            self.counts["taken"] += 1
            if not self._free.get(cls) and not self._pending.get(cls):
                self._ahead(cls)   # the next take of this class finds one registered
        ptr = buf.ctypes.data
        with _lock:   # the block's last copies (noted by the transport) are done before it is rewritten
            events = list(_uses.get(ptr, {}).values())
        for ev in events:
            ev.synchronize()
        view = buf[:max(nbytes, 1)]
        weakref.finalize(view, self._give, cls, buf)   # back to its class when its last tensor dies
        return torch.from_numpy(view)[:nbytes].view(dtype).view(tuple(shape))

    def _give(self, cls: int, buf) -> None:
        with self._lock:
            if not self.closed:
                self._free.setdefault(cls, []).append(buf)

    def close(self) -> None:
        """Drop the free blocks (unregistered as they are freed) and forget those in flight."""
        with self._lock:
            self.closed = True
            self._free.clear()
            pending = [f for fs in self._pending.values() for f in fs]
            self._pending.clear()
            self.held = 0
        for f in pending:
            f.cancel()


class PinnedPool:
    """Host buffers for one engine: pinned (``pin=True``: CUDA) or plain; ``held`` bytes so far.
    :meth:`empty` registers a buffer of its own (the engine's fixed ones: the landing ring, the
    cast buffer); :meth:`recycled` serves buffers whose shapes vary (a window's host activations:
    one per sequence length) from :class:`SizeClasses`, registered once per size class in the
    pool's registrar thread (``mtnb-pin``, made on first need; ``run``: tests inject their own)."""

    def __init__(self, *, pin: bool, device=None, run=None):
        self.pin = pin
        self.held = 0
        self.device = device
        self._lock = threading.Lock()
        self._registrar = None
        self.classes = SizeClasses(run or self._submit)

    def _submit(self, fn, *args):
        with self._lock:
            if self._registrar is None:
                self._registrar = executor(PIN, device=self.device)
            return self._registrar.submit(fn, *args)

    def empty(self, numel: int, dtype=torch.float32) -> torch.Tensor:
        t = pinned_empty(numel, dtype) if self.pin else torch.empty(numel, dtype=dtype)
        n = numel * t.element_size()
        with self._lock:
            self.held += held_bytes(n, self.pin)
        return t

    def recycled(self, shape, dtype=torch.float32) -> torch.Tensor:
        """A host buffer of ``shape`` (an int: 1-D) and ``dtype``, pinned on a size class's block
        where registration works (see :class:`SizeClasses`), else as :meth:`empty`."""
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        if self.pin and exact_pinned() and _cuda_present():
            t = self.classes.take(shape, dtype)
            if t is not None:
                return t
        return self.empty(_numel(shape), dtype).view(shape)

    def reserve(self, nbytes: int, count: int = 1) -> None:
        """Register ``count`` blocks for buffers of ``nbytes`` ahead of their :meth:`recycled`, in the
        registrar (a caller that knows its shapes before its compute: nothing registers there)."""
        if self.pin and exact_pinned() and _cuda_present():
            self.classes.reserve(nbytes, count)

    def total_held(self) -> int:
        """Bytes held: the buffers of :meth:`empty` and the size classes' blocks."""
        return self.held + self.classes.held

    def close(self) -> None:
        """Forget the count and release the cached pinned blocks no tensor uses any more (the
        caching host allocator keeps them otherwise for the life of the process; registered
        buffers are unregistered as their last tensor dies)."""
        with self._lock:
            self.held = 0
            registrar, self._registrar = self._registrar, None
        self.classes.close()
        if registrar is not None:
            registrar.shutdown(wait=True)
        if self.pin:
            release_cached_pinned()


def release_cached_pinned() -> None:
    """Hand the caching host allocator's free pinned blocks back (a no-op where the build has no
    such call)."""
    empty = getattr(torch._C, "_host_emptyCache", None)
    if empty is not None:
        empty()


def reset_for_tests(exact: Optional[bool] = None) -> None:
    """Forget the decision (tests: a fake cudart, or a forced fallback)."""
    with _lock:
        _state["exact"] = exact
        _state["warned"] = False
