"""The save-and-load protocol of a Trainer's checkpoints and snapshots, on explicit inputs.

One protocol writes both (``write_state``): the engine's files, then the trainer's (the state
file last), in a temporary folder renamed into place; under data parallel every rank writes its
shards into one folder rank 0 names (``write_sharded``). ``shared_writer`` captures, as of
now, the trainer's files of a checkpoint (what a snapshot completed later writes);
``resolve_resume`` finds the checkpoint a resume starts from (rank 0 looks, every rank
takes its answer) and ``load_state`` reads it back and returns what the Trainer takes from it.
``Trainer`` (trainer/trainer.py) keeps the public methods and delegates here.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Callable, Optional

import torch

from megatrain_nb.atomic import commit_dir, staging_dir, temp_name
from megatrain_nb.engine.ranks.linked_ranks import disk_folders

from . import checkpoint as ckpt
from .snapshot import mark_damaged


@dataclasses.dataclass
class Restored:
    """What a resume takes from a checkpoint besides the engine's state, the schedule and the stream."""

    state: object            # transformers TrainerState
    tokens_seen: int
    log_accum: tuple
    run_id: Optional[str]
    parent_run_id: Optional[str]
    forked_at_step: Optional[int]


def shared_writer(meta: dict, schedule, state, args, tokenizer) -> Callable[[Path], None]:
    """``write_shared(tmp)``: the trainer's files of a checkpoint as of now (the scheduler's and
    RNG state, ``trainer_state.json``, the arguments, the tokenizer), the state file ``meta`` last."""
    scheduler, rng = copy.deepcopy(schedule.state_dict()), ckpt.rng_state()   # (as of now)
    state_text = json.dumps(dataclasses.asdict(state), indent=2, sort_keys=True) + "\n"   # (as save_to_json)
    args_dict = args.to_dict()

    def write_shared(tmp: Path) -> None:
        ckpt.write_json(tmp / ckpt.SCHEDULER_FILE, scheduler, strict=True)
        ckpt.write_json(tmp / ckpt.RNG_FILE, rng, strict=True)
        (tmp / "trainer_state.json").write_text(state_text, encoding="utf-8")
        ckpt.write_json(tmp / "training_args.json", args_dict)
        if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(str(tmp))
        ckpt.write_json(tmp / ckpt.STATE_FILE, meta)  # last: marks a complete checkpoint
    return write_shared


def write_state(engine, dist, final: Path, write_shared, snapshot: bool = False):
    """The one save protocol of checkpoints and snapshots: the engine's files, then the
    trainer's (``write_shared``, state file last), in a temporary folder renamed into place.
    Returns ``(the checkpoint's path, the bytes linked/copied/written of a snapshot)``."""
    sizes: dict = {}

    def write(tmp: Path) -> None:
        if snapshot:   # (the NaN check would read the whole disk tier; on_nonfinite guards steps)
            sizes.update(engine.save_checkpoint(str(tmp), link_disk=True) or {})
        else:
            refuse_non_finite(engine, final)
            engine.save_checkpoint(str(tmp))
        write_shared(tmp)

    with engine.lock:
        if dist.world > 1:
            out = write_sharded(engine, dist, final, write_shared, snapshot=snapshot, sizes=sizes)
        else:
            out = ckpt.write_checkpoint(final, write, manifest_exclude=("disk",) if snapshot else ())
    return out, sizes


def write_sharded(engine, dist, final: Path, write_shared, snapshot: bool = False,
                  sizes: Optional[dict] = None) -> Path:
    """Data parallel: every rank writes its shards into one temporary folder (named by rank 0)
    in parallel; rank 0 then writes the shared files, the state file last, and renames the
    folder into place. The others wait for the rename, so a checkpoint is whole when seen.
    A snapshot: each rank links its own disk-tier files and writes its RAM-held shards
    (``engine/ranks/linked_ranks.py``); the manifest leaves the links out."""
    d = dist
    tmp = None
    if not snapshot:   # (the NaN check would read the whole disk tier; on_nonfinite guards steps)
        refuse_non_finite(engine, final)   # collective: every rank reads the gathered weights
    if d.is_main:
        final.parent.mkdir(parents=True, exist_ok=True)
        ckpt.remove_stale_temporaries(final.parent)
        tmp = Path(temp_name(final))
        tmp.mkdir()
    tmp = Path(d.all_gather_json(str(tmp) if tmp is not None else None)[0])
    try:
        # collective: each rank its file (or linked folder), then a barrier
        written = engine.save_checkpoint(str(tmp), link_disk=snapshot)
        if sizes is not None and written:
            sizes.update(written)
        if d.is_main:   # every rank's shards are written (the barrier ending save_checkpoint)
            write_shared(tmp)
            # last, over every rank's files
            ckpt.write_manifest(tmp, exclude=disk_folders(d.world) if snapshot else ())
            commit_dir(tmp, final)
    except BaseException:
        if d.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    d.barrier()
    return final


def verify_whole(path: Path, engine, dist=None) -> None:
    """Check the checkpoint or snapshot at ``path`` whole before anything is loaded: the manifest
    (every file it lists; the error names the checkpoint to fall back to), the engine's part
    (a snapshot's linked files, ``engine.verify_checkpoint``) and the state file. With several
    ranks every rank checks its part and all raise the first rank's error, so none loads alone."""
    error = None
    try:
        ckpt.verify(path)
        check = getattr(engine, "verify_checkpoint", None)
        if callable(check):
            check(path, manifest=False)
        meta = ckpt.read_json(path / ckpt.STATE_FILE)
        if not isinstance(meta, dict) or not isinstance(meta.get("data"), dict):
            raise ckpt.IntegrityError(f"{str(path / ckpt.STATE_FILE)!r} is damaged: it holds no data position")
    except Exception as e:  # noqa: BLE001 - every rank must reach the gather below, whatever failed
        error = e
    if dist is not None and dist.world > 1:
        told = dist.all_gather_json([type(error).__name__, str(error)] if error is not None else None)
        first = next((t for t in told if t is not None), None)
        if error is None and first is not None:
            raise ckpt.IntegrityError(f"another rank: {first[1]}")
    if error is not None:
        mark_damaged(path, str(error))
        raise error


def load_state(path: Path, engine, schedule, stream, mine: dict, ignore_data_skip: bool,
               quiet: bool = False, dist=None) -> Restored:
    """Resume from the checkpoint at ``path``: verify it whole, warn when ``mine`` (this run's
    settings) differs from the run that wrote it (unless ``quiet``), read the trainer's files,
    then load the engine, the schedule, the data stream and the RNG state; returns the rest for
    the Trainer. Nothing is changed before every file was checked and read."""
    import warnings

    from transformers.trainer_callback import TrainerState

    verify_whole(path, engine, dist)  # before reading anything from it
    ckpt.check_model(path, engine)
    meta = ckpt.read_json(path / ckpt.STATE_FILE)
    mine = dict(mine)
    if "micro_batches_per_step" in meta:
        # a run may resume on another number of ranks: what must match is the global step
        mine.pop("gradient_accumulation_steps")
    else:
        mine.pop("micro_batches_per_step")
    changed = {k: (meta.get(k), v) for k, v in mine.items() if meta.get(k) != v}
    if changed and not quiet:   # (a branch changes settings on purpose)
        warnings.warn(f"resuming from {path} with settings that differ from the run that wrote it "
                      f"{changed}: the continuation will not match an uninterrupted run", stacklevel=4)
    scheduler = ckpt.read_scheduler_state(path)
    state = TrainerState.load_from_json(str(path / "trainer_state.json"))
    rng = ckpt.read_rng_state(path)
    data = dict(meta["data"])
    if ignore_data_skip:
        data["consumed"] = 0
    load = getattr(engine, "verify_checkpoint", None)
    if callable(load):
        engine.load_checkpoint(str(path), verify=False)   # (checked whole above)
    else:
        engine.load_checkpoint(str(path))
    schedule.load_state_dict(scheduler)
    stream.load_state_dict(data)
    restored = Restored(state=state, tokens_seen=int(meta.get("tokens_seen", 0)),
                        log_accum=tuple(meta.get("log_accum", (0.0, 0))),
                        run_id=meta.get("run_id"),  # a resumed run goes on as the same run
                        parent_run_id=meta.get("parent_run_id"), forked_at_step=meta.get("forked_at_step"))
    ckpt.set_rng_state(rng)
    engine.zero_grad()
    return restored


def resolve_resume(resume_from_checkpoint, output_dir, dist) -> Optional[Path]:
    """The checkpoint to resume from. With several ranks rank 0 alone looks (listing the
    checkpoints also clears the partial one a failed run left) and every rank takes its answer,
    or its error. Under a torchrun restart with no resume asked, warn: that attempt starts over."""
    import warnings

    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if restart > 0 and resume_from_checkpoint in (None, False) and dist.is_main:
        warnings.warn(f"torchrun restart {restart}: no resume was asked, so this attempt starts from step 0; "
                      f"pass resume_from_checkpoint='{ckpt.AUTO}' (megatrain-nb train --resume {ckpt.AUTO}) "
                      "to continue from the last complete checkpoint", stacklevel=3)
    if dist.world == 1:
        return ckpt.resolve_resume(resume_from_checkpoint, output_dir)
    found = error = mine = None
    if dist.is_main:
        try:
            found = ckpt.resolve_resume(resume_from_checkpoint, output_dir)
        except Exception as e:   # handed to every rank: the others must not wait for rank 0
            error = e
            mine = [type(e).__name__, str(e)]
    found, told = dist.all_gather_json([str(found) if found is not None else None, mine])[0]
    if error is not None:
        raise error
    if told is not None:   # the others raise what rank 0 raised, rebuilt from its name and text
        kind = {"CheckpointError": ckpt.CheckpointError, "IntegrityError": ckpt.IntegrityError}.get(told[0])
        raise kind(told[1]) if kind is not None else RuntimeError(f"rank 0: {told[0]}: {told[1]}")
    return Path(found) if found is not None else None


def save_model_folder(engine, tokenizer, dist, target: Path) -> str:
    """Write a folder ``AutoModelForCausalLM.from_pretrained`` loads (and the tokenizer, if any)."""
    if not dist.is_main:   # the other ranks take part in each unit's gather; rank 0 writes
        engine.save_pretrained(str(target))
        return str(target)
    target.mkdir(parents=True, exist_ok=True)
    # output_dir also holds checkpoints and metrics: each file is renamed in, not the folder
    with staging_dir(target, prefix=".save-tmp-") as tmp:
        engine.save_pretrained(str(tmp))
        if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(str(tmp))
        for f in sorted(tmp.iterdir()):
            dest = target / f.name
            if dest.is_dir() and not f.is_dir():
                shutil.rmtree(dest)
            os.replace(f, dest)
    return str(target)


def refuse_non_finite(engine, final) -> None:
    """A diverged run's weights never become the latest checkpoint (which a resume would pick)."""
    for name, p in engine.named_parameters():
        if not bool(torch.isfinite(p).all()):
            raise FloatingPointError(f"refusing to save checkpoint {str(final)!r}: weight {name!r} holds NaN/inf (the "
                                     "run diverged). The earlier checkpoints are kept; resume from the last one "
                                     "with a lower learning rate")
