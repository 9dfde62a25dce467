"""mt.Session(..., nproc_per_node=2): worker processes (gloo, 127.0.0.1) steered from this
process; mt.Session.attach(name) on a torchrun job. Every wait is bounded."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from .launch import REPO, controller_env, free_port, until

HERE = Path(__file__).parent
BOUND = 60


@pytest.fixture(autouse=True)
def _env(tmp_path, monkeypatch):
    controller_env(tmp_path, monkeypatch)


def _until(pred, what, bound=BOUND):
    until(pred, what, bound)


def _data():
    sys.path.insert(0, str(REPO / "tests"))
    from trainer.helpers import args, micro_model, token_dataset

    return args, micro_model, token_dataset


def test_launcher_pause_lr_checkpoint_stop_land_on_every_rank_at_one_step(tmp_path, timed_part_done):
    import megatrain_nb as mt
    from megatrain_nb.channel.registry import list_sessions
    from megatrain_nb.trainer import Trainer

    args, micro_model, token_dataset = _data()
    targs = args(tmp_path / "out", max_steps=100000, logging_steps=2, learning_rate=1e-3,
                 lr_scheduler_type="constant", seed=3)
    s = mt.Session(micro_model(), train_dataset=token_dataset(64), args=targs, nproc_per_node=2,
                   name="launch-test", device="cpu")
    t0 = time.monotonic()
    s.train()
    assert time.monotonic() - t0 < 3.0 and s.state == "running"
    timed_part_done()   # (ALONE_TESTS) what follows waits on bounds of a minute: other tests may run beside it
    assert not torch.cuda.is_initialized()     # the controller never touches CUDA
    assert s.wait(timeout=BOUND, until_step=2) == "running" and s.step >= 2
    runs = [b for b in list_sessions() if b["name"] == "launch-test"]
    assert len(runs) == 1 and runs[0]["kind"] == "run" and runs[0]["world_size"] == 2   # the sidebar: once

    s.pause()
    _until(lambda: s.state == "paused", "the pause")
    held = s.step
    time.sleep(1.0)
    assert s.step == held and s.state == "paused"
    s.set_lr(5e-4)
    s.resume()
    s.wait(timeout=BOUND, until_step=held + 2)
    path = s.save_checkpoint()
    assert Path(path).is_dir() and sorted(p.name for p in Path(path).glob("shards-*")) == [
        "shards-00000-of-00002.safetensors", "shards-00001-of-00002.safetensors"]
    s.wait(timeout=BOUND, until_step=held + 4)
    s.stop(timeout=BOUND)
    assert s.state == "stopped", (s.state, s.worker_log)
    final = s.step

    # every command was applied by both ranks at the same step, in the same order
    kinds = [e["kind"] for e in s.events]
    assert kinds == ["pause", "lr", "resume", "checkpoint", "stop"], s.events
    assert [e["step"] for e in s.events[:3]] == [held] * 3
    ranks = s.ranks
    assert [r["rank"] for r in ranks] == [0, 1] and all(r["outcome"] == "stopped" for r in ranks)
    seen = [[(e["kind"], e["step"], e["id"]) for e in r["events"]] for r in ranks]
    assert seen[0] == seen[1] == [(e["kind"], e["step"], e["id"]) for e in s.events]
    assert ranks[0]["step"] == ranks[1]["step"] == final
    # history: the global loss and LR of rank 0, every rank's memory tiers on logging steps
    hist = s.history
    assert [r["step"] for r in hist] == list(range(1, final + 1))
    assert all(r["lr"] == (1e-3 if r["step"] <= held else 5e-4) for r in hist)
    mem = [r for r in hist if r.get("rank_memory")]
    assert mem and all(len(r["rank_memory"]) == 2 and "host" in r["rank_memory"][1] for r in mem)

    # the saved model equals one process with accumulation 2, the same LR change and stop
    ref = Trainer(model=micro_model(), train_dataset=token_dataset(64), device="cpu",
                  args=args(tmp_path / "ref", max_steps=100000, learning_rate=1e-3, lr_scheduler_type="constant",
                            seed=3, gradient_accumulation_steps=2))
    for rec in ref.iter_steps():
        if rec["step"] == held:
            ref.set_lr(5e-4)
        if rec["step"] == final:
            ref.request_stop()
    from safetensors.torch import load_file

    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    want = {k: v for k, v in ref.engine.state_dict().items()}
    ref.close()
    assert got.keys() == want.keys()
    diff = sum(float((got[k] - want[k]).norm()) ** 2 for k in want) ** 0.5
    norm = sum(float(want[k].norm()) ** 2 for k in want) ** 0.5
    assert diff / norm <= 1e-5


@pytest.mark.parametrize("how", ["raises", "dies"])
def test_a_worker_that_fails_ends_wait_naming_the_rank(tmp_path, how):
    import megatrain_nb as mt
    from megatrain_nb.notebook.remote import WorkerError

    args, micro_model, token_dataset = _data()
    callback = {"raises": "RaiseOnRank1", "dies": "ExitOnRank1"}[how]
    s = mt.Session(micro_model(), train_dataset=token_dataset(64), nproc_per_node=2, device="cpu",
                   args=args(tmp_path / "out", max_steps=100000),
                   callbacks=[f"tests.distributed.launcher_helpers:{callback}"])
    t0 = time.monotonic()
    s.train()
    message = (r"rank 1 \(pid \d+\) failed: ValueError: boom on rank 1 at step 2" if how == "raises"
               else r"rank 1 \(pid \d+\) died \(exit code 9\) without raising")
    with pytest.raises(WorkerError, match=message) as info:
        s.wait(timeout=BOUND)
    assert time.monotonic() - t0 < BOUND and s.state == "failed"
    assert info.value.rank == 1
    if how == "raises":
        assert "on_step_end" in info.value.remote_traceback
    assert s.events[-1]["kind"] == "error" and "rank 1" in s.events[-1]["error"]


@pytest.mark.slow
def test_a_rank_killed_with_signal_9_is_named_first_not_the_rank_its_death_broke(tmp_path):
    """kill -9 of rank 1 mid-run (what the OOM killer does): rank 0 then fails in its next
    collective, but the error names rank 1, how it died, and rank 0's failure as the consequence."""
    import psutil

    import megatrain_nb as mt
    from megatrain_nb.notebook.remote import WorkerError

    args, micro_model, token_dataset = _data()
    s = mt.Session(micro_model(), train_dataset=token_dataset(64), nproc_per_node=2, device="cpu",
                   args=args(tmp_path / "out", max_steps=100000))
    t0 = time.monotonic()
    s.train()
    _until(lambda: s.step >= 2 or s.state == "failed", "two steps")

    def rank1():
        for p in psutil.process_iter(["cmdline"]):
            try:
                if "megatrain_nb.notebook.launch_worker" in " ".join(p.info["cmdline"] or []) and \
                        p.environ().get("RANK") == "1" and str(tmp_path / "runtime") in p.environ().get(
                            "MEGATRAIN_NB_RUNTIME_DIR", ""):
                    return p
            except psutil.Error:
                continue
        return None

    victim = rank1()
    assert victim is not None
    victim.kill()   # SIGKILL
    with pytest.raises(WorkerError) as info:
        s.wait(timeout=BOUND)
    assert time.monotonic() - t0 < 2 * BOUND and s.state == "failed"
    msg = str(info.value)
    assert info.value.rank == 1, msg
    assert msg.startswith(f"rank 1 (pid {victim.pid}) was killed (signal 9, SIGKILL)"), msg
    if "rank 0" in msg:   # rank 0 failed in a collective (or the agent stopped it first)
        assert msg.index("rank 1") < msg.index("then, as a consequence: rank 0"), msg


def test_attach_follows_and_steers_a_torchrun_job(tmp_path):
    import megatrain_nb as mt
    from megatrain_nb.channel.registry import enqueue_command, list_sessions

    env = dict(os.environ, MEGATRAIN_NB_RUN_NAME="attach-test")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", "--max-restarts=0", str(HERE / "launcher_helpers.py"),
           str(tmp_path / "job")]
    job = subprocess.Popen(cmd, cwd=str(REPO), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with pytest.raises(LookupError, match="no run named 'nope'"):
            mt.Session.attach("nope")
        _until(lambda: any(b["name"] == "attach-test" for b in list_sessions()), "the job's heartbeat")
        with pytest.raises(LookupError, match="runs: 'attach-test'"):
            mt.Session.attach("nope")
        s = mt.Session.attach("attach-test")
        assert s.wait(timeout=BOUND, until_step=3) == "running"
        assert s.history[0]["step"] == 1 and s.nproc_per_node == 2
        s.pause()
        _until(lambda: s.state == "paused", "the pause")
        held = s.step
        enqueue_command(s.id, "lr", 2e-4)          # as the JupyterLab sidebar does
        s.resume()
        s.wait(timeout=BOUND, until_step=held + 2)
        s.stop(timeout=BOUND)
        assert s.state == "stopped"
        out, _ = job.communicate(timeout=BOUND)
        assert job.returncode == 0, out[-3000:]
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert [(e["kind"], e["step"]) for e in s.events[:3]] == [("pause", held), ("lr", held), ("resume", held)]
    assert s.events[1]["source"] == "lab" and s.events[-1]["kind"] == "stop"
    assert all(r["lr"] == (1e-3 if r["step"] <= held else 2e-4) for r in s.history)
    assert (tmp_path / "job" / "final" / "model.safetensors").is_file()
    # the job's process has exited: its heartbeat went with it (issue 44: ended runs' files do not
    # pile up in the runtime folder), so the sidebar lists it no more
    assert not [x for x in list_sessions() if x["name"] == "attach-test"]


def _rendezvous_run(torchrun_args):
    """The rendezvous torchrun runs for ``torchrun_args`` once ``megatrain_nb.torchrun`` rewrote
    them (torch.distributed.run.run() turns --standalone, and a one-node static launch without a
    master port, into c10d): (backend, the rewritten arguments)."""
    from torch.distributed.run import get_args_parser

    from megatrain_nb.torchrun import loopback_argv

    args, store, _ = loopback_argv(list(torchrun_args))
    del store
    ns = get_args_parser().parse_args(args)
    backend = "c10d" if ns.standalone else ns.rdzv_backend
    if backend == "static" and not ns.rdzv_endpoint and ns.master_port is None:
        backend = "c10d"
    return backend, args


def _documented_recipes():
    """Every ``python -m megatrain_nb.torchrun ...`` command line (a line of its own) in
    docs/DISTRIBUTED.md and README.md."""
    import re
    import shlex

    found = []
    for doc in (REPO / "docs" / "DISTRIBUTED.md", REPO / "README.md"):
        text = doc.read_text().replace("\\\n", " ")
        for m in re.finditer(r"^python -m megatrain_nb\.torchrun (.+?)(?:#.*)?$", text, re.M):
            found.append(shlex.split(m.group(1)))
    return found


def _notebook_command(tmp_path, monkeypatch):
    """The command line Session(nproc_per_node=2) starts its ranks with (Popen captured, nothing started)."""
    import megatrain_nb as mt
    from megatrain_nb.notebook import remote

    args, micro_model, token_dataset = _data()
    seen = []

    def popen(cmd, **kw):
        seen.append(list(cmd))
        raise OSError("captured by the test: nothing is started")

    monkeypatch.setattr(remote.subprocess, "Popen", popen)
    s = mt.Session(micro_model(), train_dataset=token_dataset(16), nproc_per_node=2, device="cpu",
                   args=args(tmp_path / "nb", max_steps=2), name="rdzv-probe")
    try:
        s.train()
        _until(lambda: seen and s.state not in ("running",), "the launch attempt")
    finally:
        s.close()
    [cmd] = seen
    at = cmd.index("megatrain_nb.torchrun")
    return cmd[at + 1:]


def test_a_single_node_launch_names_no_rendezvous_that_unpickles(tmp_path, monkeypatch):
    """Issue 44 item 5: --standalone and c10d go through torch's dynamic rendezvous, which
    pickle.loads its state from a TCP store any local user can reach on 127.0.0.1. Every
    single-node command line the project builds or documents runs the static rendezvous or this
    package's one-node one; the latter gives each attempt a fresh store bound to 127.0.0.1."""
    import psutil
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as registry

    from megatrain_nb.torchrun import LOOPBACK_BACKEND, LoopbackRendezvous, register_loopback_rendezvous

    recipes = _documented_recipes()
    assert len(recipes) >= 2, recipes   # DISTRIBUTED.md's launch and restart recipes
    cases = recipes + [_notebook_command(tmp_path, monkeypatch),
                       ["--standalone", "--nproc-per-node=2", "train.py"],
                       ["--nproc-per-node=2", "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:29400", "train.py"],
                       ["--nproc-per-node=2", "--rdzv-backend", "c10d", "--max-restarts", "3", "-m", "pkg.mod"],
                       ["--nproc-per-node=2", "--max-restarts=1", "train.py"]]
    for case in cases:
        backend, args = _rendezvous_run(case)
        assert backend in ("static", LOOPBACK_BACKEND), (case, args)
    assert _rendezvous_run(["--nnodes=2", "--node-rank=0", "--master-addr=10.0.0.1", "--master-port=29500",
                            "train.py"])[1][0] == "--nnodes=2"   # several machines: torchrun's own, unchanged

    register_loopback_rendezvous()
    handler = registry.create_handler(RendezvousParameters(LOOPBACK_BACKEND, "127.0.0.1:0", "run-x", 1, 1))
    assert isinstance(handler, LoopbackRendezvous) and handler.use_agent_store
    first = handler.next_rendezvous()
    first.store.set("default_pg/addr", b"dead peer")
    port1 = first.bootstrap_store_info.master_port
    again = handler.next_rendezvous()            # a restart: a fresh store, none of the last attempt's keys
    port2 = again.bootstrap_store_info.master_port
    assert port2 != port1 and not again.store.check(["default_pg/addr"])
    assert (again.rank, again.world_size, again.bootstrap_store_info.master_addr) == (0, 1, "127.0.0.1")
    listening = [c.laddr.ip for c in psutil.Process().net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == port2]
    assert listening == ["127.0.0.1"], listening
    assert handler.shutdown()
