"""The disk tier's own buffers (``disk_format.aligned_empty`` from 1 MiB up, the I/O threads'
staging): private anonymous mappings that ask for transparent huge pages.

Shared anonymous memory (``mmap.mmap(-1, n)``'s default) is shmem: a fault costs about twice a
private one, and a process forked later writes into the parent's pages. Huge pages cut the
kernel's per-page work of every direct-I/O read and write into these buffers (docs/TIERS.md)."""
from __future__ import annotations

import ctypes
import os

import pytest
import torch

from megatrain_nb.engine.tiers.disk_format import HUGE_PAGE, OWN_MAPPING_MIN, aligned_empty, anonymous_mapping

linux = pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads /proc/self/smaps (Linux)")


def _vm_flags(addr: int) -> set:
    """The VmFlags of the mapping that holds ``addr`` (/proc/self/smaps)."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and line.startswith("VmFlags:"):
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {addr:#x}")


@linux
def test_large_buffers_are_private_mappings_that_ask_for_huge_pages():
    big = aligned_empty(HUGE_PAGE)          # 8 MiB of fp32
    mid = aligned_empty(OWN_MAPPING_MIN // 4)   # 1 MiB: a mapping of its own, under a huge page
    for t in (big, mid):
        assert t.data_ptr() % 4096 == 0
        assert "sh" not in _vm_flags(t.data_ptr())   # not shmem
    assert "hg" in _vm_flags(big.data_ptr())         # MADV_HUGEPAGE
    assert "hg" not in _vm_flags(mid.data_ptr())
    mm = anonymous_mapping(HUGE_PAGE)
    t = torch.frombuffer(mm, dtype=torch.uint8)
    assert {"hg"} <= _vm_flags(t.data_ptr()) and "sh" not in _vm_flags(t.data_ptr())


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_does_not_write_into_the_parents_buffer():
    t = aligned_empty(1 << 20)   # 4 MiB
    t.fill_(1.0)
    pid = os.fork()
    if pid == 0:   # the child: write (libc, not torch: its OpenMP pool does not survive a fork), leave
        ctypes.memset(t.data_ptr(), 0x40, t.numel() * 4)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert float(t.min()) == 1.0 and float(t.max()) == 1.0


def test_a_units_file_moves_in_one_vectored_syscall_each_way(tmp_path, monkeypatch):
    """A unit's two moments (page-aligned buffers, lengths a whole number of 512-byte sectors but
    not of pages, as a layer's are) are written in one ``pwritev`` and read back in the header's
    read and one ``preadv``, not one syscall per tensor and one per tensor's partial last block
    (each a sleep and a wake of an I/O thread beside the compute); the file's bytes are the
    per-tensor path's, and a tensor that does not keep to the sector takes that path."""
    from megatrain_nb.engine.tiers import disk_format as df
    from megatrain_nb.engine.tiers.disk_store import DiskStore
    calls = {"vectored": 0, "pread": 0, "pwrite": 0}

    def counted(name, fn):
        def call(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return call
    monkeypatch.setattr(df, "_vec_all", counted("vectored", df._vec_all))
    monkeypatch.setattr(df, "pread_all", counted("pread", df.pread_all))
    monkeypatch.setattr(df, "pwrite_all", counted("pwrite", df.pwrite_all))
    numel = 3146240   # bench_overlap's layer: 12,584,960 bytes = 24,580 sectors, 3072.5 pages
    m, v = aligned_empty(numel).normal_(), aligned_empty(numel).uniform_()
    with DiskStore(tmp_path) as store:
        if not store.direct_io or store.dio_sector != 512:
            pytest.skip(f"direct I/O at 512-byte sectors not available here (direct_io={store.direct_io})")
        store.write("u", {"exp_avg": m, "exp_avg_sq": v}).result()
        assert calls == {"vectored": 1, "pread": 0, "pwrite": 0}
        got = store.read("u").result()
        assert calls == {"vectored": 2, "pread": 1, "pwrite": 0}
        assert torch.equal(got["exp_avg"], m) and torch.equal(got["exp_avg_sq"], v)
        with open(store.key_path("u"), "rb") as f:
            vectored_bytes = f.read()
        store.dio_sector = 0   # the per-tensor path
        store.write("u", {"exp_avg": m, "exp_avg_sq": v}).result()
        assert calls["pwrite"] >= 5 and calls["vectored"] == 2
        with open(store.key_path("u"), "rb") as f:
            assert f.read() == vectored_bytes
        store.dio_sector = 512
        odd = torch.arange(numel + 3, dtype=torch.float32)   # not a whole number of sectors
        store.write("odd", {"w": odd}).result()
        assert calls["vectored"] == 2
        assert torch.equal(store.read("odd").result()["w"], odd)


def test_a_header_whose_memory_lands_on_a_sector_still_moves_in_one_vectored_write(tmp_path):
    """The header's bytes live in a fresh ``bytearray``; about one time in 32 its memory lands on a
    512-byte boundary by chance. Its length is never a whole number of sectors, so it must still
    be copied to the staging buffer's start: the vectored write once refused such a file and took
    the per-tensor path (a CI run caught it: 5 pwrites where one pwritev was counted)."""
    from megatrain_nb.engine.tiers import disk_format as df
    from megatrain_nb.engine.tiers.disk_store import DiskStore
    numel = 3146240
    m = aligned_empty(numel).normal_()
    with DiskStore(tmp_path) as store:
        if not store.direct_io or store.dio_sector != 512:
            pytest.skip(f"direct I/O at 512-byte sectors not available here (direct_io={store.direct_io})")
        header, offsets, size = df.layout("u", [("w", m)])
        aligned_header = aligned_empty(len(header), torch.uint8)   # its memory on a page, so on a sector
        aligned_header.copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
        assert aligned_header.data_ptr() % 512 == 0 and len(header) % 512
        path = str(tmp_path / "aligned-header.bin")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
        try:
            assert df.vectored(fd, [(0, aligned_header), (offsets[0], df.bytes_view(m))], size,
                               store._staging.get(), write=True, sector=512)
        finally:
            os.close(fd)
        with open(path, "rb") as f:
            data = f.read()
        assert data[:len(header)] == header and len(data) == size
        assert data[offsets[0]:offsets[0] + 4 * numel] == df.bytes_view(m).numpy().tobytes()
