"""A fork of a run in worker processes: ``session.fork(step, **changes)`` of an
``nproc_per_node=N`` Session is a new Session whose own N ranks start from the snapshot at that
step as a branch (``launch_spec.write_spec(..., resume=<snapshot>, branch={...})``: every rank
from its shard of the snapshot, at the same step; ``launch_worker.py`` gives the trainer the
branch). With no change it reproduces its parent bit for bit.

Where its files go: ``<parent output_dir>/branches/<name>`` (its metrics.jsonl, snapshots and
saved model beside none of the parent's). The snapshot it starts from is hard-linked in there
first (no byte copied; a copy where links are refused), so the parent's ``keep_snapshots``
pruning can never take it away, and the fork can rewind to its own first step.

The fork trains in processes of its own: starting it pauses the parent if that one is running
(both on the same devices would compete for their memory) and says so; ``parent.resume()``
then trains both side by side.
"""
from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path
from typing import Any, Optional

from megatrain_nb.trainer.saving import verify_whole
from megatrain_nb.trainer.snapshot import SCHEDULE_FIELDS

from .branches import check_changes, free_name
from .placement import PLACEMENT

#: where a fork's output folder goes, inside the parent's
BRANCHES = "branches"


def fork_ranks(session: Any, run: Any, info: Any, name: Optional[str], changes: dict) -> Any:
    """The new Session: ``session`` (whose run controller is ``run``, a ``ProcessRun``) forked from
    snapshot ``info`` (a ``SnapshotInfo``) with ``changes`` (``branches.ALLOWED``)."""
    changes = check_changes(changes, session.trainer, getattr(run, "training_kind", None))
    if PLACEMENT in changes:
        raise ValueError(f"{PLACEMENT}={changes[PLACEMENT]!r}: a fork of {session.name!r} trains on ranks of its own, "
                         "on the devices its parent's ranks use (nproc_per_node); leave device= out")
    ex = session.explorer
    taken = ex.taken_names()
    if name is not None and str(name) in taken:
        raise ValueError(f"a branch named {str(name)!r} exists already (branches: {', '.join(sorted(taken))}); "
                         "pass another name=")
    if "max_steps" in changes and int(changes["max_steps"]) <= info.step:
        raise ValueError(f"max_steps={changes['max_steps']} is not after the fork's step {info.step}")
    name = str(name) if name is not None else free_name(f"{session.name}-fork", taken)
    inputs = dict(run.inputs)
    out = Path(run.output_dir) / BRANCHES / name
    inputs["args"] = _changed_args(inputs.get("args"), run.spec_args, changes, out)
    for k in ("train_dataset", "loss_fn"):
        if k in changes:
            inputs[k] = changes[k]
    verify_whole(Path(info.path), None)   # its files, before anything starts (each rank checks its own links)
    start = link_snapshot(info, out)
    branch = {"new_run": True, "rebuild_schedule": any(k in changes for k in SCHEDULE_FIELDS),
              "restart_data": "train_dataset" in changes}
    model, options = inputs.pop("model"), dict(inputs.pop("engine_options"))
    options.update(callbacks=inputs.pop("callbacks"), save_model=inputs.pop("save_model"))
    make = type(run).factory(run.nproc_per_node, model, snapshots=(run.snapshot_every, run.keep_snapshots),
                               engine_options=options, start=(start, branch), **inputs)
    child = type(session).from_run_controller(make, tokenizer=session.tokenizer, name=name)
    child.explorer.ranks.before_launch.append(_pause_parent(session, name))
    ex.adopt(child, info, changes)
    return child


def _changed_args(args: Any, written: dict, changes: dict, output_dir: Path) -> Any:
    """The parent's training arguments with ``changes`` and the fork's own output folder (a copy:
    the parent's are left as they are)."""
    if args is None or isinstance(args, dict):
        args = dict(written)   # (what the ranks were given, the defaults spelled out)
    else:
        args = copy.deepcopy(args)
    values = {k: v for k, v in changes.items() if k not in ("train_dataset", "loss_fn")}
    values["output_dir"] = str(output_dir)
    for k, v in values.items():
        if isinstance(args, dict):
            args[k] = v
        else:
            setattr(args, k, v)
    return args


def link_snapshot(info: Any, out: Path) -> str:
    """Snapshot ``info`` hard-linked into the fork's output folder ``out`` (a snapshot under
    ``snapshots/``, a checkpoint beside it, as the parent had it); its path there."""
    src = Path(info.path)
    dest = out / (src.parent.name if info.kind == "snapshot" else "") / src.name
    if dest.is_dir():
        return str(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        shutil.copytree(src, tmp, copy_function=_link_or_copy)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return str(dest)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:   # another filesystem, or links refused: bytes copied
        shutil.copy2(src, dst)


def _pause_parent(parent: Any, name: str):
    import weakref

    ref = weakref.ref(parent)

    def pause() -> None:
        p = ref()
        if p is not None and p.state == "running":
            p.pause(source=f"branch {name}")
            print(f"megatrain_nb: branch {name!r} starts its ranks; {p.name!r} pauses at its next step "
                  f"(both on the same devices would compete for their memory; {p.name}.resume() trains both)")

    return pause
