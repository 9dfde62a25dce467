"""The ranks' run control takes "snapshot" and "rewind" (issue 21, item 3): with 2 gloo ranks a
snapshot at step 2 (each rank its shard; on the disk tier its files hard-linked), training on to
4, a rewind to 2 and training to 4 again land on the uninterrupted run's weights and optimizer
states, bit for bit, on every rank; in RAM and with weights and int8 states on the disk tier."""
import json
from pathlib import Path

import pytest
import torch

from .launch import check, torchrun

HERE = Path(__file__).parent


VARIANTS = ["ram", "disk_int8"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both variants' runs, in one launch of 2 ranks (w_rewind.py: each into its own folder)."""
    out = tmp_path_factory.mktemp("rewind-ranks")
    check(torchrun(HERE / "w_rewind.py", str(out), ",".join(VARIANTS), nproc=2, timeout=400))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_snapshot_then_rewind_on_every_rank_is_bit_exact(runs, variant):
    tmp_path = runs / variant
    for rank in range(2):
        full = torch.load(tmp_path / f"full-rank{rank}.pt")
        back = torch.load(tmp_path / f"rewind-rank{rank}.pt")
        assert full["steps"] == [1, 2, 3, 4] and back["steps"] == [1, 2, 3, 4, 3, 4]
        assert back["events"] == [{"kind": "snapshot", "step": 2}, {"kind": "rewind", "step": 4}]
        assert back["lineage"]["forked_at_step"] == 2 and back["lineage"]["parent_run_id"]
        assert full["weights"].keys() == back["weights"].keys() and full["weights"]
        for unit in full["weights"]:
            assert torch.equal(full["weights"][unit], back["weights"][unit]), (rank, unit)
            assert full["states"][unit].keys() == back["states"][unit].keys()
            for k in full["states"][unit]:
                assert torch.equal(full["states"][unit][k], back["states"][unit][k]), (rank, unit, k)
        if variant == "disk_int8":   # states in their int8 form; every unit's two files linked, none copied
            assert any(k.endswith(".codes") for s in full["states"].values() for k in s)
            n_units = len(full["weights"])
            assert back["links"] == {"files": 2 * n_units, "shared": 2 * n_units}
        else:
            assert back["links"] == {"files": 0, "shared": 0}
    snap = next((tmp_path / "rewind" / "snapshots").iterdir())
    assert sorted(p.name for p in snap.glob("rank-*")) == ["rank-00000-of-00002", "rank-00001-of-00002"]
    listed = json.loads((snap / "manifest.json").read_text())["files"]
    assert "rank-00001-of-00002/ram_state.safetensors" in listed and not any("/disk/" in n for n in listed)
    log = [json.loads(x) for x in (tmp_path / "rewind" / "metrics.jsonl").read_text().splitlines()]
    starts = [r for r in log if r.get("event") == "run_start"]
    assert [s["step"] for s in starts] == [0, 2] and starts[1]["resumed_from"] == str(snap)
    assert starts[1]["parent_run_id"] == starts[0]["run_id"] != starts[1]["run_id"]
    # the abandoned steps 3 and 4 stay in the log under the first run's id
    steps = [(r["run_id"], r["step"]) for r in log if "loss" in r and "event" not in r]
    first, branch = starts[0]["run_id"], starts[1]["run_id"]
    assert steps == [(first, 1), (first, 2), (first, 3), (first, 4), (branch, 3), (branch, 4)]
