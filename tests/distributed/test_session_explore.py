"""Snapshot, rewind and fork of a Session whose 2 ranks (gloo, 127.0.0.1) train in worker
processes (issue 21, item 3), driven as a notebook does: ``s.snapshot()`` while it runs returns
the ranks' SnapshotInfo, ``s.pause(); s.rewind(step); s.resume()`` trains the same steps again
and ends on the uninterrupted run's weights bit for bit; ``s.snapshots`` lists the ranks'
snapshots; ``s.fork(step)`` launches new ranks from one and, with no change, ends on its
parent's weights bit for bit. Every wait is bounded."""
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from .launch import REPO, controller_env, until

BOUND = 120
KW = dict(max_steps=9, learning_rate=1e-3, seed=3, weight_decay=0.1, max_grad_norm=0.5)


@pytest.fixture(autouse=True)
def _env(tmp_path, monkeypatch):
    controller_env(tmp_path, monkeypatch)


def _until(pred, what, bound=BOUND):
    until(pred, what, bound)


def _session(tmp_path, name, max_steps=KW["max_steps"], steered=True, **kw):
    """``steered``: its ranks sleep 0.3 s after each step (SlowSteps), time for the controls sent
    while they run; a run nothing steers mid-run (its forks too, which take its callbacks) trains
    at full speed."""
    import megatrain_nb as mt

    sys.path.insert(0, str(REPO / "tests"))
    from trainer.helpers import args, micro_model, token_dataset

    return mt.Session(micro_model(), train_dataset=token_dataset(64),
                      args=args(tmp_path / name, **dict(KW, max_steps=max_steps)),
                      nproc_per_node=2, device="cpu", name=name,
                      callbacks=["tests.distributed.launcher_helpers:SlowSteps"] if steered else [], **kw)


def _weights(folder: Path) -> dict:
    return load_file(str(folder / "model.safetensors"))


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.slow
def test_snapshot_rewind_resume_and_fork_of_two_ranks_are_bit_exact(tmp_path):
    from megatrain_nb.trainer.snapshot import SnapshotInfo

    # the uninterrupted run, with the ranks' automatic snapshots every 3 steps
    ref = _session(tmp_path, "ref", snapshot_steps=3, steered=False)
    ref.train()
    assert ref.wait(timeout=3 * BOUND) == "finished", ref.worker_log
    root = ref.history[0]["run_id"]
    snaps = ref.snapshots
    assert [i.step for i in snaps] == [3, 6, 9] and all(isinstance(i, SnapshotInfo) for i in snaps)
    assert {(i.kind, i.run_id, i.branch) for i in snaps} == {("snapshot", root, "ref")}
    assert all(sorted(p.name for p in Path(i.path).glob("rank-*")) == ["rank-00000-of-00002", "rank-00001-of-00002"]
               for i in snaps)

    # snapshot while running, pause, rewind, resume: the same weights as the uninterrupted run
    s = _session(tmp_path, "steered")
    s.train()
    assert s.wait(timeout=BOUND, until_step=2) == "running", s.worker_log
    info = s.snapshot()
    assert isinstance(info, SnapshotInfo) and info.step >= 2 and Path(info.path).is_dir()
    first = s.history[0]["run_id"]
    assert info.run_id == first and info.branch == "steered" and [i.step for i in s.snapshots] == [info.step]
    s.wait(timeout=BOUND, until_step=info.step + 2)
    s.pause()
    _until(lambda: s.state == "paused", "the pause")
    far = s.step
    assert info.step + 2 <= far < KW["max_steps"], (info.step, far)
    with pytest.raises(LookupError, match=f"the steps that have one: {info.step}"):
        s.rewind(info.step - 1)
    back = s.rewind(info.step)
    assert back.step == info.step and back.path == info.path
    assert s.step == info.step and s.state == "paused"
    s.resume()
    assert s.wait(timeout=3 * BOUND) == "finished", s.worker_log
    _same(_weights(tmp_path / "steered"), _weights(tmp_path / "ref"))
    # the history: steps 1..9 once, the rewound ones under the branch's run id
    hist = s.history
    assert [r["step"] for r in hist] == list(range(1, KW["max_steps"] + 1))
    branch = hist[-1]["run_id"]
    assert branch != first and {r["run_id"] for r in hist[:info.step]} == {first}
    assert {(r["run_id"], r["parent_run_id"], r["forked_at_step"]) for r in hist[info.step:]} == {
        (branch, first, info.step)}
    kinds = [(e["kind"], e["step"]) for e in s.events]
    assert kinds == [("snapshot", info.step), ("pause", far), ("rewind", info.step), ("resume", info.step)], kinds
    assert s.events[2]["from_step"] == far
    tree = {r["run_id"]: r for r in s.explorer.tree()}
    assert [r["step"] for r in tree[first]["records"]] == list(range(1, far + 1))   # the abandoned steps stay
    assert tree[branch]["parent_run_id"] == first and tree[branch]["forked_at_step"] == info.step

    # a rewind of the finished run (its ranks gone): train() launches them again from the snapshot
    again = s.rewind(info.step)
    assert again.step == info.step and s.state == "idle" and s.step == info.step
    s.train()
    assert s.wait(timeout=3 * BOUND) == "finished", s.worker_log
    _same(_weights(tmp_path / "steered"), _weights(tmp_path / "ref"))
    hist = s.history
    third = hist[-1]["run_id"]
    assert [r["step"] for r in hist] == list(range(1, KW["max_steps"] + 1)) and third not in (first, branch)
    assert {(r["run_id"], r["parent_run_id"], r["forked_at_step"]) for r in hist[info.step:]} == {
        (third, first, info.step)}
    assert [(e["kind"], e["step"], e.get("from_step")) for e in s.events][-1] == ("rewind", info.step, 9)
    assert [r["outcome"] for r in s.ranks] == ["finished", "finished"]

    # a fork with no change, from the finished parent's snapshot at step 3: new ranks, same weights
    child = ref.fork(3)
    assert child.name == "ref-fork-1" and child.nproc_per_node == 2
    child.train()
    assert child.wait(timeout=3 * BOUND) == "finished", child.worker_log
    out = tmp_path / "ref" / "branches" / "ref-fork-1"
    _same(_weights(out), _weights(tmp_path / "ref"))
    ch = child.history
    assert [r["step"] for r in ch] == list(range(4, KW["max_steps"] + 1))
    assert {(r["parent_run_id"], r["forked_at_step"]) for r in ch} == {(root, 3)} and ch[0]["run_id"] != root
    assert ref.events[-1]["kind"] == "fork" and ref.events[-1]["branch"] == "ref-fork-1"
    # its start is its own (hard-linked: the parent's pruning cannot take it); and its own snapshots
    start = out / "snapshots" / Path(snaps[0].path).name
    assert start.is_dir() and [i.step for i in child.snapshots][0] == 3
    linked = [f for f in start.rglob("*") if f.is_file()]
    assert linked and all(f.stat().st_nlink > 1 for f in linked)

    # a fork with another learning rate follows its own schedule from step 6; bad forks are refused
    with pytest.raises(ValueError, match="a branch named 'ref-fork-1' exists already"):
        ref.fork(3, name="ref-fork-1")
    with pytest.raises(ValueError, match="cannot change seq_len mid-run"):
        ref.fork(3, seq_len=8)
    low = ref.fork(6, name="low", learning_rate=5e-4)
    low.train()
    assert low.wait(timeout=3 * BOUND) == "finished", low.worker_log
    lr = {r["step"]: r["lr"] for r in ref.history}
    assert {r["step"]: r["lr"] for r in low.history} == pytest.approx({k: lr[k] / 2 for k in (7, 8, 9)}, rel=1e-9)
    theirs = _weights(tmp_path / "ref" / "branches" / "low")
    assert any(not torch.equal(theirs[k], v) for k, v in _weights(tmp_path / "ref").items())
    assert {r["name"] for r in ref.explorer.tree()} >= {"ref", "ref-fork-1", "low"}
    import megatrain_nb as mt

    table = {r["branch"]: r for r in mt.compare(ref, low).rows}
    assert table["low"]["forked_from"] == "ref" and table["low"]["forked_at_step"] == 6
    assert (table["ref"]["learning_rate"], table["low"]["learning_rate"]) == (1e-3, 5e-4)


@pytest.mark.slow
def test_a_fork_of_running_ranks_pauses_its_parent_when_it_starts(tmp_path):
    parent = _session(tmp_path, "long", snapshot_steps=2, max_steps=60)
    parent.train()
    assert parent.wait(timeout=BOUND, until_step=3) == "running", parent.worker_log
    with pytest.raises(ValueError, match="trains on ranks of its own"):
        parent.fork(2, device="cpu")
    kid = parent.fork(2, name="kid", max_steps=4)
    kid.train()
    _until(lambda: parent.state == "paused", "the parent's pause")
    assert [e["source"] for e in parent.events if e["kind"] == "pause"] == ["branch kid"]
    assert kid.wait(timeout=3 * BOUND) == "finished", kid.worker_log
    assert [r["step"] for r in kid.history] == [3, 4] and parent.state == "paused"
    parent.stop(timeout=BOUND)
    assert parent.state == "stopped"
