"""Layer statistics are gathered only once asked (they cost the optimizer two passes per unit);
with clipping their gradient norm comes from the backward's norm share."""
import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatrain_nb.engine import EngineConfig, StreamingEngine
from megatrain_nb.engine.optimizer import unit_stats

from megatrain_nb.model_configs import FAMILY_VOCAB as VOCAB, family_config


@pytest.mark.parametrize("clip", [None, 0.5])
def test_layer_stats_gathered_once_asked_and_training_unchanged(clip):
    model = AutoModelForCausalLM.from_config(family_config("llama", layers=2, hidden=64))
    a = StreamingEngine(copy.deepcopy(model), EngineConfig(device="cpu"))
    b = StreamingEngine(model, EngineConfig(device="cpu"))
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    for e in (a, b):
        e.forward_backward(ids, step_lr=1e-3, max_grad_norm=clip)
        e.zero_grad()
    assert a.adam.stats == {} and a.layer_stats() == []   # nobody asked: none gathered
    out = a.forward_backward(ids, step_lr=1e-3, max_grad_norm=clip)
    b.forward_backward(ids, step_lr=1e-3, max_grad_norm=clip)
    a.zero_grad(); b.zero_grad()
    stats = a.layer_stats()
    assert [s["unit"] for s in stats] == a.unit_names()
    assert all(s["optimizer_step"] == 2 for s in stats)
    pa = dict(a.named_parameters())
    for n, p in b.named_parameters():   # gathering them changes nothing in the training
        assert torch.equal(pa[n], p), n
    if clip is not None:   # the clipped gradient's norm, from the norm share: the global norm agrees
        total = sum(s["grad_norm"] ** 2 for s in stats) ** 0.5
        assert total == pytest.approx(min(out.grad_norm, clip), rel=1e-4)
    a.close(); b.close()


def test_unit_stats_takes_a_known_grad_norm():

    class U:   # what unit_stats reads of a unit
        name, index, kind, numel = "layers.0", 1, "layer", 1000
    p, g = torch.randn(1000), torch.randn(1000)
    old = p[::1].clone()
    assert unit_stats(U, p, g, old)["grad_norm"] == pytest.approx(float(g.norm()))
    assert unit_stats(U, p, g, old, grad_norm=3.0)["grad_norm"] == 3.0
