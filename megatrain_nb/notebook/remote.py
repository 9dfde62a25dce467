"""A Session whose ranks train in other processes: ``mt.Session(..., nproc_per_node=N)`` launches
them; ``mt.Session.attach(name)`` follows a torchrun job already running on this machine.

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

The controller is the same :class:`Session` (same properties, controls, dashboard, reports);
its background thread, instead of training, forwards the controls into rank 0's command inbox
and follows the run: rank 0's ``metrics.jsonl`` gives the records (global loss and throughput,
every rank's memory tiers in ``rank_memory``) and the events (each command as applied, at its
step, on every rank: ``trainer/control.py``); the processes' exit and ``error-<rank>.json`` give
the outcome. The JupyterLab sidebar lists the run once: rank 0 writes the heartbeat, not us.
"""
from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from .session import Session, QueuedCommand

#: after a rank reported an error, how long the agent gets to stop the others before we kill them
ERROR_GRACE_S = 15.0
POLL_S = 0.1


class WorkerError(RuntimeError):
    """A worker process failed; ``rank`` names it, ``remote_traceback`` is its traceback."""

    def __init__(self, message: str, rank: Optional[int] = None, exc_type: Optional[str] = None,
                 remote_traceback: Optional[str] = None):
        super().__init__(message)
        self.rank, self.exc_type, self.remote_traceback = rank, exc_type, remote_traceback


class RemoteSession(Session):
    """See the module docstring. Built by ``mt.Session(..., nproc_per_node=N)`` or
    :meth:`Session.attach`; ``inspect``/``generate`` need the weights in this process, so they
    are refused (load the saved model from ``output_dir``)."""

    def __init__(self, model: Any, train_dataset: Any = None, args: Any = None, tokenizer: Any = None,
                 eval_dataset: Any = None, name: Optional[str] = None, *, nproc_per_node: int,
                 seq_len: Optional[int] = None, loss_fn: Any = None, callbacks: Any = None,
                 save_model: bool = True, **engine_options: Any):
        from .launch_spec import make_run_dir, write_spec

        if isinstance(nproc_per_node, bool) or not isinstance(nproc_per_node, int) or nproc_per_node < 1:
            raise ValueError(f"nproc_per_node={nproc_per_node!r}: give the number of worker processes, an int >= 1")
        self._setup(None, tokenizer, name, model_ref=model, engine_options=engine_options)
        self._nproc = nproc_per_node
        self._attached: Optional[dict] = None
        self._proc: Optional[subprocess.Popen] = None
        self._run_dir = make_run_dir()   # 0700; removed at close() or exit, else reclaimed at the next start
        try:
            self._spec = write_spec(self._run_dir, model=model, train_dataset=train_dataset, args=args,
                                    tokenizer=tokenizer, eval_dataset=eval_dataset, seq_len=seq_len,
                                    loss_fn=loss_fn, callbacks=callbacks, engine_options=dict(engine_options))
            self._spec["save_model"] = bool(save_model)
        except BaseException:
            shutil.rmtree(self._run_dir, ignore_errors=True)
            raise
        self._init_follow(self._spec["args"].get("output_dir"))

    @classmethod
    def attach(cls, name: str, *, root: Any = None, dashboard: Any = None) -> "RemoteSession":
        """Follow and steer the run called ``name`` (or with that heartbeat id) on this machine."""
        from megatrain_nb.lab.registry import list_sessions

        beats = list_sessions(root)
        runs = [b for b in beats if b.get("kind") == "run"]
        found = [b for b in runs if name in (b.get("name"), b.get("id"))]
        if not found:
            other = [b for b in beats if name in (b.get("name"), b.get("id"))]
            if other:
                raise LookupError(f"{name!r} is a notebook Session (kernel {other[0].get('kernel_id')}), not a run "
                                  "of several ranks; steer it from its own notebook or the JupyterLab sidebar")
            names = ", ".join(repr(b.get("name")) for b in runs) or "none"
            raise LookupError(f"no run named {name!r} on this machine (runs: {names}). A torchrun job announces "
                              "itself when mt.Trainer.train() starts (MEGATRAIN_NB_RUN_NAME names it; default: its "
                              "output folder's name)")
        beat = found[-1]
        self = cls.__new__(cls)
        self._setup(None, None, beat.get("name"), model_ref=None, engine_options={})
        self.id = beat["id"]
        self._nproc, self._proc, self._run_dir, self._spec = beat.get("world_size"), None, None, None
        self._attached = beat
        self._root = root
        self._init_follow(beat.get("output_dir"), metrics=beat.get("metrics_log"), run_id=beat.get("run_id"))
        self.train(dashboard=dashboard)
        return self

    def _init_follow(self, output_dir: Optional[str], *, metrics: Optional[str] = None,
                     run_id: Optional[str] = None) -> None:
        out = Path(output_dir) if output_dir else Path("megatrain_outputs").resolve()
        self._output_dir = str(out)
        self._metrics = Path(metrics) if metrics else out / "metrics.jsonl"
        self._offset = 0
        self._run_id = run_id
        self._total: Optional[int] = None
        self._ended_by: Optional[str] = None       # "train_end" once the log says so
        self._stop_seen = False
        self._futures: dict[str, Any] = {}          # command id -> Future (checkpoints)
        self._ranks: list[dict] = []
        self._log_tail = ""
        if not hasattr(self, "_root"):
            self._root = None

    # ---- what differs from a one-process session -----------------------------------------------
    @property
    def total_steps(self) -> Optional[int]:
        if self._total:
            return self._total
        steps = (self._spec or {}).get("args", {}).get("max_steps")
        return int(steps) if isinstance(steps, int) and steps > 0 else None

    @property
    def nproc_per_node(self) -> Optional[int]:
        return self._nproc

    @property
    def output_dir(self) -> str:
        """Where the ranks write checkpoints, ``metrics.jsonl`` and, at the end, the model."""
        return self._output_dir

    @property
    def ranks(self) -> list[dict]:
        """After the run: each rank's report (outcome, steps, the commands it applied at which step)."""
        return [dict(r) for r in self._ranks]

    @property
    def worker_log(self) -> str:
        """The last lines the worker processes printed (torchrun's output)."""
        return self._read_log_tail() if self._run_dir is not None and self._run_dir.exists() else self._log_tail

    def _configured_lr(self) -> Optional[float]:   # the ranks' TrainingArguments (5e-5 when not given)
        return (self._spec or {}).get("args", {}).get("learning_rate", 5e-5 if self._spec else None)

    def launch_info(self) -> list[tuple[str, Any]]:
        """Rows for the report's configuration: ranks, model, the training arguments given."""
        rows: list[tuple[str, Any]] = [("ranks (nproc_per_node)", self._nproc), ("output_dir", self._output_dir)]
        if self._attached is not None:
            rows.append(("attached to", f"{self._attached.get('launcher')} run, rank 0 pid {self._attached.get('pid')}"))
        if self._spec:
            model = self._spec["model"]
            rows.append(("model", "(saved from the notebook)" if model.get("written") else
                         model.get("folder") or model.get("preset")))
            rows.extend((f"args.{k}", v) for k, v in sorted(self._spec["args"].items()) if k != "output_dir")
            rows.extend((f"engine.{k}", v) for k, v in sorted(self._spec["engine_options"].items()))
        return rows

    def inspect(self, layer: Any):
        raise RuntimeError(f"session {self.name!r} trains in {self._nproc} worker processes; per-layer statistics "
                           "stay there. Load the saved model (output_dir) or a checkpoint to look inside")

    def generate(self, prompt: str = "", max_new_tokens: int = 50, **kw: Any) -> str:
        raise RuntimeError(f"session {self.name!r} trains in worker processes, so its weights are not in this "
                           f"kernel; sample from the model saved in {self._output_dir!r} once the run ends")

    def _do_checkpoint(self, path: Optional[str], source: str) -> str:
        raise RuntimeError(f"session {self.name!r} has no running workers to write a checkpoint "
                           f"({self._state}); the model the run saved is in {self._output_dir!r}")

    def _start_beacon(self) -> None:   # rank 0 announces the run: the sidebar lists it once
        pass

    def _stop_beacon(self) -> None:
        pass

    def _release(self) -> None:
        if self._released:
            return
        self._released = True
        if self._run_dir is not None:
            self._log_tail = self._read_log_tail()
            shutil.rmtree(self._run_dir, ignore_errors=True)

    # ---- the follower thread -------------------------------------------------------------------
    def _run(self) -> None:
        outcome = "failed"
        try:
            outcome = self._follow()
        except BaseException as e:  # noqa: BLE001 - surfaces in wait() and the dashboard
            self._fail(e)
            outcome = "failed"
        finally:
            self._kill()
            for fut in self._futures.values():
                if not fut.done():
                    fut.set_exception(RuntimeError(f"the run {outcome} before the checkpoint was written"))
            self._drain_commands(outcome)
            self._end(outcome)

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
                    return self._launched_outcome(rc)
                if error_seen is None and self._rank_errors():
                    error_seen = time.monotonic()
                if error_seen is not None and time.monotonic() - error_seen > ERROR_GRACE_S:
                    self._kill()   # the agent did not stop the others in time
            elif not self._rank0_alive():
                self._read_metrics()
                return self._attached_outcome()
            try:   # a control wakes us at once; otherwise look again in POLL_S
                self._forward(self._commands.get(timeout=POLL_S))
            except queue.Empty:
                pass

    def _launch(self) -> None:
        from megatrain_nb.lab.beacon import current_kernel_id
        from megatrain_nb.lab.protocol import ensure_sessions_dir, make_private_dir
        from megatrain_nb.trainer import control

        spec = dict(self._spec, resume=str(self._resume) if self._resume not in (None, False) else self._spec["resume"])
        from .rank_watch import RankWatch

        self._watch = RankWatch(self._run_dir)
        with open(self._run_dir / "spec.json", "w", encoding="utf-8") as f:
            json.dump(spec, f, indent=1)
        self._offset = self._metrics.stat().st_size if self._metrics.is_file() else 0   # earlier runs' lines
        make_private_dir(ensure_sessions_dir(self._root) / f"{self.id}.inbox")   # commands may come first
        env = dict(os.environ)
        env.update({control.ENV_ENABLE: "1", control.ENV_ID: self.id, control.ENV_NAME: self.name,
                    control.ENV_LAUNCHER: "notebook", "MEGATRAIN_NB_CONTROLLER_PID": str(os.getpid()),
                    control.ENV_KERNEL: current_kernel_id() or ""})
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // self._nproc)))
        # torchrun through megatrain_nb.torchrun: its rendezvous store and the workers' sockets on
        # loopback only (torchrun's own store listens on every interface, unauthenticated)
        cmd = [sys.executable, "-m", "megatrain_nb.torchrun", f"--nproc-per-node={self._nproc}",
               "--master-addr=127.0.0.1", "--master-port=0", "--max-restarts=0",
               "--monitor-interval=0.1", "-m", "megatrain_nb.notebook.launch_worker", str(self._run_dir)]
        log = open(self._run_dir / "workers.log", "wb")
        try:
            self._proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            log.close()

    def _forward_commands(self) -> None:
        while True:
            try:
                self._forward(self._commands.get_nowait())
            except queue.Empty:
                return

    def _forward(self, cmd: QueuedCommand) -> None:
        """One control -> a file in rank 0's inbox; its id comes back on the event that records it."""
        from megatrain_nb.lab.protocol import atomic_write_json, inbox_path, make_private_dir, new_command_name

        value = cmd.value if cmd.kind in ("lr", "checkpoint") or (cmd.kind == "stop" and cmd.value) else None
        name = new_command_name()
        if cmd.future is not None:
            self._futures[name] = cmd.future
        inbox = make_private_dir(inbox_path(self.id, self._root))
        atomic_write_json(inbox / f"{name}.json", {"id": name, "command": cmd.kind, "value": value,
                                                    "source": cmd.source, "time": time.time()})

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
            if self._run_id is None:   # launched: the first run to start after we launched is ours
                self._run_id = rec.get("run_id")
            if rec.get("run_id") == self._run_id:
                self._total = rec.get("total_steps") or self._total
            return
        if self._run_id is None or rec.get("run_id") != self._run_id:
            return   # another run sharing output_dir
        if event is None:
            self._log.add_record({k: v for k, v in rec.items() if k != "run_id"})
            with self._cv:
                self._cv.notify_all()
        elif event == "control":
            self._control_event(rec)
        elif event == "train_end":
            self._ended_by = "train_end"

    def _control_event(self, rec: dict) -> None:
        kind, step = str(rec.get("kind")), int(rec.get("step") or 0)
        fields = {k: v for k, v in rec.items() if k not in ("event", "kind", "step", "run_id", "time")}
        self._log.add_event(kind, step, **fields)
        if kind == "pause":
            self._set_state("paused")
        elif kind == "resume":
            self._set_state("running")
        elif kind == "stop":
            self._stop_seen = True
        elif kind == "lr" and self._pending_lr == rec.get("value"):
            self._pending_lr = None
        fut = self._futures.pop(str(rec.get("id")), None)
        if fut is not None and not fut.done():
            if kind == "checkpoint":
                fut.set_result(rec.get("path"))
            elif kind.endswith("_failed"):
                fut.set_exception(RuntimeError(f"checkpoint failed on the workers: {rec.get('error')}"))

    # ---- how it ended ------------------------------------------------------------------------------
    def _rank_errors(self) -> list[dict]:
        from megatrain_nb.lab.protocol import read_json

        errs = [read_json(p) for p in sorted(self._run_dir.glob("error-*.json"))]
        return sorted((e for e in errs if isinstance(e, dict)), key=lambda e: e.get("time", 0))

    def _launched_outcome(self, rc: int) -> str:
        from megatrain_nb.lab.protocol import read_json

        self._ranks = [r for r in (read_json(p) for p in sorted(self._run_dir.glob("rank-*.json")))
                       if isinstance(r, dict)]
        self._ranks.sort(key=lambda r: r.get("rank", 0))
        errors = self._rank_errors()
        if rc == 0 and not errors:
            return "stopped" if any(r.get("outcome") == "stopped" for r in self._ranks) else "finished"
        tail = self._read_log_tail()
        # The first rank to fail is the cause, the others' errors (a collective failing on a
        # peer's death) its consequences. A rank that died without a word left no file: the
        # watch saw it go, torchrun's agent reports its exit code (the agent's own SIGTERM to
        # the rest, -15, is not a failure).
        from .rank_watch import first_failure

        reported = {e.get("rank") for e in errors} | {r.get("rank") for r in self._ranks}
        codes = agent_failures(tail)
        silent = {}
        for rank in (set(codes) | set(self._watch.gone_at)) - reported:
            code = codes.get(rank)
            if code in ("-15", "0"):
                continue
            silent[rank] = {"pid": self._watch.pids.get(rank), "exit_code": code,
                            "gone_at": self._watch.gone_at.get(rank), "memory": self._watch.memory_before.get(rank)}
        rank, how, then = first_failure(errors, silent)
        if rank is not None:
            err = next((e for e in errors if e.get("rank") == rank), None)
            after = ("\nthen, as a consequence: " + "; ".join(then)) if then else ""
            detail = (f"\n--- rank {rank}'s traceback ---\n{err.get('traceback', '')}" if err is not None
                      else f"\n--- the workers' last output ---\n{tail}")
            raise WorkerError(f"{how}{after}{detail}", rank=rank, exc_type=err.get("type") if err else None,
                              remote_traceback=err.get("traceback") if err else None)
        raise WorkerError(f"the worker processes ended with exit code {rc} and no rank reported an error; their "
                          f"last output:\n{tail}")

    def _attached_outcome(self) -> str:
        if self._stop_seen and self._ended_by:
            return "stopped"
        if self._ended_by:
            return "finished"
        raise WorkerError(f"run {self.name!r}: rank 0 (pid {self._attached.get('pid')}) ended without finishing "
                          "(see the torchrun job's output for the error)", rank=0)

    def _rank0_alive(self) -> bool:
        from megatrain_nb.lab.protocol import heartbeat_path, read_json
        from megatrain_nb.processes import pid_alive

        beat = read_json(heartbeat_path(self.id, self._root))
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
            with open(self._run_dir / "workers.log", "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - limit))
                return f.read().decode("utf-8", "replace")
        except OSError:
            return self._log_tail


def root_cause(agent_output: str) -> tuple[Optional[int], Optional[str]]:
    """(rank, exit code) of the first failure torchrun's agent reports ("Root Cause" block), or
    (None, None): how a rank that died without a word (a signal, ``os._exit``) is named."""
    m = re.search(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", agent_output, re.S)
    return (int(m.group(1)), m.group(2)) if m else (None, None)


def agent_failures(agent_output: str) -> dict[int, str]:
    """{rank: exit code} of every failure in torchrun's agent report."""
    return {int(r): c for r, c in re.findall(r"rank\s*:\s*(\d+) \(local_rank.*?\n\s*exitcode\s*:\s*(-?\d+)",
                                            agent_output)}
