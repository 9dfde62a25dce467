"""on_nonfinite="rewind" with 2 gloo ranks: every rank recovers at the same boundary, twice, ends
all its steps with finite weights, and the same run again lands on the same weights."""
from pathlib import Path

import pytest
import torch

from .launch import check, torchrun

HERE = Path(__file__).parent


@pytest.mark.slow
def test_every_rank_recovers_at_the_same_step_reproducibly(tmp_path):
    check(torchrun(HERE / "w_recover.py", str(tmp_path), nproc=2, timeout=300))
    got = {(run, r): torch.load(tmp_path / f"{run}-rank{r}.pt") for run in "ab" for r in range(2)}
    for (run, r), res in got.items():
        assert res["step"] == 8, (run, r)
        # (rows 3 and 9: steps 2 and 4, the windows after a skipped one come a step sooner)
        assert [x["step"] for x in res["recoveries"]] == [2, 4], (run, r, res["recoveries"])
        assert all(bool(torch.isfinite(w).all()) for w in res["weights"].values())
    for r in range(2):
        a, b = got[("a", r)], got[("b", r)]
        assert all(torch.equal(a["weights"][u], b["weights"][u]) for u in a["weights"]), r
    assert got[("a", 0)]["run_id"] == got[("a", 1)]["run_id"]
