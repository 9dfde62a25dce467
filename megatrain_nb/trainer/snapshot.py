"""Snapshots: checkpoints that cost almost nothing at scale, to rewind and fork a run.

A snapshot is written by the checkpoints' own save protocol (``saving.write_state``: the
engine's files, the scheduler, RNG, data position and trainer state, the state file last, in a
temporary folder renamed into place by ``checkpoint.write_checkpoint``). The difference is the
engine's part: the disk tier never rewrites a file in place, so its current files are
hard-linked, and only what lives in RAM is written (``engine/tiers/linked.py``). The manifest hashes
the written files; the linked ones carry checksums of their own.

Layout: ``<output_dir>/snapshots/step-<step>-<run_id>/`` (one per run and step). The run's
checkpoints (``<output_dir>/checkpoint-<step>``) count as snapshots too.

    store = SnapshotStore(output_dir)
    info = store.take(trainer)              # at a step boundary
    store.list()                            # [SnapshotInfo(step, time, run_id, path, ...)]
    store.prune(keep=5, protect={path})     # never a snapshot a branch starts from

A snapshot is checked whole before anything of it is loaded (``saving.verify_whole``); one found
damaged, there or because its state file cannot be read, stays listed with ``damaged`` saying
why. Pruning renames a snapshot out of the listed names before deleting it, so a kill half way
leaves a ``.pruning-*`` folder, reclaimed by the next snapshot or prune, never a partial one
under a valid name.
"""
from __future__ import annotations

import errno
import os
import re
import shutil
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, List, Optional

from ..engine.tiers.linked import KEPT_PREFIX
from ..processes import pid_alive
from ..threads import SNAPSHOT, thread_name
from . import checkpoint as ckpt
from .schedule import LRSchedule

FOLDER = "snapshots"
_NAME = re.compile(r"^step-(\d+)-([0-9A-Za-z_-]+)$")
_CHECKPOINT = re.compile(rf"^{ckpt.PREFIX}-(\d+)$")
_PRUNING = ".pruning-"
_KEPT = re.compile(rf"^{re.escape(KEPT_PREFIX)}(\d+)-")
#: snapshots found damaged by a load in this process: path -> why (listed with it, not hidden)
_DAMAGED: dict = {}


def mark_damaged(path, why: str) -> None:
    """Record that the snapshot or checkpoint at ``path`` failed its check (listings show why)."""
    _DAMAGED[str(Path(path).resolve())] = str(why)


def damage_of(path) -> Optional[str]:
    return _DAMAGED.get(str(Path(path).resolve()))
#: fork changes that rebuild the LR schedule from the fork's arguments at the fork's step
SCHEDULE_FIELDS = ("learning_rate", "lr_scheduler_type", "warmup_steps", "max_steps")


@dataclass
class SnapshotInfo:
    """One snapshot (or checkpoint) of a run: where it is and what it holds."""

    step: int
    time: float
    run_id: Optional[str]
    path: str
    kind: str = "snapshot"          # "snapshot" | "checkpoint"
    bytes_unique: int = 0           # bytes only this snapshot holds (freed by deleting it)
    bytes_shared: int = 0           # bytes hard-linked with the disk tier or other snapshots
    parent_run_id: Optional[str] = None
    forked_at_step: Optional[int] = None
    branch: Optional[str] = None    # the branch's name, where a Session knows it
    damaged: Optional[str] = None   # why it cannot be loaded (found at a listing or a load); None: not known bad

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class BranchStart:
    """How a trainer resumes from a snapshot as a branch (``Trainer.branch_start``).

    ``new_run``: the branch gets a run id of its own (``run_id``, or a new one) whose parent is
    the snapshot's run, forked at the snapshot's step; else the run goes on as the snapshot's.
    ``rebuild_schedule``: the LR schedule is built from the trainer's arguments and advanced to
    the step (a fork that changed learning_rate, lr_scheduler_type, warmup_steps or max_steps;
    a ``set_lr`` override of the parent is not carried), else it is the snapshot's.
    ``restart_data``: the data position starts at the beginning (another train_dataset)."""

    new_run: bool = True
    run_id: Optional[str] = None
    rebuild_schedule: bool = False
    restart_data: bool = False
    extra: dict = field(default_factory=dict)


def apply_branch_start(trainer, start: BranchStart, stream, total: int):
    """After a trainer loaded a snapshot: give it the branch's lineage, schedule and data
    position. Returns the schedule the run goes on with."""
    import uuid

    step = int(trainer.state.global_step)
    if start.new_run:
        parent = trainer.run_id
        trainer.run_id = start.run_id or uuid.uuid4().hex[:12]
        trainer.parent_run_id, trainer.forked_at_step = parent, step
    schedule = trainer.schedule
    if start.rebuild_schedule:
        a = trainer.args
        schedule = LRSchedule(learning_rate=a.learning_rate, scheduler_type=a.lr_scheduler_type,
                              num_training_steps=total, num_warmup_steps=a.get_warmup_steps(total),
                              scheduler_kwargs=a.lr_scheduler_kwargs)
        for _ in range(step):
            schedule.step()
    if start.restart_data:
        stream.load_state_dict({"epoch": 0, "consumed": 0})
    return schedule


#: snapshots of this process still completing (begin_snapshot waits for those in the same folder)
_IN_FLIGHT: set = set()


class PendingSnapshot:
    """A snapshot begun at a step boundary and completed in a thread of its own
    (``mtnb-snapshot``) while training goes on: the engine's links (``engine/tiers/linked.py``: they
    follow the step's updates in the disk tier's queue), then the manifest and the rename into
    place. Until then the folder has a temporary name and is never listed."""

    def __init__(self, final: Path, tmp: Path, linked, write_shared, step: int):
        import threading

        self.path = final
        self.step = step
        self._future: Future = Future()
        self._future.add_done_callback(lambda _: _IN_FLIGHT.discard(self))
        _IN_FLIGHT.add(self)
        self._thread = threading.Thread(target=self._complete, args=(tmp, linked, write_shared),
                                        name=thread_name(SNAPSHOT), daemon=True)
        self._thread.start()

    def _complete(self, tmp: Path, linked, write_shared) -> None:
        sizes: dict = {}

        def write(folder: Path) -> None:
            sizes.update(linked.result())
            write_shared(folder)
        try:
            ckpt.commit_checkpoint(self.path, tmp, write, manifest_exclude=("disk",))
        except BaseException as e:  # noqa: BLE001 - delivered through result()
            self._future.set_exception(e)
        else:
            self._future.set_result(sizes)

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: Optional[float] = None) -> dict:
        """The bytes linked, copied and written, once complete; raises what failed."""
        return self._future.result(timeout)

    def wait(self, timeout: Optional[float] = None) -> None:
        """Until complete (or failed: not raised here)."""
        futures_wait([self._future], timeout)


def begin_snapshot(trainer, final: Path) -> PendingSnapshot:
    """(At a step boundary, one process) a snapshot of ``trainer`` into ``final``: the trainer's
    files as of now and the engine's part begun (``Engine.begin_linked_checkpoint``, which does
    not wait for the step's updates when the disk tier holds the state); the rest completes in
    the background."""
    for other in list(_IN_FLIGHT):   # (another trainer's, e.g. a side-by-side branch's: begin_checkpoint
        if other.path.parent == Path(final).parent:   # clears this process's unfinished temporaries there)
            other.wait()
    tmp = ckpt.begin_checkpoint(final)
    try:
        with trainer.engine.lock:
            _, write_shared = trainer.snapshot_files(snapshot=True)
            linked = trainer.engine.begin_linked_checkpoint(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return PendingSnapshot(Path(final), tmp, linked, write_shared, int(trainer.state.global_step))


class SnapshotError(RuntimeError):
    """A snapshot could not be taken or found (the message says what to do)."""


class SnapshotStore:
    """The snapshots under ``<output_dir>/snapshots`` and the checkpoints in ``output_dir``."""

    def __init__(self, output_dir):
        self.output_dir = Path(output_dir)
        self.root = self.output_dir / FOLDER

    def path_for(self, step: int, run_id: Optional[str]) -> Path:
        return self.root / f"step-{int(step):08d}-{run_id or 'run'}"

    def take(self, trainer) -> SnapshotInfo:
        """Snapshot ``trainer`` now (call at a step boundary). A full disk raises ``OSError``
        (ENOSPC) naming what to free; nothing partial is left or listed."""
        return self.finish(self.begin(trainer))

    def begin(self, trainer):
        """Start a snapshot of ``trainer`` (at a step boundary); training may go on while it
        completes (one process: a :class:`PendingSnapshot`). :meth:`finish` waits for it."""
        path = self.path_for(trainer.state.global_step, trainer.run_id)
        if getattr(getattr(trainer, "dist", None), "is_main", True):
            self.reclaim()
        try:
            pending = trainer.save_snapshot(path, wait=False)
        except OSError as e:
            raise self._full(e, trainer.state.global_step) from e
        return pending if isinstance(pending, PendingSnapshot) else path

    def finish(self, pending) -> SnapshotInfo:
        """The snapshot :meth:`begin` started, once complete (its error, a full disk said so)."""
        if isinstance(pending, PendingSnapshot):
            try:
                pending.result()
            except OSError as e:
                raise self._full(e, pending.step) from e
            pending = pending.path
        return self.info(pending)

    def _full(self, e: OSError, step) -> OSError:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            return e
        return OSError(e.errno, f"the disk is full: snapshot at step {step} was not taken (nothing partial was "
                                f"kept; training goes on). Free space under {str(self.root)!r}, lower "
                                f"keep_snapshots, or delete old snapshots ({e.strerror or e})")

    def info(self, path) -> SnapshotInfo:
        """What the snapshot at ``path`` holds; one whose state file cannot be read is described
        from its folder's name, with ``damaged`` saying why."""
        path = Path(path)
        unique = shared = 0
        for f in path.rglob("*"):
            if f.is_file():
                st = f.stat()
                if st.st_nlink > 1:
                    shared += st.st_size
                else:
                    unique += st.st_size
        try:
            meta = ckpt.read_json(path / ckpt.STATE_FILE)
            if not isinstance(meta, dict):
                raise ValueError("it holds no JSON object")
            info = SnapshotInfo(step=int(meta.get("global_step", 0)), time=float(meta.get("saved_at") or 0.0),
                                run_id=meta.get("run_id"), path=str(path),
                                kind="snapshot" if meta.get("snapshot") else "checkpoint",
                                bytes_unique=unique, bytes_shared=shared, parent_run_id=meta.get("parent_run_id"),
                                forked_at_step=meta.get("forked_at_step"))
        except (ValueError, TypeError, UnicodeDecodeError) as e:
            info = self._unreadable(path, f"{str(path / ckpt.STATE_FILE)!r} cannot be read ({e})", unique, shared)
        except FileNotFoundError:
            if not path.is_dir():
                raise   # (removed meanwhile: not listed)
            info = self._unreadable(path, f"{str(path / ckpt.STATE_FILE)!r} is missing (deleted or lost), so the "
                                          "snapshot's step, run and data position cannot be read; it cannot be "
                                          "loaded", unique, shared)
        info.damaged = info.damaged or damage_of(path)
        return info

    @staticmethod
    def _unreadable(path: Path, why: str, unique: int, shared: int) -> SnapshotInfo:
        m, c = _NAME.match(path.name), _CHECKPOINT.match(path.name)
        step = int(m.group(1)) if m else int(c.group(1)) if c else 0
        try:
            when = (path / ckpt.STATE_FILE).stat().st_mtime
        except OSError:
            try:
                when = path.stat().st_mtime
            except OSError:
                when = 0.0
        return SnapshotInfo(step=step, time=when, run_id=m.group(2) if m else None, path=str(path),
                            kind="snapshot" if m else "checkpoint", bytes_unique=unique, bytes_shared=shared,
                            damaged=why)

    def list(self, include_checkpoints: bool = True) -> List[SnapshotInfo]:
        """Complete snapshots (and checkpoints), by step then time. Partial ones are never listed;
        damaged ones are, with ``damaged`` saying why."""
        # (no clean-up of temporaries here: a listing from the notebook must not remove the
        # folder a snapshot is being written into by the training thread; take() cleans up)
        # (a folder under a snapshot's name was renamed there whole, so one lacking its state files
        # is damaged and listed so; a checkpoint's name likewise once it holds any of its files)
        found = []
        if self.root.is_dir():
            found += [p for p in self.root.iterdir() if _NAME.match(p.name) and p.is_dir()]
        if include_checkpoints and self.output_dir.is_dir():
            found += [p for p in self.output_dir.iterdir() if _CHECKPOINT.match(p.name) and _looks_saved(p)]
        infos = []
        for p in found:
            try:
                info = self.info(p)
            except OSError:
                continue   # removed meanwhile
            if info.damaged is None and not ckpt.is_checkpoint(p):
                info.damaged = f"{str(p / 'trainer_state.json')!r} is missing (deleted or lost); it cannot be loaded"
            infos.append(info)
        return sorted(infos, key=lambda i: (i.step, i.time))

    def reclaim(self) -> List[str]:
        """Remove what a kill left: ``.pruning-*`` folders (a prune), and ``.kept-<pid>-*`` ones
        of a process that is gone (a load's live state set aside, ``engine/tiers/linked.py``). A folder
        under a snapshot's name that lacks its state files is damaged, not a leftover: it stays
        listed as such until pruned or deleted."""
        gone = []
        if not self.root.is_dir():
            return gone
        for p in self.root.iterdir():
            kept = _KEPT.match(p.name)
            if p.name.startswith(_PRUNING) or (kept and pid_alive(int(kept.group(1))) is False):
                shutil.rmtree(p, ignore_errors=True)
                gone.append(str(p))
        return gone

    def prune(self, keep: Optional[int], protect: Iterable = (), run_ids: Optional[Iterable[str]] = None) -> List[str]:
        """Delete the oldest snapshots (not checkpoints: ``save_total_limit`` rules those) of runs
        ``run_ids`` (all when None) until the newest ``keep`` remain, besides those in ``protect``
        (the snapshots branches start from), which are never deleted; damaged ones go first. Each
        is renamed out of the listed names first, then deleted (a kill meanwhile leaves nothing
        listed half gone).
        Returns the paths removed."""
        if not keep or keep <= 0:
            return []
        self.reclaim()
        keep_paths = {str(Path(p).resolve()) for p in protect}
        ids = None if run_ids is None else set(run_ids)
        mine = [i for i in self.list(include_checkpoints=False) if (ids is None or i.run_id in ids)
                and str(Path(i.path).resolve()) not in keep_paths]
        removed = []
        for info in sorted(mine, key=lambda i: (i.damaged is None, i.time))[:max(0, len(mine) - keep)]:
            src = Path(info.path)
            aside = src.with_name(f"{_PRUNING}{src.name}-{os.getpid()}")
            try:
                os.rename(src, aside)
            except OSError:
                continue   # gone meanwhile (another process pruned it)
            shutil.rmtree(aside, ignore_errors=True)
            removed.append(info.path)
        return removed


def _looks_saved(path: Path) -> bool:
    """A folder under a checkpoint's name holding any of a checkpoint's files."""
    return path.is_dir() and any((path / f).is_file() for f in (ckpt.STATE_FILE, "trainer_state.json", ckpt.MANIFEST))


def steps_text(infos: List[SnapshotInfo]) -> str:
    return ", ".join(str(s) for s in sorted({i.step for i in infos})) or "none"


__all__ = ["BranchStart", "PendingSnapshot", "SnapshotError", "SnapshotInfo", "SnapshotStore", "apply_branch_start",
           "begin_snapshot", "damage_of", "mark_damaged",
           "SCHEDULE_FIELDS", "FOLDER"]
