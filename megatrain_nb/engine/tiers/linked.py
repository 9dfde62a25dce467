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
    <folder>/linked.json             which unit's weights / states are which file, and each
                                     file's digest (its header's: ``linked_check.header_digest``),
                                     which binds it to this snapshot; bytes linked, copied and
                                     written

The ``.mtd`` files carry their own checksums (header and per tensor), checked when they are
read back; a checkpoint manifest need not hash them again (that would read the whole disk tier).

Taking one does not wait for the step's updates when the disk tier holds the whole state
(the bigger-than-RAM configuration): a job behind them in the AdamW worker queues, per file, an
ordered link in the disk tier's queue (``DiskStore.link``), which sees the version written by
this step's update and not the next one's; :meth:`LinkedWrite.result` then completes the
folder while training goes on.

Loading (after ``engine/tiers/linked_check.py`` checked every part) copies the state back through
the stores' ordinary write paths (``overwrite``, ``put_stored``), which keep the host cache and
the read-ahead consistent; the snapshot's files are only read.

A load never tears the live state (:func:`load_keeping`): the state is first set aside as a
linked checkpoint of its own (the disk tier's files hard-linked, what lives in RAM written
beside them, in the disk tier's folder), and a load that fails part way (an I/O error, a file
changed after it was checked) puts it back before the error is raised, so training goes on
from where it was. An engine that never took a step, or already failed, has nothing to keep.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import weakref
from concurrent.futures import Future
from typing import Callable, Dict, Optional

import torch

from .disk_params import weights_key
from .linked_check import file_digest, read_meta
from ..outcome import TornLoad

LINKED_FILE = "linked.json"
#: the folder a load sets the live state aside in (``.kept-<pid>-<random>``): removed after the
#: load; one a killed process left beside a snapshot is reclaimed (``SnapshotStore.reclaim``)
KEPT_PREFIX = ".kept-"
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
        meta = {"format": 2, "codec": codec, "units": [u.name for u in self.engine.state_units],
                "weights": names["weights"], "states": names["states"], "digests": self._digests(names),
                "linked_bytes": linked, "copied_bytes": copied, "written_bytes": written}
        with open(os.path.join(self.folder, LINKED_FILE), "w") as f:
            json.dump(meta, f, indent=1)
        return {"linked_bytes": linked, "copied_bytes": copied, "written_bytes": written}

    def _digests(self, names: Dict[str, Dict[str, str]]) -> Dict[str, Dict[str, str]]:
        """Each linked file's digest (its header, read once): what binds it to this snapshot."""
        e = self.engine
        units = {u.name: u for u in e.state_units}
        key_of = {"weights": weights_key, "states": e.states.key}
        return {role: {unit: file_digest(os.path.join(self.folder, DISK_FOLDER, name), key_of[role](units[unit]))
                       for unit, name in files.items()} for role, files in names.items()}


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


class LoadUndone(RuntimeError):
    """A load failed part way and the state from before it was put back: the run goes on from
    where it was (the message says what failed)."""


def load_keeping(engine, path, load: Callable[[str], None]) -> None:
    """``load(path)`` (under ``engine.lock``, the folder checked whole before) so that a failure
    part way never leaves a mixture: the live state is set aside first (:func:`_set_aside`) and
    put back when the load fails, which then raises :class:`LoadUndone` naming the cause. An
    engine that holds ``path``'s state already, unchanged since it loaded it (a rewind's restart
    loads its snapshot again), needs nothing set aside: a part of it loaded again is the same.
    Where nothing can be kept (several ranks, an engine that already failed or never stepped) or
    putting back fails too, the failure is recorded as a torn load, as before: nothing trains,
    saves or reads weights on the mixture until a load succeeds."""
    path = os.fspath(path)
    same = _holds(engine, path)
    kept = None if same else _set_aside(engine, path)
    try:
        load(path)
    except BaseException as e:
        _LOADED.pop(engine, None)
        if not same and (kept is None or not _put_back(engine, kept)):
            engine.updates.outcome.record_failure(TornLoad(path, e))
            raise
        if not isinstance(e, Exception):
            raise   # (an interrupt: the state is the one before; it goes on as it is)
        if same:
            _LOADED[engine] = (os.path.realpath(path), _steps(engine))
        raise LoadUndone(f"loading {path!r} failed part way ({type(e).__name__}: {e}); the state from before "
                         "the load was put back, so the run goes on from where it was") from e
    else:
        _LOADED[engine] = (os.path.realpath(path), _steps(engine))
    finally:
        if kept is not None:
            shutil.rmtree(kept, ignore_errors=True)


#: engine -> (the folder it loaded last, its AdamW step counts then): while they are unchanged
#: (no update since), the engine holds that folder's state
_LOADED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _steps(engine) -> dict:
    return {k: float(t.reshape(-1)[0]) for k, t in engine.adam.state_dict().items()}


def _holds(engine, path: str) -> bool:
    """Whether ``engine`` holds ``path``'s state, unchanged since it loaded it."""
    last = _LOADED.get(engine)
    return last is not None and last[0] == os.path.realpath(path) and last[1] == _steps(engine) \
        and engine.updates.outcome.failed is None


def _set_aside(engine, path: str) -> Optional[str]:
    """The live state as a linked checkpoint in a temporary folder (the disk tier's folder when
    there is one: its files are hard-linked there; else beside ``path``); None when there is
    nothing to keep. Raises, loading nothing, when it cannot be written (a full disk)."""
    if engine.sharded is not None:
        return None   # (a collective load: every rank would have to put back together)
    engine.pager.wait_grads()
    engine.updates.settle()
    outcome = engine.updates.outcome
    if outcome.failed is not None or outcome.nonfinite is not None:
        return None   # the live state is already a mixture or diverged: the load repairs it
    if not any(_steps(engine).values()):
        return None   # no update was ever applied: the live state is the model it was built from
    where = engine.disk.path if engine.disk is not None else os.path.dirname(os.path.abspath(path))
    kept = tempfile.mkdtemp(prefix=f"{KEPT_PREFIX}{os.getpid()}-", dir=where)
    try:
        save_linked(engine, kept)
    except BaseException as e:
        shutil.rmtree(kept, ignore_errors=True)
        raise RuntimeError(f"nothing was loaded from {path!r}: the live state could not be set aside first "
                           f"({type(e).__name__}: {e}), and a load that failed part way would lose it") from e
    return kept


def _put_back(engine, kept: str) -> bool:
    """Load the state :func:`_set_aside` kept; False when that fails too."""
    try:
        load_linked(engine, kept)
    except BaseException:  # noqa: BLE001 - the caller records the torn load
        return False
    return True
