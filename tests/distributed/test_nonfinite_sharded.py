"""Data parallel without clipping: a NaN confined to one rank's gradient shard. Every rank must
take the same decision -- never one rank applying a step another dropped, never a collective
timeout: under on_nonfinite="skip" all ranks skip the whole step (its updates wait for the
global norm); under "stop" the ranks vote per unit as each gradient becomes final (the updates
still overlap the backward), so every rank stops at the same unit with the same error, as one
process does -- including rank 0, whose own shard was finite."""
import time
from pathlib import Path

import pytest
import torch

from .launch import check, torchrun

HERE = Path(__file__).parent


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


POLICIES = ["skip", "stop"]   # (stop last: its engine ends refusing, as the launch ends)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both policies' engines, one after the other in one launch of 2 ranks: its folder, and how
    long it took."""
    out = tmp_path_factory.mktemp("nonfinite")
    t0 = time.monotonic()
    proc = torchrun(HERE / "w_nonfinite.py", str(out), ",".join(POLICIES), nproc=2, timeout=150, dist_timeout_s=30)
    check(proc)
    return out, time.monotonic() - t0


@pytest.mark.parametrize("policy", POLICIES)
def test_a_nan_in_one_ranks_shard_stops_or_skips_every_rank_alike(runs, policy):
    tmp_path, took = runs
    assert took < 120
    r = [torch.load(tmp_path / f"nonfinite-{policy}-rank{k}.pt") for k in range(2)]
    for k in range(2):
        w = r[k]["weights"]
        assert _same(w[0], r[0]["weights"][0])            # ranks see one model
        if policy == "skip":
            assert _same(w[1], w[0]), f"rank {k}: step 2 moved the weights"
            assert r[k]["error"] is None
            assert r[k]["skipped"] == [False, True, False], (k, r[k]["skipped"])
            assert r[k]["skipped_steps"] == 1
            assert not _same(w[2], w[1])                  # step 3 applied again, on both ranks
            assert _same(w[2], r[0]["weights"][2])
        else:
            # the NaN is in model.layers.0, late in the backward: the units before it were updated
            # (as in one process without clipping); the error says so, and the weights are refused
            assert len(w) == 1, f"rank {k}: weights read after the stopped step"
            assert "non-finite loss/gradient at step 2 (in the gradient of model.layers.0)" in r[k]["error"], \
                r[k]["error"]
            assert "refuses to go on until load_checkpoint()" in r[k]["error"]
    if policy == "stop":
        assert r[0]["error"] == r[1]["error"]
