"""The update scheduler's reduce point: every unit's final gradient passes through it exactly
once per step, before its update, on each path (one micro-batch, accumulation, clipping)."""
import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatrain_nb.engine import EngineConfig, StreamingEngine

from megatrain_nb.model_configs import FAMILY_VOCAB as VOCAB, family_config


def _batches(n):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(1, VOCAB, (2, 10), generator=g) for _ in range(n)]


@pytest.mark.parametrize("path", ["single", "accumulate", "clip"])
def test_reduce_point_sees_each_final_gradient_once(path):
    model = AutoModelForCausalLM.from_config(family_config("llama", layers=2)).eval()
    ref = StreamingEngine(copy.deepcopy(model), EngineConfig(device="cpu", weight_decay=0.0))
    eng = StreamingEngine(model, EngineConfig(device="cpu", weight_decay=0.0))
    batches = _batches(2 if path == "accumulate" else 1)
    tokens = 2 * 9 * len(batches)

    # The reference: the same micro-batches without an update; its accumulated gradients are final.
    for ids in batches:
        ref.forward_backward(ids, num_items_in_batch=tokens)
    want = {name: g.clone() for name, g in ref.named_gradients()}
    before = {name: p.clone() for name, p in eng.named_parameters()}

    seen = {}

    def reduce(unit, flat):      # records what reaches the reduce point, then zeroes it
        assert unit.index not in seen, f"{unit.name} reduced twice"
        seen[unit.index] = (unit, flat.clone())
        flat.zero_()
    eng.updates.intake.reduce = reduce

    kw = dict(step_lr=1e-2, max_grad_norm=0.5 if path == "clip" else None)
    for i, ids in enumerate(batches):
        last = i == len(batches) - 1
        eng.forward_backward(ids, num_items_in_batch=tokens, **(kw if last else {}))
    eng.zero_grad()              # waits for the updates

    assert {u.index for u in eng.units if u.numel} == set(seen)
    for unit, flat in seen.values():
        for p in unit.params:
            got = flat[p.offset:p.offset + p.numel].view(p.shape)
            assert torch.allclose(got, want[p.name], atol=1e-6), p.name
    # Zeroed at the reduce point, so AdamW (no weight decay) left every weight where it was.
    for name, p in eng.named_parameters():
        assert torch.equal(p, before[name]), name
    eng.close()
    ref.close()


def test_without_the_hook_the_same_step_moves_the_weights():
    model = AutoModelForCausalLM.from_config(family_config("llama", layers=2)).eval()
    eng = StreamingEngine(model, EngineConfig(device="cpu", weight_decay=0.0))
    before = {name: p.clone() for name, p in eng.named_parameters()}
    eng.forward_backward(_batches(1)[0], step_lr=1e-2)
    moved = max(float((p - before[n]).abs().max()) for n, p in eng.named_parameters())
    assert moved > 1e-3
    eng.close()
