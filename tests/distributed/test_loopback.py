"""Single-node launches listen on loopback only: every listening socket of the run's process
tree (torchrun's agent and its rendezvous store, the workers' gloo sockets, a store rank 0 hosts)
is on 127.0.0.1 / ::1. torchrun's own store would listen on every interface, unauthenticated."""
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from .launch import REPO, free_port

HERE = Path(__file__).parent
BOUND = 90


def listening(root_pid: int) -> list[tuple[str, str, int]]:
    """(process name, address, port) of every listening TCP socket of ``root_pid`` and its descendants."""
    root = psutil.Process(root_pid)
    pids = {root.pid} | {c.pid for c in root.children(recursive=True)}
    out = []
    for c in psutil.net_connections("tcp"):
        if c.pid in pids and c.status == psutil.CONN_LISTEN:
            try:
                name = psutil.Process(c.pid).name()
            except psutil.Error:
                name = "?"
            out.append((name, c.laddr.ip, c.laddr.port))
    return out


def _loopback(ip: str) -> bool:
    import ipaddress

    return ipaddress.ip_address(ip.split("%")[0]).is_loopback


def _env():
    e = dict(os.environ)
    e.update({"PYTHONPATH": f"{REPO}{os.pathsep}{e.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1",
              "MEGATRAIN_DIST_TIMEOUT_S": "60", "PYTHONWARNINGS": "ignore"})
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"):
        e.pop(name, None)
    return e


def _run_and_list(tmp_path, launcher_args, mode=""):
    cmd = [sys.executable, "-m", "megatrain_nb.torchrun", "--nproc-per-node=2", *launcher_args,
           "--monitor-interval=0.2", str(HERE / "w_listen.py"), str(tmp_path), mode]
    env = _env()
    env["TMPDIR"] = str(tmp_path / "tmp")   # where torchelastic would leave its torchelastic_* folders
    (tmp_path / "tmp").mkdir()
    p = subprocess.Popen(cmd, cwd=str(REPO), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        end = time.monotonic() + BOUND
        while not all((tmp_path / f"ready{r}").exists() for r in range(2)):
            assert p.poll() is None, p.stdout.read().decode()[-3000:]
            assert time.monotonic() < end, f"the ranks did not start within {BOUND}s"
            time.sleep(0.1)
        found = listening(p.pid)
        (tmp_path / "listed").write_text("")
        out, _ = p.communicate(timeout=BOUND)
        assert p.returncode == 0, out.decode()[-3000:]
        return found
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["", "args-first"])
@pytest.mark.parametrize("how", [
    [],                                                                      # the static rendezvous
    ["--master-port", "0"],
    ["--rdzv-backend", "c10d", "--rdzv-endpoint", "PORT", "--max-restarts", "1"],   # docs/DISTRIBUTED.md's restart recipe
    ["--standalone"],
], ids=["static", "static-port-0", "c10d", "standalone"])
def test_a_single_node_launch_listens_on_loopback_only(tmp_path, how, mode):
    """``args-first``: the script builds TrainingArguments before anything (issue 33 item 1: rank
    0's store then listened on every interface with c10d / --standalone)."""
    if mode and how == ["--master-port", "0"]:
        pytest.skip("the same rendezvous as the static case")
    how = [f"127.0.0.1:{free_port()}" if a == "PORT" else a for a in how]
    found = _run_and_list(tmp_path, how, mode)
    assert any(name == "pt_elastic" or "python" in name for name, _, _ in found), found   # the store is there
    assert len(found) >= 3, found                      # the store, and each rank's gloo socket
    assert all(_loopback(ip) for _, ip, _ in found), found
    left = [p.name for p in (tmp_path / "tmp").iterdir() if p.name.startswith(("torchelastic_", "megatrain-"))]
    assert not left, f"the launch left {left} in the temporary folder"   # issue 33 item 8


@pytest.mark.slow
def test_the_notebook_launcher_listens_on_loopback_only(tmp_path, monkeypatch):
    import megatrain_nb as mt

    monkeypatch.setenv("MEGATRAIN_NB_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("PYTHONPATH", f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MEGATRAIN_DIST_TIMEOUT_S", "30")
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(name, raising=False)
    sys.path.insert(0, str(REPO / "tests"))
    from trainer.helpers import args, micro_model, token_dataset

    before = {c.pid for c in psutil.Process().children(recursive=True)}
    s = mt.Session(micro_model(), train_dataset=token_dataset(64), nproc_per_node=2, device="cpu",
                   args=args(tmp_path / "out", max_steps=100000))
    s.train()
    try:
        end = time.monotonic() + BOUND
        while s.step < 2:
            assert s.state != "failed" and time.monotonic() < end, (s.state, s.worker_log[-2000:])
            time.sleep(0.1)
        found = []
        for child in psutil.Process().children():
            if child.pid not in before:
                found += listening(child.pid)
        assert len(found) >= 3, found
        assert all(_loopback(ip) for _, ip, _ in found), found
    finally:
        s.stop(wait=True)
        s.close()


def test_the_wrapper_rewrites_single_node_arguments_and_passes_multi_node_through():
    from megatrain_nb.torchrun import loopback_argv

    args, store, env = loopback_argv(["--nproc-per-node", "2", "train.py", "--lr", "1"])
    assert args == ["--nproc-per-node", "2", "--master-addr=127.0.0.1", f"--master-port={store.port}",
                    "train.py", "--lr", "1"]
    assert env.get("GLOO_SOCKET_IFNAME") in ("lo", "lo0", None)
    probe = [c for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN
             and c.laddr.port == store.port]
    assert [c.laddr.ip for c in probe] == ["127.0.0.1"], probe   # the store listens here, on loopback only
    del store
    # --standalone / c10d: the one-node rendezvous (no pickles; its loopback store made per attempt)
    args, store, env = loopback_argv(["--nproc-per-node=2", "--standalone", "-m", "pkg.mod", "RUN"])
    assert "--standalone" not in args and "--rdzv-backend=megatrain-loopback" in args and store is None
    assert args[-2:] == ["pkg.mod", "RUN"] and args.count("-m") == 1
    args, store, env = loopback_argv(["--nproc-per-node=2", "--rdzv-backend", "c10d", "train.py", "--x"])
    assert args[-3:] == ["--rdzv-endpoint=127.0.0.1:0", "train.py", "--x"]
    multi = ["--nnodes", "2", "--node-rank", "0", "--master-addr", "10.0.0.1", "t.py"]
    assert loopback_argv(multi) == (multi, None, {})
    with pytest.raises(SystemExit, match="not a loopback address"):
        loopback_argv(["--master-addr", "10.0.0.1", "t.py"])
