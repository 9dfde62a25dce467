"""Snapshots with 2 gloo ranks: each rank snapshots its shard at the same step, and going back
to it lands on the weights of the uninterrupted run, bit for bit."""
from pathlib import Path

import pytest
from safetensors.torch import load_file

from .launch import check, torchrun

HERE = Path(__file__).parent


@pytest.mark.slow
def test_two_ranks_rewind_to_a_snapshot_exactly(tmp_path):
    check(torchrun(HERE / "w_snapshot.py", str(tmp_path / "full"), "full", nproc=2, timeout=300))
    check(torchrun(HERE / "w_snapshot.py", str(tmp_path / "snap"), "snap", nproc=2, timeout=300))
    snaps = list((tmp_path / "snap" / "snapshots").iterdir())
    assert len(snaps) == 1 and sorted(f.name for f in snaps[0].glob("rank-*")) == ["rank-00000-of-00002", "rank-00001-of-00002"]
    a = load_file(tmp_path / "full" / "final" / "model.safetensors")
    b = load_file(tmp_path / "snap" / "final" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert (a[k] == b[k]).all(), k
