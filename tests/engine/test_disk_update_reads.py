"""The disk tier's updates read their weights after the unit's previous update wrote them: the
optimizer stream reads ahead of the updates when a step is scheduled, and after a clipped step
(its updates overlapping the next forward) a unit's previous update may still be queued then.
With updates slowed down that read would pass it (an update lost); the weights are bit for bit
the RAM tier's."""
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatrain_nb.engine import EngineConfig, StreamingEngine
from megatrain_nb.model_configs import FAMILY_VOCAB as VOCAB, family_config


def _run(tmp_path, monkeypatch, disk: bool):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config("llama", layers=3, hidden=64))
    tier = dict(offload_dir=str(tmp_path), offload_params=True, host_cache_gb=0) if disk else {}
    engine = StreamingEngine(model, EngineConfig(device="cpu", weight_decay=0.01, **tier))
    real = engine.adam.step_unit

    def slow(*a, **kw):   # updates far slower than a forward: the next step's reads come first
        time.sleep(0.05)
        return real(*a, **kw)
    monkeypatch.setattr(engine.adam, "step_unit", slow)
    ids = torch.randint(1, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    losses = []
    for i in range(4):
        losses.append(engine.forward_backward(ids if i % 2 else ids.flip(1), step_lr=1e-3,
                                              max_grad_norm=0.5 if i % 2 == 0 else None).loss)
    engine.updates.wait_all()
    weights = {n: p.clone() for n, p in engine.named_parameters()}
    engine.close()
    return losses, weights


@pytest.mark.slow   # (two runs of four slowed steps)
def test_an_update_reads_its_weights_after_the_units_previous_update(tmp_path, monkeypatch):
    ram = _run(tmp_path, monkeypatch, False)
    disk = _run(tmp_path, monkeypatch, True)
    assert disk[0] == ram[0]
    assert all(torch.equal(disk[1][k], ram[1][k]) for k in ram[1]), \
        [k for k in ram[1] if not torch.equal(disk[1][k], ram[1][k])]
