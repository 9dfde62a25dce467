"""``python -m megatrain_nb.torchrun``: torchrun for one machine, every socket on loopback.

torchrun's rendezvous store (a ``TCPStore``, in the agent process ``pt_elastic``) listens on
every interface (``::``) whatever ``--master-addr`` says, and has no authentication: anyone who
reaches the port can read and write the run's keys. On one machine nothing needs to reach it
from outside, so this wrapper takes the arguments torchrun takes and, for a single-node launch:

- binds the store's socket to 127.0.0.1 itself and hands it to a ``TCPStore`` server
  (``master_listen_fd``) created as ``multi_tenant`` before torchrun starts: the agent's own
  store on that port, in the same process, is then this server (torch keeps one server per port
  per process) instead of a new one on ``::``;
- never torch's dynamic rendezvous (``--standalone``, ``--rdzv-backend c10d``), which
  ``pickle.loads`` the state it reads from that store: any local user can reach a port on
  127.0.0.1 and write it. A launch asking for it, or for restarts (``--max-restarts`` > 0), runs
  on this package's one-node rendezvous instead (``--rdzv-backend megatrain-loopback``,
  :class:`LoopbackRendezvous`): like torch's static one it exchanges no pickles (rank and world
  size are fixed: one node), and each attempt gets a fresh store on 127.0.0.1, so a restarted
  worker never reads the failed attempt's keys (torch's static rendezvous keeps one store);
- the workers' gloo (and NCCL bootstrap) sockets go on the loopback interface
  (``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME=lo`` unless set).

Then it runs torch's own ``torch.distributed.run.main``. A multi-node launch (``--nnodes`` > 1)
is passed through unchanged: its ports must be reachable by the other nodes, so they belong on a
private network, and its c10d rendezvous unpickles what that store holds (docs/PROMISES.md,
"Between ranks"; docs/DISTRIBUTED.md, "Several machines").

    python -m megatrain_nb.torchrun --nproc-per-node 2 train.py
"""
from __future__ import annotations

import os
import sys
from typing import Optional

from torch.distributed.elastic.rendezvous.api import RendezvousHandler, RendezvousInfo, RendezvousStoreInfo

from megatrain_nb.loopback import LOOPBACK, is_loopback, loopback_env, loopback_store
from megatrain_nb.engine.tiers.reclaim import folder_prefix


def _single_node(nnodes: Optional[str]) -> bool:
    return all(x.strip() == "1" for x in str(nnodes or "1").split(":"))


def loopback_argv(argv: list[str]) -> tuple[list[str], Optional[object], dict]:
    """(torchrun's arguments, the store to keep alive, environment to add) for ``argv``; for a
    multi-node launch ``argv`` unchanged, no store, no environment. Read with torchrun's own
    parser; the settings that put the rendezvous on loopback are added right before the script
    (torchrun takes the last value given). A single-node launch never names a dynamic (c10d)
    rendezvous: static without restarts, else :data:`LOOPBACK_BACKEND`."""
    from torch.distributed.run import get_args_parser

    ns = get_args_parser().parse_args(argv)
    if not _single_node(ns.nnodes):
        return argv, None, {}
    at = len(argv) - len(ns.training_script_args) - 1    # where the script (or module) starts
    head = [a for a in argv[:at] if a != "--standalone"]
    backend = "c10d" if ns.standalone else ns.rdzv_backend
    if backend not in ("static", "c10d", LOOPBACK_BACKEND):
        raise SystemExit(f"megatrain_nb.torchrun: --rdzv-backend {backend}: use static (the default) or c10d")
    env = loopback_env()
    if backend == "static" and not int(ns.max_restarts or 0):
        if not is_loopback(ns.master_addr):
            raise SystemExit(f"megatrain_nb.torchrun: --master-addr {ns.master_addr} is not a loopback address; a "
                             "single-node launch listens on 127.0.0.1 only (several machines: use torchrun)")
        store = loopback_store(int(ns.master_port or 0))
        return head + [f"--master-addr={LOOPBACK}", f"--master-port={store.port}"] + argv[at:], store, env
    if backend == "c10d" and ns.rdzv_endpoint and not ns.standalone:
        host = ns.rdzv_endpoint.rpartition(":")[0]
        if not is_loopback(host or LOOPBACK):
            raise SystemExit(f"megatrain_nb.torchrun: --rdzv-endpoint {ns.rdzv_endpoint} is not on loopback; a "
                             "single-node launch listens on 127.0.0.1 only (several machines: use torchrun)")
    # c10d, --standalone or restarts: the one-node rendezvous (a fresh loopback store per attempt,
    # hosted by the agent; nothing unpickled), registered by main() in this process
    extra = ["--nnodes=1", f"--rdzv-backend={LOOPBACK_BACKEND}", f"--rdzv-endpoint={LOOPBACK}:0"]
    return head + extra + argv[at:], None, env


#: this package's one-node rendezvous (registered with torch's handler registry by :func:`main`)
LOOPBACK_BACKEND = "megatrain-loopback"


class LoopbackRendezvous(RendezvousHandler):
    """One node, rank 0 of 1: each attempt (the first, every restart) a new ``TCPStore`` bound to
    127.0.0.1 (:func:`megatrain_nb.loopback.loopback_store`), hosted by the agent, which the
    workers join as clients (``use_agent_store``). Nothing read from the store is unpickled (the
    dynamic c10d rendezvous pickles its state into its store), and a restarted attempt starts on
    a store holding none of the failed one's keys."""

    def __init__(self, run_id: str, timeout_s: float = 600.0):
        self.run_id, self.timeout_s = run_id, timeout_s
        self._store = None

    def get_backend(self) -> str:
        return LOOPBACK_BACKEND

    @property
    def use_agent_store(self) -> bool:
        return True

    def next_rendezvous(self) -> RendezvousInfo:
        from torch.distributed import PrefixStore

        self._store = loopback_store(0, timeout_s=self.timeout_s)   # (the last attempt's is dropped)
        return RendezvousInfo(PrefixStore(self.run_id, self._store), 0, 1,
                              RendezvousStoreInfo(LOOPBACK, self._store.port))

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self.run_id

    def shutdown(self) -> bool:
        self._store = None
        return True


def register_loopback_rendezvous() -> None:
    """Make ``--rdzv-backend megatrain-loopback`` known to torchrun in this process."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as registry

    try:
        registry.register(LOOPBACK_BACKEND, _loopback_handler)
    except ValueError:
        pass   # registered already (by this function)


def _loopback_handler(params) -> LoopbackRendezvous:
    if params.max_nodes != 1:
        raise ValueError(f"--rdzv-backend {LOOPBACK_BACKEND} is for one node (--nnodes 1)")
    timeout = params.config.get("join_timeout", 600)
    return LoopbackRendezvous(params.run_id, float(timeout))


def log_dir_argv(argv: list[str]) -> tuple[list[str], Optional[str]]:
    """torchrun makes a ``torchelastic_*`` folder in the temporary folder for every launch and
    leaves it there. Without a ``--log-dir`` (or ``PET_LOG_DIR``) given, its logs go into a
    launch folder of this process instead (removed at the end; one a killed launch leaves is
    reclaimed as the notebook's launch folders are, ``engine/tiers/reclaim.py``). Returns (arguments,
    the folder made or None)."""
    if os.environ.get("PET_LOG_DIR") or any(a.split("=")[0] in ("--log-dir", "--log_dir") for a in argv):
        return argv, None
    import tempfile


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
    register_loopback_rendezvous()
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(args)
    finally:
        del store
        if log_dir is not None:
            shutil.rmtree(log_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
