"""Checkpoints: exact resume in a new process, crash safety, rotation, and bad resume paths."""
import os
import subprocess
import sys

import pytest
import torch

from megatrain_nb.trainer import CheckpointError, Trainer, latest_checkpoint, list_checkpoints

from .ckpt_job import make_trainer
from .helpers import args, micro_model, token_dataset

JOB = os.path.join(os.path.dirname(__file__), "ckpt_job.py")


def _run_job(*argv, check=True):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, JOB, *map(str, argv)], capture_output=True, text=True, env=env, timeout=300)
    if check and p.returncode != 0:
        raise AssertionError(f"job {argv} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return p


@pytest.mark.parametrize("compression", ["none", "int8"])
def test_resume_in_a_new_process_lands_on_the_uninterrupted_weights(tmp_path, compression):
    full = make_trainer(str(tmp_path / "full"), compression)
    full.train()
    expected = full.engine.state_dict()

    out = tmp_path / "split"
    first = make_trainer(str(out), compression)
    for record in first.iter_steps():
        if record["step"] == 3:
            break  # "stopped after checkpoint 3"
    first.close()
    assert [p.name for p in list_checkpoints(out)] == ["checkpoint-3"]
    if compression != "none":
        assert any(f.startswith("optimizer") for f in os.listdir(out / "checkpoint-3"))
    _run_job(f"resume:{out / 'checkpoint-3'}", out, compression)
    resumed = torch.load(out / "final.pt")
    assert resumed.keys() == expected.keys()
    for name in expected:
        assert torch.equal(resumed[name], expected[name]), name


def test_killed_while_writing_leaves_the_previous_checkpoint_and_ignores_the_partial(tmp_path):
    out = tmp_path / "run"
    p = _run_job("kill-at:4", out, "none", check=False)
    assert p.returncode == -9, p.stderr[-2000:]
    partial = [c for c in os.listdir(out) if c.startswith("checkpoint-4")]
    assert partial and all(".tmp-" in c for c in partial)
    assert [c.name for c in list_checkpoints(out)] == ["checkpoint-2"]
    assert not [c for c in os.listdir(out) if ".tmp-" in c]  # the dead process's partial was cleaned up
    assert latest_checkpoint(out).name == "checkpoint-2"

    tr = make_trainer(str(out), "none", save_steps=2)
    tr.train(resume_from_checkpoint=True)  # picks checkpoint-2, not the partial one
    assert tr.state.global_step == 8
    assert [c.name for c in list_checkpoints(out)] == ["checkpoint-2", "checkpoint-4", "checkpoint-6", "checkpoint-8"]
    # ...and lands on the weights and states of a run that was never interrupted
    full = make_trainer(str(tmp_path / "full"), "none", save_steps=2)
    full.train()
    expected, got = full.engine.state_dict(), tr.engine.state_dict()
    assert got.keys() == expected.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


def test_rotation_keeps_the_newest_and_checkpoints_load_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    tr = Trainer(model=micro_model(), train_dataset=token_dataset(12),
                 args=args(tmp_path, max_steps=4, save_strategy="steps", save_steps=1, save_total_limit=2),
                 device="cpu")
    tr.train()
    assert [c.name for c in list_checkpoints(tmp_path)] == ["checkpoint-3", "checkpoint-4"]
    files = set(os.listdir(tmp_path / "checkpoint-4"))
    assert {"trainer_state.json", "scheduler.json", "rng_state.json", "megatrain_state.json", "manifest.json"} <= files
    assert not [f for f in files if f.endswith((".pt", ".pth", ".bin", ".pkl"))]  # nothing pickled
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint-4")
    for name, p in tr.engine.named_parameters():
        assert torch.equal(dict(loaded.named_parameters())[name], p), name


def test_save_checkpoint_to_a_chosen_path(tmp_path):
    tr = Trainer(model=micro_model(), train_dataset=token_dataset(12), args=args(tmp_path / "o", max_steps=4),
                 device="cpu")
    with pytest.raises(RuntimeError, match="training run"):
        tr.save_checkpoint()
    for r in tr.iter_steps():
        if r["step"] == 2:
            path = tr.save_checkpoint(tmp_path / "mine")
    assert path == str(tmp_path / "mine")
    again = Trainer(model=micro_model(), train_dataset=token_dataset(12), args=args(tmp_path / "o2", max_steps=4),
                    device="cpu")
    again.train(resume_from_checkpoint=path)
    assert again.state.global_step == 4


def test_bad_resume_paths_are_named(tmp_path):
    tr = Trainer(model=micro_model(), train_dataset=token_dataset(8), args=args(tmp_path / "out", max_steps=2),
                 device="cpu")
    with pytest.raises(CheckpointError, match="does not exist"):
        tr.train(resume_from_checkpoint=str(tmp_path / "missing"))
    (tmp_path / "junk").mkdir()
    with pytest.raises(CheckpointError, match="is not a megatrain_nb checkpoint"):
        tr.train(resume_from_checkpoint=str(tmp_path / "junk"))
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        tr.train(resume_from_checkpoint=True)
    tr.args.save_strategy = "steps"
    tr.train()
    with pytest.raises(CheckpointError, match="the latest being"):
        tr.train(resume_from_checkpoint=str(tmp_path / "out"))


def test_runs_sharing_an_output_dir_stay_apart(tmp_path):
    """A second, fresh run into the same folder: its own run id, the limit kept with the older
    run's checkpoints removed first, only its checkpoints offered, a marker in metrics.jsonl."""
    import io
    import json

    from megatrain_nb.cli import print_summary

    def run(steps, resume=None, limit=2):
        tr = Trainer(model=micro_model(), train_dataset=token_dataset(12),
                     args=args(tmp_path, max_steps=steps, save_strategy="steps", save_steps=1,
                               save_total_limit=limit), device="cpu")
        tr.train(resume_from_checkpoint=resume)
        return tr

    first = run(4)
    assert [c.name for c in list_checkpoints(tmp_path)] == ["checkpoint-3", "checkpoint-4"]
    second = run(2)
    assert second.run_id and second.run_id != first.run_id
    assert [c.name for c in list_checkpoints(tmp_path)] == ["checkpoint-1", "checkpoint-2"]  # limit 2, all its own
    assert list_checkpoints(tmp_path, run_id=first.run_id) == []
    assert latest_checkpoint(tmp_path).name == "checkpoint-2"
    text = io.StringIO()
    print_summary(second, {"steps": 2, "seconds": 1.0, "tokens": 1, "tokens_per_s": 1.0, "first_loss": None},
                  model_dir=None, eval_metrics=None, out=text)
    offered = [line for line in text.getvalue().splitlines() if "checkpoints" in line]
    assert offered and "checkpoint-2" in offered[0] and "checkpoint-4" not in offered[0]

    third = run(3, resume=True)  # continues the second run
    assert third.run_id == second.run_id and third.state.global_step == 3
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    starts = [x for x in lines if x.get("event") == "run_start"]
    assert [x["run_id"] for x in starts] == [first.run_id, second.run_id, second.run_id]
    assert starts[2]["resumed_from"].endswith("checkpoint-2") and starts[1]["resumed_from"] is None
    assert all("run_id" in x for x in lines)
    steps = [x["step"] for x in third.metrics_log.read(run_id=second.run_id) if "loss" in x and "event" not in x]
    assert steps == [1, 2, 3]


def test_resume_true_picks_the_latest_run_not_the_highest_step(tmp_path):
    def run(steps, resume=None):
        tr = Trainer(model=micro_model(), train_dataset=token_dataset(12),
                     args=args(tmp_path, max_steps=steps, save_strategy="steps", save_steps=1), device="cpu")
        tr.train(resume_from_checkpoint=resume)
        return tr

    run(3)
    later = run(1)
    assert [c.name for c in list_checkpoints(tmp_path)] == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    assert latest_checkpoint(tmp_path).name == "checkpoint-1"  # the later run's, not the earlier run's step 3
    assert list_checkpoints(tmp_path, run_id=later.run_id) == [tmp_path / "checkpoint-1"]


def _lr_run(trainer, changes, stop_at=None, resume=None, lrs=None):
    """Train, calling set_lr(changes[s]) at the boundary after step s; {step: lr} it trained with."""
    lrs = {} if lrs is None else lrs
    for record in trainer.iter_steps(resume_from_checkpoint=resume):
        lrs[record["step"]] = record["lr"]
        if record["step"] in changes:
            trainer.set_lr(changes[record["step"]])
        if record["step"] == stop_at:
            break
    return lrs


def test_lr_changes_made_before_a_checkpoint_survive_a_resume(tmp_path):
    # set_lr at boundary 2 comes before checkpoint-4: the resume must take it from the checkpoint
    # (not re-applied here). The change at boundary 4 comes after checkpoint-4 was written, so the
    # resumed run is given it before it starts (what the soak and a Session do).
    changes = {2: 1e-3, 4: 7e-4, 6: 2e-3}
    full = make_trainer(str(tmp_path / "full"), "none", save_steps=4)
    lrs_full = _lr_run(full, changes)
    expected = full.engine.state_dict()
    full.close()
    assert len(set(lrs_full.values())) == 8  # the changes and the cosine schedule move every step

    out = tmp_path / "split"
    first = make_trainer(str(out), "none", save_steps=4)
    lrs = _lr_run(first, {2: changes[2]}, stop_at=4)
    first.close()  # as a kill -9 after checkpoint-4: nothing of this process carries over

    fresh = make_trainer(str(out), "none", save_steps=4)
    fresh.set_lr(changes[4])  # before the run starts: applied on top of the checkpoint's state
    _lr_run(fresh, {6: changes[6]}, resume=out / "checkpoint-4", lrs=lrs)
    assert lrs == lrs_full
    got = fresh.engine.state_dict()
    assert all(torch.equal(got[k], expected[k]) for k in expected)

    # the same trainer object, stopped and resumed: a set_lr between its two runs is kept too
    again = make_trainer(str(tmp_path / "again"), "none", save_steps=4)
    lrs = _lr_run(again, {2: changes[2]}, stop_at=4)
    again.set_lr(changes[4])
    _lr_run(again, {6: changes[6]}, resume=tmp_path / "again" / "checkpoint-4", lrs=lrs)
    assert lrs == lrs_full
    got = again.engine.state_dict()
    assert all(torch.equal(got[k], expected[k]) for k in expected)


def test_a_step_in_a_checkpoint_has_its_line_in_metrics_jsonl_even_if_the_process_dies_right_after(tmp_path):
    import json

    out = tmp_path / "run"
    tr = make_trainer(str(out), "none", save_steps=2)
    real = tr.save_checkpoint

    class Died(BaseException):
        pass

    def save_then_die(path=None):
        real(path)
        if tr.state.global_step == 4:
            raise Died  # as a kill -9 the moment checkpoint-4 is complete
    tr.save_checkpoint = save_then_die
    with pytest.raises(Died):
        tr.train()
    tr.close()
    assert latest_checkpoint(out).name == "checkpoint-4"
    steps = [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert steps == [1, 2, 3, 4]  # the resume starts at 5: no step is missing from the log
