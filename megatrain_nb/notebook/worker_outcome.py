"""How a run in worker processes ended (``remote.ProcessRun``): the ranks' reports, the first
rank to fail and what the others did as a consequence, torchrun's agent report."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

from megatrain_nb.channel.protocol import read_json

from .rank_watch import first_failure


class WorkerError(RuntimeError):
    """A worker process failed; ``rank`` names it, ``remote_traceback`` is its traceback."""

    def __init__(self, message: str, rank: Optional[int] = None, exc_type: Optional[str] = None,
                 remote_traceback: Optional[str] = None):
        super().__init__(message)
        self.rank, self.exc_type, self.remote_traceback = rank, exc_type, remote_traceback


def rank_errors(run_dir: Path) -> list[dict]:
    """The ``error-<rank>.json`` reports in the launch folder, oldest first."""
    errs = [read_json(p) for p in sorted(run_dir.glob("error-*.json"))]
    return sorted((e for e in errs if isinstance(e, dict)), key=lambda e: e.get("time", 0))


def rank_reports(run_dir: Path) -> list[dict]:
    """Each rank's ``rank-<rank>.json`` report (outcome, steps, commands applied), by rank."""
    ranks = [r for r in (read_json(p) for p in sorted(run_dir.glob("rank-*.json"))) if isinstance(r, dict)]
    return sorted(ranks, key=lambda r: r.get("rank", 0))


def launched_outcome(rc: int, run_dir: Path, ranks: list[dict], watch: Any, tail: str) -> str:
    """"finished" or "stopped" from the agent's exit code ``rc`` and the ranks' reports, else
    :class:`WorkerError` naming the first rank that failed."""
    errors = rank_errors(run_dir)
    if rc == 0 and not errors:
        return "stopped" if any(r.get("outcome") == "stopped" for r in ranks) else "finished"
    # The first rank to fail is the cause, the others' errors (a collective failing on a
    # peer's death) its consequences. A rank that died without a word left no file: the
    # watch saw it go, torchrun's agent reports its exit code (the agent's own SIGTERM to
    # the rest, -15, is not a failure).

    reported = {e.get("rank") for e in errors} | {r.get("rank") for r in ranks}
    codes = agent_failures(tail)
    silent = {}
    for rank in (set(codes) | set(watch.gone_at)) - reported:
        code = codes.get(rank)
        if code in ("-15", "0"):
            continue
        silent[rank] = {"pid": watch.pids.get(rank), "exit_code": code,
                        "gone_at": watch.gone_at.get(rank), "memory": watch.memory_before.get(rank)}
    rank, how, then = first_failure(errors, silent)
    if rank is not None:
        err = next((e for e in errors if e.get("rank") == rank), None)
        after = ("\nthen, as a consequence: " + "; ".join(then)) if then else ""
        detail = (f"\n--- rank {rank}'s traceback ---\n{err.get('traceback', '')}" if err is not None
                  else f"\n--- the workers' last output ---\n{tail}")
        raise WorkerError(f"{how}{after}{detail}", rank=rank, exc_type=err.get("type") if err else None,
                          remote_traceback=err.get("traceback") if err else None)
    raise WorkerError(f"the worker processes ended with exit code {rc} and no rank reported an error; their "
                      f"last output:\n{tail}")


def attached_outcome(name: str, pid: Any, *, stop_seen: bool, ended_by: Optional[str]) -> str:
    """How an attached torchrun job ended, once its rank 0 is gone."""
    if stop_seen and ended_by:
        return "stopped"
    if ended_by:
        return "finished"
    raise WorkerError(f"run {name!r}: rank 0 (pid {pid}) ended without finishing "
                      "(see the torchrun job's output for the error)", rank=0)


def root_cause(agent_output: str) -> tuple[Optional[int], Optional[str]]:
    """(rank, exit code) of the first failure torchrun's agent reports ("Root Cause" block), or
    (None, None): how a rank that died without a word (a signal, ``os._exit``) is named."""
    m = re.search(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", agent_output, re.S)
    return (int(m.group(1)), m.group(2)) if m else (None, None)


def agent_failures(agent_output: str) -> dict[int, str]:
    """{rank: exit code} of every failure in torchrun's agent report."""
    return {int(r): c for r, c in re.findall(r"rank\s*:\s*(\d+) \(local_rank.*?\n\s*exitcode\s*:\s*(-?\d+)",
                                            agent_output)}
