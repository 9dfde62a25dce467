"""A Session's run in worker processes: ``mt.Session(..., nproc_per_node=N)`` launches them;
``mt.Session.attach(name)`` follows a torchrun job already running on this machine.

Example::

    session = mt.Session(model, train_dataset=ds, args=args, nproc_per_node=2)
    session.train()                  # returns at once; N worker processes train
    session.pause(); session.set_lr(1e-4); session.resume()
    session.wait()                   # re-raises a worker's error, naming its rank

    job = mt.Session.attach("my-run")    # a `torchrun ... train.py` job (mt.Trainer inside)
    job.dashboard(); job.stop()

Why torchrun's elastic agent (``python -m torch.distributed.run``, a child process) rather than
``torch.multiprocessing``: the workers then run exactly what a user's torchrun job runs (the
environment, the process group, the failure handling: one rank failing makes the agent stop the
others), nothing is forked from a kernel full of threads, nothing is pickled (``spawn`` would
pickle the model and the dataset, and cannot import functions defined in a notebook), and this
process never imports a CUDA context, so the kernel stays usable.

The Session is the same (same properties, controls, dashboard, reports); its run controller is
a :class:`ProcessRun`, whose background thread, instead of training, forwards the controls into
rank 0's command inbox and follows the run: rank 0's ``metrics.jsonl`` gives the records (global
loss and throughput, every rank's memory tiers in ``rank_memory``) and the events (each command
as applied, at its step, on every rank: ``trainer/control.py``); the processes' exit and
``error-<rank>.json`` give the outcome (``worker_outcome.py``). Only the commands the one table
(``megatrain_nb/commands.py``) marks ``ranks`` are forwarded; the others are refused, saying so
(``snapshot`` and ``rewind`` among them: their events come back with the snapshot's path, answered
as the Session's ``SnapshotInfo``; after a rewind the next run to start is the branch, followed;
a finished run rewound launches its ranks again from the snapshot). ``fork`` is no command to the
ranks: it launches new ones (``rank_fork.py``). The JupyterLab sidebar lists the run once: rank 0
writes the heartbeat, not us.
"""
from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

from megatrain_nb.channel.beacon import current_kernel_id
from megatrain_nb.channel.protocol import ensure_sessions_dir, heartbeat_path, make_private_dir, read_json, write_command
from megatrain_nb.channel.registry import list_sessions
from megatrain_nb.commands import COMMANDS
from megatrain_nb.processes import pid_alive
from megatrain_nb.trainer import control

from .launch_spec import make_run_dir, write_spec
from .rank_fork import fork_ranks
from .rank_watch import RankWatch
from .run_state import Order, RunState
# WorkerError and the agent's report are re-exported (where they were)
from .worker_outcome import (WorkerError, agent_failures, attached_outcome, launched_outcome,  # noqa: F401
                             rank_errors, rank_reports, root_cause)

#: the training kind a launched run's arguments' class builds (launch_spec._check_args)
SPEC_KINDS = {"GRPOConfig": "grpo", "DPOConfig": "dpo", "SFTConfig": "sft"}
#: after a rank reported an error, how long the agent gets to stop the others before we kill them
ERROR_GRACE_S = 15.0
POLL_S = 0.1


class ProcessRun:
    """Launches or follows the worker ranks of a Session (see the module docstring). Built by
    :meth:`launching` (``nproc_per_node=N``) or :meth:`attaching` (``Session.attach``)."""

    public = ("nproc_per_node", "output_dir", "ranks", "worker_log", "launch_info", "run_dir", "training_kind")
    announces = False   # rank 0 announces the run: the sidebar lists it once

    def __init__(self, status: RunState, session_id: str, *, nproc: Optional[int], spec: Optional[dict] = None,
                 run_dir: Optional[Path] = None, attached: Optional[dict] = None, root: Any = None):
        self.status, self.session_id = status, session_id
        self.nproc_per_node = nproc
        self.run_dir = run_dir      # 0700; removed at close() or exit, else reclaimed at the next start
        self.resume_from: Any = None
        self.snapshot_every: Optional[int] = None   # snapshot_steps / keep_snapshots, for the ranks
        self.keep_snapshots: Optional[int] = None
        self.explorer: Any = None    # the Session's snapshots and branches (branches.Explorer)
        self.inputs: Optional[dict] = None   # what the spec was written from (a fork writes its own)
        self.before_launch: list[Callable[[], None]] = []   # e.g. a fork pauses its parent
        self._spec, self._attached, self._root = spec, attached, root
        self._proc: Optional[subprocess.Popen] = None
        output_dir = (attached or {}).get("output_dir") or (spec or {}).get("args", {}).get("output_dir")
        out = Path(output_dir) if output_dir else Path("megatrain_outputs").resolve()
        self.output_dir = str(out)
        metrics = (attached or {}).get("metrics_log")
        self._metrics = Path(metrics) if metrics else out / "metrics.jsonl"
        self._offset = 0
        self._run_id: Optional[str] = (attached or {}).get("run_id")
        self._total: Optional[int] = None
        self._ended_by: Optional[str] = None       # "train_end" once the log says so
        self._stop_seen = False
        self._futures: dict[str, Any] = {}          # command id -> Future (checkpoints)
        self._ranks: list[dict] = []
        self._log_tail = ""
        self._watch: Any = None
        self._branch: Optional[dict] = None   # a relaunch after a rewind: BranchStart fields
        self._next_start = False   # a rewind: the next run to start is the branch it starts

    @classmethod
    def launching(cls, status: RunState, session_id: str, nproc_per_node: Any, *, save_model: bool = True,
                  **spec: Any) -> "ProcessRun":
        """``nproc_per_node`` ranks to launch at ``train()``; ``spec``: what ``launch_spec.write_spec``
        takes (model, datasets, args, tokenizer, ...), written now into a private launch folder."""
        if isinstance(nproc_per_node, bool) or not isinstance(nproc_per_node, int) or nproc_per_node < 1:
            raise ValueError(f"nproc_per_node={nproc_per_node!r}: give the number of worker processes, an int >= 1")
        run_dir = make_run_dir()
        try:
            written = write_spec(run_dir, **spec)
            written["save_model"] = bool(save_model)
        except BaseException:
            shutil.rmtree(run_dir, ignore_errors=True)
            raise
        return cls(status, session_id, nproc=nproc_per_node, spec=written, run_dir=run_dir)

    @classmethod
    def factory(cls, nproc_per_node: Any, model: Any, *, snapshots: tuple = (None, None), engine_options: dict,
                start: tuple = (None, None), **given: Any) -> Callable[[RunState, Any, str], "ProcessRun"]:
        """What ``Session(model, ..., nproc_per_node=N)`` builds its run controller with (``given``:
        the datasets, args, tokenizer, seq_len, loss_fn; ``callbacks=``/``save_model=`` come in
        ``engine_options``). ``start``: ``(snapshot, branch)`` a fork's ranks start from
        (``rank_fork.py``)."""
        options = dict(engine_options)
        inputs = dict(given, model=model, engine_options=options, callbacks=options.pop("callbacks", None),
                      save_model=options.pop("save_model", True))

        def build(status: RunState, explorer: Any, session_id: str) -> "ProcessRun":
            run = cls.launching(status, session_id, nproc_per_node, **inputs, resume=start[0], branch=start[1])
            run.snapshot_every, run.keep_snapshots = snapshots   # every rank takes them (its own shard)
            run.inputs, run.explorer = inputs, explorer
            explorer.ranks = run   # the ranks' snapshots are the Session's (output_dir, run_id)
            return run

        return build

    @classmethod
    def attaching(cls, status: RunState, beat: dict, root: Any = None, explorer: Any = None) -> "ProcessRun":
        """Follow the torchrun job whose rank 0 wrote heartbeat ``beat`` (see :func:`find_run`)."""
        run = cls(status, beat["id"], nproc=beat.get("world_size"), attached=beat, root=root)
        run.explorer = explorer
        if explorer is not None:
            explorer.ranks = run
        return run

    # ---- what only a run in worker processes has (the Session shows them as its own) -------------
    @property
    def training_kind(self) -> Optional[str]:
        """What the ranks train (``trainer.kinds``: "grpo", "dpo", ...; the displays pick their
        panels by it, as an in-kernel run's trainer tells them): a launched run's from the
        arguments' class it wrote, an attached one's from rank 0's heartbeat; None: not known."""
        if self._spec is not None:
            return SPEC_KINDS.get(self._spec.get("args_class"), "plain")
        return (self._attached or {}).get("training_kind")

    @property
    def ranks(self) -> list[dict]:
        """After the run: each rank's report (outcome, steps, the commands it applied at which step)."""
        return [dict(r) for r in self._ranks]

    @property
    def worker_log(self) -> str:
        """The last lines the worker processes printed (torchrun's output)."""
        return self._read_log_tail() if self.run_dir is not None and self.run_dir.exists() else self._log_tail

    def launch_info(self) -> list[tuple[str, Any]]:
        """Rows for the report's configuration: ranks, model, the training arguments given."""
        rows: list[tuple[str, Any]] = [("ranks (nproc_per_node)", self.nproc_per_node),
                                       ("output_dir", self.output_dir)]
        if self._attached is not None:
            rows.append(("attached to", f"{self._attached.get('launcher')} run, rank 0 pid {self._attached.get('pid')}"))
        if self._spec:
            model = self._spec["model"]
            rows.append(("model", "(saved from the notebook)" if model.get("written") else
                         model.get("folder") or model.get("preset")))
            rows.extend((f"args.{k}", v) for k, v in sorted(self._spec["args"].items()) if k != "output_dir")
            rows.extend((f"engine.{k}", v) for k, v in sorted(self._spec["engine_options"].items()))
        return rows

    @property
    def run_id(self) -> Optional[str]:
        """The id of the run the ranks train now (a rewind starts a branch: a new one)."""
        return self._run_id

    @property
    def spec_args(self) -> dict:
        """The training arguments the ranks were given (fields that differ from the defaults)."""
        return dict((self._spec or {}).get("args", {}))

    # ---- the run controller (run_state.RunController) ---------------------------------------------
    def total_steps(self) -> Optional[int]:
        if self._total:
            return self._total
        steps = (self._spec or {}).get("args", {}).get("max_steps")
        return int(steps) if isinstance(steps, int) and steps > 0 else None

    def configured_lr(self) -> Optional[float]:   # the ranks' TrainingArguments (5e-5 when not given)
        return (self._spec or {}).get("args", {}).get("learning_rate", 5e-5 if self._spec else None)

    def check(self, what: str) -> None:
        if what in COMMANDS and COMMANDS[what].ranks:
            return
        if what == "fork" and self.inputs is not None:   # new ranks from a snapshot (rank_fork.py)
            return
        hint = {"inspect": "per-layer statistics stay there. Load the saved model (output_dir) or a checkpoint "
                           "to look inside",
                "generate": f"sample from the model saved in {self.output_dir!r} once the run ends"}.get(
            what, f"the ranks do not apply {what!r} (megatrain_nb/commands.py marks the commands they do); "
                  "save_checkpoint() writes a checkpoint that mt.Session.from_checkpoint starts from")
        raise RuntimeError(f"session {self.status.name!r} trains in {self.nproc_per_node} worker processes, so its "
                           f"weights are not in this kernel: {hint}")

    def deliver(self, cmd: Order) -> None:
        self.check(cmd.kind)
        if cmd.kind == "rewind" and self.status.state == "running":   # as in this kernel: paused after it
            self.status.commands.put(Order("pause", source="rewind"))
        self.status.commands.put(cmd)

    def apply_now(self, kind: str, value: Any, source: str) -> Any:
        self.check(kind)
        if kind == "rewind" and self.status.state == "finished" and self.inputs is not None:
            return self._rewind_ended(int(value), source)
        raise RuntimeError(f"session {self.status.name!r} has no running workers to {kind} "
                           f"({self.status.state}); the model the run saved is in {self.output_dir!r}")

    def fork(self, session: Any, step: Optional[int], name: Optional[str], changes: dict) -> Any:
        """``session.fork``: a new Session whose own ranks start from the snapshot at ``step``
        (None: one taken now by the ranks) as a branch with ``changes`` (``rank_fork.py``)."""
        if step is None and self.status.state not in ("running", "paused"):
            raise RuntimeError(f"session {self.status.name!r} has no running workers to snapshot now "
                               f"({self.status.state}): fork(step=...) from one of its snapshots "
                               f"(steps: {', '.join(str(i.step) for i in self.explorer.snapshots()) or 'none'})")
        info = session.snapshot() if step is None else self.explorer.find(step)
        return fork_ranks(session, self, info, name, changes)

    def _rewind_ended(self, step: int, source: str) -> Any:
        """A rewind of a finished run (its ranks gone): ``train()`` launches them again from the
        snapshot at ``step``, as a branch of the run (a new run id whose parent is this one)."""
        info = self.explorer.find(step)
        old_step = self.status.step
        self.explorer.abandon_after(info.step, self._run_id)
        self.resume_from, self._branch = info.path, {"new_run": True}
        self._ended_by, self._stop_seen, self._ranks, self._next_start = None, False, [], True
        for old in (p for pattern in ("rank-*.json", "error-*.json", "pid-*.json") for p in self.run_dir.glob(pattern)):
            old.unlink()   # the last launch's reports
        self.status.log.add_event("rewind", info.step, from_step=old_step, path=info.path, source=source)
        return info

    def release(self) -> None:
        if self.run_dir is not None:
            self._log_tail = self._read_log_tail()
            shutil.rmtree(self.run_dir, ignore_errors=True)

    # ---- the follower thread -------------------------------------------------------------------
    def body(self, on_end: Callable[[str], None]) -> None:
        outcome = "failed"
        try:
            outcome = self._follow()
        except BaseException as e:  # noqa: BLE001 - surfaces in wait() and the dashboard
            self.status.fail(e)
            outcome = "failed"
        finally:
            self._kill()
            for fut in self._futures.values():
                if not fut.done():
                    fut.set_exception(RuntimeError(f"the run {outcome} before the checkpoint was written"))
            self.status.drain(outcome)
            on_end(outcome)

    def _follow(self) -> str:
        if self._attached is None:
            self._launch()
        error_seen: Optional[float] = None
        while True:
            self._forward_commands()
            self._read_metrics()
            if self._attached is None:
                self._watch.poll()
                rc = self._proc.poll()
                if rc is not None:
                    self._read_metrics()
                    self._ranks = rank_reports(self.run_dir)
                    return launched_outcome(rc, self.run_dir, self._ranks, self._watch, self._read_log_tail())
                if error_seen is None and rank_errors(self.run_dir):
                    error_seen = time.monotonic()
                if error_seen is not None and time.monotonic() - error_seen > ERROR_GRACE_S:
                    self._kill()   # the agent did not stop the others in time
            elif not self._rank0_alive():
                self._read_metrics()
                return attached_outcome(self.status.name, self._attached.get("pid"), stop_seen=self._stop_seen,
                                        ended_by=self._ended_by)
            try:   # a control wakes us at once; otherwise look again in POLL_S
                self._forward(self.status.commands.get(timeout=POLL_S))
            except queue.Empty:
                pass

    def _launch(self) -> None:
        for hook in self.before_launch:
            hook()
        resume = self.resume_from
        spec = dict(self._spec, resume=str(resume) if resume not in (None, False) else self._spec["resume"])
        if self._branch is not None:   # rewound after the end: the ranks start from the snapshot as a branch
            spec["branch"] = self._branch
        self._watch = RankWatch(self.run_dir)
        with open(self.run_dir / "spec.json", "w", encoding="utf-8") as f:
            json.dump(spec, f, indent=1)
        self._offset = self._metrics.stat().st_size if self._metrics.is_file() else 0   # earlier runs' lines
        make_private_dir(ensure_sessions_dir(self._root) / f"{self.session_id}.inbox")   # commands may come first
        env = dict(os.environ)
        env.update({control.ENV_ENABLE: "1", control.ENV_ID: self.session_id, control.ENV_NAME: self.status.name,
                    control.ENV_LAUNCHER: "notebook", "MEGATRAIN_NB_CONTROLLER_PID": str(os.getpid()),
                    control.ENV_KERNEL: current_kernel_id() or ""})
        for var, value in ((control.ENV_SNAPSHOT_STEPS, self.snapshot_every),
                           (control.ENV_KEEP_SNAPSHOTS, self.keep_snapshots)):
            if value is not None:
                env[var] = str(int(value))
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // self.nproc_per_node)))
        # torchrun through megatrain_nb.torchrun: its rendezvous store and the workers' sockets on
        # loopback only (torchrun's own store listens on every interface, unauthenticated)
        cmd = [sys.executable, "-m", "megatrain_nb.torchrun", f"--nproc-per-node={self.nproc_per_node}",
               "--master-addr=127.0.0.1", "--master-port=0", "--max-restarts=0",
               "--monitor-interval=0.1", f"--log-dir={self.run_dir / 'elastic'}",   # torchelastic's logs: here
               "-m", "megatrain_nb.notebook.launch_worker", str(self.run_dir)]
        log = open(self.run_dir / "workers.log", "wb")
        try:
            self._proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            log.close()

    def _forward_commands(self) -> None:
        while True:
            try:
                self._forward(self.status.commands.get_nowait())
            except queue.Empty:
                return

    def _forward(self, cmd: Order) -> None:
        """One control (checked by the Session's door) -> a file in rank 0's inbox, by the inbox's one
        writer; its id comes back on the event that records it."""
        takes = COMMANDS[cmd.kind].value != "none" and (cmd.kind != "stop" or cmd.value)
        msg = write_command(self.session_id, cmd.kind, cmd.value if takes else None, source=cmd.source,
                            root=self._root)
        if cmd.future is not None:
            self._futures[msg["id"]] = cmd.future

    def _read_metrics(self) -> None:
        if not self._metrics.is_file() or (self._attached is not None and self._run_id is None):
            return   # attached: which lines are this run's is known once rank 0 names its run_id
        with open(self._metrics, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        end = data.rfind(b"\n")
        if end < 0:
            return
        self._offset += end + 1
        for line in data[: end + 1].splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict):
                self._take(rec)

    def _take(self, rec: dict) -> None:
        event = rec.get("event")
        if event == "run_start":
            # launched: the first run to start after we launched is ours; after a rewind, the
            # next to start is its branch (whose parent is the snapshot's run: maybe not this one)
            if self._run_id is None or self._next_start:
                self._run_id, self._next_start = rec.get("run_id"), False
            if rec.get("run_id") == self._run_id:
                self._total = rec.get("total_steps") or self._total
            return
        if self._run_id is None or rec.get("run_id") != self._run_id:
            return   # another run sharing output_dir
        if event is None:   # a step's record (with its run id, as an in-kernel run's)
            self.status.log.add_record(rec)
            if self.explorer is not None:
                self.explorer.on_record(rec)   # the run tree: the run's lineage
            self.status.notify()
        elif event == "control":
            self._control_event(rec)
        elif event == "train_end":
            self._ended_by = "train_end"

    def _control_event(self, rec: dict) -> None:
        st = self.status
        kind, step = str(rec.get("kind")), int(rec.get("step") or 0)
        fields = {k: v for k, v in rec.items() if k not in ("event", "kind", "step", "run_id", "time",
                                                           "parent_run_id", "forked_at_step")}
        result: Any = dict(fields, step=step)
        if kind == "rewind":   # as in this kernel: at the step gone back to; the later steps a branch
            fields["from_step"], step = step, int(rec.get("value") or 0)
            self._next_start = True
            if self.explorer is not None:
                self.explorer.abandon_after(step, self._run_id)
        if kind in ("snapshot", "rewind") and self.explorer is not None and rec.get("path"):
            try:
                result = self.explorer.named(self.explorer.store.info(rec["path"]))   # a SnapshotInfo
            except Exception:  # noqa: BLE001 - pruned already, or unreadable: the event's fields answer
                pass
        st.log.add_event(kind, step, **fields)
        if kind == "pause":
            st.set_state("paused")
        elif kind == "resume":
            st.set_state("running")
        elif kind == "stop":
            self._stop_seen = True
        elif kind == "lr":
            st.lr_request.taken(rec.get("value"), step)
        fut = self._futures.pop(str(rec.get("id")), None)
        if fut is not None and not fut.done():
            if kind.endswith("_failed"):
                fut.set_exception(RuntimeError(f"{kind[:-len('_failed')]} failed on the workers: {rec.get('error')}"))
            else:   # a checkpoint: its path; a snapshot or rewind: its SnapshotInfo
                fut.set_result(rec.get("path") if kind == "checkpoint" else result)

    # ---- the processes ---------------------------------------------------------------------------
    def _rank0_alive(self) -> bool:
        beat = read_json(heartbeat_path(self.session_id, self._root))
        if not isinstance(beat, dict):
            return False
        if self._run_id is None and beat.get("run_id"):
            self._run_id = beat["run_id"]
        return pid_alive(int(beat.get("pid") or 0))

    def _kill(self) -> None:
        p = self._proc
        if p is None or p.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                return
            try:
                p.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def _read_log_tail(self, limit: int = 6000) -> str:
        try:
            with open(self.run_dir / "workers.log", "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - limit))
                return f.read().decode("utf-8", "replace")
        except (OSError, TypeError):
            return self._log_tail


def find_run(name: str, root: Any = None) -> dict:
    """The heartbeat of the run called ``name`` (or with that heartbeat id) on this machine;
    LookupError listing the runs there are."""
    beats = list_sessions(root)
    runs = [b for b in beats if b.get("kind") == "run"]
    found = [b for b in runs if name in (b.get("name"), b.get("id"))]
    if found:
        return found[-1]
    other = [b for b in beats if name in (b.get("name"), b.get("id"))]
    if other:
        raise LookupError(f"{name!r} is a notebook Session (kernel {other[0].get('kernel_id')}), not a run "
                          "of several ranks; steer it from its own notebook or the JupyterLab sidebar")
    names = ", ".join(repr(b.get("name")) for b in runs) or "none"
    raise LookupError(f"no run named {name!r} on this machine (runs: {names}). A torchrun job announces "
                      "itself when mt.Trainer.train() starts (MEGATRAIN_NB_RUN_NAME names it; default: its "
                      "output folder's name)")
