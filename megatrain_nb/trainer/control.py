"""Steering a run that several ranks train: every command reaches every rank at the same step.

``Trainer.train()`` under torchrun (and the workers of ``mt.Session(..., nproc_per_node=N)``)
runs a :class:`RunControl`:

- rank 0 announces the run once (a heartbeat file, the same one a notebook Session writes, so
  the JupyterLab sidebar and ``mt.Session.attach(name)`` see one run, not N) and takes commands
  through its inbox (``channel/beacon.py``: private folder, ``O_NOFOLLOW`` reads);
- at every optimizer-step boundary the one step-boundary controller (``trainer/boundary.py``,
  this run control its host) hands rank 0's commands received since the last boundary
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
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Optional

from megatrain_nb.channel.beacon import SessionBeacon
from megatrain_nb.commands import RANKS, as_step

from .boundary import BoundaryControl, Order
from .saving import verify_whole
from .snapshot import SnapshotError, SnapshotStore, steps_text

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
    """The step-boundary channel of one ``Trainer.train()`` (every rank builds one): the host of
    the run's :class:`~megatrain_nb.trainer.boundary.BoundaryControl`, and on rank 0 what the
    beacon announces (its heartbeat fields) and hands the inbox's commands to (:meth:`command`)."""

    def __init__(self, trainer, *, name: Optional[str] = None, session_id: Optional[str] = None,
                 root: Any = None):
        self.trainer = trainer
        self.dist = trainer.dist
        self.name = name or run_name(trainer.args)
        self.id = session_id or os.environ.get(ENV_ID) or uuid.uuid4().hex[:12]
        self.state = "running"
        self.applied: list[dict] = []       # every command this rank applied, with its step
        self.rewind_to: Optional[str] = None   # set by a rewind: train() starts again from it
        self.snapshot_steps = _env_int(ENV_SNAPSHOT_STEPS)
        self.keep_snapshots = _env_int(ENV_KEEP_SNAPSHOTS)
        self.control = BoundaryControl(trainer, self, dist=self.dist)
        self._protect: set = set()   # the snapshots a rewind went back to: never pruned
        self._recent: collections.deque = collections.deque(maxlen=100)
        self._root = root
        self._beacon = None

    @property
    def stopped(self) -> bool:
        return self.control.stopped

    # ---- lifetime ----------------------------------------------------------------------------
    def start(self) -> "RunControl":
        if self.dist.is_main:
            try:
                self._beacon = SessionBeacon(self, root=self._root,
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
    def command(self, name: Any, value: Any = None, *, source: str = "lab", command_id: Optional[str] = None) -> None:
        """Queue a command of the table the ranks apply (value checked by the table) for the
        next step boundary; the inbox's one door."""
        self.control.request(name, value, source=source, command_id=command_id)

    # ---- what the heartbeat shows (rank 0) -------------------------------------------------------
    @property
    def step(self) -> int:
        return int(self.trainer.state.global_step)

    @property
    def total_steps(self) -> int:
        return self.trainer.total_steps

    @property
    def history(self) -> list:
        return self.recent_records()

    def heartbeat_extra(self) -> dict:
        t = self.trainer
        return {"kind": "run", "world_size": t.dist.world, "run_id": t.run_id, "training_kind": t.kind.name,
                "output_dir": str(Path(t.args.output_dir).resolve()),
                "metrics_log": str(Path(t.metrics_log.path).resolve()),
                "launcher": os.environ.get(ENV_LAUNCHER) or "torchrun"}

    # ---- the step boundary (every rank, main thread) --------------------------------------------
    def boundary(self, record: dict) -> None:
        """Exchange and apply commands at this step boundary; gather the ranks' memory."""
        self._recent.append(record)
        self._exchange(record, wait=0.0)
        step = self.trainer.state.global_step
        if self.snapshot_steps and step % self.snapshot_steps == 0 and self.rewind_to is None and not any(
                e["kind"] == "snapshot" and e["step"] == step for e in self.applied[-4:]):
            self.control.apply(Order("snapshot", source="snapshot_steps"))   # every rank, this same step

    def hold(self) -> None:
        """While paused, meet the other ranks every PAUSE_POLL_S for the next commands (after the
        step's record is written, so a paused run shows the step it paused at)."""
        while self.state == "paused" and not self.stopped and self.rewind_to is None:
            self._exchange(None, wait=PAUSE_POLL_S)

    def _exchange(self, record: Optional[dict], wait: float) -> None:
        mine = {"memory": _plain(record.get("memory")) if record is not None else None}
        gathered = self.control.exchange(mine, wait=wait)
        if record is not None and any(g["memory"] is not None for g in gathered):
            record["rank_memory"] = [g["memory"] for g in gathered]

    # ---- the boundary controller's host (trainer/boundary.py) ------------------------------------
    def set_state(self, state: str) -> None:
        self.state = state

    def current_step(self) -> int:
        return self.step

    def lr_before(self) -> Optional[float]:
        schedule = self.trainer.schedule
        return schedule.current() if schedule is not None else None

    def record(self, kind: str, step: int, fields: dict) -> None:
        event = {"kind": kind, "step": step, "id": None, **fields}
        if kind == "stop":
            self.state = "running"   # leaves a pause; the run ends after this step
        self.applied.append(dict(event, time=time.time()))
        self.trainer.metrics_log.write({"event": "control", **event, "time": time.time()})

    def explore(self, order: Order) -> tuple:
        t = self.trainer
        if order.kind == "snapshot":   # collective: each rank its shard, rank 0 the shared files
            store = SnapshotStore(t.args.output_dir)
            info = store.take(t)
            fields = {"path": info.path, "bytes_unique": info.bytes_unique}
            if self.keep_snapshots and self.dist.is_main:   # (one filesystem: rank 0 prunes)
                fields["pruned"] = store.prune(self.keep_snapshots, protect=self._protect)
            return info.path, fields
        if order.kind == "rewind":   # (checked whole first: a damaged snapshot leaves the run going on)
            path = snapshot_at(t, int(order.value))
            verify_whole(Path(path), t.engine, t.dist)
            self.rewind_to = path
            self._protect.add(path)   # a branch starts from it
            t.request_stop()   # this pass ends after the step; train() starts again from it
            return path, {"path": path, "value": int(order.value)}
        raise RuntimeError(f"the ranks do not apply {order.kind!r} (megatrain_nb/commands.py)")

    def take_rewind(self) -> Optional[str]:
        """The snapshot a rewind asked for since the last call (None: none), cleared."""
        path, self.rewind_to = self.rewind_to, None
        return path

    def recent_records(self) -> list:
        """The last records this rank logged (at most 100), oldest first."""
        return list(self._recent)


def snapshot_at(trainer, step: int) -> str:
    """The snapshot (or checkpoint) at ``step`` to rewind to: rank 0 looks (this run's own first,
    else the newest) and every rank takes its answer, or its error (:class:`SnapshotError`
    listing the steps that have one)."""
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
