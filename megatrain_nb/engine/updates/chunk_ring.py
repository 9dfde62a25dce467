"""ChunkRing: the moving parts of a chunked update of compressed optimizer states.

A unit's moments are updated ``chunk_numel`` elements at a time (whole codec blocks): each
chunk's codes are decoded into one of ``RING`` pairs of fp32 buffers (in the decoder thread, a
chunk ahead), the caller's ``apply`` runs AdamW on it (its own thread), and it is encoded back
(in the encoder thread, a chunk behind). The codes come from, and go to, either a unit's codes
in RAM (a dict of tensors: views of them) or a ranged rewrite of its file on the disk tier
(``DiskStore.ranged``: each chunk's codes read into, and written from, the ring's own code
buffers), so no unit-sized fp32 moments -- nor, ranged, codes -- ever exist. An update whose
master weights are rewritten range by range too (``WeightStore.ranged_update``) has each chunk's
weights read with its codes (a chunk ahead) and written with them (a chunk behind), through the
ring's own fp32 weight buffers; a final gradient held on the disk tier for a clipping norm
(``final_grads.HeldGradient``) is read with them, a chunk ahead, into the ring's fp32 gradient buffers.
"""
from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Dict, List, Optional, Tuple

import torch

from .codecs import ROLES
from ..tiers.disk_store import aligned_empty

#: Chunks in flight: decoded ahead, in AdamW, encoded behind.
RING = 3


def chunk_bounds(numel: int, chunk: int):
    """``[(a, b), ...]``: the unit's elements in chunks of ``chunk`` (the last one shorter)."""
    return [(a, min(a + chunk, numel)) for a in range(0, numel, chunk)]


def run_on(pool, fn, *args) -> Future:
    """``fn(*args)`` in ``pool``'s thread, or here when there is none (the codec in line)."""
    if pool is not None:
        return pool.submit(fn, *args)
    fut = Future()
    fut.set_result(fn(*args))
    return fut


class ChunkRing:
    """``codecs``: role -> block codec; ``chunk_numel``: elements per chunk (whole blocks)."""

    def __init__(self, codecs: Dict[str, object], chunk_numel: int):
        self.codecs = codecs
        self.chunk_numel = chunk_numel
        self._moments = None   # RING x (m, v) chunk buffers, made on the first update
        self._codes = None     # RING chunks' codes, read from a ranged rewrite
        self._weights = None   # RING chunks' fp32 master weights, read from a ranged rewrite
        self._grads = None     # RING chunks' fp32 final gradients, read from the disk tier
        self._specs: Dict[int, list] = {}   # numel -> its code_specs' items (new_codes)
        #: seconds the caller's thread waited for the disk in :meth:`run` (cumulative): each wait
        #: for a decode or an encode, times the share of that job spent reading or writing the disk
        self.disk_wait = 0.0

    def code_specs(self, numel: int) -> Dict[str, tuple]:
        """name -> (dtype, shape) of the stored codes and scales of ``numel`` elements."""
        out = {}
        for role in ROLES:
            c = self.codecs[role]
            nblocks = -(-numel // c.block)
            out[f"{role}.codes"] = (c.code_dtype, (nblocks * c.block // c.codes_per_byte,))
            out[f"{role}.scales"] = (torch.float32, (nblocks,))
        return out

    def new_codes(self, numel: int) -> Dict[str, torch.Tensor]:
        specs = self._specs.get(numel)
        if specs is None:   # (a model's units come in a few sizes: each one's specs made once)
            specs = self._specs[numel] = list(self.code_specs(numel).items())
        return {k: torch.empty(shape, dtype=dtype) for k, (dtype, shape) in specs}

    def nbytes(self) -> int:
        """The ring's buffers (moments, and codes once a ranged update made them)."""
        out = RING * 8 * self.chunk_numel if self._moments is not None else 0
        if self._codes is not None:
            out += sum(t.numel() * t.element_size() for r in self._codes for d in r.values() for t in d.values())
        out += sum(RING * 4 * self.chunk_numel for b in (self._weights, self._grads) if b is not None)
        return out

    def run(self, numel: int, stored, out, apply, decoder=None, encoder=None, weights=None, grads=None) -> None:
        """Update ``numel`` elements: ``stored`` (codes dict, a ranged rewrite, or None: zeros)
        decoded chunk by chunk (in ``decoder``, a single-thread executor, or in line), ``apply(a,
        b, m, v)`` on each (here), encoded into ``out`` (codes dict or ranged rewrite; in
        ``encoder``). ``weights``: a ranged rewrite of the unit's fp32 weights (``"w"``), each
        chunk's slice read with its codes and written with them; ``apply(a, b, m, v, p)`` then
        gets it. ``grads``: the unit's final gradient read chunk by chunk (``read(a, out)``),
        each chunk's slice passed to ``apply`` last (``apply(a, b, m, v[, p], g)``). A failed
        encode (diverged states) raises here."""
        chunks = chunk_bounds(numel, self.chunk_numel)
        ring = self._ring()
        codes = None if isinstance(stored, dict) or stored is None else self._ring_codes()
        wbufs = None if weights is None else self._ring_weights()
        gbufs = None if grads is None else self._ring_grads()

        io: Dict[tuple, tuple] = {}   # ("d"/"e", chunk) -> (its disk seconds, its seconds)
        disk_in, disk_out = not isinstance(stored, dict) and stored is not None, not isinstance(out, dict)

        def decode(i):
            a, b = chunks[i]
            t0 = time.perf_counter()
            disk = 0.0
            m, v = (t[:b - a] for t in ring[i % RING])
            for role, t in zip(ROLES, (m, v)):
                if stored is None:
                    t.zero_()
                else:
                    r0 = time.perf_counter()
                    part = self._slice(role, stored, a, b, codes and codes[i % RING])
                    disk += (time.perf_counter() - r0) if disk_in else 0.0
                    self.codecs[role].decode(part, t)
            got, r0 = (m, v), time.perf_counter()   # (ranged weights and a held gradient: the disk tier's)
            if wbufs is not None:
                got += (weights.read("w", a, wbufs[i % RING][:b - a]),)
            if gbufs is not None:
                got += (grads.read(a, gbufs[i % RING][:b - a]),)
            io["d", i] = (disk + time.perf_counter() - r0, time.perf_counter() - t0)
            return got

        def encode(i, m, v, *rest):
            a, b = chunks[i]
            t0 = time.perf_counter()
            disk = 0.0
            for role, t in zip(ROLES, (m, v)):
                enc = self.codecs[role].encode(t)
                w0 = time.perf_counter()
                self._put(role, out, a, b, enc)
                disk += (time.perf_counter() - w0) if disk_out else 0.0
            w0 = time.perf_counter()
            if wbufs is not None:
                weights.write("w", a, rest[0])
            io["e", i] = (disk + time.perf_counter() - w0, time.perf_counter() - t0)

        def wait(fut: Future, job: tuple):
            return self._wait(fut, io, job, inline=(decoder if job[0] == "d" else encoder) is None)

        decoded = {0: run_on(decoder, decode, 0)}
        encoded: List[Future] = []
        done = False
        try:
            for i, (a, b) in enumerate(chunks):
                if i + 1 < len(chunks):
                    if i + 1 >= RING:   # chunk i+1's ring slot is free once chunk i+1-RING is encoded
                        wait(encoded[i + 1 - RING], ("e", i + 1 - RING))
                    decoded[i + 1] = run_on(decoder, decode, i + 1)
                got = wait(decoded.pop(i), ("d", i))
                apply(a, b, *got)
                encoded.append(run_on(encoder, encode, i, *got))
            for i, f in enumerate(encoded):   # (a failed encode raises here)
                wait(f, ("e", i))
            done = True
        finally:   # nothing may still write into the ring (a failure: the next update reuses it)
            for f in [] if done else list(decoded.values()) + encoded:
                try:
                    f.result()
                except BaseException:  # noqa: BLE001 - already raising
                    pass

    # ------------------------------------------------------------------ internals
    def _wait(self, fut: Future, io: dict, job: tuple, inline: bool):
        """``fut``'s result, the disk's share of the job waited for added to :attr:`disk_wait`
        (a job run in line: its disk time, this thread's own)."""
        t0 = time.perf_counter()
        got = fut.result()
        disk, total = io.get(job, (0.0, 0.0))
        if disk > 0:
            self.disk_wait += disk if inline else (time.perf_counter() - t0) * min(disk / max(total, 1e-9), 1.0)
        return got

    def _ring(self):
        if self._moments is None:

            self._moments = [(aligned_empty(self.chunk_numel), aligned_empty(self.chunk_numel)) for _ in range(RING)]
        return self._moments

    def _ring_weights(self):
        if self._weights is None:
            self._weights = self._fp32_chunks()
        return self._weights

    def _ring_grads(self):
        if self._grads is None:
            self._grads = self._fp32_chunks()
        return self._grads

    def _fp32_chunks(self):

        return [aligned_empty(self.chunk_numel) for _ in range(RING)]

    def _ring_codes(self):
        if self._codes is None:
            specs = self.code_specs(self.chunk_numel)
            self._codes = [{r: {k: torch.empty(specs[f"{r}.{k}"][1], dtype=specs[f"{r}.{k}"][0])
                                for k in ("codes", "scales")} for r in ROLES} for _ in range(RING)]
        return self._codes

    def _ranges(self, role: str, a: int, b: int) -> Dict[str, Tuple[int, int]]:
        """Where the codes and scales of elements ``[a, b)`` are (``a`` on a block boundary)."""
        c = self.codecs[role]
        lo, hi = a // c.block, -(-b // c.block)
        return {"codes": (lo * c.block // c.codes_per_byte, hi * c.block // c.codes_per_byte), "scales": (lo, hi)}

    def _slice(self, role: str, codes, a: int, b: int, ring: Optional[dict] = None) -> Dict[str, torch.Tensor]:
        """The codes and scales of elements ``[a, b)``: views of ``codes`` (a unit's), or read
        into ``ring``'s buffers from ``codes`` when it is a ranged rewrite's old version."""
        spans = self._ranges(role, a, b)
        if isinstance(codes, dict):
            return {k: codes[f"{role}.{k}"][s:e] for k, (s, e) in spans.items()}
        return {k: codes.read(f"{role}.{k}", s, ring[role][k][:e - s]) for k, (s, e) in spans.items()}

    def _put(self, role: str, out, a: int, b: int, encoded: Dict[str, torch.Tensor]) -> None:
        """A chunk's new codes into ``out`` (a unit's codes, or a ranged rewrite's new version)."""
        spans = self._ranges(role, a, b)
        for k, val in encoded.items():
            if isinstance(out, dict):
                out[f"{role}.{k}"][spans[k][0]:spans[k][1]].copy_(val)
            else:
                out.write(f"{role}.{k}", spans[k][0], val)
