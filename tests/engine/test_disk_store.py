"""DiskStore: round trips, ordering, permissions, cleanup, and failing clearly on a full disk."""

import errno
import os
import stat
import threading
import time

import pytest
import torch

from megatrain_nb.engine.tiers import disk_format, disk_store
from megatrain_nb.engine.tiers.disk_store import ALIGN, DiskStore, OffloadError, aligned_empty


def sample(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "codes": torch.randint(-128, 127, (5000,), dtype=torch.int8, generator=g),
        "scales": torch.rand(20, generator=g),
        "w": torch.randn(3, 7, generator=g).to(torch.bfloat16),
        "flag": torch.tensor(True),
        "empty": torch.empty(0, 4),
    }


def assert_same(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(params=["direct", "buffered"])
def store(request, tmp_path, monkeypatch):
    if request.param == "buffered":     # the fallback used where O_DIRECT is refused (tmpfs...)
        monkeypatch.setattr(disk_store, "probe_direct_io", lambda folder: False)
    s = DiskStore(tmp_path, io_threads=2)
    yield s
    s.close()


def test_write_read_round_trip(store):
    data = sample()
    assert store.write("layers.0/adam", data).result() == store.nbytes_of("layers.0/adam")
    got = store.read("layers.0/adam").result()
    assert_same(got, data)
    for t in got.values():                          # read() allocates direct-I/O ready memory
        assert t.data_ptr() % ALIGN == 0 or t.numel() == 0


@pytest.mark.parametrize("align_min", [4096, 1 << 30])
def test_large_tensors_zero_copy_and_staged(store, monkeypatch, align_min):
    # small chunks and threshold: exercises zero-copy runs, staged windows and ragged tails
    monkeypatch.setattr(disk_format, "IO_CHUNK", 64 * 1024)
    monkeypatch.setattr(disk_format, "ALIGN_MIN", align_min)
    x = aligned_empty(100_003).copy_(torch.randn(100_003))
    data = {"s": torch.arange(7, dtype=torch.int16), "x": x, "y": torch.randn(50_001),
            "t": torch.ones(3, dtype=torch.uint8), "z": torch.randn(4096)}
    store.write("big", data).result()
    out = {"x": torch.empty(100_003), "y": aligned_empty(50_001), "z": aligned_empty(4096)}
    got = store.read("big", out).result()
    assert_same(got, data)
    assert_same(store.read("big").result(), data)


def test_reads_into_provided_buffers(store):
    data = sample(1)
    store.write("k", data)
    out = {"codes": torch.empty(5000, dtype=torch.int8), "w": aligned_empty((21,), torch.bfloat16)}
    ptrs = {k: t.data_ptr() for k, t in out.items()}
    got = store.read("k", out).result()
    assert got["codes"] is out["codes"] and got["w"] is out["w"]
    assert {k: out[k].data_ptr() for k in out} == ptrs          # no reallocation
    assert torch.equal(out["codes"], data["codes"])
    assert torch.equal(out["w"], data["w"].reshape(-1))
    assert torch.equal(got["scales"], data["scales"])           # the rest is allocated
    with pytest.raises(ValueError, match="scales"):
        store.read("k", {"scales": torch.empty(21)}).result()
    with pytest.raises(ValueError, match="not stored"):
        store.read("k", {"nope": torch.empty(1)}).result()


def test_read_after_write_of_the_same_key_sees_the_new_data(store, monkeypatch):
    release = threading.Event()
    real = disk_format.pwrite_all

    def slow(fd, mv, offset):
        release.wait(5)
        real(fd, mv, offset)

    store.write("k", {"x": torch.zeros(1000)}).result()
    monkeypatch.setattr(disk_format, "pwrite_all", slow)
    w1 = store.write("k", {"x": torch.ones(1000)})
    w2 = store.write("k", {"x": torch.full((1000,), 2.0)})
    r = store.read("k")
    assert not r.done()                             # waits for both writes, in order
    release.set()
    assert float(r.result()["x"][0]) == 2.0
    assert w1.done() and w2.done()
    store.wait_key("k")
    assert float(store.read("k").result()["x"][0]) == 2.0


def test_other_keys_do_not_wait(tmp_path, monkeypatch):
    with DiskStore(tmp_path, io_threads=2) as s:
        s.write("b", {"x": torch.ones(10)}).result()
        release = threading.Event()
        real = disk_format.pwrite_all
        monkeypatch.setattr(disk_format, "pwrite_all",
                            lambda fd, mv, off: (release.wait(5), real(fd, mv, off)))
        w = s.write("a", {"x": torch.zeros(10)})
        assert float(s.read("b").result(timeout=5)["x"][0]) == 1.0
        assert not w.done()
        release.set()
        w.result()


def test_permissions_and_cleanup(tmp_path):
    s = DiskStore(tmp_path)
    assert os.path.dirname(s.path) == str(tmp_path)
    assert os.path.basename(s.path).startswith(f"megatrain-{os.getpid()}-")
    assert stat.S_IMODE(os.stat(s.path).st_mode) == 0o700
    s.write("a", sample()).result()
    s.write("b/c", {"x": torch.ones(3)}).result()
    files = os.listdir(s.path)
    assert len(files) == 2
    for f in files:
        assert stat.S_IMODE(os.stat(os.path.join(s.path, f)).st_mode) == 0o600
    s.close()
    assert not os.path.exists(s.path)
    assert os.listdir(tmp_path) == []
    s.close()                                       # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        s.write("a", {"x": torch.ones(1)})


def test_keep_leaves_the_files(tmp_path):
    with DiskStore(tmp_path, keep=True) as s:
        s.write("a", {"x": torch.ones(3)})
    assert len(os.listdir(s.path)) == 1             # close() waited for the pending write


def test_missing_root_is_created_and_bad_root_names_the_path(tmp_path):
    with DiskStore(tmp_path / "new" / "dir") as s:
        assert os.path.isdir(s.path)
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(OffloadError, match=str(not_a_dir)):
        DiskStore(not_a_dir / "sub")


def test_unwritable_root_names_the_path(tmp_path, monkeypatch):
    def refuse(*a, **k):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(disk_store.tempfile, "mkdtemp", refuse)
    with pytest.raises(OffloadError, match=f"{tmp_path}.*Permission denied"):
        DiskStore(tmp_path)


def test_read_only_root(tmp_path):
    """As root (CI) the store is opened by an unprivileged user in a forked child."""
    from pathlib import Path

    from ..privileges import as_user, shared_dir

    root = os.geteuid() == 0
    ro = Path(shared_dir(None, "ro") if root else tmp_path) / "ro"
    ro.mkdir(mode=0o500)

    def open_store():
        try:
            DiskStore(ro).close()
        except OffloadError as e:
            return str(e)
        return "accepted"
    ok, msg = as_user(open_store) if root else (True, open_store())
    assert ok and str(ro) in msg, msg


def test_reserve_bytes_checked_up_front(tmp_path):
    free = disk_store.shutil.disk_usage(tmp_path).free
    with pytest.raises(OffloadError) as err:
        DiskStore(tmp_path, reserve_bytes=free * 4 + (1 << 40))
    msg = str(err.value)
    assert str(tmp_path) in msg and str(free * 4 + (1 << 40)) in msg and "free" in msg
    assert os.listdir(tmp_path) == []               # nothing left behind


def test_enospc_fails_clearly_and_keeps_the_previous_version(tmp_path, monkeypatch):
    s = DiskStore(tmp_path)
    old = {"x": torch.arange(4096, dtype=torch.float32)}
    s.write("unit", old).result()
    size = s.nbytes_of("unit")

    def full(fd, mv, offset):                       # one block lands, then the disk is full
        os.pwrite(fd, memoryview(mv)[:ALIGN], offset)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_format, "pwrite_all", full)
    fut = s.write("unit", {"x": torch.zeros(4096)})
    with pytest.raises(OffloadError) as err:
        fut.result()
    msg = str(err.value)
    assert s.path in msg and "bytes" in msg and "No space left" in msg
    assert any(ch.isdigit() for ch in msg)
    monkeypatch.undo()
    assert [f for f in os.listdir(s.path) if ".tmp" in f] == []
    assert_same(s.read("unit").result(), old)       # the previous version is intact
    assert s.nbytes_of("unit") == size
    with pytest.raises(OffloadError):                # flush() reports the failed write once
        s.flush()
    s.flush()
    s.close()


def test_not_enough_free_space_is_refused_before_writing(tmp_path, monkeypatch):
    s = DiskStore(tmp_path)
    usage = disk_store.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(disk_store.shutil, "disk_usage",
                        lambda p: usage._replace(free=1000))
    with pytest.raises(OffloadError, match=r"needs \d+ bytes .* 1000 bytes"):
        s.write("k", {"x": torch.ones(10_000)}).result()
    monkeypatch.undo()
    assert os.listdir(s.path) == []
    s.close()


def test_truncated_file_is_not_read_as_valid(store):
    store.write("k", {"x": torch.ones(5000)}).result()
    path = store.key_path("k")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - ALIGN)
    with pytest.raises(OffloadError, match="damaged|incomplete|valid"):
        store.read("k").result()
    with pytest.raises(KeyError):
        store.read("missing").result()


def test_nbytes_and_stats(store):
    assert store.nbytes() == 0 and store.nbytes_of("a") == 0
    store.write("a", {"x": torch.ones(1000)})
    store.write("b", {"x": torch.ones(3000), "y": torch.ones(1, dtype=torch.uint8)})
    store.flush()
    a, b = store.nbytes_of("a"), store.nbytes_of("b")
    assert a == os.path.getsize(store.key_path("a")) and b == os.path.getsize(store.key_path("b"))
    assert (a, b) == (2 * ALIGN, 4 * ALIGN)     # small header + packed tensors, whole blocks
    assert store.nbytes() == a + b
    assert sorted(store.keys()) == ["a", "b"] and "a" in store
    store.read("a").result()
    st = store.stats()
    assert st["writes"] == 2 and st["reads"] == 1
    assert st["bytes_written"] == a + b and st["bytes_read"] == a
    assert st["write_seconds"] > 0 and st["read_seconds"] > 0
    store.delete("a")
    assert store.nbytes() == b and "a" not in store


def test_concurrent_writers_and_readers(store):
    errors = []

    def worker(i):
        try:
            for j in range(5):
                x = torch.full((3000 + i,), float(i * 10 + j))
                store.write(f"k{i}", {"x": x})
                got = store.read(f"k{i}").result()["x"]
                assert torch.equal(got, x)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    assert store.nbytes() == sum(store.nbytes_of(f"k{i}") for i in range(4))


def _uses(t):
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def test_finished_operations_release_their_tensors(store):
    """The store holds a written tensor only until its write is done (a worker once kept the
    last job it ran, and with it a whole unit's buffer, until it got another one)."""
    t = torch.ones(1 << 16)
    before = _uses(t)
    store.write("k", {"w": t}).result()
    out = torch.empty(1 << 16)
    before_out = _uses(out)
    store.read("k", out={"w": out}).result()
    store.flush()
    deadline = time.monotonic() + 5
    while (_uses(t) > before or _uses(out) > before_out) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _uses(t) == before and _uses(out) == before_out


def test_urgent_reads_go_ahead_of_queued_work(tmp_path):
    """Compute waits on urgent reads: they run even while every general worker is busy (a
    long write, say) and other work is queued."""
    store = DiskStore(tmp_path, io_threads=1)
    store.write("a", {"w": torch.ones(8)}).result()
    store.write("b", {"w": torch.ones(8)}).result()
    gate = threading.Event()
    store._pool.submit(gate.wait, 1)           # the only general worker is busy
    queued = store.read("a")
    urgent = store.read("b", urgent=True)
    assert float(urgent.result(timeout=10)["w"].sum()) == 8.0
    assert not queued.done()
    gate.set()
    queued.result(timeout=10)
    store.close()


def test_a_job_wakes_one_idle_worker(tmp_path):
    """Each queued job wakes one idle worker (an urgent one the urgent-only worker), not every
    idle worker: a wake is a thread that takes a core and the GIL from the compute. Jobs one at a
    time, each waited for, with every worker idle: about one wake a job (a wait's 1 s timeout
    adds at most one a worker a second); waking all three idle workers gave three a job."""
    store = DiskStore(tmp_path, io_threads=2)
    pool = store._pool
    time.sleep(0.05)   # every worker waiting
    jobs = 30
    t0 = time.perf_counter()
    with pool._cv:
        before = pool.wakeups
    for i in range(jobs):
        done = threading.Event()
        pool.submit(done.set, 0 if i % 2 else 1)   # urgent and general in turn
        assert done.wait(10)
        time.sleep(0.002)   # the worker back to waiting
    with pool._cv:
        woken = pool.wakeups - before
    timeouts = 3 * (int(time.perf_counter() - t0) + 1)
    assert woken <= jobs + timeouts, (woken, jobs)
    store.close()


def test_an_urgent_read_hurries_the_queued_write_it_waits_for(tmp_path):
    """The read of a key follows its last write; compute waits on an urgent read, so a write
    still queued (behind general work) is made urgent with it: the read does not wait for the
    queue, and the other queued work still waits."""
    store = DiskStore(tmp_path, io_threads=1)
    gate = threading.Event()
    store._pool.submit(gate.wait, 1)             # the only general worker is busy
    other = store.write("x", {"w": torch.ones(4)})   # general work queued first
    new = store.write("a", {"w": torch.full((8,), 2.0)})
    urgent = store.read("a", urgent=True)
    assert float(urgent.result(timeout=10)["w"].sum()) == 16.0   # the new version, not waiting
    assert new.done() and not other.done()
    assert store.stats()["writes_hurried"] == 1
    # the other queued write, hurried the same way, still before the busy worker is free
    late = store.read("x", urgent=True)
    assert float(late.result(timeout=10)["w"].sum()) == 4.0
    assert store.stats()["writes_hurried"] == 2
    gate.set()
    store.close()


@pytest.mark.parametrize("big", [False, True], ids=["packed", "aligned"])
def test_a_flipped_payload_byte_is_refused_by_name(store, big):
    x = torch.randn((1 << 19) if big else 1000)  # 2 MiB starts on an ALIGN boundary; 4 KB is packed
    store.write("k", {"a": torch.ones(3), "x": x}).result()
    path = store.key_path("k")
    with open(path, "r+b") as f:  # the last bytes of x: the header still checks out
        where = os.path.getsize(path) - ALIGN if big else 512
        f.seek(where)
        b = f.read(1)
        f.seek(where)
        f.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(OffloadError, match=f"{path}.*'x'.*checksum"):
        store.read("k").result()


# -- fault injection: each fault ends in a clear error or a correct result, in bounded time ----

def test_eio_on_a_read_is_a_clear_error_in_bounded_time(store, monkeypatch):
    data = {"x": torch.randn(300_000)}
    store.write("k", data).result(timeout=30)

    def eio(fd, bufs, off):
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(disk_store.os, "preadv", eio)
    t0 = time.monotonic()
    with pytest.raises(OffloadError, match=f"reading 'k' from {store.key_path('k')}.*Input/output error"):
        store.read("k").result(timeout=30)
    assert time.monotonic() - t0 < 10
    monkeypatch.undo()
    assert_same(store.read("k").result(timeout=30), data)  # the file itself is intact


def test_short_writes_and_reads_still_give_the_right_bytes(store, monkeypatch):
    real_pwrite, real_preadv = os.pwrite, os.preadv

    def cut(n):  # the kernel may move less than asked (whole blocks, under O_DIRECT)
        return (n // 3) // ALIGN * ALIGN or n

    def short_write(fd, mv, off):
        return real_pwrite(fd, memoryview(mv)[: cut(len(mv))], off)

    def short_read(fd, bufs, off):
        mv = memoryview(bufs[0])
        return real_preadv(fd, [mv[: cut(len(mv))]], off)
    monkeypatch.setattr(disk_store.os, "pwrite", short_write)
    monkeypatch.setattr(disk_store.os, "preadv", short_read)
    data = sample(3)
    data["big"] = torch.randn(700_000)
    store.write("k", data).result(timeout=30)
    assert_same(store.read("k").result(timeout=30), data)


def test_a_read_that_takes_seconds_still_returns_the_right_data(store, monkeypatch):
    real_preadv = os.preadv
    slow = {"n": 0}

    def slow_read(fd, bufs, off):
        if slow["n"] == 0:
            time.sleep(2.0)
        slow["n"] += 1
        return real_preadv(fd, bufs, off)
    data = {"x": torch.randn(100_000)}
    store.write("k", data).result(timeout=30)
    monkeypatch.setattr(disk_store.os, "preadv", slow_read)
    t0 = time.monotonic()
    got = store.read("k").result(timeout=30)
    assert 2.0 <= time.monotonic() - t0 < 15
    assert_same(got, data)


def test_a_short_file_on_disk_is_refused_not_read_as_zeros(store):
    store.write("k", {"x": torch.randn(300_000)}).result(timeout=30)
    path = store.key_path("k")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:  # a write that was cut short without the size changing
        f.seek(size - 3 * ALIGN)
        f.write(b"\0" * ALIGN)
    with pytest.raises(OffloadError, match="checksum"):
        store.read("k").result(timeout=30)
def test_prepare_offload_dir_creates_it_with_its_parents_user_only(tmp_path):
    """Issue 25: offload_dir=os.path.join(output_dir, "offload") before output_dir exists is
    created (as output_dir is); each folder created is user-only, an existing one is untouched."""
    from megatrain_nb.engine.tiers.disk_store import OffloadError, prepare_offload_dir

    assert prepare_offload_dir(tmp_path) == str(tmp_path)  # an existing folder is kept as it is
    mode = tmp_path.stat().st_mode & 0o777
    new = tmp_path / "cache"
    assert prepare_offload_dir(str(new), 10) == str(new)
    assert new.is_dir() and (new.stat().st_mode & 0o777) == 0o700
    assert tmp_path.stat().st_mode & 0o777 == mode
    deep = tmp_path / "run" / "outputs" / "offload"
    assert prepare_offload_dir(deep, 10) == str(deep)
    for d in (tmp_path / "run", tmp_path / "run" / "outputs", deep):
        assert d.is_dir() and (d.stat().st_mode & 0o777) == 0o700, d
    (tmp_path / "afile").write_text("x")
    with pytest.raises(OffloadError, match="afile.*not a folder"):
        prepare_offload_dir(tmp_path / "afile")
    with pytest.raises(OffloadError, match="afile.*not a folder"):
        prepare_offload_dir(tmp_path / "afile" / "below")


def test_a_disk_tier_that_does_not_fit_is_refused_with_the_numbers(tmp_path):
    import shutil

    from megatrain_nb.engine.tiers.disk_store import DiskStore, OffloadError

    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(OffloadError) as e:
        DiskStore(tmp_path / "a" / "b", reserve_bytes=free * 4)
    text = str(e.value)
    assert f"needs {free * 4} bytes" in text and "free but" in text and "mounted at " in text
    assert os.listdir(tmp_path / "a" / "b") == []   # its private folder was removed again


def test_payload_checksums_xxh3_and_the_older_crc32_are_both_checked():
    """The payload checksum is xxh3-64 (fast: the disk tier's CPU share); files written before it
    carry crc32 and still verify; a range-by-range checksum equals the one-shot one."""
    import zlib

    from megatrain_nb.engine.tiers.disk_format import CHECKSUM, RunningChecksum, as_numpy, bytes_view, crc, payload_ok

    t = torch.randn(1000)
    raw = as_numpy(bytes_view(t))
    assert payload_ok({CHECKSUM: crc(t)}, t) and not payload_ok({CHECKSUM: crc(t) ^ 1}, t)
    assert payload_ok({"crc32": zlib.crc32(raw)}, t) and not payload_ok({"crc32": zlib.crc32(raw) ^ 1}, t)
    assert payload_ok({}, t)
    for field, whole in ((CHECKSUM, crc(t)), ("crc32", zlib.crc32(raw))):
        run = RunningChecksum(field)
        for a in range(0, 4000, 1024):
            run.update(raw[a:a + 1024])
        assert run.value() == whole, field
    empty = torch.empty(0)
    run = RunningChecksum()
    assert payload_ok({CHECKSUM: run.value()}, empty)   # an empty tensor: the same either way
