"""Fresh copies after an unclipped step (tiers/weight_store.py, fresh_after_step): the last updates'
buffers that the next forward reads first stay in RAM as its loads' source -- the embedding's (an
optimizer stream buffer) and the first layers' (compute stream buffers their backward handed over,
one of the stream's buffers left free for the forward's reads). Counted in bytes; the weights stay
the RAM tier's bit for bit."""
from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatrain_nb.engine import EngineConfig, StreamingEngine
from megatrain_nb.engine.tiers import weight_store
from megatrain_nb.engine.tiers.disk_params import weights_key
from megatrain_nb.engine.tiers.weight_store import fresh_after_step
from megatrain_nb.engine.units import Unit
from megatrain_nb.model_configs import FAMILY_VOCAB as VOCAB, family_config


def _units(n):
    return [Unit(name=f"u{i}", kind="layer", index=i, params=[], numel=8, decay_numel=8) for i in range(n)]


def test_fresh_after_step_leaves_a_compute_buffer_free():
    u = _units(6)
    order = [u[5], u[4], u[3], u[2], u[1], u[0]]   # the backward's order: embed (0) updated last
    early = {0, 1, 2, 3}
    handed = {1, 2, 3, 4}                          # layers: their backward's buffer; 0 reads its own
    assert fresh_after_step(order, early, handed, compute_buffers=3) == {0, 1, 2}
    # large units: two compute buffers, one of them kept, as before the third was kept
    assert fresh_after_step(order, early, handed, compute_buffers=2) == {0, 1}
    assert fresh_after_step(order, {0, 5}, handed, compute_buffers=3) == {0}   # only what the forward reads first


def _run(model, tmp_path, kept, monkeypatch, disk=True):
    """Trains four steps; per step, how many times each unit's weights were read from disk."""
    monkeypatch.setattr(weight_store, "LAST_UPDATES_KEPT", kept)
    opts = dict(offload_dir=str(tmp_path), offload_params=True, host_cache_gb=0) if disk else {}
    e = StreamingEngine(model, EngineConfig(device="cpu", **opts))
    torch.manual_seed(1)
    reads, step = [], Counter()
    if disk:
        read = e.disk.read

        def counted(key, *a, **kw):   # the reads the engine issues, named by key
            step[key] += 1
            return read(key, *a, **kw)
        monkeypatch.setattr(e.disk, "read", counted)
    for b in [torch.randint(0, VOCAB, (2, 24)) for _ in range(4)]:
        step.clear()
        e.forward_backward(b, step_lr=1e-3)
        reads.append({u.index: step[weights_key(u)] for u in e.units})
    e.updates.wait_all()
    weights = [t.detach().clone() for _, t in e.named_parameters()]
    e.close()
    return reads, weights


@pytest.mark.slow   # (three engines train four steps: seconds)
def test_the_second_layer_is_not_read_back_for_the_next_forward(tmp_path, monkeypatch):
    models = [AutoModelForCausalLM.from_config(family_config("llama")) for _ in range(3)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    three, w3 = _run(models[0], tmp_path / "three", 3, monkeypatch)
    two, w2 = _run(models[1], tmp_path / "two", 2, monkeypatch)
    _, w_ram = _run(models[2], tmp_path / "ram", 3, monkeypatch, disk=False)
    # steady steps (their forward follows a step's updates): the second layer (unit 2) is read
    # once fewer; the units after it, read as before. (The embedding's and the first layer's are
    # fresh copies in both runs; whether one survives to the next forward's read can depend on
    # timing -- an optimizer stream reclaiming its only buffer -- so they are not compared: the
    # CI once saw the embedding's survive one step in one run.)
    for t, h in zip(two[1:], three[1:]):
        assert t[2] - h[2] == 1, (two, three)
        assert t[3] == h[3] and t[4] == h[4], (two, three)
    for a, b, c in zip(w3, w2, w_ram):
        assert torch.equal(a, b) and torch.equal(a, c)
