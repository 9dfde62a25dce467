"""Cost of checkpoint integrity, side by side in one run: the hash functions on this CPU (one
thread, from memory), then hashing a checkpoint-shaped folder into manifest.json (at save) and
verifying it (at resume), per GiB, from the page cache as right after a save:

* ``v1``: format 1 as first written (one sha256 per whole file, files on parallel threads);
* ``xxh3_128`` (what the package writes) / ``sha256`` / ``blake2b``: format 2 (every 64 MiB piece of every file hashed in parallel).

    python benchmarks/bench_integrity.py [--gib 1]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megatrain_nb import manifest as mf  # noqa: E402


def hash_speeds(mib: int = 256) -> dict[str, float]:
    """Seconds per GiB of each hash, one thread, on a buffer in memory."""
    data = os.urandom(1 << 20) * mib
    fns = {name: (lambda b, n=name: hashlib.new(n, b).digest()) for name in ("sha256", "blake2b", "sha512", "sha3_256")}
    fns["crc32"] = zlib.crc32
    try:
        import xxhash

        fns["xxh3_128"] = lambda b: xxhash.xxh3_128(b).digest()
    except ImportError:
        pass
    out = {}
    for name, fn in fns.items():
        fn(data[: 1 << 20])
        t0 = time.perf_counter()
        fn(data)
        out[name] = (time.perf_counter() - t0) / (mib / 1024)
    return out


def write_v1(folder: Path) -> None:
    """The format-1 manifest (whole-file sha256), as the first version wrote it."""
    names = mf._files(folder)
    digests = mf._whole_files(folder, names, "sha256")
    m = {"format": 1, "algorithm": "sha256", "files": {n: {"size": s, "sha256": d} for n, (s, d) in zip(names, digests)}}
    (folder / mf.MANIFEST).write_text(json.dumps(m))


def read_floor(folder: Path) -> None:
    for n in mf._files(folder):
        with open(folder / n, "rb", buffering=0) as f:
            while f.read(8 << 20):
                pass


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    o = ap.parse_args(argv)
    for name, s in hash_speeds().items():
        print(f"RESULT hash_{name}_one_thread {s:.3f} s/GiB (from memory; info)")
    with tempfile.TemporaryDirectory() as d:
        folder = Path(d)
        total = int(o.gib * (1 << 30))
        sizes = [total // 2, total // 4, total // 4]  # weights, two state files
        for i, n in enumerate(sizes):
            with open(folder / f"part-{i}.safetensors", "wb") as f:
                f.write(os.urandom(1 << 20) * (n >> 20))
        gib = sum((folder / n).stat().st_size for n in mf._files(folder)) / (1 << 30)
        read_floor(folder)  # warm the page cache, as right after a save
        t0 = time.perf_counter()
        read_floor(folder)
        print(f"RESULT checkpoint_read_page_cache {(time.perf_counter() - t0) / gib:.3f} s/GiB (the floor; info)")
        runs = [("v1", write_v1), ("xxh3_128", lambda f: mf.write_manifest(f, algorithm="xxh3_128")),
                ("sha256", lambda f: mf.write_manifest(f, algorithm="sha256")),
                ("blake2b", lambda f: mf.write_manifest(f, algorithm="blake2b"))]
        for name, write in runs:
            t0, c0 = time.perf_counter(), time.process_time()
            write(folder)
            t1, c1 = time.perf_counter(), time.process_time()
            assert mf.verify_manifest(folder)
            t2, c2 = time.perf_counter(), time.process_time()
            target = "target < 1.0" if name == mf.ALGORITHM else "info"
            # CPU seconds too: on a shared machine the wall time says more about the neighbours
            print(f"RESULT checkpoint_manifest_write_{name} {(t1 - t0) / gib:.3f} s/GiB ({target}; "
                  f"{(c1 - c0) / gib:.3f} CPU-s/GiB)")
            print(f"RESULT checkpoint_manifest_verify_{name} {(t2 - t1) / gib:.3f} s/GiB ({target}; "
                  f"{(c2 - c1) / gib:.3f} CPU-s/GiB)")
    load = os.getloadavg()[0]
    print(f"# {os.cpu_count()} CPUs, load average {load:.1f}; {gib:.2f} GiB in {len(sizes)} files; "
          f"the package writes format 2 with {mf.ALGORITHM}")


if __name__ == "__main__":
    main()
