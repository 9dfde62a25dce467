"""Session.snapshot / rewind / fork (notebook/branches.py) over the real Trainer and engine:
bit-exact rewinds and no-change forks, branches switching on one engine, bad input."""
import json
import os

import numpy as np
import pytest
import torch

from nb_fakes import close_sessions, wait_until


def _dataset(n=48, seq=16, seed=0):
    import datasets

    rng = np.random.default_rng(seed)
    return datasets.Dataset.from_dict({"input_ids": rng.integers(0, 512, size=(n, seq)).tolist()})


def _args(out, **kw):
    from transformers import TrainingArguments

    base = dict(max_steps=6, per_device_train_batch_size=2, learning_rate=3e-3, lr_scheduler_type="linear",
                logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, use_cpu=True,
                max_grad_norm=0.5, gradient_accumulation_steps=2)
    base.update(kw)
    return TrainingArguments(output_dir=str(out), **base)


@pytest.fixture
def make(tmp_path):
    from transformers import AutoModelForCausalLM

    from megatrain_nb.notebook import Session
    from megatrain_nb.model_configs import preset_config

    made = []

    def build(out="out", name=None, engine=None, **kw):
        torch.manual_seed(0)
        opts = {k: kw.pop(k) for k in list(kw) if k in ("snapshot_steps", "keep_snapshots", "offload_dir",
                                                        "optimizer_compression", "offload_params", "host_cache_gb")}
        s = Session(AutoModelForCausalLM.from_config(preset_config("micro")), train_dataset=_dataset(),
                    args=_args(tmp_path / out, **kw), name=name, **opts)
        made.append(s)
        return s

    yield build
    close_sessions(made, timeout=30)


def _weights(s):
    return {k: v.clone() for k, v in s.engine.state_dict().items()}


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_rewind_a_finished_run_and_train_again_lands_on_the_same_weights(make, tmp_path):
    s = make(snapshot_steps=2)
    s.train(block=True)
    assert s.state == "finished"
    final = _weights(s)
    assert [i.step for i in s.snapshots] == [2, 4, 6]
    first_run = s.trainer.run_id
    info = s.rewind(2)
    assert info.step == 2 and s.step == 2 and s.state == "idle"
    assert [r["step"] for r in s.history] == [1, 2]
    s.train(block=True)
    _same(_weights(s), final)
    assert [r["step"] for r in s.history] == [1, 2, 3, 4, 5, 6]
    # the abandoned steps are a branch of their own; the run goes on under a child run id
    tree = {n["run_id"]: n for n in s.explorer.tree()}
    second = s.trainer.run_id
    assert second != first_run and tree[second]["parent_run_id"] == first_run
    assert tree[second]["forked_at_step"] == 2
    assert [r["step"] for r in tree[first_run]["records"]] == [1, 2, 3, 4, 5, 6]
    assert "abandoned" in tree[first_run]["name"]
    lines = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if "loss" in x and x.get("run_id") == second]
    assert [x["step"] for x in steps] == [3, 4, 5, 6]
    assert all(x["parent_run_id"] == first_run and x["forked_at_step"] == 2 for x in steps)
    assert all("run_id" in x and "parent_run_id" in x and "forked_at_step" in x for x in lines)


def test_rewind_to_a_step_without_a_snapshot_lists_those_with_one(make):
    s = make(snapshot_steps=3)
    s.train(block=True)
    with pytest.raises(LookupError, match=r"no snapshot at step 4.*steps that have one: 3, 6"):
        s.rewind(4)


def test_rewind_while_running_applies_at_a_step_boundary_and_pauses(make):
    s = make(max_steps=400, snapshot_steps=2)
    s.train()
    assert s.wait(until_step=3, timeout=120) == "running"
    info = s.rewind(2)
    assert info.step == 2 and s.state == "paused" and s.step == 2
    s.resume()
    assert s.wait(until_step=4, timeout=120) == "running"
    s.stop()
    kinds = [e["kind"] for e in s.events]
    assert "rewind" in kinds and kinds.index("rewind") < kinds.index("resume")


def test_a_fork_without_changes_reproduces_its_parent_bit_for_bit(make):
    s = make(snapshot_steps=3, name="main")
    s.train(block=True)
    final = _weights(s)
    b = s.fork(step=3, name="same")
    assert b.state == "idle" and b.name == "same"
    b.train(block=True)
    _same(_weights(b), final)
    assert [r["step"] for r in b.history] == [4, 5, 6]
    # a changed fork goes elsewhere, with its changes described
    c = s.fork(step=3, name="low-lr", learning_rate=1e-4)
    c.train(block=True)
    after = _weights(c)
    assert any(not torch.equal(after[k], final[k]) for k in final)
    assert c.history[0]["lr"] < 1e-4 + 1e-12 and c.history[0]["forked_at_step"] == 3
    tree = {n["name"]: n for n in s.explorer.tree()}
    assert tree["low-lr"]["changes"] == "learning_rate=0.0001"


def test_fork_refuses_what_cannot_change_and_names_taken(make):
    s = make(snapshot_steps=3, name="main")
    s.train(block=True)
    with pytest.raises(ValueError, match="optimizer_compression.*stored in that codec.*It can change: learning_rate"):
        s.fork(optimizer_compression="int8")
    with pytest.raises(ValueError, match="per_device_train_batch_size"):
        s.fork(step=3, per_device_train_batch_size=4)
    s.fork(step=3, name="b1")
    with pytest.raises(ValueError, match="'b1' exists already"):
        s.fork(step=3, name="b1")
    with pytest.raises(ValueError, match="'main' exists already"):
        s.fork(step=3, name="main")


def test_one_branch_trains_at_a_time_and_switching_back_is_exact(make, capsys):
    ref = make(out="ref", max_steps=10)
    ref.train(block=True)
    expected = _weights(ref)
    ref.close()

    s = make(max_steps=10, name="main")
    s.train()
    assert s.wait(until_step=2, timeout=120) == "running"
    b = s.fork(name="side", max_grad_norm=0.1)   # a snapshot at the next step boundary
    b.train()
    assert wait_until(lambda: s.state == "paused", timeout=120)
    assert b.wait(timeout=300) == "finished"
    assert "branch 'side' trains now; 'main' is paused" in capsys.readouterr().out
    assert any(e["kind"] == "switched_out" and e["by"] == "side" for e in s.events)
    s.resume()
    assert s.wait(timeout=300) == "finished"
    _same(_weights(s), expected)


def test_keep_snapshots_prunes_but_never_a_snapshot_a_branch_starts_from(make):
    s = make(max_steps=8, snapshot_steps=1, keep_snapshots=2, name="main")
    s.train()
    assert s.wait(until_step=2, timeout=120) == "running"
    b = s.fork(name="later")          # at the next step boundary, while the run goes on
    start = b.explorer.origin[1]
    assert s.wait(timeout=300) == "finished"
    steps = [i.step for i in s.snapshots]
    assert steps == [start, 7, 8]     # the two newest, and the one the branch starts from
    assert [i.step for i in b.snapshots] == [start]


def test_a_full_disk_during_a_snapshot_is_reported_and_the_run_goes_on(make, monkeypatch):
    import errno

    from megatrain_nb.engine import engine as engine_mod

    class Full:   # the engine's part fails in the background, after writing part of its files
        def __init__(self, path):
            self.path = path

        def result(self):
            open(os.path.join(self.path, "partial"), "w").write("x")
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(engine_mod.StreamingEngine, "begin_linked_checkpoint", lambda self, path: Full(path))
    s = make(snapshot_steps=2, max_steps=4)
    s.train(block=True)
    assert s.state == "finished" and s.step == 4
    failed = [e for e in s.events if e["kind"] == "snapshot_failed"]
    assert [e["step"] for e in failed] == [2, 4] and "disk is full" in failed[0]["error"]
    assert s.snapshots == []
    assert not os.listdir(os.path.join(s.trainer.args.output_dir, "snapshots"))
    with pytest.raises(OSError, match="disk is full.*training goes on"):
        s.snapshot()


def test_a_branch_saves_its_own_weights(make, tmp_path):
    from transformers import AutoModelForCausalLM

    s = make(snapshot_steps=3, name="main")
    s.train(block=True)
    b = s.fork(step=3, name="b", learning_rate=1e-4)
    b.train(block=True)
    b.trainer.save_model(str(tmp_path / "b-model"))
    loaded = dict(AutoModelForCausalLM.from_pretrained(str(tmp_path / "b-model")).named_parameters())
    mine = _weights(b)
    assert all(torch.equal(loaded[k].detach(), mine[k]) for k in mine)


def test_a_branch_that_does_not_hold_the_engine_snapshots_its_kept_state(make):
    s = make(snapshot_steps=3, name="main")
    s.train(block=True)
    b = s.fork(step=3, name="b", learning_rate=1e-4)
    b.train(block=True)                  # main was switched out (finished, at step 6)
    kept = s.snapshot()
    assert kept.step == 6 and kept.run_id == s.trainer.run_id
    c = s.fork(name="c")                 # from main's step 6, not from the weights b left
    assert c.explorer.origin == (s.trainer.run_id, 6)


def test_every_allowed_change_applies_and_the_parent_is_unaffected(make):
    s = make(snapshot_steps=3, name="main")
    s.train(block=True)
    final = _weights(s)
    seen = []

    def loss_sum(logits, labels):
        seen.append(labels.numel())
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                 ignore_index=-100, reduction="sum")

    b = s.fork(step=3, name="all", learning_rate=1e-3, lr_scheduler_type="constant", warmup_steps=0,
               weight_decay=0.5, max_grad_norm=2.0, max_steps=5, gradient_accumulation_steps=1, data_seed=5,
               train_dataset=_dataset(n=20, seed=9), loss_fn=loss_sum)
    b.train(block=True)
    assert [r["step"] for r in b.history] == [4, 5] and seen
    assert all(r["lr"] == 1e-3 for r in b.history)
    assert b.trainer.engine.adam.weight_decay == 0.5
    # the parent goes back to its own settings (weight decay included) and lands where it did
    s.rewind(3)
    s.train(block=True)
    assert s.trainer.engine.adam.weight_decay == 0.0
    _same(_weights(s), final)


def test_after_a_rewind_a_snapshot_or_fork_is_of_the_rewound_state(make):
    s = make(max_steps=400, snapshot_steps=2, name="main")
    s.train()
    assert s.wait(until_step=5, timeout=120) == "running"
    s.pause()
    assert wait_until(lambda: s.state == "paused", timeout=60)
    target = s.rewind(2)
    assert s.snapshot().path == target.path      # not the trainer's old step with step 2's weights
    b = s.fork(name="from-2")
    assert b.explorer.origin == (target.run_id, 2)
    s.stop()
