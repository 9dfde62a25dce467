"""Per-file checksums of a checkpoint folder (``manifest.json``), written with every checkpoint
and verified before one is loaded, so a flipped byte or a truncated file is refused by name
instead of resuming silently with wrong numbers.

``manifest.json``: ``{"format": 1, "algorithm": "sha256", "files": {relpath: {"size", "sha256"}}}``.
Files are hashed on a few threads (hashlib releases the GIL on large buffers); the cost is one
read of the checkpoint from the page cache (``benchmarks/bench_integrity.py`` prints it).
"""
from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

MANIFEST = "manifest.json"
_CHUNK = 8 << 20


class IntegrityError(ValueError):
    """A checkpoint file does not match its manifest (the message names it)."""


def _digest(path: Path) -> tuple[int, str]:
    h, size = hashlib.sha256(), 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_CHUNK)
        mv = memoryview(buf)
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(mv[:n])
            size += n
    return size, h.hexdigest()


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def _threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def write_manifest(folder) -> dict:
    """Hash every file under ``folder`` into ``folder/manifest.json``; returns the manifest."""
    folder = Path(folder)
    names = _files(folder)
    with ThreadPoolExecutor(_threads()) as pool:
        digests = list(pool.map(lambda n: _digest(folder / n), names))
    manifest = {"format": 1, "algorithm": "sha256",
                "files": {n: {"size": s, "sha256": d} for n, (s, d) in zip(names, digests)}}
    tmp = folder / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    os.replace(tmp, folder / MANIFEST)
    return manifest


def verify_manifest(folder, previous: Optional[Path] = None) -> bool:
    """Check every file listed in ``folder/manifest.json``; raise :class:`IntegrityError` naming
    the first bad file and ``previous`` (the checkpoint to fall back to). Returns False when the
    folder has no manifest (written before manifests existed), True when all files match."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        return False
    hint = (f"Resume from the previous checkpoint instead: resume_from_checkpoint={str(previous)!r}"
            if previous is not None else "There is no earlier checkpoint in that folder to fall back to")
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        if manifest.get("algorithm") != "sha256":
            raise KeyError("algorithm")
    except (ValueError, KeyError, TypeError) as e:
        raise IntegrityError(f"checkpoint {str(folder)!r}: its {MANIFEST} is damaged ({e!s}). {hint}") from None

    def check(item):
        name, want = item
        f = folder / name
        if not f.is_file():
            return f"{str(f)!r} is missing"
        size = f.stat().st_size
        if size != want["size"]:
            return f"{str(f)!r} is {size} bytes, the manifest says {want['size']} (truncated or overwritten)"
        if _digest(f)[1] != want["sha256"]:
            return f"{str(f)!r} does not match its checksum (the file is corrupted)"
        return None

    with ThreadPoolExecutor(_threads()) as pool:
        problems = [p for p in pool.map(check, sorted(files.items())) if p]
    if problems:
        raise IntegrityError(f"checkpoint {str(folder)!r} is damaged: {problems[0]}"
                             + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "") + f". {hint}")
    return True
