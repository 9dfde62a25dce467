"""Checking a linked checkpoint (a snapshot's engine part, ``engine/tiers/linked.py``) whole before
anything of it is loaded.

A load copies the snapshot into the live stores unit by unit; a file found damaged half way
would leave the engine holding some units of the snapshot and some of the run it replaced. So
every part is checked first, and the error names the file:

- ``linked.json``: JSON of the expected shape, this engine's codec and units, file names that
  stay inside ``disk/`` and exist there;
- ``ram_state.safetensors``: a readable header holding every tensor ``linked.json`` does not
  place on disk;
- every ``disk/*.mtd``: its header (magic, crc, key: the file belongs to the unit it is named
  for) and the xxh3 of every tensor's bytes (the disk tier's own checksums, which the
  checkpoint manifest leaves out); and the file is the one this snapshot linked: the digest of
  its header (which holds every tensor's checksum), recorded in ``linked.json`` when the
  snapshot was taken, must match. ``linked.json`` is in the snapshot's manifest beside
  ``megatrain_state.json`` (the step and the run), so a disk-tier file of another step or run
  put in place of this one (same unit, same name, a valid file of its own) is refused by name.

:func:`verify_folder` is what ``Engine.verify_checkpoint`` runs: by content, every time a
folder is loaded (no shortcut on unchanged sizes and times: bit rot keeps both).

Files above a few MiB are hashed through the page cache in 8 MiB reads; reading the disk tier's
files is the price of a load that never tears.
"""
from __future__ import annotations

import json
import os
import zlib
from typing import Optional

import xxhash

from megatrain_nb.manifest import IntegrityError, verify_manifest

from .disk_format import CHECKSUM, IO_CHUNK, OffloadError, pread_all, read_header
from .disk_params import weights_key

_READ = 8 << 20


def damaged(path: str, why: str) -> Exception:
    """The error a damaged part raises: ``IntegrityError`` (a ``ValueError``) naming the file."""
    return IntegrityError(f"{path!r} is damaged: {why}. Nothing was loaded from it")


def read_meta(folder: str) -> dict:
    """``linked.json`` of ``folder``, checked for shape (not against an engine)."""
    path = os.path.join(folder, "linked.json")
    try:
        with open(path) as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise damaged(path, "it is missing") from None
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise damaged(path, f"it is not readable JSON ({e})") from None
    if not isinstance(meta, dict):
        raise damaged(path, "it holds no JSON object")
    units, weights, states = meta.get("units"), meta.get("weights"), meta.get("states")
    if not (isinstance(units, list) and all(isinstance(u, str) for u in units)):
        raise damaged(path, "its unit list is missing or malformed")
    for role, names in (("weights", weights), ("states", states)):
        if not isinstance(names, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                  for k, v in names.items()):
            raise damaged(path, f"its {role!r} table is missing or malformed")
        for name in names.values():
            if os.path.basename(name) != name or name in ("", ".", ".."):
                raise damaged(path, f"it names a file outside its disk folder ({name!r})")
    if "codec" not in meta:
        raise damaged(path, "it does not name the optimizer states' codec")
    digests = meta.get("digests")
    if digests is not None or meta.get("format") not in (None, 1):
        if not (isinstance(digests, dict) and all(
                isinstance(digests.get(role), dict) and set(digests[role]) == set(meta[role])
                and all(isinstance(d, str) for d in digests[role].values()) for role in ("weights", "states"))):
            raise damaged(path, "its table of the disk-tier files' digests is missing or does not match its file "
                                "tables")
    return meta


def verify_folder(engine, path, *, manifest: bool = True) -> None:
    """Check a checkpoint or snapshot folder whole, by content, before any of it is loaded: its
    manifest (every file but a snapshot's hard links; a folder a Trainer wrote must have one)
    and, for a snapshot, every part of the engine's (:func:`verify_linked`). Raises
    ``IntegrityError`` (a ``ValueError``) naming the file; reads, never writes."""
    path = os.fspath(path)
    if manifest and (os.path.isfile(os.path.join(path, "manifest.json"))
                     or os.path.isfile(os.path.join(path, "megatrain_state.json"))):
        verify_manifest(path)
    if os.path.isfile(os.path.join(path, "linked.json")):
        verify_linked(engine, path)
    else:   # a rank-linked snapshot: this rank's folder (another world size: load_linked_rank says so)
        mine = rank_folder(path, engine.dist.rank, engine.dist.world)
        if os.path.isfile(os.path.join(mine, "linked.json")):
            verify_linked(engine, mine)


def rank_folder(folder, rank: int, world: int) -> str:
    """A rank's linked folder in a rank-linked snapshot (``engine/ranks/linked_ranks.py``)."""
    return os.path.join(os.fspath(folder), f"rank-{rank:05d}-of-{world:05d}")


def header_digest(meta: dict) -> str:
    """The digest that binds a disk-tier file to a snapshot: xxh3-128 of its checked header
    (key, size, every tensor's offset and checksum), so with the payload checks it covers every byte."""
    return xxhash.xxh3_128_hexdigest(json.dumps(meta, sort_keys=True, separators=(",", ":")).encode())


def file_digest(path: str, key: str) -> str:
    """:func:`header_digest` of the disk-tier file at ``path`` (of ``key``): one header read."""
    buf = bytearray(IO_CHUNK)
    fd = os.open(path, os.O_RDONLY)
    try:
        return header_digest(read_header(fd, key, path, memoryview(buf)))
    finally:
        os.close(fd)


def verify_linked(engine, folder) -> None:
    """Check the linked checkpoint in ``folder`` against ``engine`` (see the module docstring);
    raise naming the first damaged or mismatched file. Reads, never writes."""
    folder = os.fspath(folder)
    meta = read_meta(folder)
    codec = meta.get("codec")
    if codec != engine.config.optimizer_compression:
        raise ValueError(f"snapshot {folder!r} holds optimizer states in codec {codec!r} but this engine uses "
                         f"{engine.config.optimizer_compression!r}; a snapshot loads into the run that wrote it")
    names = [u.name for u in engine.state_units]
    if meta["units"] != names:
        raise ValueError(f"snapshot {folder!r} was written by a model with units {meta['units']}, "
                         f"not this one ({names})")
    want = set()
    for u in engine.state_units:
        if u.name not in meta["weights"]:
            want.add(f"w/{u.name}")
    _check_ram(os.path.join(folder, "ram_state.safetensors"), want)
    disk = engine.disk
    for role, key_of in (("weights", weights_key), ("states", engine.states.key)):
        for u in engine.state_units:
            name = meta[role].get(u.name)
            if name is None:
                continue
            path = os.path.join(folder, "disk", name)
            key = key_of(u)
            if disk is not None and os.path.basename(disk.key_path(key)) != name:
                raise damaged(os.path.join(folder, "linked.json"),
                              f"it names {name!r} for the {role} of {u.name}, not that unit's file")
            header = verify_mtd(path, key)
            want = (meta.get("digests") or {}).get(role, {}).get(u.name)
            if want is not None and header_digest(header) != want:
                raise damaged(path, f"it is not the file this snapshot linked for the {role} of {u.name}: its "
                                    f"contents (digest {header_digest(header)[:16]}...) differ from those "
                                    f"recorded in {os.path.join(folder, 'linked.json')!r} ({want[:16]}...), so it "
                                    "was replaced, e.g. by the file of another step or run")


def _check_ram(path: str, want: set) -> None:
    from safetensors import safe_open

    if not os.path.isfile(path):
        raise damaged(path, "it is missing")
    try:
        with safe_open(path, "pt") as fh:
            keys = set(fh.keys())
    except Exception as e:  # noqa: BLE001 - safetensors raises its own kinds; all mean the same
        raise damaged(path, f"its header cannot be read ({type(e).__name__}: {e})") from None
    missing = sorted(want - keys)
    if missing:
        raise damaged(path, f"it lacks {len(missing)} tensor(s) the snapshot needs, e.g. {missing[0]!r}")


def verify_mtd(path: str, key: str, buffer: Optional[bytearray] = None) -> dict:
    """Check a disk-tier file in full: header (magic, crc, key, size) and every tensor's
    checksum; returns its header."""
    if not os.path.isfile(path):
        raise damaged(path, f"it is missing (the file of {key!r})")
    buf = buffer if buffer is not None else bytearray(IO_CHUNK)
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            meta = read_header(fd, key, path, memoryview(buf))
        except (OffloadError, ValueError, OSError) as e:
            raise damaged(path, f"its header does not check ({e})") from None
        mv = memoryview(buf)
        for e in meta["tensors"]:
            if not _payload_ok(fd, mv, e):
                raise damaged(path, f"the bytes of {e.get('name')!r} (key {key!r}) do not match their checksum")
    finally:
        os.close(fd)
    return meta


def _payload_ok(fd: int, mv: memoryview, entry: dict) -> bool:
    try:
        off, n = int(entry["offset"]), int(entry["nbytes"])
    except (KeyError, TypeError, ValueError):
        return False
    xx = xxhash.xxh3_64() if CHECKSUM in entry else None
    crc = 0
    done = 0
    while done < n:
        k = min(_READ, n - done, len(mv))
        try:
            pread_all(fd, mv[:k], off + done)
        except OSError:
            return False
        if xx is not None:
            xx.update(mv[:k])
        else:
            crc = zlib.crc32(mv[:k], crc)
        done += k
    if xx is not None:
        return xx.intdigest() == entry[CHECKSUM]
    return "crc32" not in entry or crc == entry["crc32"]
