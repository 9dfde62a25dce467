"""Per-file checksums of a checkpoint folder (``manifest.json``), written with every checkpoint
and verified before one is loaded, so a flipped byte or a truncated file is refused by name
instead of resuming silently with wrong numbers.

``manifest.json`` (format 2)::

    {"format": 2, "algorithm": "xxh3_128", "chunk_bytes": 67108864,
     "files": {relpath: {"size": n, "chunks": [hexdigest of each chunk_bytes piece, ...]}},
     "self_xxh3_128": hexdigest of the rest of the manifest}

The manifest's checksum of itself (``self_xxh3_128``, over its other fields as canonical JSON)
tells a damaged manifest from a damaged file: a flipped byte in a file's digest inside the
manifest is refused as the manifest's damage, not blamed on that file. Manifests written
before it have none and are read as they were.

Each file is hashed in independent pieces of ``chunk_bytes`` so that all pieces of all files
are hashed in parallel (the hashers release the GIL): a checkpoint is mostly one or two big files.

The checksum is xxh3-128 (the ``xxhash`` package, already a dependency of ``datasets``): it
catches corruption — a flipped bit, a truncated or zeroed block — with a 2^-128 chance of
missing one, at about 0.1 s/GiB against sha256's 0.7 CPU-s/GiB here
(``benchmarks/bench_integrity.py`` prints both). A cryptographic hash would add nothing: the
manifest is not signed, so whoever can rewrite a checkpoint can rewrite its manifest too (the
package never unpickles a file, so a rewritten checkpoint can hold wrong numbers, not code).
Manifests naming sha256 (format 1: one per file; format 2 as written before) and the other
algorithms in :data:`ALGORITHMS` stay verifiable.

The files are hashed from the page cache right after they were written: the big ones come
from safetensors' own writer, which does not hand its bytes to Python on the way.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

from megatrain_nb.threads import MANIFEST as HASH_THREADS

MANIFEST = "manifest.json"
ALGORITHM = "xxh3_128"
ALGORITHMS = ("xxh3_128", "sha256", "sha512", "blake2b", "sha3_256")  # what a manifest may name (verified)
CHUNK_BYTES = 64 << 20  # the independently hashed piece of a file
SELF = "self_xxh3_128"  # the manifest's checksum of its other fields
_FIELDS = frozenset({"format", "algorithm", "chunk_bytes", "files", "excluded", SELF})
_READ = 8 << 20         # one read into a thread's buffer
_buffers = threading.local()


class IntegrityError(ValueError):
    """A checkpoint file does not match its manifest (the message names it)."""


def _buffer() -> bytearray:
    buf = getattr(_buffers, "buf", None)
    if buf is None:
        buf = _buffers.buf = bytearray(_READ)
    return buf


def digest_range(path: Path, start: int, length: Optional[int], algorithm: str = ALGORITHM) -> tuple[int, str]:
    """(bytes read, hexdigest) of ``length`` bytes of ``path`` from ``start`` (None: to the end)."""
    h, done = _hasher(algorithm), 0
    buf = _buffer()
    mv = memoryview(buf)
    fd = os.open(path, os.O_RDONLY)
    try:
        while length is None or done < length:
            want = _READ if length is None else min(_READ, length - done)
            n = os.preadv(fd, [mv[:want]], start + done)
            if not n:
                break
            h.update(mv[:n])
            done += n
    finally:
        os.close(fd)
    return done, h.hexdigest()


def _hasher(algorithm: str):
    if algorithm == "xxh3_128":
        import xxhash

        return xxhash.xxh3_128()
    return hashlib.new(algorithm)


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def _excluded(name: str, folders) -> bool:
    return any(name.startswith(x + "/") for x in folders)


def _threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def _pieces(size: int, chunk: int) -> list[tuple[int, int]]:
    return [(off, min(chunk, size - off)) for off in range(0, size, chunk)] or [(0, 0)]


def file_checksums(folder, names, *, algorithm: str = ALGORITHM, chunk: int = CHUNK_BYTES) -> dict:
    """``{name: {"size", "chunks"}}`` for files under ``folder``, every piece hashed in parallel."""
    folder = Path(folder)
    sizes = {n: (folder / n).stat().st_size for n in names}
    jobs = [(n, off, length) for n in names for off, length in _pieces(sizes[n], chunk)]
    # the biggest pieces first, so the pool does not end on one long piece
    order = sorted(range(len(jobs)), key=lambda i: -jobs[i][2])
    with ThreadPoolExecutor(_threads(), thread_name_prefix=HASH_THREADS.name) as pool:
        done = dict(zip(order, pool.map(lambda i: digest_range(folder / jobs[i][0], jobs[i][1], jobs[i][2],
                                                               algorithm), order)))
    out = {n: {"size": sizes[n], "chunks": []} for n in names}
    for i, (n, _, length) in enumerate(jobs):
        got, hexd = done[i]
        if got != length:
            raise IntegrityError(f"{str(folder / n)!r} changed size while it was being hashed")
        out[n]["chunks"].append(hexd)
    return out


def write_manifest(folder, *, algorithm: str = ALGORITHM, chunk: int = CHUNK_BYTES, exclude: tuple = ()) -> dict:
    """Hash every file under ``folder`` into ``folder/manifest.json``; returns the manifest.
    ``exclude``: sub-folders left out (a snapshot's hard links to disk-tier files, which carry
    checksums of their own)."""
    folder = Path(folder)
    exclude = sorted(x.rstrip("/") for x in exclude)
    names = [n for n in _files(folder) if not _excluded(n, exclude)]
    manifest = {"format": 2, "algorithm": algorithm, "chunk_bytes": chunk,
                "files": file_checksums(folder, names, algorithm=algorithm, chunk=chunk)}
    if exclude:   # recorded, so verify_manifest knows those files are left out on purpose
        manifest["excluded"] = exclude
    manifest[SELF] = _self_digest(manifest)
    tmp = folder / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    os.replace(tmp, folder / MANIFEST)
    return manifest


def verify_manifest(folder, previous: Optional[Path] = None) -> bool:
    """Check every file listed in ``folder/manifest.json``; raise :class:`IntegrityError` naming
    the first bad file and ``previous`` (the checkpoint to fall back to). A folder without a
    manifest is refused (every checkpoint megatrain_nb writes has one, so its absence is damage),
    and so is a file the manifest does not list. Returns True when all files match.

    A checkpoint assembled by hand has no manifest: :func:`seal` writes one for it, the one
    explicit way to vouch for files this package did not write."""
    folder = Path(folder)
    path = folder / MANIFEST
    hint = (f"Resume from the previous checkpoint instead: resume_from_checkpoint={str(previous)!r}"
            if previous is not None else "There is no earlier checkpoint in that folder to fall back to")
    if not path.is_file():
        raise IntegrityError(
            f"checkpoint {str(folder)!r} has no {MANIFEST}: every checkpoint megatrain_nb writes carries one, so "
            f"it was removed or lost and nothing in the folder can be checked. {hint}. If you assembled this "
            f"checkpoint yourself, vouch for its files with megatrain_nb.trainer.checkpoint.seal({str(folder)!r}), "
            "which writes the manifest")
    try:
        manifest = json.loads(path.read_text())
        if SELF in manifest and manifest[SELF] != _self_digest(manifest):
            raise ValueError("it does not match its own checksum: a byte of it changed after it was written")
        unknown = sorted(set(manifest) - _FIELDS)
        if unknown:   # (its own checksum's name damaged, say)
            raise ValueError(f"it holds a field no manifest has ({unknown[0]!r})")
        files, algorithm, fmt = manifest["files"], manifest.get("algorithm"), manifest.get("format", 1)
        excluded = [str(x) for x in manifest.get("excluded", [])]
        if algorithm not in ALGORITHMS:
            raise KeyError(f"algorithm {algorithm!r}")
        if fmt == 1:   # one digest of each whole file
            chunk = None
            want = {n: (int(e["size"]), [str(e[algorithm])]) for n, e in files.items()}
        elif fmt == 2:
            chunk = int(manifest["chunk_bytes"])
            if chunk <= 0:
                raise ValueError(f"chunk_bytes {chunk}")
            want = {n: (int(e["size"]), [str(d) for d in e["chunks"]]) for n, e in files.items()}
        else:
            raise KeyError(f"format {fmt!r}")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise IntegrityError(f"checkpoint {str(folder)!r}: its {MANIFEST} is damaged ({e!s}), so no file of it "
                             f"can be checked: {str(path)!r} is the damaged file. {hint}") from None

    problems: dict[str, str] = {}
    # (files under a folder the manifest names as excluded carry checksums of their own)
    for name in sorted(n for n in set(_files(folder)) - set(want) if not _excluded(n, excluded)):
        problems[name] = (f"{str(folder / name)!r} is not listed in its {MANIFEST} (added after the checkpoint was "
                          "written, or its entry was removed)")
    present = []
    for name, (size, digests) in sorted(want.items()):
        f = folder / name
        if not f.is_file():
            problems[name] = f"{str(f)!r} is missing"
        elif f.stat().st_size != size:
            problems[name] = (f"{str(f)!r} is {f.stat().st_size} bytes, the manifest says {size} "
                              "(truncated or overwritten)")
        elif len(digests) != len(_pieces(size, chunk or max(size, 1))):
            problems[name] = f"{str(f)!r}: its manifest entry is damaged"
        else:
            present.append(name)
    if present:
        try:
            if chunk:
                got = file_checksums(folder, present, algorithm=algorithm, chunk=chunk)
            else:
                got = {n: {"chunks": [h]} for n, (_, h) in zip(present, _whole_files(folder, present, algorithm))}
        except IntegrityError as e:
            raise IntegrityError(f"checkpoint {str(folder)!r} is damaged: {e}. {hint}") from None
        for name in present:
            if got[name]["chunks"] != want[name][1]:
                problems[name] = f"{str(folder / name)!r} does not match its checksum (the file is corrupted)"
    if problems:
        first = problems[sorted(problems)[0]]
        raise IntegrityError(f"checkpoint {str(folder)!r} is damaged: {first}"
                             + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "") + f". {hint}")
    return True


def _self_digest(manifest: dict) -> str:
    """xxh3-128 of the manifest's fields but its own checksum, as canonical JSON."""
    import xxhash

    rest = {k: v for k, v in manifest.items() if k != SELF}
    return xxhash.xxh3_128_hexdigest(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode())


def _whole_files(folder: Path, names, algorithm: str) -> list[tuple[int, str]]:
    """Format 1: one digest per whole file (files in parallel)."""
    with ThreadPoolExecutor(_threads(), thread_name_prefix=HASH_THREADS.name) as pool:
        return list(pool.map(lambda n: digest_range(folder / n, 0, None, algorithm), names))
