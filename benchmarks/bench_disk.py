"""DiskStore bandwidth against dd with direct I/O, on the same disk, in the same run.

    python benchmarks/bench_disk.py [--dir PATH] [--gib 1] [--unit-mib 128] [--reps 3]

Each repetition runs, alternating which goes first:

* ``dd if=/dev/zero of=F bs=64M count=N oflag=direct`` and ``dd if=F of=/dev/null bs=64M
  iflag=direct`` (dd's own reported time);
* ``DiskStore.write`` of ``--gib`` GiB as ``--unit-mib`` MiB tensors (one key each, all issued
  write-behind, timed until ``flush()`` returns) and ``DiskStore.read`` of the same keys into
  preallocated tensors (all issued read-ahead, timed until the last one is done);
* the ranged pattern of the tier without a host cache: ``DiskStore.ranged`` rewrites of the same
  tensors a chunk (``states.UPDATE_CHUNK`` elements) at a time, committed behind, and
  ``DiskStore.read_ranged`` reads of them a chunk at a time (printed beside the others).

The store is measured with ordinary ``torch.empty`` tensors (their memory is not 4096-aligned,
so the data goes through the store's aligned staging buffers: the general case) and with
``aligned_empty`` tensors (zero-copy direct I/O). Reads bypass the page cache (O_DIRECT; the
pages of every file are also dropped with posix_fadvise before reading). Prints medians and
ends with

    RESULT disk_write_vs_dd <ratio> x (target >= 0.8)
    RESULT disk_read_vs_dd <ratio> x (target >= 0.8)
    RESULT disk_ranged_write_vs_dd <ratio> x (target >= 0.9)
    RESULT disk_ranged_read_vs_dd <ratio> x (target >= 0.95)

the first two computed with the ordinary tensors, the last two with the ranged pattern.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from megatrain_nb.engine.tiers.disk_store import DiskStore, aligned_empty
from megatrain_nb.engine.updates.states import UPDATE_CHUNK

MIB = 1 << 20


def _dd(args: list[str]) -> float:
    """Run dd; return the seconds it reports."""
    proc = subprocess.run(["dd", *args], capture_output=True, text=True, check=True)
    m = re.search(r"copied, ([0-9.]+) s", proc.stderr)
    if not m:
        raise RuntimeError(f"cannot parse dd output: {proc.stderr!r}")
    return float(m.group(1))


def _drop_pages(folder: str) -> None:
    for root, _, files in os.walk(folder):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _store_write(store: DiskStore, units: list[torch.Tensor]) -> float:
    t0 = time.perf_counter()
    for i, t in enumerate(units):
        store.write(f"unit.{i}", {"data": t})
    store.flush()
    return time.perf_counter() - t0


def _store_read(store: DiskStore, outs: list[torch.Tensor]) -> float:
    _drop_pages(store.path)
    t0 = time.perf_counter()
    futs = [store.read(f"unit.{i}", {"data": t}) for i, t in enumerate(outs)]
    for f in futs:
        f.result()
    return time.perf_counter() - t0


def _ranged_write(store: DiskStore, units: list[torch.Tensor], chunk: int) -> float:
    """The tier's ranged rewrites (``DiskStore.ranged``, as a chunked update writes weights and
    codes with no host cache): each unit's new version written ``chunk`` elements at a time from
    one aligned chunk buffer, committed behind; timed until ``flush()`` returns."""
    t0 = time.perf_counter()
    for i, t in enumerate(units):
        rw = store.ranged(f"ranged.{i}", {"data": (t.dtype, tuple(t.shape))}, read_old=False)
        for a in range(0, t.numel(), chunk):
            rw.write("data", a, t[a:a + chunk])
        rw.commit(behind=True)
    store.flush()
    return time.perf_counter() - t0


def _ranged_read(store: DiskStore, outs: list[torch.Tensor], chunk: int) -> float:
    """The tier's ranged reads (``DiskStore.read_ranged``, as an update reads a held gradient):
    ``chunk`` elements at a time into the caller's tensor."""
    _drop_pages(store.path)
    t0 = time.perf_counter()
    for i, t in enumerate(outs):
        rr = store.read_ranged(f"ranged.{i}")
        try:
            for a in range(0, t.numel(), chunk):
                rr.read("data", a, t[a:a + chunk])
        finally:
            rr.close()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=str(Path(__file__).resolve().parents[1]),
                    help="folder on the disk to test (default: the repository root)")
    ap.add_argument("--gib", type=float, default=1.0, help="GiB per measurement")
    ap.add_argument("--unit-mib", type=int, default=128, help="MiB per stored tensor")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--io-threads", type=int, default=2)
    args = ap.parse_args()

    nunits = max(1, round(args.gib * 1024 / args.unit_mib))
    unit_numel = args.unit_mib * MIB // 4
    total = nunits * unit_numel * 4
    dd_count = max(1, total // (64 * MIB))
    dd_bytes = dd_count * 64 * MIB
    work = tempfile.mkdtemp(prefix=".bench-disk-", dir=args.dir)
    dd_file = os.path.join(work, "dd.bin")
    print(f"disk benchmark in {work} ({shutil.disk_usage(work).free / 2**30:.1f} GiB free): "
          f"{nunits} x {args.unit_mib} MiB = {total / 2**30:.2f} GiB per measurement, "
          f"dd {dd_count} x 64 MiB, {args.reps} repetitions")
    kinds = {"plain": torch.empty, "aligned": aligned_empty}
    chunk = UPDATE_CHUNK
    units = {k: [alloc(unit_numel).fill_(1.25 + i) for i in range(nunits)]
             for k, alloc in kinds.items()}
    outs = {k: [alloc(unit_numel) for _ in range(nunits)] for k, alloc in kinds.items()}
    times: dict[str, list[float]] = {}
    sizes = {"dd write": dd_bytes, "dd read": dd_bytes}
    try:
        stores = {k: DiskStore(work, io_threads=args.io_threads)
                  for k in kinds}
        print(f"direct I/O: {stores['plain'].direct_io}")
        for rep in range(args.reps + 1):        # rep 0 is the warm-up
            steps = [("dd write", lambda: _dd(["if=/dev/zero", f"of={dd_file}", "bs=64M",
                                               f"count={dd_count}", "oflag=direct"]))]
            for k in kinds:
                steps.append((f"store write {k}",
                              lambda k=k: _store_write(stores[k], units[k])))
            steps.append(("dd read", lambda: _dd([f"if={dd_file}", "of=/dev/null", "bs=64M",
                                                 "iflag=direct"])))
            for k in kinds:
                steps.append((f"store read {k}", lambda k=k: _store_read(stores[k], outs[k])))
            if rep % 2:                          # alternate the order within each pair
                steps = [steps[1], steps[2], steps[0], steps[4], steps[5], steps[3]]
            # the ranged pattern of the tier without a host cache (chunks of UPDATE_CHUNK elements)
            steps.insert(3, ("store write ranged", lambda: _ranged_write(stores["aligned"], units["aligned"], chunk)))
            steps.append(("store read ranged", lambda: _ranged_read(stores["aligned"], outs["aligned"], chunk)))
            for name, fn in steps:
                sec = fn()
                if rep:
                    times.setdefault(name, []).append(sec)
        for k in kinds:   # (the aligned outs hold the ranged reads' data, the last read)
            for a, b in zip(units[k], outs[k]):
                assert torch.equal(a, b), "read back different data"
        stats = {k: s.stats() for k, s in stores.items()}
        for s in stores.values():
            s.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"\n{'contender':22s} {'median s':>9s} {'GB/s':>7s}   (all reps, s)")
    bw = {}
    for name, ts in times.items():
        nbytes = sizes.get(name, total)
        bw[name] = nbytes / statistics.median(ts) / 1e9
        print(f"{name:22s} {statistics.median(ts):9.3f} {bw[name]:7.2f}   "
              + " ".join(f"{t:.3f}" for t in ts))
    for k, st in stats.items():
        print(f"store {k}: {st['writes']} writes, {st['reads']} reads, worker write "
              f"{st['bytes_written'] / max(st['write_seconds'], 1e-9) / 1e9:.2f} GB/s/thread, "
              f"worker read {st['bytes_read'] / max(st['read_seconds'], 1e-9) / 1e9:.2f} "
              f"GB/s/thread")
    print(f"aligned tensors: write {bw['store write aligned'] / bw['dd write']:.2f} x dd, "
          f"read {bw['store read aligned'] / bw['dd read']:.2f} x dd")
    print(f"RESULT disk_write_vs_dd {bw['store write plain'] / bw['dd write']:.2f} x "
          f"(target >= 0.8)")
    print(f"RESULT disk_read_vs_dd {bw['store read plain'] / bw['dd read']:.2f} x "
          f"(target >= 0.8)")
    # the tier's own pattern without a host cache (issue 31 item 4: >= 0.9 writes, >= 0.95 reads)
    print(f"RESULT disk_ranged_write_vs_dd {bw['store write ranged'] / bw['dd write']:.2f} x (target >= 0.9)")
    print(f"RESULT disk_ranged_read_vs_dd {bw['store read ranged'] / bw['dd read']:.2f} x (target >= 0.95)")


if __name__ == "__main__":
    main()
