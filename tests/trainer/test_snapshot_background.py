"""Snapshots that do not wait for the step (engine/tiers/linked.py begin_linked, DiskStore.link,
trainer/snapshot.py PendingSnapshot): with the whole state on the disk tier a snapshot is begun
at the step boundary while the step's updates and writes still run; the ordered links see this
step's version of every file, never the next step's."""
import errno
import os
import threading

import pytest
import torch

from megatrain_nb.engine.tiers.disk_store import DiskStore
from megatrain_nb.trainer.snapshot import PendingSnapshot, SnapshotStore

from .test_snapshot import _train_to, _trainer


def _state_at(tmp_path, compression, step, **kw):
    ref = _trainer(tmp_path / "ref", tmp_path / "ref-offload", compression, **kw)
    it, _ = _train_to(ref, step)
    it.close()
    state = {k: v.clone() for k, v in ref.engine.state_dict().items()}
    ref.close()
    return state


@pytest.mark.parametrize("compression", ["int8", "none"])
def test_background_snapshots_hold_their_step_while_training_runs_on(tmp_path, compression):
    expected = _state_at(tmp_path, compression, 3, max_grad_norm=None, gradient_accumulation_steps=1)
    tr = _trainer(tmp_path / "run", tmp_path / "offload", compression, max_grad_norm=None,
                  gradient_accumulation_steps=1)
    store = SnapshotStore(tmp_path / "run")
    it, _ = _train_to(tr, 3)
    pending = store.begin(tr)    # step 3's updates (straight: started in the backward) may still run
    assert isinstance(pending, PendingSnapshot)
    assert store.list() == []    # not listed before it is complete
    next(it)                     # step 4 writes new versions of every file (the snapshot waited in line)
    next(it)
    info = store.finish(pending)
    assert info.step == 3 and len(os.listdir(os.path.join(info.path, "disk"))) == 2 * len(tr.engine.units)
    it.close()
    tr.engine.load_checkpoint(info.path)
    got = tr.engine.state_dict()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    tr.close()


def test_a_snapshot_is_begun_while_the_steps_writes_are_held(tmp_path, monkeypatch):
    """The snapshot call returns while every disk write of the step is still held back: it
    waited neither for the updates' writes nor for the links (they are queued behind them),
    and the links still hold step 3's files, not step 2's (most of step 3's updates had not
    even issued their writes when it was begun)."""
    expected = _state_at(tmp_path, "int8", 3, steps=4)
    tr = _trainer(tmp_path / "run", tmp_path / "offload", "int8", steps=4)
    store = SnapshotStore(tmp_path / "run")
    it, _ = _train_to(tr, 2)
    gate, held = threading.Event(), []
    real = DiskStore._write_file

    def gated(self, key, items):
        held.append(key)
        assert gate.wait(60), "the test's gate was never opened"
        return real(self, key, items)

    tr.engine.updates.wait_all()
    monkeypatch.setattr(DiskStore, "_write_file", gated)
    rec = next(it)   # step 3: its updates write behind, into the gate
    assert rec["step"] == 3
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("pending", store.begin(tr)), daemon=True)
    t.start()
    t.join(30)
    assert "pending" in out, "the snapshot waited for the step's writes"
    assert not out["pending"].done()
    gate.set()
    info = store.finish(out["pending"])
    monkeypatch.setattr(DiskStore, "_write_file", real)
    assert info.step == 3 and held
    it.close()
    tr.engine.load_checkpoint(info.path)
    got = tr.engine.state_dict()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    tr.close()


@pytest.mark.parametrize("at", [1, 2])   # step 1: read now (no file yet); 2: links in the queue
def test_disk_full_while_linking_leaves_nothing_listed(tmp_path, monkeypatch, at):
    tr = _trainer(tmp_path / "run", tmp_path / "offload", steps=at + 2)
    store = SnapshotStore(tmp_path / "run")
    it, _ = _train_to(tr, at)
    real = os.link

    def full(src, dst):
        if "adam" in os.path.basename(src):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(os, "link", full)
    with pytest.raises(OSError, match="disk is full.*training goes on") as e:
        store.take(tr)
    assert e.value.errno == errno.ENOSPC
    assert store.list() == [] and not list((tmp_path / "run" / "snapshots").iterdir())
    monkeypatch.setattr(os, "link", real)
    assert next(it)["step"] == at + 1   # the run goes on
    assert store.take(tr).step == at + 1
    it.close()
    tr.close()
