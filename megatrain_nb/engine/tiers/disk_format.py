"""The disk tier's file format and raw I/O: what :class:`~.disk_store.DiskStore` and
:class:`~.disk_ranged.RangedRewrite` both write and read.

File layout (``<key>-<hash>.mtd``), one file per key::

    [0, H)          header: magic b"MTNBDS\\x00\\x01", u64 json length, u32 crc32(json), json
                    {"key", "file_size", "tensors": [{"name", "dtype", "shape", "offset",
                    "nbytes", "xxh3"}]}
    [offset, ...)   each tensor's raw bytes, back to back: tensors of 1 MiB or more start on a
                    4096-byte boundary, smaller ones are packed at 64 bytes
    ... file_size   zero padding to a multiple of 4096 (the direct-I/O block)

:func:`read_header` checks the magic, the header checksum, the key and that the file size
matches the header, so a truncated or foreign file is refused with ``OffloadError``; each
tensor's entry also carries the xxh3-64 of its bytes (:func:`crc`; "crc32" in older files), checked after the read.

Raw I/O: :func:`transfer` moves segments with direct I/O (through a per-thread aligned
:class:`Staging` buffer where memory or offsets are not aligned); :func:`buffered_write` and
:func:`buffered_read` go through the page cache, dropping the pages they touched.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import struct
import threading
import zlib

import torch
import xxhash

ALIGN = 4096                      # file offsets and direct-I/O buffers are aligned to this
IO_CHUNK = 32 << 20               # bytes per read/write syscall (large sequential I/O)
ALIGN_MIN = 1 << 20               # tensors this large start on an ALIGN boundary in the file
PACK = 64                         # smaller tensors are packed at this alignment
BUFFERED_SYNC_EVERY = 256 << 20   # buffered mode: fdatasync + drop pages this often
MAGIC = b"MTNBDS\x00\x01"
PREFIX = struct.Struct("<8sQI")   # magic, json length, crc32(json)
SUFFIX = ".mtd"


class OffloadError(RuntimeError):
    """The disk tier could not be used: the message names the path, the bytes needed and what
    to do about it."""


def align_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


#: Buffers from this size up get a mapping of their own (:func:`aligned_empty`).
OWN_MAPPING_MIN = 1 << 20


def aligned_empty(shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised CPU tensor whose data starts on a 4096-byte boundary, so that
    ``DiskStore`` can read and write it with direct I/O without a staging copy.

    From :data:`OWN_MAPPING_MIN` bytes up it is an anonymous mapping of its own (whole pages),
    given back to the OS when the tensor dies: the disk tier's unit-sized buffers never stay in
    the heap, so RAM stays flat while units stream through it, without pinning glibc's mmap
    threshold for the whole process (that made every torch temporary of 1 MiB or more a fresh
    mapping, faulted in and zeroed page by page: ~440 MiB of page faults a step, ~0.5 core-s, for
    the 33M-parameter model of ``bench_overlap``, the compute's own temporaries included).
    Smaller ones come from torch's allocator with room to align. :func:`aligned_storage_bytes`
    is what the storage holds.

    >>> t = aligned_empty((3, 5), torch.bfloat16)
    >>> t.data_ptr() % 4096
    0
    >>> big = aligned_empty(1 << 20)
    >>> big.data_ptr() % 4096, big.untyped_storage().nbytes() == aligned_storage_bytes(4 << 20)
    (0, True)
    """
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    numel = 1
    for s in shape:
        numel *= int(s)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes >= OWN_MAPPING_MIN:
        raw = torch.frombuffer(anonymous_mapping(align_up(nbytes)), dtype=torch.uint8)   # page aligned
        return raw[:nbytes].view(dtype).view(shape)
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    off = (-raw.data_ptr()) % ALIGN
    return raw[off:off + nbytes].view(dtype).view(shape)


#: Mappings from this size up ask for transparent huge pages (the x86-64 PMD size).
HUGE_PAGE = 2 << 20


def anonymous_mapping(nbytes: int) -> mmap.mmap:
    """``nbytes`` (whole pages) of private anonymous memory, backed by transparent huge pages where
    the kernel allows (``madvise(MADV_HUGEPAGE)`` from :data:`HUGE_PAGE` up; a no-op where THP is
    off).

    Private, not ``mmap.mmap(-1, n)``'s default ``MAP_SHARED``: shared anonymous memory is shmem,
    each page a page-cache page (a fault 1.2 core-s per GiB faulted in, against 0.6-0.7 private),
    and a process forked later would write into the same pages. Huge pages, because these buffers
    are what the disk tier's direct I/O pins and maps page by page: with 4 KiB pages the kernel's
    pinning (``gup_fast``) and bio building took 0.06-0.08 core-s per GiB moved (about dd's), with
    2 MiB pages 0.010-0.013; a fresh buffer faults in 0.13-0.3 core-s per GiB (measured on this
    project's 2-core VM, kernel 6.18, 16 MiB reads and writes with ``O_DIRECT``). A huge page is
    only used where the mapping covers it whole, so the buffer takes no more RAM than its pages."""
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    if nbytes >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:   # (THP compiled out, or refused: plain pages)
            pass
    return mm


def aligned_storage_bytes(nbytes: int) -> int:
    """The bytes of the storage under :func:`aligned_empty` of ``nbytes`` (what it holds in RAM)."""
    return align_up(nbytes) if nbytes >= OWN_MAPPING_MIN else nbytes + ALIGN


def bytes_view(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's memory (no copy)."""
    return t.detach().reshape(-1).view(torch.uint8)


def as_numpy(t: torch.Tensor):
    return t.numpy()


class Staging(threading.local):
    """A page-aligned ``IO_CHUNK``-byte buffer per I/O thread (so ``io_threads * 32 MiB``)."""

    def get(self) -> tuple[torch.Tensor, memoryview]:
        if not hasattr(self, "buf"):
            self.mm = anonymous_mapping(IO_CHUNK)      # anonymous mmap: page aligned
            self.buf = torch.frombuffer(self.mm, dtype=torch.uint8)
            self.mv = memoryview(self.mm)
        return self.buf, self.mv


def pwrite_all(fd: int, mv, offset: int) -> None:
    mv = memoryview(mv).cast("B")
    while len(mv):
        n = os.pwrite(fd, mv, offset)
        mv, offset = mv[n:], offset + n


def pread_all(fd: int, mv, offset: int) -> None:
    mv = memoryview(mv).cast("B")
    while len(mv):
        n = os.preadv(fd, [mv], offset)
        if n == 0:
            raise OSError(errno.EIO, "unexpected end of file")
        mv, offset = mv[n:], offset + n


def large_unaligned(dest: torch.Tensor) -> bool:
    """A destination too large for the staging buffer whose memory cannot take direct I/O."""
    return dest.numel() >= ALIGN_MIN and dest.data_ptr() % ALIGN != 0


def buffered_read(path: str, segments) -> None:
    """Read [(file offset, uint8 tensor)] through the page cache, dropping each chunk's pages."""
    fd = os.open(path, os.O_RDONLY)
    try:
        for off, dest in segments:
            arr = as_numpy(dest)
            for a in range(0, len(arr), IO_CHUNK):
                b = min(a + IO_CHUNK, len(arr))
                pread_all(fd, arr[a:b], off + a)
                drop_cache(fd, off + a, b - a)
        drop_cache(fd)  # and whatever the kernel read ahead past the end
    finally:
        os.close(fd)


def drop_cache(fd: int, offset: int = 0, length: int = 0) -> None:
    try:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    except (AttributeError, OSError):
        pass

def probe_direct_io(folder: str) -> bool:
    """True if ``folder``'s filesystem accepts O_DIRECT writes of aligned buffers."""
    if not hasattr(os, "O_DIRECT"):
        return False
    path = _probe_path(folder, "direct-io")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        with mmap.mmap(-1, ALIGN) as mm:
            os.pwrite(fd, mm, 0)
        return True
    except OSError:
        return False
    finally:
        _close_and_remove(fd, path)


def _probe_path(folder: str, what: str) -> str:
    """A probe file's name of this process's and thread's own (two stores on one folder, in two
    ranks or two threads, probe at once)."""
    return os.path.join(folder, f".{what}-probe-{os.getpid()}-{threading.get_ident()}")


def _close_and_remove(fd: int, path: str) -> None:
    os.close(fd)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass



def layout(key: str, items, crcs=None) -> tuple[bytes, list[int], int]:
    """Header bytes, each tensor's offset and the file size (a multiple of ALIGN).

    Tensors of at least ``ALIGN_MIN`` bytes start on an ALIGN boundary (so aligned memory moves
    with zero-copy direct I/O); smaller ones are packed at ``PACK`` bytes after the header, so
    small files stay small. ``crcs``: the tensors' checksums when ``items`` hold no data yet."""
    reserved = 256
    crcs = [crc(t) for _, t in items] if crcs is None else crcs
    while True:
        cursor, entries = round_up(reserved, PACK), []
        for (name, t), checksum in zip(items, crcs):
            n = t.numel() * t.element_size()
            off = align_up(cursor) if n >= ALIGN_MIN else round_up(cursor, PACK)
            entries.append({"name": name, "dtype": str(t.dtype).removeprefix("torch."),
                            "shape": list(t.shape), "offset": off, "nbytes": n, CHECKSUM: checksum})
            cursor = off + n
        file_size = align_up(cursor)
        header = header_bytes(key, file_size, entries)
        if len(header) <= reserved:
            return header, [e["offset"] for e in entries], file_size
        reserved = len(header) + 64


def header_bytes(key: str, file_size: int, entries: list[dict]) -> bytes:
    """The header: prefix (magic, json length, crc32 of the json) and the json itself."""
    body = json.dumps({"key": key, "file_size": file_size, "tensors": entries}, separators=(",", ":")).encode()
    return PREFIX.pack(MAGIC, len(body), zlib.crc32(body)) + body


def read_header(fd: int, key: str, path: str, mv: memoryview) -> dict:
    """The checked header of ``key``'s file open as ``fd`` (``mv``: an ALIGN-aligned buffer of
    ``IO_CHUNK`` bytes to read it into); ``OffloadError`` for a short, foreign or damaged file."""
    size = os.fstat(fd).st_size
    if size < ALIGN or size % ALIGN:
        raise OffloadError(f"{path} (key {key!r}) is not a valid DiskStore file "
                           f"({size} bytes)")
    pread_all(fd, mv[:ALIGN], 0)
    magic, length, crc32 = PREFIX.unpack_from(mv, 0)
    header_size = align_up(PREFIX.size + length)
    if magic != MAGIC or header_size > min(size, IO_CHUNK):
        raise OffloadError(f"{path} (key {key!r}) is not a valid DiskStore file")
    if header_size > ALIGN:
        pread_all(fd, mv[:header_size], 0)
    body = bytes(mv[PREFIX.size:PREFIX.size + length])
    meta = json.loads(body) if zlib.crc32(body) == crc32 else None
    if meta is None or meta.get("key") != key or meta.get("file_size") != size:
        raise OffloadError(f"{path} (key {key!r}) is damaged or incomplete "
                           f"({size} bytes on disk)")
    return meta


#: The payload checksum's field: xxh3-64 of the tensor's bytes (the xxhash package; about 7x
#: zlib's crc32 on these machines, so the disk tier's reads and writes spend little CPU on it,
#: and it releases the GIL). Files written before it carry "crc32"; both are checked on read.
CHECKSUM = "xxh3"
WIDEST_CHECKSUM = 2 ** 64 - 1   # room in a header written before its checksums are known


def crc(t: torch.Tensor) -> int:
    """The payload checksum (:data:`CHECKSUM`) of a tensor's bytes."""
    return xxhash.xxh3_64_intdigest(as_numpy(bytes_view(t)) if t.numel() else b"")


def payload_ok(entry: dict, t: torch.Tensor) -> bool:
    """Whether ``t`` matches the checksum its header entry carries (xxh3, or crc32 in files
    written before it; an entry without one passes)."""
    if CHECKSUM in entry:
        return crc(t) == entry[CHECKSUM]
    if "crc32" in entry:
        return (zlib.crc32(as_numpy(bytes_view(t))) if t.numel() else 0) == entry["crc32"]
    return True


class RunningChecksum:
    """A payload checksum taken range by range (the ranged rewrite), of the kind ``field``
    names: :data:`CHECKSUM` for what is written, the old entry's own field for what is read."""

    def __init__(self, field: str = CHECKSUM):
        self.field = field
        self._h = xxhash.xxh3_64() if field == CHECKSUM else None
        self._crc = 0

    def update(self, arr) -> None:
        if self._h is not None:
            self._h.update(arr)
        else:
            self._crc = zlib.crc32(arr, self._crc)

    def value(self) -> int:
        return self._h.intdigest() if self._h is not None else self._crc


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def probe_dio_sector(folder: str) -> int:
    """The smallest direct-I/O alignment ``folder``'s filesystem takes for memory, offsets and
    lengths: 512 where a 512-byte write at offset 512 from memory 512 bytes into a page is
    accepted (ext4 and xfs on most disks: the device's logical block), else :data:`ALIGN`."""
    path = _probe_path(folder, "dio-sector")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except (OSError, AttributeError):
        return ALIGN
    try:
        with mmap.mmap(-1, ALIGN) as mm:
            os.pwrite(fd, memoryview(mm)[512:1024], 512)
        return 512
    except OSError:
        return ALIGN
    finally:
        _close_and_remove(fd, path)


#: Bytes at the end of the staging buffer that :func:`vectored` reads gaps into or writes them from.
GAP_ROOM = 64 << 10


def vectored(fd: int, segments, file_size: int, staging, *, write: bool, sector: int) -> bool:
    """Direct I/O of ``segments`` [(file offset, uint8 tensor)] (sorted, not overlapping) as few
    vectored syscalls (``preadv`` / ``pwritev`` of up to ``IO_CHUNK`` bytes), straight between
    the tensors and the disk: the gaps between them (and, writing, the padding up to
    ``file_size``) come from ``GAP_ROOM`` zeros at the staging buffer's end, and a write's
    unaligned header (the first segment, at offset 0) is copied to the staging buffer's start.
    A file of a unit's weights or its two moments is then one syscall, where :func:`transfer`
    made one per tensor and one per tensor's last partial block: each a sleep and a wake of the
    I/O thread, and the GIL taken back after it, beside the compute. False (nothing done) where
    a segment is not ``sector``-aligned in memory, offset or length: :func:`transfer` then."""
    buf, _ = staging
    if not segments or len(buf) < 2 * GAP_ROOM:
        return False
    gaps = buf[len(buf) - GAP_ROOM:]
    parts: list = []
    cursor = segments[0][0]
    for i, (off, t) in enumerate(segments):
        n = t.numel()
        # (the header's memory may land on a sector by chance, 1 time in 32: its length does not)
        if write and i == 0 and off == 0 and (t.data_ptr() % sector or n % sector):
            head = align_up(n) if len(segments) == 1 else segments[1][0]
            if head > len(buf) - GAP_ROOM or head % sector:
                return False
            buf[:n].copy_(t)
            buf[n:head].zero_()
            parts.append(buf[:head])
            cursor = head
            continue
        if off < cursor or n == 0 or off % sector or n % sector or t.data_ptr() % sector or off - cursor > GAP_ROOM:
            return False
        if off > cursor:
            parts.append(gaps[:off - cursor])
        parts.append(t)
        cursor = off + n
    end = file_size if write else cursor
    if end - cursor > GAP_ROOM or (end - cursor) % sector:
        return False
    if end > cursor:
        parts.append(gaps[:end - cursor])
    if write:
        gaps.zero_()
    offset, batch, size = segments[0][0], [], 0
    for part in parts:
        for a in range(0, part.numel(), IO_CHUNK):
            piece = as_numpy(part[a:a + IO_CHUNK])
            if batch and size + len(piece) > IO_CHUNK:
                _vec_all(fd, batch, offset, write)
                offset, batch, size = offset + size, [], 0
            batch.append(piece)
            size += len(piece)
    if batch:
        _vec_all(fd, batch, offset, write)
    return True


def _vec_all(fd: int, arrays: list, offset: int, write: bool) -> None:
    """``preadv`` / ``pwritev`` of ``arrays`` at ``offset``, again from where a short one stopped."""
    views = [memoryview(a).cast("B") for a in arrays]
    while views:
        n = os.pwritev(fd, views, offset) if write else os.preadv(fd, views, offset)
        if n == 0 and not write:
            raise OSError(errno.EIO, "unexpected end of file")
        offset += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if n:
            views[0] = views[0][n:]


def transfer(fd: int, segments, file_size: int, staging, *, write: bool, sector: int = 0) -> None:
    """Direct I/O of ``segments`` [(file offset, uint8 tensor)], sorted by offset.

    With ``sector`` (the filesystem's direct-I/O alignment, :func:`probe_dio_sector`), segments
    that all keep to it move in vectored syscalls (:func:`vectored`). Else a segment whose memory
    and offset are ALIGN-aligned moves straight between the tensor and
    the disk (its last partial block excepted); everything else is gathered into / scattered
    from the aligned staging buffer in windows of up to ``IO_CHUNK`` bytes, with the gaps
    between segments zero-filled when writing."""
    if sector and vectored(fd, segments, file_size, staging, write=write, sector=sector):
        return
    run: list[tuple[int, torch.Tensor]] = []
    for off, t in segments:
        n = t.numel()
        body = n - n % ALIGN
        if n and off % ALIGN == 0 and body and t.data_ptr() % ALIGN == 0:
            if run:
                staged(fd, run, file_size, staging, write)
                run = []
            arr, move = as_numpy(t), (pwrite_all if write else pread_all)
            for a in range(0, body, IO_CHUNK):
                move(fd, arr[a:min(a + IO_CHUNK, body)], off + a)
            if body < n:
                run.append((off + body, t[body:]))
        elif n:
            run.append((off, t))
    if run:
        staged(fd, run, file_size, staging, write)


def staged(fd: int, run, file_size: int, staging, write: bool) -> None:
    buf, mv = staging
    start = run[0][0] - run[0][0] % ALIGN
    end = min(align_up(run[-1][0] + run[-1][1].numel()), file_size)
    first = 0
    for w in range(start, end, IO_CHUNK):
        wl = min(IO_CHUNK, end - w)
        if not write:
            pread_all(fd, mv[:wl], w)
        cursor = w
        for i in range(first, len(run)):
            off, t = run[i]
            a, b = max(off, w), min(off + t.numel(), w + wl)
            if off >= w + wl:
                break
            if b <= a:
                first = i + 1
                continue
            if write:
                if a > cursor:
                    buf[cursor - w:a - w].zero_()
                buf[a - w:b - w].copy_(t[a - off:b - off])
            else:
                t[a - off:b - off].copy_(buf[a - w:b - w])
            cursor = b
        if write:
            if cursor < w + wl:
                buf[cursor - w:wl].zero_()
            pwrite_all(fd, mv[:wl], w)


def buffered_write(fd: int, segments, file_size: int) -> None:
    """Page-cache writes straight from the tensors; sync and drop the pages as we go."""
    since_sync = 0
    for off, t in segments:
        arr = as_numpy(t)
        for a in range(0, t.numel(), IO_CHUNK):
            pwrite_all(fd, arr[a:a + IO_CHUNK], off + a)
            since_sync += min(IO_CHUNK, t.numel() - a)
            if since_sync >= BUFFERED_SYNC_EVERY:
                os.fdatasync(fd)
                drop_cache(fd)
                since_sync = 0
    os.ftruncate(fd, file_size)

