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

Taking one does not wait for the step's updates when the disk tier holds the whole state
(the bigger-than-RAM configuration): a job behind them in the AdamW worker queues, per file, an
ordered link in the disk tier's queue (``DiskStore.link``), which sees the version written by
this step's update and not the next one's; :meth:`LinkedWrite.result` then completes the
folder while training goes on.

Loading (after ``engine/linked_check.py`` checked every part) copies the state back through
the stores' ordinary write paths (``overwrite``, ``put_stored``), which keep the host cache and
the read-ahead consistent; the snapshot's files are only read.
"""
from __future__ import annotations

import json
import os
from concurrent.futures import Future
from typing import Dict

import torch

from .disk_params import weights_key
from .linked_check import read_meta

LINKED_FILE = "linked.json"
RAM_FILE = "ram_state.safetensors"
DISK_FOLDER = "disk"


def is_linked(folder) -> bool:
    return os.path.isfile(os.path.join(os.fspath(folder), LINKED_FILE))


def save_linked(engine, folder) -> Dict[str, int]:
    """Write ``engine``'s training state into ``folder`` (which exists) as a linked checkpoint.
    Returns ``{"linked_bytes", "copied_bytes", "written_bytes"}`` (call at a step boundary, under
    ``engine.lock``)."""
    return begin_linked(engine, folder).result()


def begin_linked(engine, folder) -> "LinkedWrite":
    """Start a linked checkpoint of the state at this step boundary (under ``engine.lock``);
    :meth:`LinkedWrite.result` completes it, from any thread, while training goes on.

    When the disk tier holds every unit's weights and optimizer states, nothing waits for the
    step's updates: a job queued behind them in the AdamW worker (``after_updates``) asks the
    disk tier for an ordered link of each file (``DiskStore.link``: after that update's write,
    before the next step's) and copies the AdamW step counts. Otherwise (state in RAM, or a
    data-parallel engine) the state is read now, after the updates."""
    folder = os.fspath(folder)
    engine.pager.wait_grads()
    units = engine.state_units
    if engine.disk is not None and engine.params_on_disk and engine.sharded is None \
            and all(engine.states.on_disk(u) for u in units):
        engine.updates.outcome.refuse_if_failed("a snapshot")
        dest = os.path.join(folder, DISK_FOLDER)
        os.makedirs(dest, exist_ok=True)
        return LinkedWrite(engine, folder, engine.updates.after_updates(lambda: _capture_disk(engine, dest)))
    engine.updates.check_intact("a snapshot")
    done: Future = Future()
    done.set_result(_capture_now(engine, folder))
    return LinkedWrite(engine, folder, done)


def _capture_disk(engine, dest: str):
    """(AdamW worker, the step's updates done) ordered links of every disk-tier file, step counts."""
    engine.states.wait_encodes()   # a codec's writes are issued from its own thread
    disk = engine.disk
    write_back = getattr(disk, "write_back_all", None)
    if write_back is not None:
        write_back()   # dirty keys the host cache holds are written (same bytes), the links follow
    links = {"weights": {u.name: disk.link(weights_key(u), dest) for u in engine.state_units},
             "states": {u.name: disk.link(engine.states.key(u), dest) for u in engine.state_units}}
    steps = {f"step/{k}": t.clone().reshape(1) for k, t in engine.adam.state_dict().items()}
    return links, steps


def _capture_now(engine, folder: str):
    """(Training thread, the step's updates done) links of the disk tier's files and the RAM
    state (tensors the engine holds: written before training goes on)."""
    disk = engine.disk
    if disk is not None:
        disk.write_back_all()
        disk.flush()
    dest = os.path.join(folder, DISK_FOLDER)
    tensors: Dict[str, torch.Tensor] = {}
    links: Dict[str, Dict[str, Future]] = {"weights": {}, "states": {}}
    for u in engine.state_units:
        if engine.params_on_disk:
            links["weights"][u.name] = _done(_link(disk, weights_key(u), dest))
        else:
            tensors[f"w/{u.name}"] = engine.weights.read_now(u).contiguous()
        if engine.states.on_disk(u):
            links["states"][u.name] = _done(_link(disk, engine.states.key(u), dest))
        else:
            for k, t in (engine.states.stored(u) or {}).items():
                tensors[f"s/{u.name}/{k}"] = t.contiguous()
    for k, t in engine.adam.state_dict().items():
        tensors[f"step/{k}"] = t.reshape(1)
    _write_ram(engine, folder, tensors)
    return links, {}


def _done(value) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


class LinkedWrite:
    """A linked checkpoint begun by :func:`begin_linked`; :meth:`result` completes it."""

    def __init__(self, engine, folder: str, captured: Future):
        self.engine = engine
        self.folder = folder
        self.captured = captured

    def result(self) -> Dict[str, int]:
        """Wait for the links, write the RAM-held state and ``linked.json``; the bytes linked,
        copied and written. Raises what failed (the folder is then the caller's to remove)."""
        links, steps = self.captured.result()
        names: Dict[str, Dict[str, str]] = {"weights": {}, "states": {}}
        linked = copied = 0
        for role, futs in links.items():
            for unit, fut in futs.items():
                names[role][unit], n, c = fut.result()
                linked, copied = linked + n, copied + c
        if steps:   # (the slow path wrote the RAM state itself)
            _write_ram(self.engine, self.folder, steps)
        written = os.path.getsize(os.path.join(self.folder, RAM_FILE))
        codec = self.engine.config.optimizer_compression
        meta = {"format": 1, "codec": codec, "units": [u.name for u in self.engine.state_units],
                "weights": names["weights"], "states": names["states"], "linked_bytes": linked,
                "copied_bytes": copied, "written_bytes": written}
        with open(os.path.join(self.folder, LINKED_FILE), "w") as f:
            json.dump(meta, f, indent=1)
        return {"linked_bytes": linked, "copied_bytes": copied, "written_bytes": written}


def _write_ram(engine, folder: str, tensors: Dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file(tensors, os.path.join(folder, RAM_FILE),
              metadata={"codec": engine.config.optimizer_compression, "format": "megatrain_nb-linked-v1"})


def _link(disk, key: str, dest_dir: str):
    """(file name in ``dest_dir``, bytes linked, bytes copied) for ``key``'s current file, now
    (every write of it done)."""
    if disk.file_of(key) is None:
        raise RuntimeError(f"the disk tier has no file for {key!r}; a snapshot needs every unit written")
    os.makedirs(dest_dir, exist_ok=True)
    return disk.link(key, dest_dir).result()


def load_linked(engine, folder) -> None:
    """Replace ``engine``'s weights, optimizer states and step counts by a linked checkpoint's."""
    from safetensors import safe_open

    folder = os.fspath(folder)
    meta = read_meta(folder)   # (engine.verify_checkpoint checked the whole folder before)
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
