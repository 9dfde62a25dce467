"""Host RAM as a schedule-driven cache of the disk tier.

A training step touches the disk tier in an order the engine knows before the step starts
(the forward's and backward's weight reads, then each update's state read, weight write and
state write), and the next step repeats it. With the future known, the best eviction is
Belady's: drop what is needed furthest ahead. This module has three parts:

* :func:`step_accesses` — the step's disk accesses ``(key, op, nbytes)`` in schedule order,
  derived from the same compute/update orders the engine runs (one place, explicit).
* :func:`plan_cache` — simulates that sequence, repeated step after step, through a cache of
  ``capacity`` bytes with furthest-next-use eviction and write-back of dirty data, and returns
  the steady-state decision for every access ("keep it resident until its next use?") with
  the disk bytes read and written per step that this reaches: the schedule's minimum that
  :class:`HostCache` is judged against.
* :class:`HostCache` — wraps the DiskStore (same ``read``/``write`` futures) and applies the
  plan: a resident key is served from RAM (a hit), a dirty one is written back once, on
  eviction, and a clean one is never rewritten.

Decisions are keyed by *phase*, not by time: ``(key, op, n)`` where ``n`` counts that op on
that key since its last write (weights: read 0 = forward, read 1 = backward, write 0 = the
update). Operations on one key are ordered by the engine, so the phases each access takes are
the same in every step however the threads interleave, and the bytes moved from one quiescent
step boundary to the next equal the simulation's exactly. Accesses outside the plan (a
checkpoint read, an evaluation, gradient accumulation) find no decision and are not kept: they
stay correct, and only cost disk bytes.

Why furthest-next-use is a sound target: for same-size keys and clean data it is the optimum
(Belady 1966); with dirty data the simulator counts a write-back whenever a dirty key leaves,
so a dirty key is preferred resident until its next write (it never touches the disk at all).
With keys of unequal sizes (embedding and head vs layers) it is the standard heuristic, not a
proven optimum.
"""
from __future__ import annotations

import math
import threading
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .disk_params import handed_after_backward, handed_units, shadow_key, weights_key
from .disk_store import aligned_empty
from .staging import disk_staging_buffers
from ...threads import CACHE, executor
from ..units import Unit

READ, WRITE = "R", "W"
Access = Tuple[str, str, int]   # (key, READ | WRITE, nbytes)


def step_accesses(compute_order: Sequence[Unit], update_order: Sequence[Unit], *, clipped: bool,
                  params_on_disk: bool, state_key, state_nbytes, shadow_bytes: int = 0,
                  held: Optional[set] = None) -> List[Access]:
    """One training step's disk accesses, in schedule order.

    Unclipped: each unit's update follows its last compute access (the backward's), and a unit
    loaded twice hands that read's buffer to its update (no third read). Clipped: every update
    runs after the backward, in ``update_order``, and reads its weights again -- but for the
    units in ``held`` (no host cache: :func:`held_after_backward`,
    the backward's last reads held for their updates, whose buffers then stay as fresh copies
    for the next forward, ``weight_store.DiskWeights.schedule``): no update read, and no read by
    the forward's first load of them. ``shadow_bytes`` (the compute dtype's bytes a parameter:
    the disk tier's compute-dtype copy, ``weight_store.DiskWeights``' ``shadow``): the loads
    read the copy, so every update reads its fp32 masters and writes both.
    """
    seq: List[Access] = []
    compute = [u for u in compute_order if u.numel > 0]
    updates = [u for u in update_order if u.numel > 0]
    held = set(held or ()) if clipped and not shadow_bytes else set()
    handed = held if clipped or shadow_bytes else handed_units(compute, updates)
    last = {u.index: i for i, u in enumerate(compute)}
    first = {}
    for i, u in enumerate(compute):
        first.setdefault(u.index, i)

    def update(u: Unit) -> None:
        seq.append((state_key(u), READ, state_nbytes(u)))
        if params_on_disk and u.index not in handed:
            seq.append((weights_key(u), READ, 4 * u.numel))
        if params_on_disk:
            seq.append((weights_key(u), WRITE, 4 * u.numel))
        if params_on_disk and shadow_bytes:
            seq.append((shadow_key(u), WRITE, shadow_bytes * u.numel))
        seq.append((state_key(u), WRITE, state_nbytes(u)))

    updated = {u.index for u in updates}
    for i, u in enumerate(compute):
        if params_on_disk and not (u.index in held and first[u.index] == i):   # (held: a fresh copy)
            seq.append((shadow_key(u), READ, shadow_bytes * u.numel) if shadow_bytes else
                       (weights_key(u), READ, 4 * u.numel))
        if not clipped and u.index in updated and last[u.index] == i:
            update(u)
    done = set() if clipped else {u.index for u in compute if u.index in updated}
    for u in updates:
        if u.index not in done:
            update(u)
    return seq


def held_after_backward(compute_order: Sequence[Unit], update_order: Sequence[Unit], *, held_units: int,
                        depth: int) -> set:
    """The units a clipped step without a host cache holds from the backward for their updates
    (``weight_store.DiskWeights.schedule``): the compute stream's buffers but one
    (``staging.disk_staging_buffers``) and ``held_units`` more (``parts.held_weight_units``).
    Unit indices, for :func:`step_accesses`' ``held``."""
    big = max((u.numel for u in compute_order), default=0)
    own = disk_staging_buffers(big, depth)[0] - 1
    return handed_after_backward(compute_order, update_order, own + held_units)


def _phases(seq: Sequence[Access]) -> List[tuple]:
    """``(key, op, n)`` for each access: n counts ``op`` on ``key`` since its last write."""
    count: Dict[Tuple[str, str], int] = {}
    out = []
    for key, op, _ in seq:
        if op == WRITE:
            count[(key, READ)] = 0
        n = count.get((key, op), 0)
        count[(key, op)] = n + 1 if op == READ else 0
        out.append((key, op, n))
    return out


@dataclass
class CachePlan:
    capacity: int
    keep: Dict[tuple, bool] = field(default_factory=dict)   # phase -> keep resident after it
    read_bytes: int = 0           # per step, steady state: the schedule's minimum
    write_bytes: int = 0
    hits: int = 0
    hit_bytes: int = 0
    resident_peak: int = 0


def plan_cache(seq: Sequence[Access], capacity: int, *, steps: int = 4) -> CachePlan:
    """Simulate ``seq`` repeated ``steps + 1`` times through ``capacity`` bytes (furthest next
    use evicted first; a dirty key written back when it leaves) and return the decisions and
    disk bytes of the last complete step (the steady state)."""
    n = len(seq)
    plan = CachePlan(capacity=capacity)
    if n == 0:
        return plan
    full = list(seq) * (steps + 1)
    size = {k: b for k, _, b in seq}
    # next access of each kind after position p, for each key (one backward pass)
    INF = float("inf")
    next_any, next_read = [INF] * len(full), [INF] * len(full)
    seen_any: Dict[str, float] = {}
    seen_read: Dict[str, float] = {}
    for p in range(len(full) - 1, -1, -1):
        k, op, _ = full[p]
        next_any[p], next_read[p] = seen_any.get(k, INF), seen_read.get(k, INF)
        seen_any[k] = p
        if op == READ:
            seen_read[k] = p
        else:
            seen_read.pop(k, None)  # a write ends the value: reads after it need the new one
    resident: Dict[str, dict] = {}    # key -> {"dirty", "since" (position of the access that keeps it)}
    used = 0
    lo = (steps - 1) * n              # the step measured
    stats = {"read": 0, "write": 0, "hits": 0, "hit_bytes": 0, "peak": 0}
    kept_at: Dict[int, bool] = {}
    for p, (k, op, nb) in enumerate(full):
        measured = lo <= p < lo + n
        e = resident.get(k)
        if e is not None:
            kept_at[e["since"]] = True
        if op == READ:
            if e is None:
                stats["read"] += nb * measured
                e = resident[k] = {"dirty": False}
                used += nb
            else:
                stats["hits"] += measured
                stats["hit_bytes"] += nb * measured
        else:
            if e is None:
                e = resident[k] = {"dirty": True}
                used += nb
            e["dirty"] = True
        e["since"] = p
        e["next_read"], e["next_any"] = next_read[p], next_any[p]
        while used > capacity:
            def cost(key):
                r = resident[key]
                # clean: its next read; dirty: its next access of any kind (a write then
                # replaces it for free, a read finds it) -> furthest is evicted first
                return r["next_any"] if r["dirty"] else r["next_read"]
            # a key larger than the whole cache never stays; else the furthest next use goes
            too_big = [key for key in resident if size[key] > capacity]
            victim = too_big[0] if too_big else max(resident, key=cost)
            r = resident.pop(victim)
            used -= size[victim]
            kept_at[r["since"]] = False
            if r["dirty"]:
                stats["write"] += size[victim] * (lo <= p < lo + n)
        if measured:
            stats["peak"] = max(stats["peak"], used)
    phases = _phases(seq)
    for j in range(n):
        plan.keep[phases[j]] = kept_at.get(lo + j, False)
    plan.read_bytes, plan.write_bytes = stats["read"], stats["write"]
    plan.hits, plan.hit_bytes, plan.resident_peak = stats["hits"], stats["hit_bytes"], stats["peak"]
    return plan


#: Without max_host_gb the cache leaves this share of RAM (at least SAFETY_MIN_BYTES) free.
SAFETY_SHARE = 0.25
SAFETY_MIN_BYTES = 4 << 30


def cache_budget(host_cache_gb: Optional[float], max_host_gb: Optional[float], host_needed: int,
                 disk_bytes: int) -> int:
    """Bytes of host RAM for the cache: ``host_cache_gb`` if given; else what ``max_host_gb``
    leaves after the engine's own host needs; else the available RAM less a safety margin
    (a quarter of RAM, at least 4 GiB). Never more than the disk tier holds."""
    gib = 1 << 30
    if host_cache_gb is not None:
        want = int(host_cache_gb * gib)
    elif max_host_gb is not None:
        want = int(max_host_gb * gib) - host_needed
    else:
        import psutil

        vm = psutil.virtual_memory()
        # other engines' caches in this process fill lazily: what they may still take is not free
        pending = sum(max(0, c.capacity - c.ram_bytes()) for c in list(_LIVE))
        want = int(vm.available) - pending - host_needed - max(int(SAFETY_SHARE * vm.total), SAFETY_MIN_BYTES)
    return max(0, min(want, disk_bytes))


#: Open caches of this process (their budgets are taken when the next one is sized).
_LIVE: "weakref.WeakSet[HostCache]" = weakref.WeakSet()


def _done(value) -> Future:
    f = Future()
    f.set_result(value)
    return f


def _chain(src: Future, dst: Future) -> None:
    """Resolve ``dst`` as ``src`` resolves (no thread waits)."""
    def copy(f):
        err = f.exception()
        dst.set_exception(err) if err is not None else dst.set_result(f.result())
    src.add_done_callback(copy)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


class HostCache:
    """The disk tier seen through a RAM cache of ``capacity`` bytes driven by a
    :class:`CachePlan`. Every other DiskStore method is the store's own. Counts the disk
    bytes really moved into ``counters`` (links ``disk_to_host`` / ``host_to_disk``).
    ``capacity`` 0: a pass-through that only counts."""

    def __init__(self, store, capacity: int, counters=None):
        self.store = store
        self.capacity = int(capacity)
        self.counters = counters
        self.plan: Optional[CachePlan] = None
        self._plan_for: Optional[tuple] = None
        self._lock = threading.Lock()
        self._entries: Dict[str, dict] = {}      # key -> {"t": {name: tensor}, "dirty", "version"}
        self._reads: Dict[str, int] = {}          # key -> reads since its last write (the phase)
        self._version: Dict[str, int] = {}
        self._loading: Dict[str, Future] = {}     # key -> a read in flight that will stay resident
        self._lost: Dict[str, BaseException] = {}  # key -> its write-back failed (file is stale)
        self._copier = executor(CACHE)  # hits copied out
        if self.capacity > 0:
            _LIVE.add(self)
        self.counts = {"disk_read_bytes": 0, "disk_write_bytes": 0, "hits": 0, "bytes_saved": 0,
                      "write_backs": 0, "ram_bytes": 0, "ram_peak_bytes": 0, "steps_planned": 0,
                      "shared_reads": 0, "adopted_writes": 0}

    def __getattr__(self, name):   # the DiskStore's other methods (flush, stats, nbytes_of, ...)
        return getattr(self.store, name)

    # ------------------------------------------------------------------ the plan
    def set_schedule(self, seq: Sequence[Access]) -> None:
        """The step's access sequence; replanned only when it changes."""
        sig = tuple(seq)   # (with no capacity the plan still says what the schedule moves)
        if sig != self._plan_for:
            self.plan = plan_cache(seq, self.capacity)
            self._plan_for = sig
        with self._lock:
            self.counts["steps_planned"] += 1

    def _keep(self, key: str, op: str) -> bool:
        """Phase of this access (advanced), and the plan's decision for it."""
        if op == WRITE:
            self._reads[key] = 0
            n = 0
        else:
            n = self._reads.get(key, 0)
            self._reads[key] = n + 1
        plan = self.plan
        return bool(plan is not None and plan.keep.get((key, op, n), False))

    # ------------------------------------------------------------------ reads and writes
    def read(self, key: str, out: Optional[dict] = None, *, urgent: bool = False,
             outside_plan: bool = False, share: bool = False) -> Future:
        """As ``DiskStore.read``. ``outside_plan``: a read the schedule does not contain (a
        checkpoint, ``state_dict``): served from RAM if resident, never changes the cache.
        ``share`` (with ``out`` None): the reader only reads the tensors it gets, so a resident
        key hands out its own tensors, no copy (a later write of the key replaces them).
        The future's ``stall_kind`` says what a wait on it waits for: "host_cache" (served from
        RAM) or "disk" (a read of the disk tier)."""
        with self._lock:
            keep = False if outside_plan else self._keep(key, READ)
            loading = self._loading.get(key)
        if loading is not None:
            # a read of this key that will stay resident is still in flight (the forward's and
            # the backward's reads of the last layer are issued back to back): it is a hit
            mine = Future()
            mine.stall_kind = "disk"   # waiting for that disk read
            loading.add_done_callback(lambda _: _chain(self._serve(key, out, keep, urgent, outside_plan, share), mine))
            return mine
        return self._serve(key, out, keep, urgent, outside_plan, share)

    def _serve(self, key, out, keep, urgent, outside_plan, share=False) -> Future:
        """From RAM if resident (evicted after if not ``keep``), else from disk (and kept)."""
        evict = None
        with self._lock:
            lost = self._lost.get(key)
            if lost is not None:
                f = Future()
                f.set_exception(lost)
                return f
            e = self._entries.get(key)
            if e is not None:
                self.counts["hits"] += 1
                self.counts["bytes_saved"] += _nbytes(e["t"])
                if out is None and share:
                    e["shared"] = True   # read-only from now on: never reused in place
                    self.counts["shared_reads"] += 1
                    result = _done(dict(e["t"]))
                elif out is None:
                    result = _done(self._copy_out(e["t"], None))
                else:
                    # The copy runs in the cache's own thread (the second core), so read-ahead
                    # of a resident key costs its reader nothing; the entry is lent meanwhile
                    # (a write of the key then does not reuse its tensors in place).
                    e["lent"] = e.get("lent", 0) + 1
                    result = self._copier.submit(self._lend, e, out)
                if not keep and not outside_plan:
                    evict = self._pop(key)
            version = self._version.get(key, 0)
        if e is not None:
            if evict is not None and evict["dirty"]:
                self._write_back(key, evict)
            result.stall_kind = "host_cache"   # a wait on it is a wait for RAM, not for the disk
            return result
        raw = self.store.read(key, out=out, urgent=urgent)
        self._busy("disk_to_host", raw)
        mine = Future()
        mine.stall_kind = "disk"
        if keep:
            with self._lock:
                self._loading[key] = mine

        def arrived(f):
            try:
                got = f.result()
            except BaseException as err:  # noqa: BLE001 - delivered to the reader
                with self._lock:
                    if self._loading.get(key) is mine:
                        del self._loading[key]
                mine.set_exception(err)
                return
            self._count("disk_to_host", _nbytes(got), "disk_read_bytes")
            with self._lock:
                if keep and self._version.get(key, 0) == version and key not in self._entries:
                    if share and out is None:   # the store's own fresh tensors, read-only
                        self._insert(key, dict(got), dirty=False)
                        self._entries[key]["shared"] = True
                    else:
                        self._insert(key, {n: _aligned_copy(t) for n, t in got.items()}, dirty=False)
                if self._loading.get(key) is mine:
                    del self._loading[key]
            mine.set_result(got)
        raw.add_done_callback(arrived)
        return mine

    def write(self, key: str, tensors: dict) -> Future:
        """As ``DiskStore.write``: kept resident (dirty, no disk write now) when the plan says
        so, else written through (and any resident copy dropped)."""
        with self._lock:
            keep = self._keep(key, WRITE)
            self._version[key] = self._version.get(key, 0) + 1
            self._lost.pop(key, None)   # a complete new version replaces what was lost
            old = self._pop(key)
            if keep:
                reuse = (old["t"] if old is not None and not old.get("lent") and not old.get("shared")
                         and _same_layout(old["t"], tensors) else None)
                if reuse is not None:
                    for n, t in tensors.items():
                        reuse[n].copy_(t.reshape(reuse[n].shape))
                else:
                    reuse = {n: _aligned_copy(t) for n, t in tensors.items()}
                self._insert(key, reuse, dirty=True)
                self.counts["bytes_saved"] += _nbytes(tensors)
                return _done(_nbytes(tensors))
        return self._raw_write(key, tensors)

    def ranged(self, key: str, specs: dict, *, read_old: bool):
        """As ``DiskStore.ranged`` (used where nothing is kept: ``capacity`` 0): the key's
        phase advances as a read (``read_old``) and a write, a resident copy (stale from now
        on) is dropped, and the bytes it moves are counted as they are issued."""
        with self._lock:
            if read_old:
                self._keep(key, READ)
            self._keep(key, WRITE)
            self._version[key] = self._version.get(key, 0) + 1
            self._lost.pop(key, None)
            self._pop(key)
        rw = self.store.ranged(key, specs, read_old=read_old)
        self._busy("host_to_disk", rw.outer)
        if read_old:
            self._busy("disk_to_host", rw.outer)
        nb = sum(math.prod(shape) * torch.empty((), dtype=dtype).element_size() for dtype, shape in specs.values())
        if read_old:
            self._count("disk_to_host", nb, "disk_read_bytes")
        self._count("host_to_disk", nb, "disk_write_bytes")
        return rw

    def read_ranged(self, key: str):
        """As ``DiskStore.read_ranged`` (used where nothing is kept: ``capacity`` 0): the key's
        phase advances as a read and the bytes it moves are counted as it is issued."""
        with self._lock:
            self._keep(key, READ)
        rr = self.store.read_ranged(key)
        self._busy("disk_to_host", rr.outer)
        self._count("disk_to_host", sum(e["nbytes"] for e in rr.entries.values()), "disk_read_bytes")
        return rr

    def write_adopt(self, key: str, tensors: dict) -> Tuple[Future, Optional[dict]]:
        """As :meth:`write`, without the copy into RAM: when the plan keeps the key resident the
        cache takes ``tensors`` themselves (the caller must not touch them again) and returns,
        as the second value, the tensors of the key's previous version for the caller to reuse
        (same layout, no reader copying from them; else ``{}``). Second value None: not adopted
        (written through or copied, as :meth:`write`): ``tensors`` stay the caller's.

        The optimizer states' write after each update is the largest copy of the clipped path
        (two fp32 moments per parameter); with this it is a swap of buffers."""
        with self._lock:
            if self.capacity <= 0 or not self._adoptable(key):
                adopt = False
            else:
                adopt = True
                self._keep(key, WRITE)
                self._version[key] = self._version.get(key, 0) + 1
                self._lost.pop(key, None)
                old = self._pop(key)
                self._insert(key, dict(tensors), dirty=True)
                self.counts["bytes_saved"] += _nbytes(tensors)
                self.counts["adopted_writes"] += 1
                spare = {}
                if old is not None and not old.get("lent") and not old.get("shared") \
                        and _same_layout(old["t"], tensors):
                    spare = old["t"]
        if not adopt:
            return self.write(key, tensors), None
        return _done(_nbytes(tensors)), spare

    def _adoptable(self, key: str) -> bool:
        """(lock held) Whether the plan keeps the key's next write resident (phase not advanced)."""
        plan = self.plan
        return bool(plan is not None and plan.keep.get((key, WRITE, 0), False))

    def write_back_all(self) -> None:
        """Every dirty key to disk, and the cache dropped (before files are kept or linked).

        Each key's write is issued while the key is still resident, and only then does it leave
        RAM: a read meanwhile (the next step's, while a snapshot taken in the AdamW worker links
        the files) is served from RAM or follows the write in the disk tier's queue, never the
        older file. Its tensors are lent until written, so a newer version of the key written
        meanwhile gets tensors of its own (and stays resident: it is not this call's to drop)."""
        with self._lock:
            keys = list(self._entries)
        for k in keys:
            with self._lock:
                e = self._entries.get(k)
                if e is None:
                    continue
                if e["dirty"]:
                    e["lent"] = e.get("lent", 0) + 1
            if e["dirty"]:
                self._write_back(k, e, release=True)
            with self._lock:
                if self._entries.get(k) is e:
                    self._pop(k)

    def delete(self, key: str) -> None:
        """As ``DiskStore.delete``; a resident copy goes too."""
        with self._lock:
            self._version[key] = self._version.get(key, 0) + 1
            self._pop(key)
            self._lost.pop(key, None)
        self.store.delete(key)

    def invalidate(self) -> None:
        """Forget the phases (a step failed, or new weights were loaded): nothing resident is
        stale, but the next accesses start a fresh cycle."""
        with self._lock:
            self._reads.clear()

    def close(self) -> None:
        _LIVE.discard(self)
        self._copier.shutdown(wait=True)
        if getattr(self.store, "keep", False):
            self.write_back_all()
        with self._lock:
            self._entries.clear()
            self.counts["ram_bytes"] = 0
        self.store.close()

    # ------------------------------------------------------------------ accounting
    def report(self) -> dict:
        """Cache telemetry: actual disk bytes vs the plan's per-step minimum, hits, RAM."""
        with self._lock:
            out = dict(self.counts)
        out["capacity_bytes"] = self.capacity
        plan = self.plan
        out["planned"] = None if plan is None else {
            "read_bytes_per_step": plan.read_bytes, "write_bytes_per_step": plan.write_bytes,
            "hits_per_step": plan.hits, "resident_peak_bytes": plan.resident_peak}
        return out

    def ram_bytes(self) -> int:
        with self._lock:
            return self.counts["ram_bytes"]

    def resident_bytes(self, keys) -> int:
        """Bytes of RAM the cache holds for ``keys`` (their owners report them as their own
        kind: cached optimizer states are optimizer states)."""
        with self._lock:
            return sum(_nbytes(self._entries[k]["t"]) for k in keys if k in self._entries)

    # ------------------------------------------------------------------ internals (lock held)
    def _insert(self, key: str, tensors: dict, dirty: bool) -> None:
        self._entries[key] = {"t": tensors, "dirty": dirty}
        self.counts["ram_bytes"] += _nbytes(tensors)
        self.counts["ram_peak_bytes"] = max(self.counts["ram_peak_bytes"], self.counts["ram_bytes"])

    def _pop(self, key: str) -> Optional[dict]:
        e = self._entries.pop(key, None)
        if e is not None:
            self.counts["ram_bytes"] -= _nbytes(e["t"])
        return e

    def _lend(self, entry: dict, out: dict) -> dict:
        """(cache thread) a resident entry's tensors into ``out``."""
        try:
            return self._copy_out(entry["t"], out)
        finally:
            with self._lock:
                entry["lent"] -= 1

    @staticmethod
    def _copy_out(tensors: dict, out: Optional[dict]) -> dict:
        got = {}
        for n, t in tensors.items():
            dst = (out or {}).get(n)
            if dst is None:
                dst = _aligned_copy(t)
            else:
                dst.copy_(t.reshape(dst.shape))
            got[n] = dst
        return got

    # ------------------------------------------------------------------ disk traffic
    def _write_back(self, key: str, entry: dict, release: bool = False) -> None:
        """A dirty key leaves RAM. If its write fails (a full disk), the file still holds the
        old version: the key's next read raises that error instead of returning stale data.
        ``release``: the entry was lent for the write (``write_back_all``); given back once written."""
        with self._lock:
            self.counts["write_backs"] += 1
        fut = self._raw_write(key, entry["t"])

        def written(f):
            err = f.exception()
            with self._lock:
                if err is not None:
                    self._lost[key] = err
                if release:
                    entry["lent"] -= 1
        fut.add_done_callback(written)

    def _raw_write(self, key: str, tensors: dict) -> Future:
        fut = self.store.write(key, tensors)
        self._busy("host_to_disk", fut)
        self._count("host_to_disk", _nbytes(tensors), "disk_write_bytes")
        return fut

    def _busy(self, link: str, fut) -> None:
        if hasattr(self.counters, "busy_while"):   # (a plain counter in tests has only add_bytes)
            self.counters.busy_while(link, fut)

    def _count(self, link: str, nb: int, stat: str) -> None:
        with self._lock:
            self.counts[stat] += nb
        if self.counters is not None:
            self.counters.add_bytes(link, nb)


def _aligned_copy(t: torch.Tensor) -> torch.Tensor:
    """A page-aligned copy (direct I/O writes it back without a bounce copy)."""
    dst = aligned_empty(tuple(t.shape), t.dtype)
    dst.copy_(t)
    return dst


def _same_layout(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[n].dtype == b[n].dtype and a[n].numel() == b[n].numel() for n in a)
