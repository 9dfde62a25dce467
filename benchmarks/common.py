"""Shared helpers for the benchmark scripts (machine facts, RSS, medians, RESULT lines)."""
from __future__ import annotations

import os
import platform
import resource
import shutil
import statistics


def machine() -> str:
    try:
        import psutil

        ram = psutil.virtual_memory().total / 1024 ** 3
    except Exception:
        ram = float("nan")
    disk = shutil.disk_usage(os.getcwd())
    return (f"{platform.machine()} {os.cpu_count()} cores, {ram:.0f} GiB RAM, disk {disk.total / 1024 ** 3:.0f} GiB "
            f"({disk.free / 1024 ** 3:.0f} free), python {platform.python_version()}")


def peak_rss_bytes() -> int:
    """Peak resident set size of this process as the OS saw it (ru_maxrss)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> bool:
    """Start the peak-RSS mark (VmHWM) afresh (Linux: /proc/self/clear_refs), so a peak read after
    it is the work's own, not what came before (the model's construction); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def hwm_bytes() -> int:
    """The peak RSS since the last reset_peak_rss() (VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def current_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def median(xs):
    return statistics.median(xs)


def result(name: str, value: float, unit: str, op: str, target: float) -> str:
    line = f"RESULT {name} {value:.4g} {unit} (target {op} {target:g})"
    print(line, flush=True)
    return line
