"""Where a fork trains (notebook/placement.py): with ``device=`` another device trains it side
by side on an engine of its own; the same device (or none) shares the parent's engine, one
branch at a time. The decision is tested on device strings (no CUDA needed); the side-by-side
path on CPU, by letting the decision say "side_by_side" for a CPU device."""
import pytest

from nb_fakes import wait_until
from test_branches import _same, _weights, make  # noqa: F401 - the fixture

from megatrain_nb.notebook import branches
from megatrain_nb.notebook.placement import placement


@pytest.mark.parametrize("current,wanted,expected", [
    ("cuda:0", "cuda:1", "side_by_side"),
    ("cuda:1", "cuda:0", "side_by_side"),
    ("cpu", "cuda:0", "side_by_side"),
    ("cuda:0", "cuda:0", "shared"),
    ("cuda", "cuda:0", "shared"),
    ("cuda:0", "CUDA", "shared"),
    ("cpu", "cpu", "shared"),
    ("cuda:0", None, "shared"),
])
def test_two_devices_train_side_by_side_one_device_takes_turns(current, wanted, expected):
    assert placement(current, wanted) == expected


def test_a_device_that_is_not_one_is_refused_by_name():
    with pytest.raises(ValueError, match="device='cuda:x' is not a device; use 'cpu', 'cuda' or 'cuda:N'"):
        placement("cuda:0", "cuda:x")


def test_a_side_by_side_branch_trains_while_its_parent_trains_and_reproduces_it(make, monkeypatch, capsys):
    monkeypatch.setattr(branches, "placement", lambda current, wanted: "side_by_side")
    s = make(snapshot_steps=3, max_steps=8, name="main")
    s.train()
    assert s.wait(until_step=4, timeout=120) == "running"
    b = s.fork(step=3, name="side", device="cpu")
    assert b.engine is not s.engine
    assert "branch 'side' trains side by side on cpu" in capsys.readouterr().out
    b.train()
    assert b.wait(timeout=300) == "finished"
    assert s.wait(timeout=300) == "finished"
    # neither was paused for the other: no switch of the engine happened
    assert not [e for e in s.events + b.events if e["kind"] == "switched_out"]
    assert [r["step"] for r in b.history] == [4, 5, 6, 7, 8]
    _same(_weights(b), _weights(s))     # a no-change fork reproduces its parent, on its own engine
    tree = {n["name"]: n for n in s.explorer.tree()}
    assert tree["side"]["changes"] == "device=cpu" and tree["side"]["forked_at_step"] == 3
    b.close()
    assert not s.released and wait_until(lambda: b.released, timeout=30)
