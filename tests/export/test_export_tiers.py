"""Exports read from wherever the weights live: the disk tier (unit by unit, the same bytes as
from RAM), and a running Session (a snapshot at a step boundary, then read while it trains on:
the export holds exactly the snapshot's weights)."""
from __future__ import annotations

import warnings

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import megatrain_nb as mt
from megatrain_nb.engine.tiers.disk_params import weights_key

from . import helpers as h

pytestmark = pytest.mark.slow

DISK = dict(offload_params=True, host_cache_gb=0)   # (no host cache: every unit read from its file; the cache's case is its own test below)


def _folder_state(folder):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()


def test_the_disk_tier_exports_the_same_bytes_unit_by_unit(tmp_path):
    ram = h.trained("qwen2", tmp_path / "ram")
    disk = h.trained("qwen2", tmp_path / "disk", offload_dir=str(tmp_path / "offload"), **DISK)
    try:
        assert disk.engine.params_on_disk and not ram.engine.params_on_disk
        read0 = disk.engine.disk.stats()["bytes_read"]
        a, b = mt.export(ram, tmp_path / "a"), mt.export(disk, tmp_path / "b")
        read = disk.engine.disk.stats()["bytes_read"] - read0
        assert read == 4 * sum(u.numel for u in disk.engine.units)   # each unit read once, from the disk
        sa, sb = load_file(f"{a}/model.safetensors"), load_file(f"{b}/model.safetensors")
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mt.export(disk, tmp_path / "b.gguf", format="gguf", dtype="f32")
            m = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="b.gguf", dtype=torch.float32)
        ids = h.batch()
        with torch.no_grad():
            assert h.max_rel_err(m(ids).logits, disk.engine.forward_logits(ids)) <= 1e-4
    finally:
        ram.close()
        disk.close()


@pytest.mark.parametrize("tier", ["ram", "disk"])
def test_shards_are_laid_out_before_the_weights_are_read(tmp_path, monkeypatch, tier):
    from megatrain_nb.export import safetensors_out, stream

    monkeypatch.setattr(stream, "CHUNK", 1 << 16)   # the disk tier's units read in several chunks each
    opts = dict(offload_dir=str(tmp_path / "offload"), **DISK) if tier == "disk" else {}
    t = h.trained("llama", tmp_path, **opts)
    try:
        monkeypatch.setattr(safetensors_out, "SHARD_BYTES", 200_000)
        out = safetensors_out.write_safetensors(mt.export.source_of(t), tmp_path / "sharded", shard_bytes=200_000)
        import json
        import os

        index = json.load(open(os.path.join(out, safetensors_out.INDEX_NAME)))
        assert len(set(index["weight_map"].values())) > 2
        got = _folder_state(out)
        assert all(torch.equal(got[k], v) for k, v in t.engine.state_dict().items())
    finally:
        t.close()


@pytest.mark.parametrize("tier", ["ram", "disk"])
def test_a_running_session_exports_its_snapshot_and_trains_on(tmp_path, tier):
    from megatrain_nb.notebook import Session

    opts = dict(offload_dir=str(tmp_path / "offload"), **DISK) if tier == "disk" else {}
    s = Session(h.model("llama"), train_dataset=Dataset.from_list(h.rows(n=64)), tokenizer=h.tokenizer(),
                args=h.args(tmp_path / "out", max_steps=400), **opts)
    try:
        s.train()
        assert s.wait(until_step=2, timeout=120) == "running"
        out = mt.export(s, tmp_path / "live")
        (snap,) = s.snapshots   # the export's snapshot, taken at a step boundary
        assert s.wait(until_step=snap.step + 2, timeout=120) == "running"   # trained on meanwhile
        s.rewind(snap.step)   # the project's own loader puts the snapshot's weights back
        want = {k: v.clone() for k, v in s.engine.state_dict().items()}
        got = _folder_state(out)
        assert want.keys() <= got.keys() and all(torch.equal(got[k], v) for k, v in want.items())
        s.stop()
    finally:
        s.close()


def test_units_the_host_cache_holds_are_exported_from_ram(tmp_path):
    """The disk tier with its host cache after training: the units it holds (their newest weights
    may not be on the disk yet) come from RAM, the others from their files; the export is the
    engine's own state either way."""
    t = h.trained("llama", tmp_path, steps=2, offload_dir=str(tmp_path / "offload"), offload_params=True,
                  host_cache_gb=0.0002)
    try:
        engine = t.engine
        keys = [weights_key(u) for u in engine.units]
        engine.pager.wait_grads()
        for u in engine.units:   # the last step's writes issued (one may still move a unit into the cache)
            engine.weights.dirty.wait_clean(u)
        held = [k for k in keys if engine.disk.resident_bytes([k])]
        assert engine.params_on_disk and 0 < len(held) < len(keys)   # some units in the cache, some not
        store, ranged = engine.disk.store, []
        original = store.read_ranged

        def counted(key):
            ranged.append(key)
            return original(key)

        store.read_ranged = counted
        out = t.export(tmp_path / "cached")
        assert sorted(ranged) == sorted(k for k in keys if k not in held)   # the others read from their files
        got = load_file(f"{out}/model.safetensors")
        assert all(torch.equal(got[k], v) for k, v in engine.state_dict().items())
    finally:
        t.close()
