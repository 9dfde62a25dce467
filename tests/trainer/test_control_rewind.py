"""The run control's "snapshot" and "rewind" commands (trainer/control.py), in one process (the
2-rank case: tests/distributed/test_rewind_ranks.py): a rewind lands on the uninterrupted run's
weights bit for bit; a rewind to a step without a snapshot is refused naming the steps that have
one, and the run goes on; a run rewound while paused stays paused at the snapshot's step."""
import threading
import time

import pytest
import torch
from transformers import TrainerCallback

from megatrain_nb.commands import CommandError, check_command
from megatrain_nb.trainer import Trainer

from .helpers import args, micro_model, token_dataset

BOUND = 60


@pytest.fixture(autouse=True)
def _control_on(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRAIN_NB_CONTROL", "1")
    monkeypatch.setenv("MEGATRAIN_NB_RUNTIME_DIR", str(tmp_path / "runtime"))


def _trainer(out):
    a = args(out, max_steps=5, gradient_accumulation_steps=2, max_grad_norm=0.5, weight_decay=0.1, seed=7)
    return Trainer(model=micro_model(), train_dataset=token_dataset(40, masked=True), args=a, device="cpu")


class At(TrainerCallback):
    """Calls ``fn(step)`` at each step's end, before the step's boundary (where commands apply)."""

    def __init__(self, fn):
        self.fn = fn

    def on_step_end(self, a, state, control, **k):
        self.fn(state.global_step)


def _uninterrupted(tmp_path):
    t = _trainer(tmp_path / "full")
    t.train()
    want = t.engine.state_dict()
    t.close()
    return want


def test_snapshot_and_rewind_commands_retrain_bit_exactly(tmp_path):
    want = _uninterrupted(tmp_path)
    t = _trainer(tmp_path / "run")
    seen, asked = [], set()

    def steer(step):
        seen.append(step)
        rc = t.run_control
        if step == 2 and "snap" not in asked:
            rc.command("snapshot", source="test")
            asked.add("snap")
        if step == 3 and "bad" not in asked:
            rc.command("rewind", 1, source="test")    # no snapshot there: refused, the run goes on
            asked.add("bad")
        if step == 4 and "rewind" not in asked:
            rc.command("rewind", 2, source="test")
            asked.add("rewind")

    t.add_callback(At(steer))
    t.train()
    events = t.run_control.applied
    assert [(e["kind"], e["step"]) for e in events] == [("snapshot", 2), ("rewind_failed", 3), ("rewind", 4)]
    assert "no snapshot at step 1" in events[1]["error"] and "steps with one: 2" in events[1]["error"]
    assert seen == [1, 2, 3, 4, 3, 4, 5] and t.forked_at_step == 2 and t.parent_run_id != t.run_id
    got = t.engine.state_dict()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert t.parent_run_id and t.state.global_step == 5
    t.close()


def test_a_run_rewound_while_paused_stays_paused_at_the_snapshot(tmp_path):
    want = _uninterrupted(tmp_path)
    t = _trainer(tmp_path / "run")
    at_pause = {}

    def steer(step):
        if step == 2 and not at_pause:
            t.run_control.command("snapshot", source="test")
        if step == 4 and not at_pause:
            t.run_control.command("pause", source="test")
            at_pause["step"] = step

    def send(rc, command, value=None):   # as the notebook's controller does: a file in rank 0's inbox
        from megatrain_nb.channel.protocol import atomic_write_json, inbox_path, make_private_dir, new_command_name

        name = new_command_name()
        inbox = make_private_dir(inbox_path(rc.id))
        atomic_write_json(inbox / f"{name}.json", {"id": name, "command": command, "value": value,
                                                    "source": "controller", "time": time.time()})

    def drive():   # another thread: commands through the beacon while the run waits paused
        end = time.monotonic() + BOUND
        rc = None
        while time.monotonic() < end and (rc is None or rc.state != "paused" or t.state.global_step != 4):
            rc = t.run_control
            time.sleep(0.02)
        send(rc, "rewind", 2)
        while time.monotonic() < end and t.state.global_step != 2:
            time.sleep(0.02)
        time.sleep(0.5)
        at_pause["after_rewind"] = (t.state.global_step, rc.state)
        send(rc, "resume")

    t.add_callback(At(steer))
    th = threading.Thread(target=drive, daemon=True)
    th.start()
    t.train()
    th.join(BOUND)
    assert at_pause["after_rewind"] == (2, "paused")
    kinds = [(e["kind"], e["step"]) for e in t.run_control.applied]
    assert kinds == [("snapshot", 2), ("pause", 4), ("rewind", 4), ("resume", 2)]
    assert [e["source"] for e in t.run_control.applied[2:]] == ["controller", "controller"]
    got = t.engine.state_dict()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    t.close()


def test_snapshot_steps_and_keep_on_the_ranks_never_prune_a_rewind_target(tmp_path, monkeypatch):
    """MEGATRAIN_NB_SNAPSHOT_STEPS=2 / KEEP_SNAPSHOTS=1 (what an nproc_per_node Session passes its
    ranks): a snapshot every 2 steps, the newest kept, and the one a rewind went back to too."""
    from megatrain_nb.trainer.snapshot import SnapshotStore

    monkeypatch.setenv("MEGATRAIN_NB_SNAPSHOT_STEPS", "2")
    monkeypatch.setenv("MEGATRAIN_NB_KEEP_SNAPSHOTS", "1")
    t = _trainer(tmp_path / "run")
    t.args.max_steps = 7
    done = []

    def steer(step):
        if step == 3 and not done:
            t.run_control.command("rewind", 2, source="test")
            done.append(step)

    t.add_callback(At(steer))
    t.train()
    applied = [(e["kind"], e["step"], e["source"]) for e in t.run_control.applied]
    assert applied == [("snapshot", 2, "snapshot_steps"), ("rewind", 3, "test"), ("snapshot", 4, "snapshot_steps"),
                       ("snapshot", 6, "snapshot_steps")]
    left = SnapshotStore(tmp_path / "run").list(include_checkpoints=False)
    assert [i.step for i in left] == [2, 6]
    assert t.run_control.applied[-1]["pruned"] and "step-00000004" in t.run_control.applied[-1]["pruned"][0]
    t.close()


@pytest.mark.parametrize("value,want", [(3, 3), ("12", 12), (0, 0)])
def test_rewind_takes_a_step(value, want):
    assert check_command("rewind", value) == ("rewind", want)
    assert check_command("snapshot") == ("snapshot", None)


@pytest.mark.parametrize("value", [-1, "x", 1.5, True, None])
def test_rewind_refuses_what_is_not_a_step(value):
    with pytest.raises(CommandError, match="must be a whole number >= 0"):
        check_command("rewind", value)


def test_a_rewind_command_to_a_damaged_snapshot_is_refused_and_the_run_goes_on(tmp_path):
    want = _uninterrupted(tmp_path)
    t = _trainer(tmp_path / "run")
    asked = set()

    def steer(step):
        rc = t.run_control
        if step == 2 and "snap" not in asked:
            rc.command("snapshot", source="test")
            asked.add("snap")
        if step == 3 and "rewind" not in asked:
            snap = next((tmp_path / "run" / "snapshots").iterdir())
            victim = snap / "ram_state.safetensors"
            data = bytearray(victim.read_bytes())
            data[-2] ^= 0x10
            victim.write_bytes(bytes(data))
            rc.command("rewind", 2, source="test")
            asked.add("rewind")

    t.add_callback(At(steer))
    t.train()
    events = t.run_control.applied
    assert [(e["kind"], e["step"]) for e in events] == [("snapshot", 2), ("rewind_failed", 3)]
    assert "ram_state.safetensors" in events[1]["error"]
    got = t.engine.state_dict()
    assert all(torch.equal(got[n], want[n]) for n in want) and t.state.global_step == 5
    t.close()
