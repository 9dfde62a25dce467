"""Pruning snapshots never leaves a half-deleted folder under a snapshot's name: each is renamed
out of the listed names first, and what a kill left is reclaimed at the next prune or snapshot."""
import json
import os
import shutil

import pytest

from megatrain_nb.trainer import snapshot
from megatrain_nb.trainer.snapshot import SnapshotStore


def _fake(store, step, run="r1", files=16):
    folder = store.path_for(step, run)
    folder.mkdir(parents=True)
    for k in range(files):
        (folder / f"part-{k}.bin").write_bytes(b"x" * 10)
    (folder / "trainer_state.json").write_text("{}")
    (folder / "megatrain_state.json").write_text(json.dumps({"global_step": step, "run_id": run,
                                                             "snapshot": True, "saved_at": float(step)}))
    return folder


def test_a_kill_during_pruning_leaves_nothing_half_gone_under_a_snapshot_name(tmp_path, monkeypatch):
    store = SnapshotStore(tmp_path)
    for step in (2, 4, 6):
        _fake(store, step)
    real = shutil.rmtree
    deleting = []

    def killed(path, *a, **kw):   # removes a few files, then the process dies
        deleting.append(str(path))
        for f in sorted(p for p in __import__("pathlib").Path(path).iterdir())[:6]:
            f.unlink()
        raise KeyboardInterrupt
    monkeypatch.setattr(snapshot.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        store.prune(keep=1)
    monkeypatch.setattr(snapshot.shutil, "rmtree", real)
    assert deleting and ".pruning-" in deleting[0], "deleted under its listed name"
    assert [i.step for i in store.list()] == [4, 6]     # step 2 is gone from the names, not half there
    assert all(not i.damaged for i in store.list())
    store.prune(keep=1)                                  # the next prune reclaims the leftover
    assert [p.name for p in store.root.iterdir()] == [store.path_for(6, "r1").name]


def test_a_snapshot_whose_state_file_was_deleted_is_listed_as_damaged_not_reclaimed(tmp_path):
    """Issue 44 item 9: a deleted megatrain_state.json made the snapshot vanish from the listing
    (and the next snapshot's reclaim deleted it). It stays listed, ``damaged`` naming the file and
    why; a prune removes it as the oldest; ``.kept-<pid>-`` folders of a dead process go."""
    store = SnapshotStore(tmp_path)
    _fake(store, 2)
    left = _fake(store, 4)
    (left / "megatrain_state.json").unlink()
    listed = store.list()
    assert [i.step for i in listed] == [2, 4] and listed[0].damaged is None
    assert listed[1].run_id == "r1" and "megatrain_state.json" in listed[1].damaged
    assert "missing" in listed[1].damaged
    dead = store.root / ".kept-999999999-abc"      # a pid no process has
    dead.mkdir()
    live = store.root / f".kept-{os.getpid()}-abc"
    live.mkdir()
    assert store.reclaim() == [str(dead)]
    assert left.exists() and live.exists()
    store.prune(keep=1)                               # a damaged one is pruned first
    assert [i.step for i in store.list()] == [2]
