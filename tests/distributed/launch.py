"""Run a script on N local ranks with torchrun (gloo, 127.0.0.1), every wait bounded."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def argument_groups(argv: list) -> list:
    """A worker script's several runs in one process (one launch): their argument lists, separated
    by ``--`` on its command line (``OUT ... -- OUT ...``; an empty list is left out)."""
    groups: list = [[]]
    for arg in argv:
        if arg == "--":
            groups.append([])
        else:
            groups[-1].append(arg)
    return [g for g in groups if g]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: Path, *args: str, nproc: int = 2, timeout: float = 180, env: dict | None = None,
             dist_timeout_s: float = 60, max_restarts: int = 0) -> subprocess.CompletedProcess:
    """``python -m megatrain_nb.torchrun --nproc-per-node N`` (torchrun, on loopback). The collectives'
    own timeout (MEGATRAIN_DIST_TIMEOUT_S) is well under ``timeout``, so a stuck rank fails
    the run with an error before the subprocess bound kills it."""
    e = dict(os.environ)
    e.update({"PYTHONPATH": f"{REPO}{os.pathsep}{e.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1",
              "MEGATRAIN_DIST_TIMEOUT_S": str(dist_timeout_s), "HF_HUB_OFFLINE": "1",
              "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONWARNINGS": "ignore"})
    e.update(env or {})
    # Restarts: the c10d rendezvous, and a fresh TCPStore per attempt (TORCH_DISABLE_SHARE_RDZV_TCP_STORE):
    # in the agent's shared store the restarted ranks read the first attempt's keys, so a new
    # rank connects to a dead peer's address (docs/DISTRIBUTED.md, "When a rank fails").
    where = ([f"--master-addr=127.0.0.1", f"--master-port={free_port()}"] if max_restarts == 0 else
             ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--nnodes=1"])
    if max_restarts:
        e["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    # megatrain_nb.torchrun, as docs/DISTRIBUTED.md's single-node recipes: every socket on loopback
    cmd = [sys.executable, "-m", "megatrain_nb.torchrun", f"--nproc-per-node={nproc}", *where,
           f"--max-restarts={max_restarts}", "--monitor-interval=0.5", str(script), *args]
    try:
        return subprocess.run(cmd, cwd=str(REPO), env=e, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:  # name the bound; the test fails with the output so far
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = (exc.stderr or b"").decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        raise AssertionError(f"torchrun {script.name} ran past {timeout}s\n{out[-3000:]}\n{err[-3000:]}") from None


def two_agents(script: Path, *args: str, timeout: float = 240, dist_timeout_s: float = 60) -> list:
    """Two torchrun agents on localhost, one rank each, as two "nodes" (static rendezvous:
    --nnodes 2 --node-rank 0/1 against one master). Returns both CompletedProcess-like results."""
    e = dict(os.environ)
    e.update({"PYTHONPATH": f"{REPO}{os.pathsep}{e.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1",
              "MEGATRAIN_DIST_TIMEOUT_S": str(dist_timeout_s), "HF_HUB_OFFLINE": "1",
              "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONWARNINGS": "ignore"})
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={n}",
                               "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={port}",
                               "--max-restarts=0", str(script), *args], cwd=str(REPO), env=e,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for n in range(2)]
    out = []
    try:
        for p in procs:
            so, se = p.communicate(timeout=timeout)
            out.append(subprocess.CompletedProcess(p.args, p.returncode, so, se))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def alone(script: Path, *argv: str, timeout: float = 300) -> None:
    """Run a worker ``script`` as one plain process (no torchrun), offline, one thread; it must succeed."""
    p = subprocess.run([sys.executable, str(script), *argv], cwd=str(REPO),
                       env={"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                            "HF_DATASETS_OFFLINE": "1", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1",
                            "PYTHONWARNINGS": "ignore"},
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-3000:]


_ONCE: dict = {}


def alone_once(script: Path, *argv: str, timeout: float = 300) -> Path:
    """The output folder of ``alone(script, OUT, *argv)``, run once in this test process: the tests
    that compare their own runs with the same one-process run share it (an xdist group of their
    own puts them in one worker)."""
    key = (str(script), argv)
    out = _ONCE.get(key)
    if out is None or not out.is_dir():
        out = Path(tempfile.mkdtemp(prefix="one-process-", dir=os.environ.get("MEGATRAIN_NB_TEST_ROOT"))) / "one"
        alone(script, str(out), *argv, timeout=timeout)
        _ONCE[key] = out
    return out


#: every run of engine_flow.py that a module-scoped ``two_ranks`` fixture reads (test_engine_sharded's
#: cases, test_sharded_window_disk's variants, test_estimate_sharded's runs): one two-rank launch
#: makes them all (each run seeds its own model and data: what it gives does not depend on the
#: others in the launch), where each module launched its own and three runs were made twice
ENGINE_FLOW_RUNS = ("adamw", "clip_wd", "tied_clip_wd", "tied", "int8", "moe",
                    "clip_wd+window", "tied_clip_wd+window", "clip_wd+params_on_disk",
                    "clip_wd+window+params_on_disk", "int8+params_on_disk",
                    # and the sharded checkpoints' two-rank sides (test_checkpoint_sharded's, and
                    # test_sharded_window_disk's of master weights on the disk tier): written by the
                    # 2 ranks, and resumed by them from one written by one process
                    "save=clip_wd", "resume=clip_wd", "save=clip_wd+params_on_disk",
                    "resume=clip_wd+params_on_disk",
                    # and zero3_flow.py's harness on every one of its cases (test_zero3_flow's)
                    "zero3=adamw", "zero3=clip_wd", "zero3=tied_clip_wd", "zero3=tied", "zero3=int8",
                    "zero3=moe")
#: the xdist group of the tests that read it (so that one worker launches it)
ENGINE_FLOW = "engine-flow"


def engine_flow_runs() -> Path:
    """The output folder of the shared launch (engine_flow_launch)."""
    return engine_flow_launch()[0]


def engine_flow_launch() -> tuple:
    """(The output folder, the finished process) of one launch of ``engine_flow.py`` on 2 ranks with every run of
    ENGINE_FLOW_RUNS (``<run>-rank<r>.pt``; ``ckpt-save=<variant>``, the 2 ranks' checkpoints), launched
    once in this test process; before it, this process writes the checkpoints the ranks resume
    (``ckpt-one=<variant>``: the first 2 steps of the one-process run, accumulation 2A)."""
    from megatrain_nb.engine.ranks.dist import Dist

    from . import engine_flow

    key = ("engine_flow", ENGINE_FLOW_RUNS)
    done = _ONCE.get(key)
    if done is None or not done[0].is_dir():
        out = Path(tempfile.mkdtemp(prefix="engine-flow-", dir=os.environ.get("MEGATRAIN_NB_TEST_ROOT")))
        for run in ENGINE_FLOW_RUNS:
            if run.startswith("resume="):
                case, kw = engine_flow._variant(run.split("=", 1)[1])
                engine_flow.run_engine(Dist.single(), case, 2 * engine_flow.ACC, steps=(0, 2),
                                       save_to=str(out / f"ckpt-one={run.split('=', 1)[1]}"), **kw)
        proc = torchrun(Path(__file__).with_name("engine_flow.py"), str(out), ",".join(ENGINE_FLOW_RUNS),
                        nproc=2, timeout=600, env={"PYTHONFAULTHANDLER": "1"})
        check(proc)
        done = _ONCE[key] = (out, proc)
    return done


def check(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"torchrun failed (rc {proc.returncode})\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"


def controller_env(tmp_path, monkeypatch) -> None:
    """The environment of a test that steers worker processes from this one (a Session with
    ``nproc_per_node``): its own runtime folder, the repo importable, collectives bounded."""
    monkeypatch.setenv("MEGATRAIN_NB_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("PYTHONPATH", f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("MEGATRAIN_DIST_TIMEOUT_S", "30")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONWARNINGS", "ignore")


def until(pred, what: str, bound: float) -> None:
    """Wait (at most ``bound`` seconds, else fail saying for what) until ``pred()``."""
    import time

    end = time.monotonic() + bound
    while not pred():
        assert time.monotonic() < end, f"waited {bound}s for {what}"
        time.sleep(0.05)
