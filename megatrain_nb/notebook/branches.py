"""Snapshots, rewind and fork for a Session: the logic ``Session.snapshot / rewind / fork``
delegate to (the Session only queues the call to a step boundary and displays).

A *branch* is a run with a parent: its ``run_id``, ``parent_run_id`` and ``forked_at_step``
are on every metrics line (``trainer/snapshot.py``). Branches of one Session share its engine
(the training state of one model in host RAM / on disk, a few layers at a time on the device):
one branch trains at a time. Starting or resuming a branch pauses the one training (at its
next step boundary), snapshots it and loads the branch's own state; it says so on the
console and in both runs' events. Resuming the paused one later switches back the same way.

Decisions where the issue left a choice:

* ``rewind(step)`` while the run is *running* applies at the next step boundary and leaves
  the run paused there (change settings, then ``resume()``); on a *paused* run at once; on a
  *finished* one it loads the snapshot and ``train()`` continues. A stopped or failed run has
  released its model: rewind is refused (``Session.from_checkpoint`` on a snapshot folder
  works). The abandoned steps stay as a branch of their own (the run id they were logged
  under); the run goes on under a new run id whose parent is that one.
* ``fork(step=None)`` snapshots the run at its next step boundary (a running run keeps
  running until the fork starts training). A fork that changes ``learning_rate``,
  ``lr_scheduler_type``, ``warmup_steps`` or ``max_steps`` rebuilds the schedule from its
  settings at the fork's step (a ``set_lr`` override of the parent is not carried); another
  ``train_dataset`` starts at its beginning (same tokenizer and ``seq_len``).
"""
from __future__ import annotations

import copy
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

from megatrain_nb.values import VALUES, check

from .branch_dpo import check_dpo_changes
from .branch_grpo import check_grpo_changes, is_grpo_trainer
from .branch_rows import sidebar_rows
from .placement import PLACEMENT, placement, sibling_engine

# (the trainer's modules import torch: loaded when first used, so importing a Session stays light)

#: what a fork may change mid-run (TrainingArguments fields, the data, the loss)
ALLOWED = ("learning_rate", "lr_scheduler_type", "warmup_steps", "weight_decay", "max_grad_norm", "max_steps",
           "gradient_accumulation_steps", "data_seed", "train_dataset", "loss_fn")
#: what a fork of a preference run (an mt.DPOTrainer) may change besides: the loss's DPOConfig fields
#: (the reference log-probs do not depend on them, so the fork reads the parent's cache)
DPO_ALLOWED = ("beta", "loss_type")
#: and of a GRPO run (an mt.GRPOTrainer): its sampling temperature and KL coefficient (branch_grpo.py)
GRPO_ALLOWED = ("temperature", "beta")
#: what cannot change mid-run, and why (anything else not in ALLOWED is refused too)
FIXED = {
    "optimizer_compression": "the optimizer states are stored in that codec",
    "precision": "the run's compute precision is fixed by its engine",
    "model": "the model (and its shape) is the snapshot's",
    "per_device_train_batch_size": "the data position counts batches of that size",
    "seq_len": "the data position counts blocks of that length",
    "offload_dir": "the disk tier holds the run's state",
}


@dataclass
class Node:
    """One run of the tree: its lineage, its label and, once abandoned, its records."""

    run_id: str
    name: str
    parent_run_id: Optional[str] = None
    forked_at_step: Optional[int] = None
    changes: str = ""
    abandoned: list = field(default_factory=list)   # records no session's history holds any more


class BranchGroup:
    """The branches sharing one engine: which one's state the engine holds, the run tree, and
    the snapshots branches start from (never pruned)."""

    def __init__(self):
        self.lock = threading.RLock()
        self.switch = threading.Lock()     # one branch switch at a time
        self.members: list = []            # Explorers
        self.active = None                 # the Explorer whose state the engine holds
        self.nodes: dict[str, Node] = {}
        self.protected: set = set()

    def names(self) -> list[str]:
        """Every branch's name (a dropped Session's too: its runs stay in the tree)."""
        return [m.name for m in self.members]

    def node(self, run_id: str, name: str, parent: Optional[str] = None, at: Optional[int] = None) -> Node:
        with self.lock:
            n = self.nodes.get(run_id)
            if n is None:
                n = self.nodes[run_id] = Node(run_id, name, parent, at)
            return n

    def records_by_run(self) -> dict[str, list]:
        """Every run's records, by step: what sessions hold now and what rewinds abandoned."""
        out: dict[str, list] = {}
        for m in list(self.members):   # (the log, not the Session: a dropped fork's records stay)
            for r in m.log.records():
                if r.get("run_id"):
                    out.setdefault(r["run_id"], []).append(r)
        with self.lock:
            for n in self.nodes.values():
                out.setdefault(n.run_id, []).extend(n.abandoned)
        return {k: sorted(v, key=lambda r: r.get("step", 0)) for k, v in out.items()}


class Explorer:
    """One Session's snapshots and branches (``session.explorer``)."""

    def __init__(self, session, snapshot_steps: Optional[int] = None, keep_snapshots: Optional[int] = None,
                 trainer: Any = None):
        self._session = weakref.ref(session)
        self._trainer = _ref(trainer)   # (weak: a dropped fork's trainer goes with its Session)
        # what the tree keeps of this branch if its Session is dropped (a notebook cell run again):
        # its name, its records and the run id it trained last
        self.name = session.name
        self.log = session.run_log
        self._last_run_id: Optional[str] = None
        self.snapshot_steps = check("snapshot_steps", snapshot_steps)
        self.keep_snapshots = check("keep_snapshots", keep_snapshots)
        self.group = BranchGroup()
        self.group.members.append(self)
        self.origin: Optional[tuple] = None      # a fork: (parent run id, step) before its first step
        self.changes: dict = {}                  # a fork's changes (described)
        self.note: str = ""                      # e.g. "rewound to step 20": said of the run going on
        self.weight_decay: Optional[float] = None
        self.restart_path: Optional[str] = None  # the loop restarts from here (rewind, switch back)
        self.switched_out: Optional[str] = None  # the state to load when this branch trains again
        # rewound, not trained since: the engine holds that snapshot's state but the trainer's
        # step, schedule and data position are still those of before (they load when it trains)
        self.pending_start: Optional[str] = None
        # a run in worker processes (remote.ProcessRun): its ranks take the snapshots into its
        # output_dir; what it shows of them (output_dir, run_id) is what this lists and finds
        self.ranks: Any = None
        self.own_engine = False                  # a side-by-side branch (another device): not the group's engine
        self._pending = None                     # (a snapshot completing in the background, its source)
        self._pending_lock = threading.Lock()

    @property
    def session(self):
        return self._session()

    @property
    def run_id(self) -> Optional[str]:
        """The id of the run going on (None before its first step)."""
        if self.ranks is not None:
            return self.ranks.run_id
        if self.session is None:   # dropped: the run it trained last
            return self._last_run_id
        rid = getattr(self.trainer, "run_id", None)
        if rid is not None:
            self._last_run_id = rid
        return rid

    @property
    def trainer(self):
        # (not Session.trainer, which switches the weights back)
        return self._trainer() if self._trainer is not None else None

    @property
    def store(self):
        from megatrain_nb.trainer.snapshot import SnapshotStore   # light: no torch for mt.compare

        if self.ranks is not None:
            return SnapshotStore(self.ranks.output_dir)
        if not callable(getattr(self.trainer, "save_snapshot", None)):
            raise NotImplementedError(f"session {self.session.name!r} drives a trainer without snapshots "
                                      f"({type(self.trainer).__name__}); snapshots, rewind and fork need mt.Trainer "
                                      "in this process, or nproc_per_node=N")
        return SnapshotStore(self.trainer.args.output_dir)

    def apply(self, kind: str, value: Any = None, source: str = "notebook"):
        """A snapshot / rewind / fork at a step boundary (the training thread), or now when
        nothing trains. ``fork``'s value: (step, name, changes)."""
        if kind == "snapshot":
            return self.take(source)
        if kind == "rewind":
            return self.rewind(value, source)
        step, name, changes = value
        info = self.take(source) if step is None else self.find(step)
        return self.fork(info, name, changes)

    # ---- snapshots ---------------------------------------------------------------------------
    def take(self, source: str = "notebook", wait: bool = True):
        """A snapshot now (the caller is at a step boundary); an event either way. ``wait``
        False (automatic snapshots): it completes in the background while training goes on,
        logged once complete (:meth:`settle`); returns None then."""
        s = self.session
        if getattr(self.trainer, "run_id", None) is None:
            raise RuntimeError(f"session {s.name!r} has not trained a step yet: nothing to snapshot")
        self.settle()
        with self.group.lock:
            elsewhere = not self.own_engine and self.group.active is not None and self.group.active is not self
        if self.pending_start is not None:   # its state is that snapshot's until it trains again
            return self.named(self.store.info(self.pending_start))
        if elsewhere:   # the engine holds another branch's state; this one's was kept when it left
            if self.switched_out is None:
                raise RuntimeError(f"session {s.name!r} does not hold the engine; resume it to snapshot it")
            return self.named(self.store.info(self.switched_out))
        try:
            pending = self.store.begin(self.trainer)
            if not wait:
                with self._pending_lock:
                    self._pending = (pending, source)
                return None
            info = self.store.finish(pending)
        except Exception as e:
            s.run_log.add_event("snapshot_failed", s.step, error=f"{type(e).__name__}: {e}", source=source)
            raise
        return self._taken(info, source)

    def settle(self, block: bool = True) -> None:
        """A snapshot completing in the background: once complete, logged and pruned as
        :meth:`take` does (a failure is logged and said on stderr; the run goes on).
        ``block`` False: only if complete already."""
        with self._pending_lock:
            if self._pending is None or not (block or getattr(self._pending[0], "done", lambda: True)()):
                return
            (pending, source), self._pending = self._pending, None
        try:
            info = self.store.finish(pending)
        except Exception as e:  # noqa: BLE001 - a failed snapshot must not stop the run
            self.session.run_log.add_event("snapshot_failed", getattr(pending, "step", self.session.step),
                                           error=f"{type(e).__name__}: {e}", source=source)
            print(f"megatrain_nb: a snapshot failed, training goes on: {e}", file=sys.stderr)
            return
        self._taken(info, source)

    def _taken(self, info, source: str):
        self._register(info.run_id)
        self.session.run_log.add_event("snapshot", info.step, path=info.path, bytes_unique=info.bytes_unique,
                                       bytes_shared=info.bytes_shared, source=source)
        self.prune()
        return self.named(info)

    def on_record(self, record: dict) -> None:
        """After each step (training thread): automatic snapshots every ``snapshot_steps``,
        completed in the background (the step's updates and the next step go on meanwhile)."""
        self.pending_start = None
        self._last_run_id = record.get("run_id") or self._last_run_id
        self._register(record.get("run_id"), record.get("parent_run_id"), record.get("forked_at_step"))
        self.settle(block=False)
        step = int(record.get("step", 0) or 0)
        if self.snapshot_steps and step % self.snapshot_steps == 0:
            try:
                self.take(source="snapshot_steps", wait=False)
            except Exception as e:  # noqa: BLE001 - a failed snapshot must not stop the run
                print(f"megatrain_nb: snapshot at step {step} failed, training goes on: {e}", file=sys.stderr)

    def prune(self) -> list:
        if not self.keep_snapshots:
            return []
        return self.store.prune(self.keep_snapshots, protect=self.protected(), run_ids=[self.trainer.run_id])

    def protected(self) -> set:
        with self.group.lock:
            keep = set(self.group.protected)
        keep |= {m.switched_out for m in self.group.members if m.switched_out}
        return keep

    def snapshots(self) -> list:
        """The snapshots (and checkpoints) this run can rewind to: its own, and its ancestors'
        up to the step it was forked at."""
        self.settle()
        reach = self._lineage()
        return [self.named(i) for i in self.store.list()
                if i.run_id in reach and i.step <= reach[i.run_id]]

    def all_snapshots(self) -> list:
        self.settle()
        ids = set(self.group.nodes) | {m.run_id for m in self.group.members}
        return [self.named(i) for i in self.store.list() if i.run_id in ids]

    def find(self, step: int) :
        found = [i for i in self.snapshots() if i.step == int(step)]
        if not found:
            have = sorted({i.step for i in self.snapshots()})
            raise LookupError(f"no snapshot at step {step} of session {self.session.name!r}; the steps that "
                              f"have one: {', '.join(map(str, have)) or 'none'} (take them with "
                              "session.snapshot() or snapshot_steps=N)")
        return max(found, key=lambda i: (not i.damaged, i.time))   # (one known damaged: the rewind says why)

    # ---- rewind ------------------------------------------------------------------------------
    def rewind(self, step: int, source: str = "notebook") :
        """Go back to the snapshot at ``step`` (the caller is at a step boundary or the run has
        finished). The loop restarts from it as a new run whose parent is the current one."""
        s, tr = self.session, self.trainer
        info = self.find(step)
        old_step, old_run = s.step, tr.run_id
        self.verify(info)   # whole, before anything changes: a damaged snapshot leaves the run as it was
        self.activate(source=f"rewind of {s.name}")
        from megatrain_nb.trainer.snapshot import SCHEDULE_FIELDS, BranchStart   # light: no torch for mt.compare

        # at once: generate()/save_model() see that step's weights (a load failing part way marks
        # the engine failed: nothing trains, saves or reads on the mixture)
        tr.load_engine_state(info.path, verify=False)
        self.abandon_after(info.step, old_run)
        # back into an ancestor's run (before this fork's point): this fork's changes apply again
        other = info.run_id != old_run
        tr.start_branch(BranchStart(new_run=True,
                                    rebuild_schedule=other and any(k in self.changes for k in SCHEDULE_FIELDS),
                                    restart_data=other and "train_dataset" in self.changes))
        self.restart_path, self.switched_out, self.pending_start = info.path, None, info.path
        s.run_log.add_event("rewind", info.step, from_step=old_step, path=info.path, source=source)
        return info

    def verify(self, info) -> None:
        """Check the snapshot ``info`` whole (manifest, the engine's linked files, state file)
        before a rewind or fork changes anything; the error names the damaged file, and the
        snapshot is listed as damaged from then on."""
        try:
            self.trainer.verify_whole(info.path)
        except Exception as e:
            self.session.run_log.add_event("snapshot_damaged", info.step, path=info.path,
                                           error=f"{type(e).__name__}: {e}")
            raise

    def abandon_after(self, step: int, old_run: Optional[str]) -> None:
        """A rewind to ``step``: the records after it leave the history and stay in the tree as
        the abandoned branch of ``old_run``; the run going on is said to be rewound."""
        s = self.session
        gone = s.run_log.truncate_after(step)
        if old_run is not None:
            n = self._register(old_run)
            with self.group.lock:
                n.abandoned.extend(r for r in gone if r.get("run_id") == old_run)
                if gone:
                    n.name = f"{s.name} (abandoned after step {step})"
        self.note = f"rewound to step {step}"

    def on_recovery(self, event: dict) -> None:
        """(Training thread) the trainer recovered by itself (on_nonfinite="rewind",
        ``trainer/recovery.py``): the steps after the snapshot it went back to become the
        abandoned branch, as a rewind's do; a "recovery" event says why and what was skipped."""
        self.abandon_after(int(event["to_step"]), event.get("abandoned_run_id"))
        self.note = f"recovered at step {event['step']}"
        fields = {k: event.get(k) for k in ("reason", "from_step", "to_step", "snapshot", "attempt", "max_recoveries",
                                            "lr_factor", "lr", "skipped_window", "abandoned_run_id")}
        self.session.run_log.add_event("recovery", int(event["step"]), **fields)

    def take_restart(self) -> Optional[str]:
        path, self.restart_path = self.restart_path, None
        return path

    # ---- fork ----------------------------------------------------------------------------------
    def fork(self, info, name: Optional[str], changes: dict):
        """A new Session from snapshot ``info``, sharing this engine, with ``changes``."""
        from megatrain_nb.trainer.snapshot import SCHEDULE_FIELDS, BranchStart   # light: no torch for mt.compare

        changes = check_changes(changes, self.trainer)
        self.verify(info)   # a damaged snapshot is refused here, not when the fork first trains
        device = changes.pop(PLACEMENT, None)
        side = placement(self.trainer.engine.device, device) == "side_by_side"
        taken = set(self.group.names())
        if name is not None and str(name) in taken:
            raise ValueError(f"a branch named {str(name)!r} exists already (branches: {', '.join(sorted(taken))}); "
                             "pass another name=")
        tr = self.trainer
        args = copy.deepcopy(tr.args)
        for k, v in changes.items():
            if k not in ("train_dataset", "loss_fn"):
                setattr(args, k, v)
        if "max_steps" in changes and int(changes["max_steps"]) <= info.step:
            raise ValueError(f"max_steps={changes['max_steps']} is not after the fork's step {info.step}")
        from megatrain_nb.trainer.checkpoint import rng_state, set_rng_state   # light: no torch for mt.compare

        rng = rng_state()   # a Trainer seeds the global generators: the parent's run must not notice
        engine = sibling_engine(tr.engine, device) if side else tr.engine
        build = getattr(tr, "fork_trainer", None) or type(tr)   # a GRPO run builds its own (its reward functions)
        trainer = build(model=engine, train_dataset=changes.get("train_dataset", tr.train_dataset), args=args,
                        eval_dataset=tr.eval_dataset, tokenizer=tr.tokenizer, data_collator=tr.data_collator,
                        loss_fn=changes.get("loss_fn", tr.loss_fn), seq_len=tr.seq_len)
        set_rng_state(rng)
        trainer.start_branch(BranchStart(new_run=True, rebuild_schedule=any(k in changes for k in SCHEDULE_FIELDS),
                                         restart_data="train_dataset" in changes))
        if name is None:
            name = free_name(f"{self.session.name}-fork", taken)
        child = type(self.session).from_trainer(trainer, tokenizer=self.session.tokenizer, name=str(name),
                                     resume_from_checkpoint=info.path)
        self.adopt(child, info, changes, weight_decay=float(changes.get("weight_decay", self.engine_weight_decay())),
                   device=device if side else None)
        return child

    def adopt(self, child, info, changes: dict, weight_decay: Optional[float] = None, device: Any = None) -> None:
        """``child`` (a new Session) is this run's fork from snapshot ``info`` with ``changes``: it
        joins the tree, and the snapshot it starts from is never pruned; a "fork" event here."""
        ex = child.explorer
        ex.snapshot_steps, ex.keep_snapshots = self.snapshot_steps, self.keep_snapshots
        ex.join(self.group)
        ex.origin = (info.run_id, info.step)
        ex.changes = {k: _describe(v) for k, v in changes.items()}
        ex.weight_decay = weight_decay
        if device is not None:   # an engine of its own: never paused for another branch, nor pausing one
            ex.own_engine = True
            ex.changes["device"] = str(device)
            print(f"megatrain_nb: branch {child.name!r} trains side by side on {device} (an engine of its own); "
                  f"{self.session.name!r} goes on on {self.trainer.engine.device}")
        with self.group.lock:
            self.group.protected.add(str(info.path))
        self.session.run_log.add_event("fork", info.step, branch=child.name, changes=ex.changes, path=info.path)

    def taken_names(self) -> set:
        """The names of the branches of this tree (a fork's name must be another)."""
        return set(self.group.names())

    def join(self, group: BranchGroup) -> None:
        with group.lock:
            self.group.members.remove(self)
            self.group = group
            group.members.append(self)

    def engine_shared(self) -> bool:
        """Whether another branch still uses this engine (not released)."""
        if self.own_engine:
            return False
        with self.group.lock:
            others = [m.session for m in self.group.members if m is not self and not m.own_engine]
        return any(o is not None and not o.released for o in others)

    def engine_weight_decay(self) -> float:
        if self.weight_decay is None:
            self.weight_decay = float(self.trainer.weight_decay)
        return self.weight_decay

    # ---- one branch trains at a time -------------------------------------------------------------
    def activate(self, source: Optional[str] = None) -> None:
        """Make the engine hold this branch's state (training thread, before it trains): the
        branch that holds it now is paused at its step boundary and snapshotted first. A
        side-by-side branch holds an engine of its own: nothing to switch."""
        if self.own_engine:
            self.trainer.set_weight_decay(self.engine_weight_decay())
            return
        g = self.group
        with g.switch:
            with g.lock:
                cur = g.active
                if cur is self or (cur is None and len(g.members) == 1):
                    g.active = self
                    return
            if cur is not None and cur.session is not None and not cur.session.released:
                cur.switch_out(by=self.session.name)
            self.engine_weight_decay()
            self.trainer.set_weight_decay(self.weight_decay)
            with g.lock:
                g.active = self
            if self.switched_out is not None:   # it trained before: back to where it was
                self._back_from(self.switched_out)

    def switch_out(self, by: str, reading: bool = False) -> None:
        """Another branch takes the engine: pause this one (if running), keep its state
        (``reading``: to read the other's weights, said by its event, not printed)."""
        s = self.session
        if s.state == "running":
            s.pause(source=f"branch {by}")
            while s.state == "running":     # it pauses at its next step boundary
                time.sleep(0.02)
        if getattr(self.trainer, "run_id", None) is None:
            return   # never trained: its state is its start snapshot
        self.engine_weight_decay()
        self.settle()
        self.switched_out = self.pending_start or self.store.take(self.trainer).path
        if s.state == "paused":
            back = f"{s.name}.resume() switches back"
        elif s.state == "idle":
            back = f"{s.name}.train() switches back"
        else:   # finished: it trains no more, but its weights are its own
            back = (f"reading {s.name}'s weights ({s.name}.generate(), .engine, .trainer.save_model(), a report) "
                    "switches them back")
        if not reading:
            print(f"megatrain_nb: branch {by!r} trains now; {s.name!r} is {s.state} at step {s.step} "
                  f"(one device trains one branch at a time; {back})")
        s.run_log.add_event("switched_out", s.step, by=by, path=self.switched_out)

    def hold_weights(self, what: str, strict: bool = True) -> None:
        """Before ``what`` reads this branch's weights: make the shared engine hold them again
        when another branch that is not training holds it now (that one's state is kept in a
        snapshot, as when it is paused for a branch that trains). While the other one trains,
        ``strict`` raises saying what would be read and how to switch, else warns."""
        s = self.session
        g = self.group
        if self.own_engine or s is None or s.released or g.active is self or g.active is None:
            return   # (checked before the lock: a switch in progress saves the branch it switches out)
        with g.switch:
            with g.lock:
                cur = g.active
            if cur is None or cur is self or self.switched_out is None:
                return
            other = cur.session
            if other is not None and other.state == "running":
                msg = (f"{what} would read branch {cur.name!r}'s weights: it trains now on the engine "
                       f"{s.name!r} shares (one device trains one branch at a time). Pause it "
                       f"({cur.name}.pause()) or let it end, then ask again; {s.name}.resume() switches back "
                       "and trains")
                if strict:
                    raise RuntimeError(msg)
                import warnings

                warnings.warn(msg, stacklevel=4)
                return
            if other is not None and not other.released:
                cur.switch_out(by=s.name, reading=True)
            path = self.switched_out
            self.trainer.load_engine_state(path)
            self.trainer.set_weight_decay(self.engine_weight_decay())
            with g.lock:
                g.active = self
            self._back_from(path)
            s.run_log.add_event("switched_in", s.step, path=path, source=what)

    def _back_from(self, path: str) -> None:
        """The engine holds (or will hold) this branch's state kept at ``path``: training again
        restarts from it (the data position and RNG too), as the same run."""
        from megatrain_nb.trainer.snapshot import BranchStart   # light: no torch for mt.compare

        self.restart_path, self.switched_out = path, None
        # (a rewind's new run, not started yet, stays one)
        self.trainer.start_branch(BranchStart(new_run=False), replace=False)

    # ---- the tree ------------------------------------------------------------------------------
    def tree(self) -> list[dict]:
        """One row per run of the tree: run id, name, parent, fork step, what changed, records."""
        recs = self.group.records_by_run()
        with self.group.lock:
            nodes = list(self.group.nodes.values())
        return [{"run_id": n.run_id, "name": n.name, "parent_run_id": n.parent_run_id,
                 "forked_at_step": n.forked_at_step, "changes": n.changes, "records": recs.get(n.run_id, [])}
                for n in nodes]

    def sidebar_rows(self) -> list[dict]:
        """The run tree in a few fields per run, for the JupyterLab sidebar (branch_rows.py)."""
        return sidebar_rows(self)

    def _register(self, run_id, parent=None, at=None) -> Optional[Node]:
        if not run_id:
            return None
        s = self.session
        n = self.group.node(run_id, s.name, parent, at)
        with self.group.lock:
            if parent is not None and n.parent_run_id is None:
                n.parent_run_id, n.forked_at_step = parent, at
            if not n.abandoned:
                n.name = s.name
            if not n.changes and (self.changes or self.note):
                n.changes = ", ".join([f"{k}={v}" for k, v in self.changes.items()] + ([self.note] if self.note else []))
        return n

    def _lineage(self) -> dict:
        """run id -> the last step of it this run descends from."""
        reach: dict = {}
        rid = self.run_id
        limit = float("inf")
        if rid is None and self.origin is not None:
            rid, limit = self.origin
        with self.group.lock:
            while rid and rid not in reach:
                reach[rid] = limit
                n = self.group.nodes.get(rid)
                if n is None or n.parent_run_id is None:
                    break
                limit = min(limit, n.forked_at_step if n.forked_at_step is not None else limit)
                rid = n.parent_run_id
        return reach

    def named(self, info) :
        n = self.group.nodes.get(info.run_id)
        info.branch = n.name if n is not None else None
        return info


def _ref(obj):
    if obj is None:
        return None
    try:
        return weakref.ref(obj)
    except TypeError:   # (an object without weak references: held)
        return lambda: obj


def check_changes(changes: dict, trainer: Any = None, kind: Any = None) -> dict:
    """A fork's ``changes``, each name allowed and each value checked by the table of values
    (:mod:`megatrain_nb.values`, the Trainer's arguments' rules), at ``fork()``; the checked values.
    ``beta``/``loss_type`` (``DPO_ALLOWED``) only in a DPO run, checked by ``branch_dpo``;
    ``temperature``/``beta`` in a GRPO run by ``branch_grpo``. ``kind``: what ranks in worker
    processes train (``remote.ProcessRun.training_kind``), where ``trainer`` is None."""
    bad = [k for k in changes if k not in ALLOWED + DPO_ALLOWED + GRPO_ALLOWED and k != PLACEMENT]
    if bad:
        why = "; ".join(f"{k}: {FIXED[k]}" if k in FIXED else f"{k}: not a setting a fork can change" for k in bad)
        raise ValueError(f"a fork cannot change {', '.join(bad)} mid-run ({why}). It can change: "
                         f"{', '.join(ALLOWED)} (and {', '.join(DPO_ALLOWED)} in a DPO run, "
                         f"{', '.join(GRPO_ALLOWED)} in a GRPO run)")
    # (a field whose rule depends on the run's kind -- beta: DPO's > 0, GRPO's >= 0 -- by its kind's module)
    own = DPO_ALLOWED + GRPO_ALLOWED
    out = {k: check(k, v, f"fork({k})") if k in VALUES and k not in own else v for k, v in changes.items()}
    loss_fn = out.get("loss_fn")
    if loss_fn is not None and not callable(loss_fn):
        raise ValueError(f"fork(loss_fn)={loss_fn!r}: must be a function (logits chunk, labels chunk) -> summed "
                         "loss, or None")
    check_grpo_changes(out, trainer, kind)
    if not (is_grpo_trainer(trainer) or (trainer is None and kind == "grpo")):
        check_dpo_changes(out, trainer, kind)
    return out


def _describe(v: Any) -> str:
    if callable(v):
        return getattr(v, "__name__", type(v).__name__)
    if hasattr(v, "__len__") and not isinstance(v, (str, bytes)) and hasattr(v, "column_names"):
        return f"<dataset of {len(v)}>"
    return repr(v) if isinstance(v, str) else str(v)


def free_name(base: str, taken: set) -> str:
    k = 1
    while f"{base}-{k}" in taken:
        k += 1
    return f"{base}-{k}"


