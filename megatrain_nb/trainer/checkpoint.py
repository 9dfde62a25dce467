"""Checkpoint folders: ``output_dir/checkpoint-<step>/`` written whole under a temporary name
(``checkpoint-<step>.tmp-<pid>-<random>``) and renamed into place, so a crash mid-write leaves
the previous checkpoints intact and the partial one ignored (and cleaned up later).

A checkpoint folder holds:

- what ``engine.save_checkpoint`` writes: weights in the Hugging Face safetensors layout and the
  optimizer states in their stored (codec) form;
- ``scheduler.json`` (the LR scheduler's state and any live ``set_lr`` override),
- ``rng_state.json`` (python, numpy, torch CPU and CUDA generators),
- ``manifest.json`` (size and checksum of every 64 MiB piece of every other file; checked before a
  resume: a checkpoint without one, or with a file it does not list, is refused; :func:`seal`
  writes one for a checkpoint made by hand),
- ``trainer_state.json`` (``transformers.TrainerState``: step, epoch, log history),
- ``megatrain_state.json`` (data position, tokens seen, the run's shape, the model that wrote it
  (:func:`model_record`: its type, size and every parameter's shape), the ``run_id`` of the run
  that wrote it and when; written last: it marks a megatrain_nb checkpoint),
- ``training_args.json`` and, when there is one, the tokenizer.
"""
from __future__ import annotations

import base64
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from megatrain_nb.atomic import atomic_dir, commit_dir, recover_interrupted, temp_name
from megatrain_nb.engine.tiers.io import shard_files
from megatrain_nb.manifest import MANIFEST, IntegrityError, verify_manifest, write_manifest  # noqa: F401

PREFIX = "checkpoint"
STATE_FILE = "megatrain_state.json"
_NAME = re.compile(rf"^{PREFIX}-(\d+)$")


class CheckpointError(ValueError):
    """A path given as a checkpoint is not one (the message says what was found)."""


def is_checkpoint(path) -> bool:
    p = Path(path)
    return p.is_dir() and (p / STATE_FILE).is_file() and (p / "trainer_state.json").is_file()


def checkpoint_info(path) -> dict:
    """``run_id`` (None for checkpoints written before runs had ids) and ``saved_at`` (seconds
    since the epoch; the state file's mtime when not recorded) of a checkpoint."""
    state = Path(path) / STATE_FILE
    try:
        meta = json.loads(state.read_text())
    except (OSError, ValueError):
        meta = {}
    saved = meta.get("saved_at")
    if not isinstance(saved, (int, float)):
        try:
            saved = state.stat().st_mtime
        except OSError:
            saved = 0.0
    return {"run_id": meta.get("run_id"), "saved_at": float(saved)}


def list_checkpoints(output_dir, run_id: Optional[str] = None) -> list[Path]:
    """Complete checkpoints in ``output_dir``, oldest step first. Partial (temporary) ones are
    ignored. With ``run_id``, only the checkpoints that run wrote (several runs may share a folder)."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    recover_interrupted(root)
    found = []
    for child in root.iterdir():
        m = _NAME.match(child.name)
        if m and is_checkpoint(child) and (run_id is None or checkpoint_info(child)["run_id"] == run_id):
            found.append((int(m.group(1)), child))
    return [p for _, p in sorted(found)]


def latest_checkpoint(output_dir) -> Optional[Path]:
    """The newest checkpoint of the run that wrote last into ``output_dir``: when runs share a
    folder, a later run's step 20 is the resume point, not an earlier run's step 250."""
    found = list_checkpoints(output_dir)
    if not found:
        return None
    info = {p: checkpoint_info(p) for p in found}
    last_run = max(found, key=lambda p: info[p]["saved_at"])
    mine = [p for p in found if info[p]["run_id"] == info[last_run]["run_id"]]
    return mine[-1]


#: ``resume_from_checkpoint=AUTO``: the latest complete checkpoint in output_dir if there is one,
#: else a fresh start. One script then serves the first launch and every restart (torchrun
#: ``--max-restarts``, a job scheduler's requeue): the restarted workers resume by themselves.
AUTO = "auto"


def resolve_resume(resume, output_dir) -> Optional[Path]:
    """``True`` -> the latest checkpoint in output_dir; ``"auto"`` -> the same, or None when there
    is none; a path -> that checkpoint, checked."""
    if resume is None or resume is False:
        return None
    if isinstance(resume, str) and resume == AUTO and not Path(resume).exists():
        return latest_checkpoint(output_dir)
    if resume is True:
        last = latest_checkpoint(output_dir)
        if last is None:
            raise CheckpointError(f"resume_from_checkpoint=True but no complete checkpoint was found in "
                                  f"output_dir={str(output_dir)!r}")
        return last
    p = Path(resume)
    recover_interrupted(p.parent)  # a save of this very name may have been cut short
    if not p.exists():
        raise CheckpointError(f"resume_from_checkpoint={str(resume)!r} does not exist")
    if is_checkpoint(p):
        return p
    inside = latest_checkpoint(p) if p.is_dir() else None
    hint = (f"; it holds checkpoints, the latest being {str(inside)!r}" if inside is not None
            else "; pass a folder like <output_dir>/checkpoint-<step> written by megatrain_nb")
    raise CheckpointError(f"resume_from_checkpoint={str(resume)!r} is not a megatrain_nb checkpoint "
                          f"(no {STATE_FILE} and trainer_state.json in it){hint}")


def resume_point(resume, output_dir) -> Optional[Path]:
    """The checkpoint a resume asked for before the run starts would load (an engine built for it
    takes its codec: ``optimizer_compression="auto"`` never re-picks), or None; a resume that
    cannot be resolved is left to the resume itself to refuse."""
    try:
        return resolve_resume(resume, output_dir)
    except (CheckpointError, OSError):
        return None


def verify(path) -> bool:
    """Check ``path`` against its manifest; the error names the bad file and the checkpoint
    before it in the same folder (the one to resume from instead)."""
    path = Path(path)
    others = [c for c in list_checkpoints(path.parent) if c.resolve() != path.resolve()]
    mine = _NAME.match(path.name)
    if mine:
        others = [c for c in others if int(_NAME.match(c.name).group(1)) < int(mine.group(1))]
    return verify_manifest(path, others[-1] if others else None)


def seal(path, *, reseal: bool = False) -> dict:
    """Vouch for a checkpoint assembled by hand (not written by megatrain_nb): write its
    ``manifest.json`` over the files it holds now, so that a resume accepts it. This is the one
    explicit opt-out from "a checkpoint without a manifest is damaged"; run it only on a folder
    whose every file you trust. Returns the manifest.

    A folder whose manifest exists and verifies is left as it is. One whose manifest exists and
    does not verify (a file damaged, added or changed since it was written) is refused: sealing
    it would launder the damage. ``reseal=True`` overwrites that manifest, vouching for the files
    as they are now: only for changes you made yourself. ``scheduler.json`` must hold a schedule
    (a resume reads it)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"seal({str(path)!r}): not a folder")
    _check_scheduler_file(path)
    if (path / MANIFEST).is_file() and not reseal:
        try:
            verify_manifest(path)
        except IntegrityError as e:
            raise CheckpointError(
                f"seal({str(path)!r}) refused: it has a {MANIFEST} and it does not verify, so the folder changed "
                f"after it was written ({e}). Sealing would vouch for that change. If you made it yourself and "
                f"trust every file, seal({str(path)!r}, reseal=True) overwrites the manifest") from None
        return json.loads((path / MANIFEST).read_text())
    return write_manifest(path)


def _check_scheduler_file(path: Path) -> None:
    """A ``scheduler.json`` that is not a schedule's state, named now rather than at the resume."""
    f = path / SCHEDULER_FILE
    if f.is_file():
        read_scheduler_state(path)


# -- the model a checkpoint belongs to ---------------------------------------------------------

_DESCRIBE = ("model_type", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
             "num_key_value_heads", "vocab_size", "n_layer", "n_embd", "n_head")


def model_record(engine) -> dict:
    """What a checkpoint records about the model that wrote it: a description (type, layers,
    widths, its name or path) and every parameter's name and shape, the part that is checked."""
    config = engine.model_config
    cfg = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    describe = {k: cfg[k] for k in _DESCRIBE if cfg.get(k) is not None}
    name = getattr(config, "name_or_path", None) or cfg.get("_name_or_path")
    if name:
        describe["name_or_path"] = str(name)
    if cfg.get("architectures"):
        describe["architectures"] = list(cfg["architectures"])
    params = {p.name: list(p.shape) for u in engine.units for p in u.params}
    return {"describe": describe, "parameters": params}


def _describe(record: dict) -> str:
    d = dict(record.get("describe") or {})
    kind = (d.pop("architectures", None) or [d.get("model_type", "?")])[0]
    name = d.pop("name_or_path", None)
    d.pop("model_type", None)
    sizes = ", ".join(f"{k}={d[k]}" for k in _DESCRIBE if k in d)   # one order, whatever JSON kept
    return f"a {kind} model ({sizes}{', from ' + repr(name) if name else ''})"


def check_model(path, engine) -> None:
    """Refuse a checkpoint written by another model: a parameter it lacks, holds in another shape,
    or holds that this model does not have (a 3-layer checkpoint into a 2-layer model). Checked
    against the record the checkpoint carries; a checkpoint made by hand without one is checked
    against the tensors its weights file names."""
    path = Path(path)
    mine = model_record(engine)
    meta = read_json(path / STATE_FILE) if (path / STATE_FILE).is_file() else {}
    theirs = meta.get("model") if isinstance(meta, dict) else None
    if isinstance(theirs, dict) and isinstance(theirs.get("parameters"), dict):
        saved = {k: list(v) for k, v in theirs["parameters"].items()}
        writer = _describe(theirs)
    else:
        saved = _weights_in(path)
        if saved is None:
            return   # a sharded checkpoint from before models were recorded: its shards are checked by unit
        writer = "a model that did not record itself (a checkpoint made by hand or by an older version)"
    want = mine["parameters"]
    extra = sorted(set(saved) - set(want))
    missing = sorted(set(want) - set(saved))
    shape = sorted(k for k in set(saved) & set(want) if list(saved[k]) != list(want[k]))
    if not (extra or missing or shape):
        return
    parts = []
    if shape:
        k = shape[0]
        parts.append(f"{len(shape)} parameter(s) differ in shape, e.g. {k!r}: {tuple(saved[k])} in the checkpoint, "
                     f"{tuple(want[k])} in this model")
    if extra:
        parts.append(f"{len(extra)} parameter(s) this model does not have, e.g. {extra[0]!r}")
    if missing:
        parts.append(f"{len(missing)} of this model's parameters are missing, e.g. {missing[0]!r}")
    raise CheckpointError(f"checkpoint {str(path)!r} was written by {writer}; this Trainer's model is "
                          f"{_describe(mine)}: " + "; ".join(parts) + ". Resume it with the model that wrote it, "
                          "or start this model from its own checkpoints")


def _weights_in(path: Path) -> Optional[dict]:
    """name -> shape of the tensors in a checkpoint's Hugging Face weights files (None: there are none)."""
    from safetensors import safe_open

    try:
        files = shard_files(path)
    except FileNotFoundError:
        return None
    out = {}
    for f in sorted(set(files.values())):
        with safe_open(f, "pt") as fh:
            for k in fh.keys():
                out[k] = list(fh.get_slice(k).get_shape())
    return out


def remove_stale_temporaries(output_dir) -> list[str]:
    """Finish the saves that processes died in (see ``atomic.recover_interrupted``): partial
    checkpoints go, a previous checkpoint left moved aside comes back."""
    return recover_interrupted(output_dir)


def write_checkpoint(final_dir, write: Callable[[Path], None], *, manifest_exclude: tuple = ()) -> Path:
    """Call ``write(tmp_dir)``, add the checksum manifest (last: a folder with a manifest is
    complete), then rename ``tmp_dir`` to ``final_dir`` (replacing an older one); see
    ``atomic.atomic_dir`` for what a crash at any point leaves."""
    final = Path(final_dir)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(final.parent)
    atomic_dir(final, lambda tmp: _fill(final, Path(tmp), write, manifest_exclude))
    return final


def begin_checkpoint(final_dir) -> Path:
    """The temporary folder a checkpoint of ``final_dir`` is written into by parts (a snapshot
    completed in the background): stale temporaries cleared, the folder made. Complete it with
    :func:`commit_checkpoint` (which removes it on failure). One at a time per folder: a later
    begin clears this process's unfinished ones too."""
    final = Path(final_dir)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(final.parent)
    tmp = Path(temp_name(final))
    tmp.mkdir()
    return tmp


def commit_checkpoint(final_dir, tmp: Path, write: Callable[[Path], None], *, manifest_exclude: tuple = ()) -> Path:
    """As :func:`write_checkpoint`, into ``tmp`` from :func:`begin_checkpoint`."""
    final = Path(os.path.abspath(os.fspath(final_dir)))
    try:
        _fill(final, Path(tmp), write, manifest_exclude)
        commit_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _fill(final: Path, tmp: Path, write: Callable[[Path], None], manifest_exclude: tuple) -> None:
    try:
        write(tmp)
        write_manifest(tmp, exclude=manifest_exclude)
    except Exception as e:  # noqa: BLE001 - a full disk is reported plainly, the rest as it is
        if _disk_full(e):
            raise _disk_full_error(final, tmp, e) from e
        raise


def _disk_full(e: BaseException) -> bool:
    """ENOSPC/EDQUOT from Python, or safetensors' Rust error text for it ("os error 28")."""
    import errno
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(e)
    return "os error 28" in text or "StorageFull" in text or "No space left on device" in text


def _disk_full_error(final: Path, tmp: Path, e: BaseException) -> OSError:
    import errno
    written = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file())
    try:
        free = shutil.disk_usage(tmp).free
    except OSError:
        free = -1
    return OSError(errno.ENOSPC, f"the disk is full: writing checkpoint {str(final)!r} stopped after {written} bytes "
                                 f"({free} bytes free there). Nothing was replaced; earlier checkpoints are intact. "
                                 "Free space, lower save_total_limit, or point output_dir at a larger disk "
                                 f"(cause: {type(e).__name__}: {e})")


def rotate(output_dir, keep: Optional[int], protect: Optional[Path] = None,
           run_id: Optional[str] = None) -> list[Path]:
    """Delete checkpoints until ``output_dir`` holds at most ``keep`` (``save_total_limit``);
    never ``protect``. Other runs' checkpoints go first (the longest ago written first), then
    run ``run_id``'s lowest steps: a new run never loses its own checkpoints to an old run's
    higher step numbers."""
    if not keep or keep <= 0:
        return []
    found = list_checkpoints(output_dir)
    info = {p: checkpoint_info(p) for p in found}
    others = sorted((p for p in found if run_id is None or info[p]["run_id"] != run_id),
                    key=lambda p: info[p]["saved_at"]) if run_id is not None else []
    order = others + [p for p in found if p not in others]
    removed = []
    for p in order:
        if len(found) - len(removed) <= keep:
            break
        if protect is not None and p.resolve() == Path(protect).resolve():
            continue
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


# -- small files: JSON only, so that loading a checkpoint never unpickles anything ----------------

RNG_FILE = "rng_state.json"
SCHEDULER_FILE = "scheduler.json"
_OLD_RNG, _OLD_SCHEDULER = "rng_state.pth", "scheduler.pt"  # pickles written by earlier versions


def rng_state() -> dict:
    """Python, numpy, torch CPU (and CUDA) generator states as JSON-able values."""
    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": [version, list(mt), gauss],
             "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
             "cpu": _b64(torch.get_rng_state())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_b64(t) for t in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict) -> None:
    version, mt, gauss = state["python"]
    random.setstate((version, tuple(mt), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(state["cpu"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(t) for t in state["cuda"]])


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.contiguous().numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def read_rng_state(folder: Path) -> dict:
    folder = Path(folder)
    if (folder / RNG_FILE).is_file():
        return read_json(folder / RNG_FILE)
    old = _load_old(folder / _OLD_RNG)
    # the old pickle held python's state as a tuple and numpy's arrays; normalise to the JSON form
    py, npst = old["python"], old["numpy"]
    out = {"python": [py[0], list(py[1]), py[2]],
           "numpy": [npst[0], np.asarray(npst[1]).tolist(), int(npst[2]), int(npst[3]), float(npst[4])],
           "cpu": _b64(old["cpu"])}
    if "cuda" in old:
        out["cuda"] = [_b64(t) for t in old["cuda"]]
    return out


def read_scheduler_state(folder: Path) -> dict:
    """The learning-rate schedule's saved state; :class:`CheckpointError` naming the file when it
    is not one (``{"scheduler": {...}, "override": null or [lr, anchor]}``)."""
    folder = Path(folder)
    if not (folder / SCHEDULER_FILE).is_file():
        return _load_old(folder / _OLD_SCHEDULER)
    f = folder / SCHEDULER_FILE
    try:
        state = read_json(f)
    except ValueError as e:
        raise CheckpointError(f"{str(f)!r} is not valid JSON ({e}); the checkpoint's schedule cannot be read") from None
    override = state.get("override") if isinstance(state, dict) else None
    if not (isinstance(state, dict) and isinstance(state.get("scheduler"), dict)
            and (override is None or (isinstance(override, list) and len(override) == 2))):
        raise CheckpointError(f"{str(f)!r} does not hold a learning-rate schedule's state (expected "
                              '{"scheduler": {...}, "override": null or [lr, anchor]}); it was damaged or '
                              "replaced. Resume from another checkpoint, or restore the file")
    return state


def _load_old(path: Path):
    """A pickle from an older checkpoint, read with ``weights_only=True``: tensors and plain
    containers only, never code. A file that needs more is refused, by name."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path.parent)!r} has neither {path.stem}.json nor {path.name}")
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - any refusal means the same to the user
        raise CheckpointError(f"{str(path)!r} cannot be loaded safely (it holds more than tensors and plain "
                              f"values, and megatrain_nb never unpickles objects from a file): {e}. "
                              "Load an older checkpoint, or re-save this one with the megatrain_nb version "
                              "that wrote it") from None


def write_json(path: Path, obj, *, strict: bool = False) -> None:
    """``strict``: a value that is not JSON fails loudly instead of being written as a string
    that would read back differently (state that is loaded again, not informational files)."""
    Path(path).write_text(json.dumps(obj, indent=2, sort_keys=True, default=None if strict else str))


def read_json(path: Path):
    return json.loads(Path(path).read_text())
