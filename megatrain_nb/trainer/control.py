"""Steering a run that several ranks train: every command reaches every rank at the same step.

``Trainer.train()`` under torchrun (and the workers of ``mt.Session(..., nproc_per_node=N)``)
runs a :class:`RunControl`:

- rank 0 announces the run once (a heartbeat file, the same one a notebook Session writes, so
  the JupyterLab sidebar and ``mt.Session.attach(name)`` see one run, not N) and takes commands
  through its inbox (``lab/beacon.py``: private folder, ``O_NOFOLLOW`` reads);
- at every optimizer-step boundary rank 0 hands the commands received since the last boundary
  to every rank in one small collective (``Dist.all_gather_json``: a few dicts as JSON bytes, never
  pickled, on the main group,
  bounded by the group's timeout), and every rank applies them in the same order at the same
  step; rank 0 records each in ``metrics.jsonl`` as ``{"event": "control", "kind", "step", ...}``;
- the same collective carries each rank's ``memory_report()`` on logging steps, so the one log
  holds every rank's memory tiers (``record["rank_memory"]``, a list by rank);
- while paused the ranks meet at the boundary every :data:`PAUSE_POLL_S` seconds (a collective
  each time), so no wait runs into the group's timeout however long the pause lasts.

Commands: ``pause``, ``resume``, ``lr`` (value), ``checkpoint`` (value: a path or None),
``stop`` (value: False, True or a path to checkpoint first), ``snapshot`` (every rank its
shard, ``trainer/snapshot.py``) and ``rewind`` (value: a step with a snapshot or checkpoint):
at the boundary every rank ends the pass it is in, and ``train()`` starts again from the
snapshot as a branch (a new run id whose parent is the snapshot's run) on every rank; a
paused run stays paused at the snapshot's step. ``MEGATRAIN_NB_SNAPSHOT_STEPS=N`` takes a
snapshot every N steps on every rank and ``MEGATRAIN_NB_KEEP_SNAPSHOTS=K`` keeps the newest K
(rank 0 prunes; never one a rewind went back to). Enabled by default when the run
has several ranks or was started by torchrun; ``MEGATRAIN_NB_CONTROL=0`` turns it off, ``=1``
on. ``MEGATRAIN_NB_RUN_NAME`` names the run (default: ``args.run_name``, else the output
folder's name) and ``MEGATRAIN_NB_SESSION_ID`` fixes its heartbeat id.
"""
from __future__ import annotations

import collections
import json
import os
import queue
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Optional

from megatrain_nb.commands import RANKS, as_step, state_after

ENV_ENABLE = "MEGATRAIN_NB_CONTROL"
ENV_NAME = "MEGATRAIN_NB_RUN_NAME"
ENV_ID = "MEGATRAIN_NB_SESSION_ID"
ENV_KERNEL = "MEGATRAIN_NB_KERNEL_ID"
ENV_LAUNCHER = "MEGATRAIN_NB_LAUNCHER"
#: a snapshot every N optimizer steps on every rank (``snapshot_steps`` of an nproc_per_node
#: Session), and how many of them to keep (``keep_snapshots``; never one a rewind went back to)
ENV_SNAPSHOT_STEPS = "MEGATRAIN_NB_SNAPSHOT_STEPS"
ENV_KEEP_SNAPSHOTS = "MEGATRAIN_NB_KEEP_SNAPSHOTS"
#: how often paused ranks meet (seconds): a pause or a stop while paused lands within this
PAUSE_POLL_S = 0.25
#: the commands the ranks apply: those the one table (megatrain_nb/commands.py) marks ``ranks``
KINDS = RANKS


def wanted(dist) -> bool:
    """Whether ``Trainer.train()`` runs a RunControl (see the module docstring)."""
    flag = os.environ.get(ENV_ENABLE, "").strip().lower()
    if flag in ("0", "false", "no", "off"):
        return False
    if flag in ("1", "true", "yes", "on"):
        return True
    return dist.world > 1 or "TORCHELASTIC_RUN_ID" in os.environ


def run_name(args) -> str:
    name = os.environ.get(ENV_NAME) or getattr(args, "run_name", None)
    if not name or str(name) == str(args.output_dir):
        name = Path(str(args.output_dir)).resolve().name or "run"
    return str(name)


class RunControl:
    """The step-boundary channel of one ``Trainer.train()`` (every rank builds one)."""

    def __init__(self, trainer, *, name: Optional[str] = None, session_id: Optional[str] = None,
                 root: Any = None):
        self.trainer = trainer
        self.dist = trainer.dist
        self.name = name or run_name(trainer.args)
        self.id = session_id or os.environ.get(ENV_ID) or uuid.uuid4().hex[:12]
        self.state = "running"
        self.applied: list[dict] = []       # every command this rank applied, with its step
        self.stopped = False
        self.rewind_to: Optional[str] = None   # set by a rewind: train() starts again from it
        self.snapshot_steps = _env_int(ENV_SNAPSHOT_STEPS)
        self.keep_snapshots = _env_int(ENV_KEEP_SNAPSHOTS)
        self._protect: set = set()   # the snapshots a rewind went back to: never pruned
        self._inbox: "queue.Queue[dict]" = queue.Queue()   # rank 0: filled by the beacon thread
        self._recent: collections.deque = collections.deque(maxlen=100)
        self._root = root
        self._beacon = None

    # ---- lifetime ----------------------------------------------------------------------------
    def start(self) -> "RunControl":
        if self.dist.is_main:
            from megatrain_nb.lab.beacon import ControlBeacon

            try:
                self._beacon = ControlBeacon(_Announced(self), root=self._root,
                                             kernel_id=os.environ.get(ENV_KERNEL) or None).start()
            except Exception as e:  # noqa: BLE001 - the channel is optional; training is not
                print(f"megatrain_nb: run {self.name!r} is not announced to JupyterLab ({e})", file=sys.stderr)
        return self

    def close(self, outcome: str) -> None:
        self.state = outcome
        if self._beacon is not None:
            self._beacon.stop()
            self._beacon = None

    # ---- rank 0's inbox (beacon thread) ---------------------------------------------------------
    def request(self, kind: str, value: Any = None, *, source: str = "lab", command_id: Optional[str] = None) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown command {kind!r}: expected one of {', '.join(KINDS)}")
        self._inbox.put({"kind": kind, "value": value, "source": source, "id": command_id})

    def _drain(self, wait: float = 0.0) -> list[dict]:
        out = []
        try:
            out.append(self._inbox.get(timeout=wait) if wait > 0 else self._inbox.get_nowait())
            while True:
                out.append(self._inbox.get_nowait())
        except queue.Empty:
            return out

    # ---- the step boundary (every rank, main thread) --------------------------------------------
    def boundary(self, record: dict) -> None:
        """Exchange and apply commands at this step boundary; gather the ranks' memory."""
        self._recent.append(record)
        self._exchange(record, wait=0.0)
        step = self.trainer.state.global_step
        if self.snapshot_steps and step % self.snapshot_steps == 0 and self.rewind_to is None and not any(
                e["kind"] == "snapshot" and e["step"] == step for e in self.applied[-4:]):
            self._apply({"kind": "snapshot", "source": "snapshot_steps"})   # every rank, this same step

    def hold(self) -> None:
        """While paused, meet the other ranks every PAUSE_POLL_S for the next commands (after the
        step's record is written, so a paused run shows the step it paused at)."""
        while self.state == "paused" and not self.stopped and self.rewind_to is None:
            self._exchange(None, wait=PAUSE_POLL_S)

    def _exchange(self, record: Optional[dict], wait: float) -> None:
        mine = {"commands": self._drain(wait) if self.dist.is_main else [],
                "memory": _plain(record.get("memory")) if record is not None else None}
        if self.dist.world > 1:
            gathered = self.dist.all_gather_json(mine)
        else:
            gathered = [mine]
        if record is not None and any(g["memory"] is not None for g in gathered):
            record["rank_memory"] = [g["memory"] for g in gathered]
        for cmd in gathered[0]["commands"]:
            self._apply(cmd)

    def _apply(self, cmd: dict) -> None:
        t = self.trainer
        step = t.state.global_step
        kind, value = cmd["kind"], cmd.get("value")
        event = {"kind": kind, "step": step, "source": cmd.get("source"), "id": cmd.get("id")}
        try:
            if kind in ("pause", "resume"):
                state = state_after(kind, self.state)
                if state is None:   # already paused / not paused: nothing to do
                    return
                self.state = state
            elif kind == "lr":
                event["previous"] = t.schedule.current() if t.schedule is not None else None
                t.set_lr(float(value))
                event["value"] = float(value)
            elif kind == "checkpoint":
                event["path"] = t.save_checkpoint(value or None)
            elif kind == "snapshot":   # collective: each rank its shard, rank 0 the shared files
                from .snapshot import SnapshotStore

                store = SnapshotStore(t.args.output_dir)
                info = store.take(t)
                event["path"], event["bytes_unique"] = info.path, info.bytes_unique
                if self.keep_snapshots and self.dist.is_main:   # (one filesystem: rank 0 prunes)
                    event["pruned"] = store.prune(self.keep_snapshots, protect=self._protect)
            elif kind == "rewind":   # (checked whole first: a damaged snapshot leaves the run going on)
                from .saving import verify_whole

                path = snapshot_at(t, int(value))
                verify_whole(Path(path), t.engine, t.dist)
                event["path"] = self.rewind_to = path
                self._protect.add(self.rewind_to)   # a branch starts from it
                event["value"] = int(value)
                t.request_stop()   # this pass ends after the step; train() starts again from it
            elif kind == "stop":
                if value:
                    event["path"] = t.save_checkpoint(None if value is True else str(value))
                t.request_stop()
                self.stopped = True
                self.state = "running"   # leaves a pause; the run ends after this step
        except Exception as e:  # noqa: BLE001 - a failed control must not end the run
            event["kind"] = f"{kind}_failed"
            event["error"] = f"{type(e).__name__}: {e}"
            if kind == "stop":
                t.request_stop()
                self.stopped = True
        self.applied.append(dict(event, time=time.time()))
        t.metrics_log.write({"event": "control", **event, "time": time.time()})

    def take_rewind(self) -> Optional[str]:
        """The snapshot a rewind asked for since the last call (None: none), cleared."""
        path, self.rewind_to = self.rewind_to, None
        return path

    def recent_records(self) -> list:
        """The last records this rank logged (at most 100), oldest first."""
        return list(self._recent)


class _Announced:
    """What the heartbeat shows of a run (rank 0 only); its controls enqueue for the boundary."""

    def __init__(self, control: RunControl):
        self._c = control
        self.id, self.name = control.id, control.name

    @property
    def state(self) -> str:
        return self._c.state

    @property
    def step(self) -> int:
        return int(self._c.trainer.state.global_step)

    @property
    def total_steps(self) -> int:
        return self._c.trainer.total_steps

    @property
    def history(self) -> list:
        return self._c.recent_records()

    def heartbeat_extra(self) -> dict:
        t = self._c.trainer
        return {"kind": "run", "world_size": t.dist.world, "run_id": t.run_id,
                "output_dir": str(Path(t.args.output_dir).resolve()),
                "metrics_log": str(Path(t.metrics_log.path).resolve()),
                "launcher": os.environ.get(ENV_LAUNCHER) or "torchrun"}

    def pause(self, *, source: str = "lab", command_id: Optional[str] = None) -> None:
        self._c.request("pause", source=source, command_id=command_id)

    def resume(self, *, source: str = "lab", command_id: Optional[str] = None) -> None:
        self._c.request("resume", source=source, command_id=command_id)

    def set_lr(self, lr: float, *, source: str = "lab", command_id: Optional[str] = None) -> None:
        self._c.request("lr", float(lr), source=source, command_id=command_id)

    def stop(self, checkpoint: Any = False, *, source: str = "lab", command_id: Optional[str] = None) -> None:
        self._c.request("stop", checkpoint, source=source, command_id=command_id)

    def save_checkpoint(self, path: Optional[str] = None, *, source: str = "lab",
                        command_id: Optional[str] = None) -> None:
        self._c.request("checkpoint", path, source=source, command_id=command_id)

    def snapshot(self, *, source: str = "lab", command_id: Optional[str] = None) -> None:
        self._c.request("snapshot", source=source, command_id=command_id)

    def rewind(self, step: int, *, source: str = "lab", command_id: Optional[str] = None) -> None:
        self._c.request("rewind", int(step), source=source, command_id=command_id)


def snapshot_at(trainer, step: int) -> str:
    """The snapshot (or checkpoint) at ``step`` to rewind to: rank 0 looks (this run's own first,
    else the newest) and every rank takes its answer, or its error (:class:`SnapshotError`
    listing the steps that have one)."""
    from .snapshot import SnapshotError, SnapshotStore, steps_text

    found = error = None
    if trainer.dist.is_main:
        infos = SnapshotStore(trainer.args.output_dir).list()
        at = sorted((i for i in infos if i.step == step), key=lambda i: (i.run_id == trainer.run_id, i.time))
        if at:
            found = at[-1].path
        else:
            error = (f"no snapshot at step {step} under {str(trainer.args.output_dir)!r}; steps with one: "
                     f"{steps_text(infos)}")
    if trainer.dist.world > 1:
        found, error = trainer.dist.all_gather_json([found, error])[0]
    if error is not None:
        raise SnapshotError(error)
    return found


def _env_int(name: str) -> Optional[int]:
    text = os.environ.get(name, "").strip()
    return (as_step(text, f"{name} (a number of steps, or unset)") or None) if text else None


def _plain(value: Any) -> Any:
    """``value`` as plain JSON data (what metrics.jsonl would hold: unknown objects as text)."""
    return json.loads(json.dumps(value, default=str)) if value is not None else None
