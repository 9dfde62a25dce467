"""A rank that raises or dies mid-step: the other stops within a bound, and the run's error
names the failed rank (torchrun's agent tears the group down; the collectives' own timeout
bounds the wait where no agent does)."""
import time
from pathlib import Path

import pytest

from .launch import torchrun

HERE = Path(__file__).parent


@pytest.mark.parametrize("mode", ["raise", "exit"])
def test_failed_rank_stops_the_run(mode):
    t0 = time.monotonic()
    proc = torchrun(HERE / "w_fail.py", mode, nproc=2, timeout=120, dist_timeout_s=30)
    took = time.monotonic() - t0
    assert proc.returncode != 0
    assert took < 60, f"the surviving rank took {took:.0f}s to stop"
    err = proc.stderr
    assert "rank      : 1" in err or "local_rank: 1" in err, err[-3000:]
    if mode == "raise":
        assert "boom in rank 1 at step 3" in err
    else:
        assert "exitcode  : 9" in err


def test_stuck_rank_times_out_the_others():
    """A rank that hangs (alive, never reaching the collective): the others' wait ends at the
    group's timeout (MEGATRAIN_DIST_TIMEOUT_S) with an error, and the agent stops the run."""
    t0 = time.monotonic()
    proc = torchrun(HERE / "w_fail.py", "hang", nproc=2, timeout=120, dist_timeout_s=8)
    took = time.monotonic() - t0
    assert proc.returncode != 0 and took < 60, (proc.returncode, took)
    err = proc.stderr.lower()
    assert "rank      : 0" in proc.stderr and ("timed out" in err or "timeout" in err), proc.stderr[-3000:]
