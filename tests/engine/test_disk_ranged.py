"""DiskStore.ranged: a key's new version written range by range beside its old one read range
by range -- ordered as a write, checksummed, committed by rename, aborted without a trace."""
import errno

import pytest
import torch

from megatrain_nb.engine.tiers import disk_store
from megatrain_nb.engine.tiers.disk_store import DiskStore, OffloadError

SPECS = {"a": (torch.float32, (5000,)), "c": (torch.uint8, (3000,))}


def _store(tmp_path):
    s = DiskStore(tmp_path)
    a, c = torch.randn(5000), torch.randint(0, 255, (3000,), dtype=torch.uint8)
    s.write("k", {"a": a, "c": c}).result()
    return s, a, c


def _rewrite(rw, step_a=700, step_c=1024):
    got_a, got_c = torch.empty(5000), torch.empty(3000, dtype=torch.uint8)
    for i in range(0, 5000, step_a):
        rw.read("a", i, got_a[i:i + step_a])
        rw.write("a", i, got_a[i:i + step_a] * 2)
    for i in range(0, 3000, step_c):
        rw.read("c", i, got_c[i:i + step_c])
        rw.write("c", i, got_c[i:i + step_c] + 1)


def test_a_ranged_rewrite_is_ordered_as_a_write_and_reads_back_whole(tmp_path):
    s, a, c = _store(tmp_path)
    rw = s.ranged("k", SPECS, read_old=True)
    _rewrite(rw)
    later = s.read("k")              # issued during the rewrite: waits for its commit
    assert not later.done()
    assert rw.commit() == s.nbytes_of("k")   # (inline; the engine commits behind)
    got = later.result()
    assert torch.equal(got["a"], a * 2) and torch.equal(got["c"], c + 1)
    fresh = s.ranged("x", SPECS, read_old=False)   # a new key: nothing to read
    fresh.write("a", 0, a)
    fresh.write("c", 0, c)
    fresh.commit()
    assert torch.equal(s.read("x").result()["a"], a)
    s.close()


def test_ranges_out_of_order_or_short_are_refused_and_abort_keeps_the_old_version(tmp_path):
    s, a, c = _store(tmp_path)
    rw = s.ranged("k", SPECS, read_old=True)
    with pytest.raises(ValueError, match="out of order"):
        rw.read("a", 100, torch.empty(10))
    rw.write("a", 0, torch.zeros(10))
    with pytest.raises(ValueError, match="out of order"):
        rw.write("a", 20, torch.zeros(10))
    with pytest.raises(ValueError, match="not written whole"):
        rw.commit()
    got = s.read("k").result()   # aborted: the old version, no temporary file left
    assert torch.equal(got["a"], a) and torch.equal(got["c"], c)
    assert not [p for p in tmp_path.rglob("*") if ".tmp" in p.name]
    s.close()


def test_a_corrupted_old_version_and_a_full_disk_fail_clearly(tmp_path, monkeypatch):
    s, a, c = _store(tmp_path)
    path = s.key_path("k")
    with open(path, "r+b") as f:   # flip a byte of "c" (the last tensor, packed after "a")
        f.seek(-4096 - 1, 2)
        byte = f.read(1)
        f.seek(-4096 - 1, 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    rw = s.ranged("k", SPECS, read_old=True)
    with pytest.raises(OffloadError, match="does not match its checksum"):
        _rewrite(rw)
    rw.abort(None)
    s.write("k", {"a": a, "c": c}).result()

    def full(fd, data, off):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(disk_store.os, "pwrite", full)
    rw = s.ranged("k", SPECS, read_old=True)
    with pytest.raises(OffloadError, match="needs .* bytes"):
        _rewrite(rw)
    rw.abort(None)
    monkeypatch.undo()
    got = s.read("k").result()
    assert torch.equal(got["a"], a) and torch.equal(got["c"], c)
    assert not [p for p in tmp_path.rglob("*") if ".tmp" in p.name]
    s.close()


def test_a_commit_behind_orders_the_next_read_and_reports_its_failure_at_flush(tmp_path, monkeypatch):
    s, a, c = _store(tmp_path)
    rw = s.ranged("k", SPECS, read_old=True)
    _rewrite(rw)
    fut = rw.commit(behind=True)
    got = s.read("k").result()          # after the rename
    assert fut.done() and torch.equal(got["a"], a * 2)
    rw = s.ranged("k", SPECS, read_old=True)
    _rewrite(rw)
    monkeypatch.setattr(disk_store.os, "fdatasync", lambda fd: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
    fut = rw.commit(behind=True)
    with pytest.raises(OffloadError, match="failed"):
        s.flush()
    monkeypatch.undo()
    assert isinstance(fut.exception(), OffloadError)
    assert torch.equal(s.read("k").result()["a"], a * 2)   # the version before stays
    s.close()


def test_aligned_ranges_go_by_direct_io_and_read_back_in_ranges(tmp_path, monkeypatch):
    """Where the store uses direct I/O, a range of whole aligned blocks from aligned memory (a
    large tensor's chunks) is written through the file's O_DIRECT descriptor, the rest (its
    unaligned tail, a small packed tensor) buffered; the committed file reads back equal, whole
    and through ``read_ranged`` a range at a time (its checksum checked at the last one)."""
    from megatrain_nb.engine.tiers import disk_ranged

    s = DiskStore(tmp_path)
    big = torch.randn((3 << 18) + 100)   # 3 MiB + 400 B: starts on an aligned offset
    small = torch.randint(0, 255, (3000,), dtype=torch.uint8)
    src = disk_store.aligned_empty(big.numel())
    src.copy_(big)
    fds = []
    real = disk_ranged.pwrite_all
    monkeypatch.setattr(disk_ranged, "pwrite_all", lambda fd, mv, off: fds.append(fd) or real(fd, mv, off))
    rw = s.ranged("k", {"big": (torch.float32, tuple(big.shape)), "small": (torch.uint8, (3000,))}, read_old=False)
    direct = rw.dfd
    assert (direct is not None) == s.direct_io
    step = 1 << 18   # 1 MiB of fp32
    for a in range(0, big.numel(), step):
        rw.write("big", a, src[a:a + step])
    rw.write("small", 0, small)
    rw.commit()
    if s.direct_io:
        assert fds[:3] == [direct] * 3 and direct not in fds[3:]   # the tail, the small one, the header: buffered
    got = s.read("k").result()
    assert torch.equal(got["big"], big) and torch.equal(got["small"], small)
    for step in (100_000, 1 << 18):   # unaligned ranges (buffered), then aligned ones (direct where used)
        rr = s.read_ranged("k")
        out = disk_store.aligned_empty(big.numel())
        for a in range(0, big.numel(), step):
            rr.read("big", a, out[a:a + step])
        rr.close()
        assert torch.equal(out, big) and rr.fd is None and rr.dfd is None
    s.write("k", {"big": big}).result()   # a write after the ranged read goes ahead (it was closed)
    s.close()
