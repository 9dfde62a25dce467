"""Where a folder's bytes land: its filesystem (mount point, type, device) and free space.

The run's header and ``memory_report()["disk"]["filesystem"]`` show it, so a disk tier that
landed on the root disk (an NVMe not mounted: its empty mount point is still there) is seen
before the run fills that disk; the DiskStore refuses a tier that does not fit, with the numbers.

Example::

    >>> from megatrain_nb.engine.tiers.diskspace import filesystem_of
    >>> sorted(filesystem_of("/tmp"))
    ['device', 'free_bytes', 'mount', 'path', 'total_bytes', 'type']
"""
from __future__ import annotations

import functools
import os
import shutil

from megatrain_nb.formatting import fmt_bytes


@functools.lru_cache(maxsize=64)
def _mount_of(real: str) -> tuple[str, str, str]:
    """(mount point, filesystem type, device) of the longest mount point above ``real``."""
    try:
        import psutil

        parts = psutil.disk_partitions(all=True)
    except Exception:  # noqa: BLE001 - no mount table readable: say what we can
        parts = []
    best, best_len = ("/", "?", "?"), -1
    for p in parts:   # the longest mount point above the path; a later mount shadows an earlier one
        mp = p.mountpoint
        if mp == "/" or real == mp or real.startswith(mp.rstrip("/") + "/"):
            n = len(mp.rstrip("/"))
            if n >= best_len:
                best, best_len = (mp, p.fstype or "?", p.device or "?"), n
    return best


def filesystem_of(path) -> dict:
    """``{"path", "mount", "type", "device", "free_bytes", "total_bytes"}`` for ``path`` (an
    existing folder, or the nearest existing folder above it)."""
    real = os.path.realpath(os.path.abspath(os.path.expanduser(os.fspath(path))))
    probe = real
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    mount, kind, device = _mount_of(probe)
    try:
        usage = shutil.disk_usage(probe)
        free, total = int(usage.free), int(usage.total)
    except OSError:
        free = total = None
    return {"path": real, "mount": mount, "type": kind, "device": device, "free_bytes": free, "total_bytes": total}


def filesystem_text(fs: dict) -> str:
    """"on ext4 (/dev/nvme0n1p1) mounted at /nvme, 812.3 GiB free of 1.8 TiB"."""
    free = "free space unknown" if fs.get("free_bytes") is None else \
        f"{fmt_bytes(fs['free_bytes'])} free of {fmt_bytes(fs['total_bytes'])}"
    return f"on {fs['type']} ({fs['device']}) mounted at {fs['mount']}, {free}"
