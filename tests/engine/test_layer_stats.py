"""Layer statistics are gathered only when switched on by the engine's config (they cost the
optimizer two passes per unit) and come with the step's EngineOutput, as its memory and
telemetry do; with clipping their gradient norm comes from the backward's norm share."""
import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatrain_nb.engine import EngineConfig, StreamingEngine
from megatrain_nb.engine.updates.optimizer import unit_stats

from megatrain_nb.model_configs import FAMILY_VOCAB as VOCAB, family_config


@pytest.mark.parametrize("clip", [None, 0.5])
def test_layer_stats_gathered_when_switched_on_and_training_unchanged(clip):
    model = AutoModelForCausalLM.from_config(family_config("llama", layers=2, hidden=64))
    a = StreamingEngine(copy.deepcopy(model), EngineConfig(device="cpu"))
    b = StreamingEngine(model, EngineConfig(device="cpu"))
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    for e in (a, b):
        out = e.forward_backward(ids, step_lr=1e-3, max_grad_norm=clip)
        e.zero_grad()
    assert a.adam.stats == {} and a.layer_stats() == []   # not switched on: none gathered
    assert out.layer_stats is None and out.memory["device"] and "bytes" in out.telemetry   # the whole step
    assert a.forward_backward(ids).memory is None   # a call that does not end a step: nothing to report
    a.zero_grad()
    a.configure(layer_stats=True)   # the config's switch, from the next step
    assert a.config.layer_stats is True
    out = a.forward_backward(ids, step_lr=1e-3, max_grad_norm=clip)
    b.forward_backward(ids, step_lr=1e-3, max_grad_norm=clip)
    a.updates.wait_all()
    a.zero_grad(); b.zero_grad()
    stats = a.layer_stats()
    assert [s["unit"] for s in stats] == a.unit_names()
    assert all(s["optimizer_step"] == 2 for s in stats)
    assert out.layer_stats is not None and {s["unit"] for s in out.layer_stats} <= set(a.unit_names())
    pa = dict(a.named_parameters())
    for n, p in b.named_parameters():   # gathering them changes nothing in the training
        assert torch.equal(pa[n], p), n
    if clip is not None:   # the clipped gradient's norm, from the norm share: the global norm agrees
        total = sum(s["grad_norm"] ** 2 for s in stats) ** 0.5
        assert total == pytest.approx(min(out.grad_norm, clip), rel=1e-4)
    a.close(); b.close()


def test_the_config_switches_layer_stats_on_from_the_first_step():
    model = AutoModelForCausalLM.from_config(family_config("llama", layers=2, hidden=64))
    e = StreamingEngine(model, EngineConfig(device="cpu", layer_stats=True))
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    out = e.forward_backward(ids, step_lr=1e-3)
    e.updates.wait_all()
    assert [s["unit"] for s in e.layer_stats()] == e.unit_names() and out.layer_stats is not None
    with pytest.raises(ValueError, match="layer_stats"):
        EngineConfig(device="cpu", layer_stats="yes")
    e.configure(weight_decay=0.25)   # a branch's own weight decay, from the next step
    assert e.adam.weight_decay == 0.25 == e.config.weight_decay
    with pytest.raises(ValueError, match="must be a finite number >= 0"):
        e.configure(weight_decay=-1)
    with pytest.raises(ValueError, match="configure\\(\\) changes only layer_stats, weight_decay"):
        e.configure(precision="bf16")
    assert e.adam.weight_decay == 0.25 and e.config.precision == "fp32"
    e.close()


def test_unit_stats_takes_a_known_grad_norm():

    class U:   # what unit_stats reads of a unit
        name, index, kind, numel, params = "layers.0", 1, "layer", 1000, []
    p, g = torch.randn(1000), torch.randn(1000)
    old = p[::1].clone()
    assert unit_stats(U, p, g, old)["grad_norm"] == pytest.approx(float(g.norm()))
    assert unit_stats(U, p, g, old, grad_norm=3.0)["grad_norm"] == 3.0
