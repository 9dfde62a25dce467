"""Checkpoint folders: ``output_dir/checkpoint-<step>/`` written whole under a temporary name
(``checkpoint-<step>.tmp-<pid>-<random>``) and renamed into place, so a crash mid-write leaves
the previous checkpoints intact and the partial one ignored (and cleaned up later).

A checkpoint folder holds:

- what ``engine.save_checkpoint`` writes: weights in the Hugging Face safetensors layout and the
  optimizer states in their stored (codec) form;
- ``scheduler.pt``  (the LR scheduler's state and any live ``set_lr`` override),
- ``rng_state.pth`` (python, numpy, torch CPU and CUDA generators),
- ``trainer_state.json`` (``transformers.TrainerState``: step, epoch, log history),
- ``megatrain_state.json`` (data position, tokens seen, the run's shape, the ``run_id`` of the
  run that wrote it and when; written last: it marks a megatrain_nb checkpoint),
- ``training_args.json`` and, when there is one, the tokenizer.
"""
from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from megatrain_nb.atomic import atomic_dir, recover_interrupted

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


def resolve_resume(resume, output_dir) -> Optional[Path]:
    """``True`` -> the latest checkpoint in output_dir; a path -> that checkpoint, checked."""
    if resume is None or resume is False:
        return None
    if resume is True:
        last = latest_checkpoint(output_dir)
        if last is None:
            raise CheckpointError(f"resume_from_checkpoint=True but no complete checkpoint was found in "
                                  f"output_dir={str(output_dir)!r}")
        return last
    p = Path(resume)
    if not p.exists():
        raise CheckpointError(f"resume_from_checkpoint={str(resume)!r} does not exist")
    if is_checkpoint(p):
        return p
    inside = latest_checkpoint(p) if p.is_dir() else None
    hint = (f"; it holds checkpoints, the latest being {str(inside)!r}" if inside is not None
            else "; pass a folder like <output_dir>/checkpoint-<step> written by megatrain_nb")
    raise CheckpointError(f"resume_from_checkpoint={str(resume)!r} is not a megatrain_nb checkpoint "
                          f"(no {STATE_FILE} and trainer_state.json in it){hint}")


def remove_stale_temporaries(output_dir) -> list[str]:
    """Finish the saves that processes died in (see ``atomic.recover_interrupted``): partial
    checkpoints go, a previous checkpoint left moved aside comes back."""
    return recover_interrupted(output_dir)


def write_checkpoint(final_dir, write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp_dir)`` then rename ``tmp_dir`` to ``final_dir`` (replacing an older one);
    see ``atomic.atomic_dir`` for what a crash at any point leaves."""
    final = Path(final_dir)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(final.parent)
    atomic_dir(final, lambda tmp: write(Path(tmp)))
    return final


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


# -- small files -------------------------------------------------------------------------------

def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def write_json(path: Path, obj) -> None:
    Path(path).write_text(json.dumps(obj, indent=2, sort_keys=True, default=str))


def read_json(path: Path):
    return json.loads(Path(path).read_text())
