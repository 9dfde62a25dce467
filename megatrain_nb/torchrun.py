"""``python -m megatrain_nb.torchrun``: torchrun for one machine, every socket on loopback.

torchrun's rendezvous store (a ``TCPStore``, in the agent process ``pt_elastic``) listens on
every interface (``::``) whatever ``--master-addr`` says, and has no authentication: anyone who
reaches the port can read and write the run's keys. On one machine nothing needs to reach it
from outside, so this wrapper takes the arguments torchrun takes and, for a single-node launch:

- binds the store's socket to 127.0.0.1 itself and hands it to a ``TCPStore`` server
  (``master_listen_fd``) created as ``multi_tenant`` before torchrun starts: the agent's own
  store on that port, in the same process, is then this server (torch keeps one server per port
  per process) instead of a new one on ``::``;
- with the c10d rendezvous (what restarts need, see docs/DISTRIBUTED.md), the workers host their own
  store (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, set here) at ``--local-addr 127.0.0.1``:
  each worker starts through :mod:`megatrain_nb.torchrun_boot`, which binds rank 0's store to
  loopback the same way before the script runs (so a script that builds ``TrainingArguments``
  first, which initialises the group through accelerate, cannot open one on every interface;
  ``--no-python`` and ``--run-path`` run the program as given, without that guard);
- the workers' gloo (and NCCL bootstrap) sockets go on the loopback interface
  (``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME=lo`` unless set).

Then it runs torch's own ``torch.distributed.run.main``. A multi-node launch (``--nnodes`` > 1)
is passed through unchanged: its ports must be reachable by the other nodes, so they belong on a
private network (docs/DISTRIBUTED.md, "Several machines").

    python -m megatrain_nb.torchrun --nproc-per-node 2 train.py
"""
from __future__ import annotations

import os
import sys
from typing import Optional

from megatrain_nb.loopback import LOOPBACK, is_loopback, loopback_env, loopback_store

_C10D_DEFAULT_PORT = 29400


def _single_node(nnodes: Optional[str]) -> bool:
    return all(x.strip() == "1" for x in str(nnodes or "1").split(":"))


def loopback_argv(argv: list[str]) -> tuple[list[str], Optional[object], dict]:
    """(torchrun's arguments, the store to keep alive, environment to add) for ``argv``; for a
    multi-node launch ``argv`` unchanged, no store, no environment. Read with torchrun's own
    parser; the settings that put the rendezvous on loopback are added right before the script
    (torchrun takes the last value given)."""
    from torch.distributed.run import get_args_parser

    ns = get_args_parser().parse_args(argv)
    if not _single_node(ns.nnodes):
        return argv, None, {}
    at = len(argv) - len(ns.training_script_args) - 1    # where the script (or module) starts
    head = [a for a in argv[:at] if a != "--standalone"]
    backend = "c10d" if ns.standalone else ns.rdzv_backend
    env = loopback_env()
    if backend == "static":
        if not is_loopback(ns.master_addr):
            raise SystemExit(f"megatrain_nb.torchrun: --master-addr {ns.master_addr} is not a loopback address; a "
                             "single-node launch listens on 127.0.0.1 only (several machines: use torchrun)")
        store = loopback_store(int(ns.master_port or 0))
        extra = [f"--master-addr={LOOPBACK}", f"--master-port={store.port}"]
    elif backend == "c10d":
        port = 0
        if ns.rdzv_endpoint and not ns.standalone:
            host, _, p = ns.rdzv_endpoint.rpartition(":")
            if not is_loopback(host or LOOPBACK):
                raise SystemExit(f"megatrain_nb.torchrun: --rdzv-endpoint {ns.rdzv_endpoint} is not on loopback; a "
                                 "single-node launch listens on 127.0.0.1 only (several machines: use torchrun)")
            port = int(p or _C10D_DEFAULT_PORT)
        store = loopback_store(port)
        # the workers then host their own store at --local-addr, bound to loopback by rank 0
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        extra = ["--nnodes=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={LOOPBACK}:{store.port}",
                 f"--local-addr={LOOPBACK}"]
        if not (ns.no_python or ns.run_path):   # rank 0's store bound to loopback before the script runs
            head = [a for a in head if a not in ("-m", "--module")]
            boot = ["-m", "megatrain_nb.torchrun_boot"] + (["--module"] if ns.module else [])
            return head + extra + boot + argv[at:], store, env
    else:
        raise SystemExit(f"megatrain_nb.torchrun: --rdzv-backend {backend}: use static (the default) or c10d")
    return head + extra + argv[at:], store, env


def log_dir_argv(argv: list[str]) -> tuple[list[str], Optional[str]]:
    """torchrun makes a ``torchelastic_*`` folder in the temporary folder for every launch and
    leaves it there. Without a ``--log-dir`` (or ``PET_LOG_DIR``) given, its logs go into a
    launch folder of this process instead (removed at the end; one a killed launch leaves is
    reclaimed as the notebook's launch folders are, ``engine/reclaim.py``). Returns (arguments,
    the folder made or None)."""
    if os.environ.get("PET_LOG_DIR") or any(a.split("=")[0] in ("--log-dir", "--log_dir") for a in argv):
        return argv, None
    import tempfile

    from megatrain_nb.engine.reclaim import folder_prefix

    path = tempfile.mkdtemp(prefix=folder_prefix(LAUNCH_LABEL))
    return [f"--log-dir={path}"] + argv, path


#: the label of launch folders (notebook/launch_spec.py's RUN_DIR_LABEL; reclaimed alike)
LAUNCH_LABEL = "launch-"


def main(argv: Optional[list[str]] = None) -> None:
    import shutil

    argv = list(sys.argv[1:] if argv is None else argv)
    args, store, env = loopback_argv(argv)
    args, log_dir = log_dir_argv(args)
    os.environ.update(env)
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(args)
    finally:
        del store
        if log_dir is not None:
            shutil.rmtree(log_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
