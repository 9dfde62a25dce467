"""A fork of a multi-process run (issue 21, item 3): the launch spec carries the branch
(``launch_spec.write_spec(..., resume=<snapshot>, branch={...})``) and every worker rank starts
from the snapshot at the same step as that branch. With no change the fork ends on its parent's
weights bit for bit; with another learning rate it follows its own schedule, and its lineage
names the parent and the step."""
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from .launch import REPO, check, torchrun

HERE = Path(__file__).parent
BASE = dict(gradient_accumulation_steps=2, weight_decay=0.1, max_grad_norm=0.5, max_steps=4, seed=7,
            save_strategy="steps", save_steps=2)


def _launch(tmp_path, name, resume=None, branch=None, **changes):
    sys.path.insert(0, str(REPO / "tests"))
    from trainer.helpers import args, micro_model, token_dataset

    from megatrain_nb.notebook.launch_spec import write_spec

    run = tmp_path / f"run-{name}"
    run.mkdir()
    write_spec(run, model=micro_model(), train_dataset=token_dataset(40, masked=True),
               args=args(tmp_path / name, **{**BASE, **changes}), tokenizer=None, eval_dataset=None, seq_len=None,
               loss_fn=None, callbacks=None, engine_options={"device": "cpu"}, resume=resume, branch=branch)
    check(torchrun(HERE / "w_launch.py", str(run), nproc=2, timeout=300,
                   env={"MEGATRAIN_NB_RUNTIME_DIR": str(tmp_path / "runtime")}))
    log = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return load_file(str(tmp_path / name / "model.safetensors")), log


@pytest.mark.slow
def test_fork_of_two_ranks_from_a_snapshot(tmp_path):
    parent, plog = _launch(tmp_path, "parent")
    snap = tmp_path / "parent" / "checkpoint-2"      # a run's checkpoints count as snapshots
    same, slog = _launch(tmp_path, "same", resume=snap, branch={"new_run": True})
    assert parent.keys() == same.keys()
    for k in parent:
        assert torch.equal(parent[k], same[k]), k
    root = [r for r in plog if r.get("event") == "run_start"][0]["run_id"]
    start = [r for r in slog if r.get("event") == "run_start"][0]
    assert start["step"] == 2 and start["parent_run_id"] == root and start["forked_at_step"] == 2
    assert start["run_id"] != root and [r["step"] for r in slog if "loss" in r and "event" not in r] == [3, 4]

    low, llog = _launch(tmp_path, "low", resume=snap, branch={"new_run": True, "rebuild_schedule": True},
                        learning_rate=1e-3)
    assert any(not torch.equal(parent[k], low[k]) for k in parent)
    lr = {r["step"]: r["lr"] for r in plog if "lr" in r and "event" not in r}
    lr_low = {r["step"]: r["lr"] for r in llog if "lr" in r and "event" not in r}
    assert lr_low == pytest.approx({s: lr[s] / 3 for s in (3, 4)}, rel=1e-9)   # 1e-3 against 3e-3, same shape
