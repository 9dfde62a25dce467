"""A damaged snapshot is refused whole, by name, before a rewind changes anything: every file
kind of a snapshot, on the RAM and the disk tier. The refused rewind leaves step, history,
weights and optimizer states bit for bit as they were, and the snapshot is listed as damaged."""
import glob
import os

import pytest
import torch

from nb_fakes import close_sessions
from test_branches import _args, _dataset

# file kind -> where in the snapshot folder (glob), which byte to flip (negative: from the end)
KINDS = {
    "manifest": ("manifest.json", 20),
    "state_file": ("megatrain_state.json", 5),
    "trainer_state": ("trainer_state.json", 5),
    "scheduler": ("scheduler.json", 3),
    "rng": ("rng_state.json", 40),
    "linked": ("linked.json", 10),
    "ram_header": ("ram_state.safetensors", 12),
    "ram_data": ("ram_state.safetensors", -3),
    "disk_weights": ("disk/weights-00002*", -5000),
    "disk_states": ("disk/adam-00001*", 300),
}
TIERS = {"ram": {}, "disk": {"offload_params": True, "optimizer_compression": "int8", "host_cache_gb": 0}}


CASES = [(tier, kind) for tier in sorted(TIERS) for kind in sorted(KINDS)
         if tier == "disk" or not KINDS[kind][0].startswith("disk/")]   # (the RAM tier has no disk files)


@pytest.fixture(scope="module")
def trained(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from megatrain_nb.notebook import Session
    from megatrain_nb.model_configs import preset_config

    tmp = tmp_path_factory.mktemp(f"damage-{request.param}")
    opts = dict(TIERS[request.param])
    if opts:
        opts["offload_dir"] = str(tmp / "offload")
    torch.manual_seed(0)
    s = Session(AutoModelForCausalLM.from_config(preset_config("micro")), train_dataset=_dataset(),
                args=_args(tmp / "out"), snapshot_steps=2, name=f"damage-{request.param}", **opts)
    s.train(block=True)
    yield request.param, s
    close_sessions([s], timeout=30)


def _everything(s):
    e = s.engine
    states = {}
    for u in e.state_units:
        for k, t in (e.states.stored(u) or {}).items():
            states[f"{u.name}/{k}"] = t.clone()
    return {"step": s.step, "history": [r["step"] for r in s.history], "run_id": s.trainer.run_id,
            "weights": {k: v.clone() for k, v in e.state_dict().items()}, "states": states,
            "adam_steps": {k: v.clone() for k, v in e.adam.state_dict().items()},
            "global_step": s.trainer.state.global_step}


def _same(a, b):
    for k in ("step", "history", "run_id", "global_step"):
        assert a[k] == b[k], k
    for part in ("weights", "states", "adam_steps"):
        assert a[part].keys() == b[part].keys(), part
        for k in a[part]:
            assert torch.equal(a[part][k], b[part][k]), (part, k)


@pytest.mark.parametrize("trained,kind", CASES, indirect=["trained"])
def test_a_damaged_snapshot_is_refused_whole_and_the_run_is_unchanged(trained, kind):
    from megatrain_nb.trainer import snapshot

    tier, s = trained
    pattern, at = KINDS[kind]
    snap = [i for i in s.snapshots if i.step == 2][0]
    found = sorted(glob.glob(os.path.join(snap.path, pattern)))
    assert found, f"{pattern} not in a {tier}-tier snapshot"
    victim = found[0]
    before = _everything(s)
    original = open(victim, "rb").read()
    pos = at if at >= 0 else len(original) + at
    damaged = bytearray(original)
    damaged[pos] ^= 0x5A
    try:
        if os.stat(victim).st_nlink > 1:   # a hard link shares the disk tier's file: break it first
            os.unlink(victim)
        with open(victim, "wb") as f:
            f.write(bytes(damaged))
        with pytest.raises(ValueError) as err:
            s.rewind(2)
        assert os.path.basename(victim) in str(err.value), str(err.value)
        _same(_everything(s), before)
        assert s.state == "finished"
        listed = [i for i in s.snapshots if i.path == snap.path]
        assert listed and listed[0].damaged, "a damaged snapshot is listed, with why"
        assert any(e["kind"] == "snapshot_damaged" for e in s.events)
        with pytest.raises(ValueError, match=os.path.basename(victim)):   # a fork from it: refused at fork()
            s.fork(step=2, name=f"from-damaged-{kind}")
        assert f"from-damaged-{kind}" not in s.explorer.taken_names()
        _same(_everything(s), before)
    finally:
        with open(victim, "wb") as f:
            f.write(original)
        snapshot._DAMAGED.clear()


def test_a_snapshot_whose_state_file_is_unreadable_is_listed_as_damaged(tmp_path):
    from megatrain_nb.trainer.snapshot import SnapshotStore

    store = SnapshotStore(tmp_path)
    folder = store.path_for(4, "abc")
    folder.mkdir(parents=True)
    (folder / "megatrain_state.json").write_text("{not json")
    (folder / "trainer_state.json").write_text("{}")
    [info] = store.list()
    assert info.step == 4 and info.run_id == "abc" and "megatrain_state.json" in info.damaged
