"""Snapshots (trainer/snapshot.py, engine/tiers/linked.py): hard links to the disk tier, RAM state
written, resumed bit for bit; pruning; a full disk leaves nothing listed."""
import errno
import os

import pytest
import torch

from megatrain_nb.trainer import Trainer
from megatrain_nb.trainer.snapshot import BranchStart, SnapshotStore

from .helpers import args, micro_model, token_dataset

DISK = dict(offload_params=True, host_cache_gb=0)


def _trainer(out, offload=None, compression="none", steps=6, **kw):
    opts = dict(device="cpu", optimizer_compression=compression)
    if offload is not None:
        opts.update(offload_dir=str(offload), **DISK)
    a = dict(max_steps=steps, max_grad_norm=0.5, gradient_accumulation_steps=2)
    a.update(kw)
    return Trainer(model=micro_model(), train_dataset=token_dataset(24), args=args(out, **a), **opts)


def _train_to(tr, step, store=None, snap_at=()):
    infos = {}
    it = tr.iter_steps()
    for rec in it:
        if store is not None and rec["step"] in snap_at:
            infos[rec["step"]] = store.take(tr)
        if rec["step"] == step:
            break
    return it, infos


@pytest.mark.parametrize("tier,compression", [("ram", "none"), ("disk", "int8"), ("disk", "none")])
def test_resuming_a_snapshot_lands_on_the_uninterrupted_weights(tmp_path, tier, compression):
    offload = tmp_path / "offload" if tier == "disk" else None
    full = _trainer(tmp_path / "full", offload, compression)
    full.train()
    expected = full.engine.state_dict()
    full.close()

    tr = _trainer(tmp_path / "run", offload, compression)
    store = SnapshotStore(tmp_path / "run")
    it, infos = _train_to(tr, 5, store, snap_at=(2,))
    it.close()
    snap = infos[2]
    assert snap.kind == "snapshot" and snap.step == 2 and snap.run_id == tr.run_id
    if tier == "disk":   # the disk tier's files are links, not copies
        assert len(os.listdir(os.path.join(snap.path, "disk"))) == 2 * len(tr.engine.units)
    # the live run moved on: its files were replaced by new versions, the snapshot kept its own
    tr.train(resume_from_checkpoint=snap.path)
    got = tr.engine.state_dict()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    tr.close()


def test_disk_snapshot_links_instead_of_writing(tmp_path):
    tr = _trainer(tmp_path / "run", tmp_path / "offload", "int8")
    store = SnapshotStore(tmp_path / "run")
    it, _ = _train_to(tr, 2)
    sizes = tr.save_snapshot(store.path_for(2, tr.run_id))
    info = store.list(include_checkpoints=False)[0]
    # every unit's weights and states file linked; only the step counts were written in RAM form
    n_units = len(tr.engine.units)
    assert len(os.listdir(os.path.join(info.path, "disk"))) == 2 * n_units
    assert sizes["copied_bytes"] == 0 and sizes["linked_bytes"] > 0
    assert sizes["written_bytes"] < 0.01 * sizes["linked_bytes"]
    # linked to the live files: they are shared until the run writes their next version
    assert info.bytes_shared >= sizes["linked_bytes"]
    next(it)   # one more step: every file of the disk tier gets a new version (renamed over the old)
    tr.save_snapshot(store.path_for(3, tr.run_id))   # (waits for those writes)
    info = store.info(info.path)
    assert info.bytes_shared == 0 and info.bytes_unique >= sizes["linked_bytes"]
    it.close()
    tr.close()


def test_branch_start_gives_a_new_run_id_and_lineage(tmp_path):
    tr = _trainer(tmp_path / "run", steps=4)
    store = SnapshotStore(tmp_path / "run")
    it, infos = _train_to(tr, 3, store, snap_at=(2,))
    it.close()
    parent = tr.run_id
    tr.branch_start = BranchStart(new_run=True)
    recs = list(tr.iter_steps(resume_from_checkpoint=infos[2].path))
    assert [r["step"] for r in recs] == [3, 4]
    assert tr.run_id != parent and tr.parent_run_id == parent and tr.forked_at_step == 2
    assert all(r["parent_run_id"] == parent and r["forked_at_step"] == 2 for r in recs)
    lines = tr.metrics_log.read(run_id=tr.run_id)
    assert lines and all(x["parent_run_id"] == parent and x["forked_at_step"] == 2 for x in lines)
    tr.close()


def test_prune_keeps_the_newest_and_never_a_protected_one(tmp_path):
    tr = _trainer(tmp_path / "run", steps=6)
    store = SnapshotStore(tmp_path / "run")
    it, infos = _train_to(tr, 6, store, snap_at=(1, 2, 3, 4, 5))
    it.close()
    removed = store.prune(2, protect={infos[1].path})
    left = [i.step for i in store.list(include_checkpoints=False)]
    assert left == [1, 4, 5]
    assert sorted(os.path.basename(p) for p in removed) == sorted(
        os.path.basename(infos[s].path) for s in (2, 3))
    tr.close()


def test_disk_full_during_a_snapshot_leaves_nothing_listed(tmp_path, monkeypatch):
    tr = _trainer(tmp_path / "run", tmp_path / "offload", steps=3)
    store = SnapshotStore(tmp_path / "run")
    it, _ = _train_to(tr, 1)
    # the link itself fails: both ways a snapshot takes the disk tier's files (read at the
    # boundary, or linked in the disk queue behind the step's updates: which one depends on
    # whether step 1's files are written yet) come down to os.link
    real = os.link

    def full(src, dst):
        if "adam" in os.path.basename(src):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(os, "link", full)
    with pytest.raises(OSError, match="disk is full.*training goes on") as e:
        store.take(tr)
    assert e.value.errno == errno.ENOSPC
    assert store.list() == []
    assert not [p for p in (tmp_path / "run" / "snapshots").iterdir()]
    monkeypatch.setattr(os, "link", real)
    rec = next(it)   # the run goes on
    assert rec["step"] == 2
    assert store.take(tr).step == 2
    it.close()
    tr.close()


def test_on_another_filesystem_the_disk_files_are_copied_and_still_resume(tmp_path, monkeypatch):
    from megatrain_nb.engine.tiers import linked

    tr = _trainer(tmp_path / "run", tmp_path / "offload", steps=3)
    store = SnapshotStore(tmp_path / "run")
    it, _ = _train_to(tr, 1)

    def cross_device(src, dst):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(linked.os, "link", cross_device)
    path = store.path_for(1, tr.run_id)
    sizes = tr.save_snapshot(path)
    assert sizes["linked_bytes"] == 0 and sizes["copied_bytes"] > 0
    info = store.info(path)
    assert info.bytes_shared == 0 and info.bytes_unique > sizes["copied_bytes"]
    before = {k: v.clone() for k, v in tr.engine.state_dict().items()}
    next(it)
    it.close()
    tr.engine.load_checkpoint(str(path))
    after = tr.engine.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)
    tr.close()
