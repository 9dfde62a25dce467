"""Cost of checkpoint integrity: hashing a checkpoint folder into manifest.json (at save) and
verifying it (at resume), per GiB, from the page cache as right after a save.

    python benchmarks/bench_integrity.py [--gib 1]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megatrain_nb.trainer.manifest import verify_manifest, write_manifest  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    o = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        folder = Path(d)
        total = int(o.gib * (1 << 30))
        sizes = [total // 2, total // 4, total // 4]  # weights, two state files
        for i, n in enumerate(sizes):
            with open(folder / f"part-{i}.safetensors", "wb") as f:
                f.write(os.urandom(1 << 20) * (n >> 20))
        t0 = time.perf_counter()
        write_manifest(folder)
        t1 = time.perf_counter()
        verify_manifest(folder)
        t2 = time.perf_counter()
    gib = sum(sizes) / (1 << 30)
    print(f"RESULT checkpoint_manifest_write {(t1 - t0) / gib:.3f} s/GiB (target < 1.0)")
    print(f"RESULT checkpoint_manifest_verify {(t2 - t1) / gib:.3f} s/GiB (target < 1.0)")


if __name__ == "__main__":
    main()
