"""Sockets on the loopback interface: whether a host is loopback, a ``TCPStore`` server bound to
127.0.0.1 only, and the environment that puts gloo's and NCCL's sockets on ``lo``. Shared by the
launcher (:mod:`megatrain_nb.torchrun`) and the engine's process group (``engine/ranks/dist.py``), so
that the engine does not import the launcher above it.
"""
from __future__ import annotations

import datetime
import ipaddress
import os
import socket
from typing import Optional

LOOPBACK = "127.0.0.1"
LOOPBACK_IFNAME = "lo"


def is_loopback(host: Optional[str]) -> bool:
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def loopback_store(port: int = 0, *, world_size: Optional[int] = None, timeout_s: float = 600.0):
    """A ``TCPStore`` server listening on 127.0.0.1 only (``port`` 0: a free one), registered as
    the process's multi-tenant server for its port, so a later ``TCPStore(..., is_master=True,
    multi_tenant=True)`` on that port in this process (torchrun's agent, ``init_process_group``)
    reuses it. Keep the returned store alive as long as the run."""
    from torch.distributed import TCPStore

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((LOOPBACK, int(port)))
        sock.listen(128)
        bound = sock.getsockname()[1]
        store = TCPStore(LOOPBACK, bound, world_size, True, datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False, multi_tenant=True, master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()   # the server listens on this very descriptor from now on: never close it here
    return store


def loopback_env(env: Optional[dict] = None) -> dict:
    """The environment variables that put the workers' collective sockets on the loopback
    interface (``lo``; ``lo0`` on macOS), unless they are set already."""
    env = os.environ if env is None else env
    try:
        names = {name for _, name in socket.if_nameindex()}
    except OSError:
        names = set()
    ifname = next((n for n in (LOOPBACK_IFNAME, "lo0") if n in names), None)
    if ifname is None:
        return {}
    return {name: ifname for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if not env.get(name)}
