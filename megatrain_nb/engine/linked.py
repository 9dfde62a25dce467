"""Linked checkpoints: the engine's part of a snapshot.

The disk tier never rewrites a file in place (``DiskStore`` writes a new version under a
temporary name and renames it over the key's file), so the files it holds now keep their
bytes for as long as someone links to them. A linked checkpoint therefore *hard-links* the
disk tier's current files (master weights and optimizer states there) and writes only what
lives in RAM, in its stored form:

    <folder>/ram_state.safetensors   weights and optimizer states held in host RAM (codec form
                                     kept), and AdamW's per-unit step counts
    <folder>/disk/<file>.mtd         hard links to the disk tier's files (copies only when the
                                     folder sits on another filesystem than offload_dir)
    <folder>/linked.json             which unit's weights / states are which file; bytes linked,
                                     copied and written

The ``.mtd`` files carry their own checksums (header and per tensor), checked when they are
read back; a checkpoint manifest need not hash them again (that would read the whole disk tier).

Loading copies the state back through the stores' ordinary write paths (``overwrite``,
``put_stored``), which keep the host cache and the read-ahead consistent; the snapshot's
files are only read.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
from typing import Dict

import torch

from .disk_params import weights_key

LINKED_FILE = "linked.json"
RAM_FILE = "ram_state.safetensors"
DISK_FOLDER = "disk"


def is_linked(folder) -> bool:
    return os.path.isfile(os.path.join(os.fspath(folder), LINKED_FILE))


def save_linked(engine, folder) -> Dict[str, int]:
    """Write ``engine``'s training state into ``folder`` (which exists) as a linked checkpoint.
    Returns ``{"linked_bytes", "copied_bytes", "written_bytes"}``. Waits for every pending update
    and disk write first (call at a step boundary, under ``engine.lock``)."""
    from safetensors.torch import save_file

    folder = os.fspath(folder)
    engine.pager.wait_grads()
    engine.updates.check_intact("a snapshot")
    disk = engine.disk
    if disk is not None:
        disk.write_back_all()   # dirty keys the host cache holds become files (same bytes)
        disk.flush()
    tensors: Dict[str, torch.Tensor] = {}
    links: Dict[str, Dict[str, str]] = {"weights": {}, "states": {}}
    linked = copied = 0
    for u in engine.state_units:
        if engine.params_on_disk:
            links["weights"][u.name], n, c = _link(disk, weights_key(u), folder)
            linked, copied = linked + n, copied + c
        else:
            tensors[f"w/{u.name}"] = engine.weights.read_now(u).contiguous()
        if engine.states.on_disk(u):
            links["states"][u.name], n, c = _link(disk, engine.states.key(u), folder)
            linked, copied = linked + n, copied + c
        else:
            stored = engine.states.stored(u)
            for k, t in (stored or {}).items():
                tensors[f"s/{u.name}/{k}"] = t.contiguous()
    for k, t in engine.adam.state_dict().items():
        tensors[f"step/{k}"] = t.reshape(1)
    ram_path = os.path.join(folder, RAM_FILE)
    save_file(tensors, ram_path, metadata={"codec": engine.config.optimizer_compression,
                                          "format": "megatrain_nb-linked-v1"})
    written = os.path.getsize(ram_path)
    meta = {"format": 1, "codec": engine.config.optimizer_compression, "units": [u.name for u in engine.state_units],
            "weights": links["weights"], "states": links["states"], "linked_bytes": linked,
            "copied_bytes": copied, "written_bytes": written}
    with open(os.path.join(folder, LINKED_FILE), "w") as f:
        json.dump(meta, f, indent=1)
    return {"linked_bytes": linked, "copied_bytes": copied, "written_bytes": written}


def _link(disk, key: str, folder: str):
    """(file name in ``folder/disk``, bytes linked, bytes copied) for ``key``'s current file."""
    src = disk.file_of(key)
    if src is None:
        raise RuntimeError(f"the disk tier has no file for {key!r}; a snapshot needs every unit written")
    dest_dir = os.path.join(folder, DISK_FOLDER)
    os.makedirs(dest_dir, exist_ok=True)
    name = os.path.basename(src)
    dest = os.path.join(dest_dir, name)
    size = os.path.getsize(src)
    try:
        os.link(src, dest)
        return name, size, 0
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
            raise
    shutil.copyfile(src, dest)   # another filesystem: the bytes must be copied
    return name, 0, size


def load_linked(engine, folder) -> None:
    """Replace ``engine``'s weights, optimizer states and step counts by a linked checkpoint's."""
    from safetensors import safe_open

    folder = os.fspath(folder)
    with open(os.path.join(folder, LINKED_FILE)) as f:
        meta = json.load(f)
    codec = meta.get("codec")
    if codec != engine.config.optimizer_compression:
        raise ValueError(f"snapshot {folder!r} holds optimizer states in codec {codec!r} but this engine uses "
                         f"{engine.config.optimizer_compression!r}; a snapshot loads into the run that wrote it")
    names = [u.name for u in engine.state_units]
    if meta.get("units") != names:
        raise ValueError(f"snapshot {folder!r} was written by a model with units {meta.get('units')}, "
                         f"not this one ({names})")
    engine.pager.wait_grads()
    engine.updates.settle()
    disk = engine.disk
    with safe_open(os.path.join(folder, RAM_FILE), "pt") as fh:
        keys = list(fh.keys())
        engine.adam.load_state_dict({k[5:]: fh.get_tensor(k).reshape(()) for k in keys if k.startswith("step/")})
        for u in engine.state_units:
            if u.name in meta["weights"]:
                flat = disk.read_file(os.path.join(folder, DISK_FOLDER, meta["weights"][u.name]), weights_key(u))["w"]
            else:
                flat = fh.get_tensor(f"w/{u.name}")
            engine.weights.overwrite(u, flat)
            if u.name in meta["states"]:
                path = os.path.join(folder, DISK_FOLDER, meta["states"][u.name])
                stored = disk.read_file(path, engine.states.key(u))
            else:
                prefix = f"s/{u.name}/"
                stored = {k[len(prefix):]: fh.get_tensor(k) for k in keys if k.startswith(prefix)}
            if stored:
                engine.states.put_stored(u, stored)
    engine.states.flush()
    engine.updates.clear_failure()
