"""Rewind and fork on the disk tier (weights and int8 states in files; with and without the
host cache holding some of them in RAM): bit for bit as in RAM."""
import os

import pytest
import torch

from test_branches import _same, _weights, make  # noqa: F401 - the fixture


@pytest.mark.parametrize("cache_gb", [0, 1])
def test_rewind_and_fork_on_the_disk_tier_are_exact(make, tmp_path, cache_gb):  # noqa: F811
    s = make(snapshot_steps=2, offload_dir=str(tmp_path / "offload"), offload_params=True,
             optimizer_compression="int8", host_cache_gb=cache_gb, name="disk")
    s.train(block=True)
    final = _weights(s)
    snap = s.snapshots[0]
    assert snap.step == 2 and os.listdir(os.path.join(snap.path, "disk"))
    s.rewind(2)
    s.train(block=True)
    _same(_weights(s), final)
    b = s.fork(step=4, name="disk-b")
    b.train(block=True)
    _same(_weights(b), final)
