"""Rank 0's store bound to 127.0.0.1 before a script runs, for a torchrun launch whose workers
host their own store (torch's c10d rendezvous with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, as
plain ``torchrun`` may be run). Whatever the script builds first (``TrainingArguments``
initialises the process group through accelerate; ``Dist.from_env``; a plain
``init_process_group``), torch's env:// rendezvous then finds this process's multi-tenant server
on the port and uses it, where it would otherwise start one listening on every interface.

``megatrain_nb.torchrun`` no longer starts workers through it: its single-node launches never
run the c10d rendezvous (it unpickles its state from the store), and in the static and the
``megatrain-loopback`` rendezvous the agent hosts the store, on loopback, and the workers join it.

    python -m megatrain_nb.torchrun_boot [--module] SCRIPT_OR_MODULE [ARGS...]
"""
from __future__ import annotations

import os
import runpy
import sys

from megatrain_nb.engine.ranks.dist import default_timeout_s, loopback_rendezvous

_STORE = None   # kept alive for the process's life: the group's rendezvous store


def host_loopback_store() -> None:
    """Rank 0, MASTER_ADDR on loopback, not a client of the agent's store: bind the store now."""
    global _STORE
    if _STORE is None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        _STORE = loopback_rendezvous(default_timeout_s())


def main(argv: list[str]) -> None:
    module = bool(argv) and argv[0] == "--module"
    if module:
        argv = argv[1:]
    if not argv:
        raise SystemExit("usage: python -m megatrain_nb.torchrun_boot [--module] SCRIPT_OR_MODULE [ARGS...]")
    host_loopback_store()
    target = argv[0]
    sys.argv = list(argv)
    if module:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:   # as `python script.py`: the script's folder first on the path
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
