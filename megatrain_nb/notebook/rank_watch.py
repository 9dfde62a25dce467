"""Which rank of a multi-process Session failed first, and how.

When one rank dies, the others fail in their next collective ("Connection reset by peer"),
and each writes its error: the first error file is then a consequence, not the cause. So the
controller watches the ranks themselves (each writes ``pid-<rank>.json`` when it starts):
every poll it notes which are alive, and how close the machine's memory is to its limit (the
lower of RAM and the cgroup's ``memory.max``), so that a rank that vanished without a word is
known, with the time it was first seen gone and the memory just before. At the end,
:func:`first_failure` orders the silent deaths and the reported errors and names the first:

- killed by a signal (torchrun's report gives ``exitcode: -9``): "killed (signal 9, SIGKILL)",
  with "— out of memory?" when memory was near its limit just before (the kernel's OOM killer
  sends exactly that signal);
- an exception: its type and message;

then what the other ranks did as a consequence.
"""
from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Optional

from megatrain_nb.channel.protocol import read_json
from megatrain_nb.processes import pid_alive

#: memory in use over this fraction of its limit at a rank's last sample: an OOM kill is likely
NEAR_LIMIT = 0.9
#: a silent death first seen up to this long after another rank's error still counts as first:
#: the poll that sees a process gone runs every 0.1 s, the survivors' collectives fail at once
SEEN_LATE_S = 2.0


def pid_file(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / f"pid-{rank}.json"


def memory_fraction() -> Optional[float]:
    """Memory in use over its limit: the machine's RAM, or the cgroup's ``memory.max`` when
    that is lower (a container); None when it cannot be read."""
    import psutil

    fracs = []
    try:
        vm = psutil.virtual_memory()
        fracs.append((vm.total - vm.available) / vm.total)
    except Exception:  # noqa: BLE001 - not knowing is an answer
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            fracs.append(used / int(limit))
    except (OSError, ValueError):
        pass
    return max(fracs) if fracs else None


class RankWatch:
    """Polled by the controller while the workers run; see the module docstring."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.pids: dict[int, int] = {}
        self.gone_at: dict[int, float] = {}       # rank -> when first seen gone
        self.memory_before: dict[int, Optional[float]] = {}   # rank -> memory fraction at its last sight
        self._memory: Optional[float] = None

    def poll(self) -> None:

        for p in self.run_dir.glob("pid-*.json"):
            rec = read_json(p)
            if isinstance(rec, dict) and isinstance(rec.get("rank"), int) and isinstance(rec.get("pid"), int):
                self.pids.setdefault(rec["rank"], rec["pid"])
        alive = [r for r in self.pids if r not in self.gone_at]
        if not alive:
            return
        now = time.time()
        for rank in alive:
            if pid_alive(self.pids[rank]) is False:
                self.gone_at[rank] = now
                self.memory_before[rank] = self._memory
        self._memory = memory_fraction()


def describe_death(rank: int, pid: Optional[int], exit_code: Optional[str], memory: Optional[float]) -> str:
    """How a rank that left no error ended, in words."""
    who = f"rank {rank}" + (f" (pid {pid})" if pid else "")
    try:
        code = int(exit_code) if exit_code is not None else None
    except ValueError:
        code = None
    near = memory is not None and memory >= NEAR_LIMIT
    mem = f" (memory was at {memory:.0%} of its limit just before)" if memory is not None else ""
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "an unknown signal"
        if -code == signal.SIGKILL:
            why = " — out of memory?" if near else " from outside the run (a kill -9, or the OOM killer)"
            return f"{who} was killed (signal 9, SIGKILL){why}{mem}"
        return f"{who} was killed by signal {-code} ({name}){mem}"
    if code is not None:
        return f"{who} died (exit code {code}) without raising (killed? out of memory?){mem}"
    return f"{who} vanished without an error (killed? out of memory?){mem}"


def first_failure(errors: list[dict], silent: dict[int, dict]) -> tuple[Optional[int], str, list[str]]:
    """(the first failing rank, how it failed, what the others did after it).

    ``errors``: the error files (``rank``, ``pid``, ``type``, ``message``, ``time``);
    ``silent``: rank -> ``{"pid", "exit_code", "gone_at", "memory"}`` for ranks that ended
    without a file. A silent death first seen no later than :data:`SEEN_LATE_S` after the first
    error is the cause (the others' errors follow from it)."""
    events = []
    for e in errors:
        events.append((float(e.get("time") or 0.0), 1, e.get("rank"),
                       f"rank {e.get('rank')} (pid {e.get('pid')}) failed: {e.get('type')}: {e.get('message')}"))
    for rank, d in silent.items():
        t = d.get("gone_at")
        t = float(t) - SEEN_LATE_S if t is not None else float("-inf")
        events.append((t, 0, rank, describe_death(rank, d.get("pid"), d.get("exit_code"), d.get("memory"))))
    if not events:
        return None, "", []
    events.sort(key=lambda e: (e[0], e[1], e[2] if e[2] is not None else -1))
    _, _, rank, how = events[0]
    then = [text for _, _, r, text in events[1:] if r != rank]
    return rank, how, then
