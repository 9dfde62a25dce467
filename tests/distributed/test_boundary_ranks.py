"""The step-boundary controller (trainer/boundary.py) on 2 gloo ranks: rank 0's commands reach
every rank at the same boundary, in the same order, with the same effect as in one process."""
import json
from pathlib import Path

from megatrain_nb.engine.ranks.dist import Dist
from megatrain_nb.trainer.boundary import BoundaryControl

from .boundary_parts import Host, Trainer, drive
from .launch import check, torchrun

HERE = Path(__file__).parent


def test_every_rank_applies_rank0s_commands_as_one_process_does(tmp_path):
    trainer, host = Trainer(), Host()
    control = BoundaryControl(trainer, host, dist=Dist.single())
    refused = drive(control, host, main=True)
    one = {"calls": trainer.calls, "events": host.events, "refused": refused}
    kinds = [e["kind"] for e in host.events]
    assert kinds == ["pause", "lr", "checkpoint", "snapshot", "rewind", "resume", "checkpoint", "stop"]
    assert ["set_lr", 2e-3] in trainer.calls and trainer.calls[-1] == ["request_stop"] and control.stopped
    assert "unknown command 'fork'" in refused[0] and "must be a finite number > 0" in refused[1]

    check(torchrun(HERE / "w_boundary.py", str(tmp_path), nproc=2, timeout=120, dist_timeout_s=30))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r, got in enumerate(ranks):
        assert got["calls"] == one["calls"], r
        assert got["events"] == one["events"], r   # the same commands, at the same steps, in the same order
    assert ranks[0]["refused"] == one["refused"] and ranks[1]["refused"] == []
