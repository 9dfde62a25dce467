"""OptimizerStates: where the Adam moments of each unit live, and in which code.

* codec "none" in RAM: persistent fp32 tensors, updated in place (no copies).
* a compressed codec: codes + scales, decoded into scratch fp32 only for the update, encoded
  right after. Stored codes round-trip bit-exactly, so save/resume is exact.
* with ``offload_dir``: the stored form lives in files on the disk tier, read ahead of the
  optimizer and written behind it.
"""
from __future__ import annotations

import math
import os
import threading
import time
from concurrent.futures import Future
from typing import Dict, Optional, Tuple

import torch

from ...threads import DECODE, ENCODE, executor
from . import fused_update
from .codecs import ROLES as _ROLES, get_codec, sliceable
from .chunk_ring import ChunkRing
from ..tiers.disk_store import DiskStore, WriteWindow, prepare_offload_dir
from ..tiers.host_store import BufferPool
from ..units import Unit, train_numel



#: Elements of the moments decoded at a time by a chunked update (OptimizerStates.update):
#: three chunks of both moments in flight (decoded ahead, in AdamW, encoded behind) = 24 MiB.
UPDATE_CHUNK = 1 << 20


READ_AHEAD_BYTES = 1 << 30
WRITES_BEHIND = 2
ENCODE_BEHIND_BYTES = 512 << 20


def min_reads_ahead(stored_nbytes: int, read_ahead_bytes: int = READ_AHEAD_BYTES) -> int:
    """Units whose states are read ahead whatever their size: two, or one when a unit's stored
    states alone exceed half the read-ahead allowance (each is RAM until its update)."""
    return 2 if stored_nbytes <= read_ahead_bytes // 2 else 1


def read_ahead_allowance(units, compression: str) -> int:
    """Stored state bytes read ahead of their updates under a host budget (``max_host_gb``):
    the least :meth:`OptimizerStates._read_ahead` reads, ``min_reads_ahead`` of the largest
    unit's stored states. The planner counts that many for fp32 states on the disk tier; for
    compressed states it counts none (read range by range), so a host cache of the disk tier
    (whole units' codes read ahead) takes these bytes out of its own budget (parts.py)."""
    if not units:
        return 0
    stored = stored_state_bytes([max(units, key=lambda u: train_numel(u))], compression)
    return min_reads_ahead(stored) * stored


def writes_pending(stored_nbytes: int, chunked: bool) -> int:
    """State writes pending at most when an update starts (their codes or moments are RAM)."""
    return WRITES_BEHIND if not chunked or stored_nbytes <= ENCODE_BEHIND_BYTES else 1


def update_chunk(codec_name: str, chunk_numel: int, largest_unit: int) -> int:
    """Elements of the moments an update decodes at a time (0: the states are not updated in
    chunks): ``chunk_numel`` in whole codec blocks, and no more than the largest unit needs (a
    small model's ring is not sized for a megaparameter chunk it never fills)."""
    if codec_name == "none":
        return 0
    codecs = [get_codec(codec_name, r) for r in _ROLES]
    if not all(sliceable(c) for c in codecs):
        return 0
    align = math.lcm(*(c.block for c in codecs))
    want = min(chunk_numel, -(-max(largest_unit, 1) // align) * align)
    return max(align, want // align * align)


class OptimizerStates:
    def __init__(self, units, config, counters, disk=None, chunk_numel: int = UPDATE_CHUNK,
                 read_ahead_bytes: Optional[int] = None):
        self.units = units
        self.codec_name = config.optimizer_compression
        self.counters = counters
        self.codecs = None
        if self.codec_name != "none":
            self.codecs = {r: get_codec(self.codec_name, r) for r in _ROLES}
        #: Compressed states in whole codec blocks are updated in chunks (:meth:`update`): only
        #: ``RING`` chunks of fp32 moments exist at a time, never a unit's.
        self.chunk_numel = update_chunk(self.codec_name, chunk_numel, max((train_numel(u) for u in units), default=0))
        self.chunked = self.chunk_numel > 0
        self.ram: Dict[int, Dict[str, object]] = {}
        self.disk = disk  # shared with the engine, which closes it
        self._reads: Dict[int, Future] = {}
        self._lock = threading.Lock()
        self._on_disk = set()
        self._updating = set()   # units between load() and store(): not read ahead
        self.writes_behind = WRITES_BEHIND
        self._writes = []   # state writes still pending (futures)
        #: With a codec thread: fp32 moments waiting to be encoded may hold up to this many bytes
        #: (beyond ``writes_behind`` units), so the encodes of a step's last updates run during
        #: the next forward instead of holding up the updates the forward waits for.
        self.encode_behind_bytes = 0
        self._sched = []    # the coming updates, in order: (unit, last of its step)
        #: stored states read ahead of their updates (RAM; None: the default)
        self.read_ahead_bytes = READ_AHEAD_BYTES if read_ahead_bytes is None else read_ahead_bytes
        # moments' buffers, recycled from step to step (disk tier); a unit larger than the cap is
        # never kept, so RAM stays flat for very large units (whose page faults cost little)
        self.pool = BufferPool(max_bytes=512 << 20)
        # Compressed states (in RAM or on the disk tier): decoded ahead (mtnb-decode) and encoded
        # behind (mtnb-encode) in threads of their own, so the codec runs beside the AdamW worker
        # (on the second core while the compute waits) instead of in line with it. Bounded: one
        # unit decoded ahead, ``writes_behind`` units (or ``encode_behind_bytes``) waiting to be
        # encoded. (In line, a 4096-hidden layer's int8 update took 9 s, in threads ~4 s.)
        self._codec = self._decoder = None
        if self.codecs is not None:
            self._codec = executor(ENCODE)
            self.encode_behind_bytes = ENCODE_BEHIND_BYTES
            self._decoder = executor(DECODE)
        #: Chunked updates' ring (only ``RING`` chunks of fp32 moments at a time, never a unit's).
        self.ring = ChunkRing(self.codecs, self.chunk_numel) if self.chunked else None
        #: Chunked updates in RAM or the host cache run the fused kernel (``fused_update``) where
        #: it is built; False: the ring's decode / AdamW / encode (tests compare the two).
        self.fused = self.chunked
        #: Threads a fused chunk is split over: this one and the two codec threads (1: this one).
        self.fused_split = 3
        if self.chunked:   # built (or loaded from the cache) now, not during the first update
            fused_update.kernels()
        self._encoding: Dict[int, Future] = {}   # unit -> its encode and write issue (codec thread)
        self._decoded: Dict[int, Future] = {}    # unit -> its moments decoded ahead (codec thread)
        self._disk_wait = 0.0   # seconds the updates waited for their states' disk reads and writes (disk_wait)

    def disk_wait(self) -> float:
        """Seconds the updates' thread has waited for the disk tier (cumulative): for its states'
        reads, for their writes to settle (the bound on writes behind) and, in chunks, the disk's
        share of each decode and encode it waited for (``ChunkRing.disk_wait``)."""
        return self._disk_wait + (self.ring.disk_wait if self.ring is not None else 0.0)

    # ------------------------------------------------------------------ sizes
    # ------------------------------------------------------------------ encode / decode
    def _encode(self, m: torch.Tensor, v: torch.Tensor) -> Dict[str, torch.Tensor]:
        if self.codecs is None:
            return {"exp_avg": m, "exp_avg_sq": v}
        out = {}
        for role, t in zip(_ROLES, (m, v)):
            for k, val in self.codecs[role].encode(t).items():
                out[f"{role}.{k}"] = val
        return out

    def _decode(self, unit: Unit, stored: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        if self.codecs is None:
            return stored["exp_avg"], stored["exp_avg_sq"]
        res = []
        for role in _ROLES:
            enc = {k.split(".", 1)[1]: v for k, v in stored.items() if k.startswith(role + ".")}
            n = train_numel(unit)
            out = self.pool.take(n) if self.disk is not None else torch.empty(n, dtype=torch.float32)
            res.append(self.codecs[role].decode(enc, out))
        return res[0], res[1]

    # ------------------------------------------------------------------ the optimizer's view
    def schedule(self, order) -> None:
        """The order of the coming updates: their state reads start now, as deep as
        ``read_ahead_bytes`` allows (at least two units), so they use the disk while the
        forward leaves it idle rather than queueing behind the backward's writes."""
        # Appended: the updates of one step may still be running when the next step schedules.
        order = list(order)
        with self._lock:  # the optimizer thread advances the same list
            self._sched.extend((u, i == len(order) - 1) for i, u in enumerate(order))
        self._read_ahead()
        self._decode_next()   # the first update's states decode during the forward and backward

    def _read_ahead(self) -> None:
        held = 0
        with self._lock:
            sched = list(self._sched)
        for i, (u, _) in enumerate(sched):
            nbytes = self._stored_nbytes(u)
            if i >= min_reads_ahead(nbytes, self.read_ahead_bytes) and held + nbytes > self.read_ahead_bytes:
                break
            held += nbytes
            self.prefetch(u)

    def _stored_nbytes(self, unit: Unit) -> int:
        if self.codecs is None:
            return 8 * train_numel(unit)
        return sum(c.encoded_nbytes(train_numel(unit)) for c in self.codecs.values())

    def _advance(self, unit: Unit) -> None:
        with self._lock:
            sched = self._sched
            try:
                i = next(i for i, (u, _) in enumerate(sched) if u is unit)
            except StopIteration:
                return
            del sched[: i + 1]
        self._read_ahead()

    def prefetch(self, unit: Unit) -> None:
        """Start reading a unit's stored states from disk ahead of its update. Not while that
        unit is being updated: the read would be issued before the update's write and return
        the old moments (the next step's schedule can come while the last update runs);
        :meth:`store` reads ahead again once the write is issued."""
        if self.disk is None or unit.index not in self._on_disk or self.ranged_io():
            return   # (ranged I/O: each chunk's codes are read by its update)
        with self._lock:
            if unit.index not in self._reads and unit.index not in self._updating and unit.index not in self._decoded:
                self._reads[unit.index] = self._read(unit)  # bounded here: read_ahead_bytes

    def _read_buffers(self, unit: Unit):
        """fp32 moments are read straight into recycled buffers; codes are allocated."""
        return {r: self.pool.take(train_numel(unit)) for r in _ROLES} if self.codecs is None else None

    def _read(self, unit: Unit) -> Future:
        """A unit's stored states from the disk tier. Codes are only decoded (read, never
        written), so the host cache may hand out its resident copy itself (``share``)."""
        out = self._read_buffers(unit)
        if out is None and self._cached():
            return self.disk.read(self._key(unit), share=True)
        return self.disk.read(self._key(unit), out=out)

    def _cached(self) -> bool:
        """Whether the disk tier is seen through a host cache (disk_cache.HostCache)."""
        return getattr(self.disk, "capacity", 0) > 0

    def load(self, unit: Unit) -> Tuple[torch.Tensor, torch.Tensor]:
        """fp32 (exp_avg, exp_avg_sq) for the update; zeros on the first step."""
        # At most ``writes_behind`` state writes pending, so only a few units' moments are in
        # RAM; the last update scheduled (nothing after it) does not wait: the next step's first
        # update does, during the forward.
        enc = self._encoding.pop(unit.index, None)
        if enc is not None:   # its last update's encode must have issued its write
            _settle(enc)
        with self._lock:
            last = bool(self._sched) and self._sched[0][0] is unit and self._sched[0][1]
        # A unit whose moments alone exceed encode_behind_bytes (a 4096-hidden layer: 1.6 GB)
        # keeps one encode pending, not two: the encoder still always has the next one queued,
        # and the step's peak RSS is a unit's moments lower (bench_bigger_than_ram).
        limit = self.writes_behind if 8 * train_numel(unit) <= self.encode_behind_bytes else 1
        while len(self._writes) >= limit and not last and self._behind_bytes() > self.encode_behind_bytes:
            self._disk_wait += _settle_timed(self._writes.pop(0))   # (a failed encode or write raises)
        for w in [w for w in self._writes if w.done()]:
            self._writes.remove(w)
            _settle(w)
        with self._lock:
            self._updating.add(unit.index)   # until store(): no read of it ahead of the write
        self._advance(unit)
        with self._lock:
            ahead = self._decoded.pop(unit.index, None)
        if ahead is not None:   # read and decoded while the update before it ran
            if self.disk is None:
                self._decode_next()
                return ahead.result()
            self.counters.prefetch_result("disk", True)
            self._decode_next()
            return self._waited(ahead)
        if self.disk is not None and unit.index in self._on_disk:
            with self._lock:
                fut = self._reads.pop(unit.index, None)
            self.counters.prefetch_result("disk", fut is not None)  # issued ahead of need, or late
            if fut is None:  # not read ahead: read now (this update's own read)
                with self._lock:
                    fut = self._read(unit)
            stored = self._waited(fut)
            out = self._decode(unit, stored)
            self._decode_next()
            return out
        stored = self.ram.get(unit.index)
        self._decode_next()   # (RAM) the next update's, beside this one
        if stored is None:
            if self.disk is not None:  # first step on the disk tier: recycled buffers
                return self.pool.take(train_numel(unit)).zero_(), self.pool.take(train_numel(unit)).zero_()
            n = train_numel(unit)
            return torch.zeros(n, dtype=torch.float32), torch.zeros(n, dtype=torch.float32)
        return self._decode(unit, stored)

    def _behind_bytes(self) -> int:
        """fp32 moment bytes of the writes still pending (encodes not done yet)."""
        return sum(getattr(f, "moment_bytes", 0) for f in self._writes if not f.done())

    def _waited(self, fut: Future):
        """A read's (or a read-ahead decode's) result, the wait counted against its cause: the
        disk, the host cache (disk_cache.HostCache marks its futures), or the decode."""
        read = getattr(fut, "read", None)   # a decode of states read ahead: first the read, then the decode
        first = fut if read is None else read
        t0 = time.perf_counter()
        try:
            got = self.counters.wait(first, "disk")
        finally:
            if getattr(first, "stall_kind", "disk") == "disk":   # (not a copy out of the host cache)
                self._disk_wait += time.perf_counter() - t0
        return got if read is None else self.counters.wait(fut, "decode")

    def _decode_next(self) -> None:
        """Decode the next update's states (read ahead) in the codec thread, now, while this
        update runs: at most one unit ahead. (A chunked update decodes its own chunks ahead.)"""
        if self._codec is None or self.chunked:
            return
        with self._lock:
            if not self._sched or self._decoded:
                return
            nxt = self._sched[0][0]
            if self.disk is None:
                # RAM: its codes, unless its update or encode is still running (they would be
                # the step before's: the encode stores the new ones before it leaves _encoding)
                codes = None if nxt.index in self._updating or nxt.index in self._encoding else self.ram.get(nxt.index)
                if codes is not None:
                    self._decoded[nxt.index] = self._decoder.submit(self._decode, nxt, codes)
                return
            # (a unit still being updated has no read ahead: its read follows its write)
            read = None if nxt.index in self._updating else self._reads.pop(nxt.index, None)
            if read is None:
                return
            dec = self._decoder.submit(lambda: self._decode(nxt, read.result()))
            dec.read = read   # (_waited tells the read's wait from the decode's)
            self._decoded[nxt.index] = dec

    # ------------------------------------------------------------------ the chunked update
    def update(self, unit: Unit, apply, weights=None, grads=None) -> None:
        """One unit's update in chunks: for each ``[a, b)`` the moments' slice is decoded (in
        ``mtnb-decode``, a chunk ahead), ``apply(a, b, m, v)`` runs AdamW on it (this thread),
        and it is encoded into the unit's new codes (in ``mtnb-encode``, a chunk behind); then
        the new codes are stored (RAM) or written behind (the disk tier). Chunks are whole codec
        blocks, so the codes equal those of the whole unit decoded, updated and encoded at once.
        ``apply`` None: a skipped step -- the states are stored again as they are. ``weights``: a
        ranged rewrite of the unit's master weights, read and written with the codes, chunk by
        chunk (``ChunkRing.run``); ``apply(a, b, m, v, p)`` then gets each chunk's weights.
        ``grads``: a final gradient held on the disk tier, read with them (``apply(..., g)``).
        Where the fused kernel runs (:attr:`fused`: RAM or the host cache, no ranged weights or
        held gradient) the unit is one chunk, stepped in one pass (:meth:`_update_fused`)."""
        self._bound_writes(unit)
        with self._lock:
            self._updating.add(unit.index)   # until stored: no read of it ahead of the write
        self._advance(unit)
        if self.ranged_io():
            self._update_ranged(unit, apply, weights, grads)
            return
        stored = self._stored_for_update(unit)
        if apply is None:
            out = None if stored is None else {k: t.clone() for k, t in stored.items()}
        else:
            # Codes read from the disk tier are this update's own: each chunk is encoded back
            # where it was decoded from. (RAM codes are the state itself until the update is
            # done; a host cache's resident codes are shared.)
            own = stored is not None and self.disk is not None and not self._cached()
            out = stored if own else self.ring.new_codes(train_numel(unit))
            kern = fused_update.kernels() if self.fused and weights is None and grads is None else None
            if kern is not None and (stored is None or isinstance(stored, dict)):
                self._update_fused(kern, train_numel(unit), stored, out, apply)
            else:
                self.ring.run(train_numel(unit), stored, out, apply, self._decoder, self._codec, weights, grads)
        if out is None:
            self.update_failed(unit)
            return
        if self.disk is not None:
            fut, _ = self._write(unit, out, adopt=True)   # the written codes are the cache's, if kept
            self._writes.append(fut)
        self._stored(unit, out)

    def _update_fused(self, kern, numel: int, stored, out, apply) -> None:
        """The chunked update in one pass (``fused_update``): ``apply`` gets the unit's codes (a
        ``CodedChunk`` of all its elements) in place of decoded moments, and AdamW
        (``UnitRun.step``) runs the kernel on it -- decode, step and encode, block by block --
        split between this thread and the codec threads (``fused_split`` parts); no fp32
        moments exist. One chunk, the whole unit: the pass holds no chunk-sized buffer (the ring's
        ``chunk_numel`` bounds the ring's fp32 moments, which this path never makes), and each
        chunk cost ~0.1 ms of Python around the kernel (a 4M-element unit: ~10% of its update).
        The kernel is elementwise with absolute indices, so the weights and codes equal the ring's
        decode / AdamW / encode chunk by chunk, bit for bit."""
        pools = (self._decoder, self._codec)[:max(self.fused_split - 1, 0)]
        chunk = fused_update.CodedChunk(kern, self.codecs, stored, out, 0, numel, pools)
        apply(0, numel, chunk, chunk)
        if not chunk.done:
            raise RuntimeError("a fused update's apply did not step its chunk (UnitRun.step runs it)")

    def ranged_io(self) -> bool:
        """Whether chunked updates read and write the codes straight from and to their file on
        the disk tier, range by range (``DiskStore.ranged``): the disk tier without a host cache
        (whose resident copies are whole units). No codes are then read ahead or written behind."""
        return self.chunked and self.disk is not None and not self._cached() and hasattr(self.disk, "ranged")

    def _update_ranged(self, unit: Unit, apply, weights=None, grads=None) -> None:
        """A chunked update from the unit's file to its new version, chunk by chunk: each
        chunk's codes are read (``mtnb-decode``), decoded, updated, encoded and written
        (``mtnb-encode``); only the ring's chunks are in RAM. A skipped step leaves the file."""
        if apply is not None:
            old = unit.index in self._on_disk
            rw = self.disk.ranged(self._key(unit), self.ring.code_specs(train_numel(unit)), read_old=old)
            try:
                self.ring.run(train_numel(unit), rw if old else None, rw, apply, self._decoder, self._codec, weights,
                              grads)
                fut = rw.commit(behind=True)   # synced and renamed behind (bounded: _bound_writes)
            except BaseException as e:
                rw.abort(e)
                raise
            self._writes.append(fut)
            self._on_disk.add(unit.index)
        self._stored(unit, None)

    def _bound_writes(self, unit: Unit) -> None:
        """At most ``writes_behind`` state writes pending (their codes are RAM) when an update
        starts; the step's last update (nothing after it) does not wait."""
        with self._lock:
            last = bool(self._sched) and self._sched[0][0] is unit and self._sched[0][1]
        # codes of a unit larger than the allowance: one write pending, not two (its codes are
        # being written while the next unit's are read and updated)
        limit = self.writes_behind if self._stored_nbytes(unit) <= self.encode_behind_bytes else 1  # writes_pending
        while len(self._writes) >= limit and not last:
            self._disk_wait += _settle_timed(self._writes.pop(0))   # a failed write raises here, in the update
        for w in [w for w in self._writes if w.done()]:
            self._writes.remove(w)
            _settle(w)

    def _stored_for_update(self, unit: Unit) -> Optional[Dict[str, torch.Tensor]]:
        """The unit's stored codes (read ahead, or read now), or None before its first update."""
        if self.disk is not None and unit.index in self._on_disk:
            with self._lock:
                fut = self._reads.pop(unit.index, None)
            self.counters.prefetch_result("disk", fut is not None)  # issued ahead of need, or late
            if fut is None:
                with self._lock:
                    fut = self._read(unit)
            return self._waited(fut)
        return self.ram.get(unit.index)

    def store(self, unit: Unit, m: torch.Tensor, v: torch.Tensor) -> None:
        if self._codec is not None:
            # Encoded and written behind, in the codec thread; the unit stays "being updated"
            # (no read ahead of it) until its write is issued.
            enc = self._codec.submit(self._store_disk, unit, m, v)
            enc.moment_bytes = 8 * train_numel(unit)
            self._encoding[unit.index] = enc
            self._writes.append(enc)
            enc.add_done_callback(lambda f, i=unit.index: f is self._encoding.get(i) and f.exception() is None
                                  and self._encoding.pop(i, None))
            self._decode_next()
            return
        self._store_disk(unit, m, v)

    def _store_disk(self, unit: Unit, m: torch.Tensor, v: torch.Tensor) -> Future:
        """Encode (a codec) and write the moments; returns the write's future (disk tier)."""
        try:
            stored = self._encode(m, v)
        except BaseException:
            if self.disk is not None:
                self.pool.give(m, v)
            self.update_failed(unit)
            raise
        fut = None
        if self.disk is not None:
            # Written behind; the next load waits until at most ``writes_behind`` are pending,
            # so the moments of only a few units are ever in RAM, and the step's last update
            # (nothing after it) never waits for a write.
            fut, spare = self._write(unit, stored, adopt=True)  # bounded in load()
            if self._codec is None:
                self._writes.append(fut)
            if spare is not None:    # the host cache kept the written tensors themselves
                if self.codecs is None:
                    self.pool.give(*spare.values())   # its previous copy, to be read into next
                else:
                    self.pool.give(m, v)
            elif self.codecs is None:  # the moments are what is written: recycle them once written
                fut.add_done_callback(lambda f, a=m, b=v: self.pool.give(a, b))
            else:                    # decoded scratch: the codes are written, the moments are free
                self.pool.give(m, v)
            self._on_disk.add(unit.index)
        self._stored(unit, stored)
        return fut

    def _stored(self, unit: Unit, stored: Dict[str, torch.Tensor]) -> None:
        """A unit's update stored its states (``stored``: kept as they are in RAM without a disk
        tier, else its write is issued): reads of it may go ahead again."""
        if self.disk is None:
            self.ram[unit.index] = stored
        with self._lock:
            self._updating.discard(unit.index)
        if self.disk is not None:
            self._read_ahead()   # reads skipped while it was being updated now follow its write

    def wait_encodes(self) -> None:
        """Every update's encode done and its write issued (the codec thread); raises the first
        failure (its unit's states were not written)."""
        for i in list(self._encoding):
            f = self._encoding.pop(i, None)
            if f is not None:
                _settle(f)

    def _drop_codec_work(self) -> None:
        """Before states are replaced (a checkpoint loaded): pending encodes finish first (their
        writes must not land after the new states); moments decoded ahead are dropped."""
        for f in list(self._encoding.values()):
            try:
                _settle(f)
            except BaseException:  # noqa: BLE001 - the states are being replaced
                pass
        self._encoding.clear()
        with self._lock:
            ahead, self._decoded = list(self._decoded.values()), {}
        for f in ahead:
            try:
                self.pool.give(*f.result())
            except BaseException:  # noqa: BLE001
                pass

    def close(self) -> None:
        if self._codec is not None:
            self._codec.shutdown(wait=True)
            self._decoder.shutdown(wait=True)

    def update_failed(self, unit: Unit) -> None:
        """The unit's update failed between load() and store(): reads of it may go ahead."""
        with self._lock:
            self._updating.discard(unit.index)

    def _write(self, unit: Unit, stored: Dict[str, torch.Tensor], adopt: bool = False):
        """Write a unit's stored states to the disk tier; a read-ahead of them issued before
        this write is dropped and issued again after it.

        Read-after-write: the next step's read-ahead (``schedule``, in the caller's thread)
        may read a unit while its update is still running in the optimizer thread, so before
        that update's write is issued. DiskStore orders a read only after the writes issued
        before it, so such a read returns the moments of the step before, and the next update
        used them: disk-tier runs differed from RAM runs (most with no accumulation, where the
        next forward starts while the updates still run). Under ``_lock``, which ``prefetch``
        holds to issue a read, every read of a unit's states is issued after its last write.

        ``adopt`` (the update's own write): a host cache that keeps the key resident takes
        ``stored`` without copying it (HostCache.write_adopt); returns (future, the tensors
        handed back in exchange, or None when ``stored`` stays the caller's). Else the future."""
        spare = None
        with self._lock:
            if adopt and self._cached():
                fut, spare = self.disk.write_adopt(self._key(unit), stored)
            else:
                fut = self.disk.write(self._key(unit), stored)
            stale = self._reads.pop(unit.index, None)
        self._on_disk.add(unit.index)
        if stale is not None:
            if self.codecs is None:  # its buffers go back to the pool once it has filled them
                stale.add_done_callback(lambda f: f.exception() or self.pool.give(*f.result().values()))
            self.prefetch(unit)
        return (fut, spare) if adopt else fut

    def flush(self) -> None:
        self.wait_encodes()
        if self.disk is not None:
            self.disk.flush()

    def on_disk(self, unit: Unit) -> bool:
        """Whether a unit's stored states are a file of the disk tier (else in RAM, or none yet)."""
        return self.disk is not None and unit.index in self._on_disk

    def key(self, unit: Unit) -> str:
        """The disk tier's key of a unit's stored states."""
        return self._key(unit)

    def stored_nbytes(self, unit: Unit) -> int:
        """Bytes of a unit's two moments in their stored form."""
        return self._stored_nbytes(unit)

    def _key(self, unit: Unit) -> str:
        return f"adam-{unit.index:05d}"

    # ------------------------------------------------------------------ accounting
    def nbytes(self) -> dict:
        host = sum(t.numel() * t.element_size() for s in self.ram.values() for t in s.values())
        with self._lock:
            ahead = [u for u in self.units if u.index in self._reads]
        # states read ahead (in flight or waiting for their update) and recycled buffers kept
        buffers = sum(self._stored_nbytes(u) for u in ahead) + self.pool.nbytes()
        # moments decoded ahead of their update or waiting to be encoded (codec thread)
        codec = set(self._decoded) | set(self._encoding)
        buffers += sum(8 * train_numel(u) for u in self.units if u.index in codec)
        buffers += self.ring.nbytes() if self.ring is not None else 0   # chunked updates' moments (and codes)
        out = {"host": host, "disk": 0, "host_buffers": buffers, "cached": 0}
        if self.disk is not None:
            out["disk"] = sum(self.disk.nbytes_of(self._key(u)) for u in self.units if u.index in self._on_disk)
            # held in RAM by the disk tier's host cache (some perhaps never written to disk)
            if hasattr(self.disk, "resident_bytes"):
                out["cached"] = self.disk.resident_bytes([self._key(u) for u in self.units])
            try:
                import shutil

                out["disk_capacity"] = shutil.disk_usage(self.disk.root).free + out["disk"]
            except OSError:
                out["disk_capacity"] = None
        return out

    # ------------------------------------------------------------------ save / resume
    def save(self, path, adam) -> None:
        from safetensors.torch import save_file

        tensors = {}
        for u in self.units:
            stored = self.stored(u)
            if stored is None:
                continue
            for k, t in stored.items():
                tensors[f"{u.name}/{k}"] = t.contiguous()
        for k, t in adam.state_dict().items():
            tensors[f"step/{k}"] = t.reshape(1)
        save_file(tensors, os.path.join(path, "optimizer_states.safetensors"),
                  metadata={"codec": self.codec_name, "format": "megatrain_nb-adam-v1"})

    def load_saved(self, path, adam) -> None:
        from safetensors import safe_open

        f = os.path.join(path, "optimizer_states.safetensors")
        if not os.path.exists(f):
            raise FileNotFoundError(f"{path} has no optimizer_states.safetensors; it is not an engine checkpoint.")
        with safe_open(f, "pt") as fh:
            codec = (fh.metadata() or {}).get("codec", "none")
            if codec != self.codec_name:
                raise ValueError(f"the checkpoint's optimizer states use codec {codec!r} but this engine uses "
                                 f"{self.codec_name!r}; set optimizer_compression={codec!r} to resume it.")
            keys = list(fh.keys())
            steps = {k.split("/", 1)[1]: fh.get_tensor(k).reshape(()) for k in keys if k.startswith("step/")}
            adam.load_state_dict(steps)
            writes = WriteWindow(2)  # a few units' states in RAM at once
            self._drop_codec_work()
            for u in self.units:
                prefix = f"{u.name}/"
                stored = {k[len(prefix):]: fh.get_tensor(k) for k in keys if k.startswith(prefix)}
                if not stored:
                    continue
                if self.disk is not None:
                    writes.add(self._write(u, stored))
                else:
                    self.ram[u.index] = stored
        self.flush()


    def stored(self, unit: Unit) -> Optional[Dict[str, torch.Tensor]]:
        """A unit's moments in their stored form (codes and scales, or fp32); None before its
        first update."""
        enc = self._encoding.get(unit.index)
        if enc is not None:
            _settle(enc)
        if self.disk is not None and unit.index in self._on_disk:
            return self.disk.read(self._key(unit), outside_plan=True).result()
        return self.ram.get(unit.index)

    def put_stored(self, unit: Unit, stored: Dict[str, torch.Tensor]) -> None:
        """Replace a unit's moments with ``stored`` (their stored form, from a sharded
        checkpoint). Waits for the write: one unit's states in RAM at a time."""
        if self.disk is not None:
            self._drop_codec_work()
            self._write(unit, stored).result()
        else:
            self._drop_codec_work()
            self.ram[unit.index] = stored


def _settle_timed(f: Future) -> float:
    """Seconds :func:`_settle` waited for a pending write (a failed one raises)."""
    t0 = time.perf_counter()
    _settle(f)
    return time.perf_counter() - t0


def _settle(f: Future):
    """Wait for a pending state write: a write's future, or a codec job's that returns one."""
    got = f.result()
    return got.result() if isinstance(got, Future) else got


def stored_state_bytes(units, codec_name: str) -> int:
    """Bytes of both Adam moments of all units in their stored form."""
    if codec_name == "none":
        return sum(2 * train_numel(u) * 4 for u in units)
    return sum(get_codec(codec_name, r).encoded_nbytes(train_numel(u)) for u in units for r in _ROLES)


def open_disk_tier(units, config, params_on_disk: bool):
    """The disk tier under ``config.offload_dir`` (optimizer states; master weights when
    ``params_on_disk``), or None without an offload_dir."""
    if not config.offload_dir:
        return None
    need = stored_state_bytes(units, config.optimizer_compression)
    if params_on_disk:
        need += sum(u.numel for u in units) * 4
    prepare_offload_dir(config.offload_dir, need)  # created (0700) with its parents when missing
    # The engine bounds the memory its disk operations hold itself (staging pools, states
    # read ahead / written behind); the store queues whatever it is given.
    return DiskStore(config.offload_dir, reserve_bytes=need, keep=config.keep_offload_files)
