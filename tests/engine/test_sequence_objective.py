"""The chunked head's sequence-level objective seam against plain Hugging Face autograd of the
same loss: DPO (a function of per-sequence log-prob sums) over pairs side by side in a batch."""
import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from megatrain_nb.engine import EngineConfig, StreamingEngine
from megatrain_nb.trainer.dpo_loss import DPOObjective, DPOSettings, PairBatch

from megatrain_nb.model_configs import FAMILY_VOCAB as VOCAB, family_config

BETA = 0.1


def _pairs(seed: int = 3, pairs: int = 2, seq: int = 14):
    """Chosen rows then rejected rows; a prompt of 5 tokens, completions of varying length."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (2 * pairs, seq), generator=g)
    am = torch.ones_like(ids)
    comp = torch.zeros_like(ids)
    for r in range(2 * pairs):
        end = seq - (r * 3) % 5
        am[r, end:] = 0
        comp[r, 5:end] = 1
    labels = ids.masked_fill(comp == 0, -100)
    ref = -torch.rand(2 * pairs, generator=g) * 40 - 20
    return ids, am, labels, comp, ref


def _hf_loss(model, ids, am, labels, ref, loss_type):
    logits = model(input_ids=ids, attention_mask=am).logits[:, :-1].float()
    lab = labels[:, 1:]
    lp = torch.log_softmax(logits, -1).gather(-1, lab.clamp(min=0)[..., None])[..., 0] * (lab != -100)
    logps = lp.sum(1)
    c, r = logps.chunk(2)
    rc, rr = ref.chunk(2)
    delta = (c - rc) - (r - rr)
    if loss_type == "sigmoid":
        return -F.logsigmoid(BETA * delta).mean()
    if loss_type == "hinge":
        return torch.relu(1 - BETA * delta).mean()
    return ((c - rc - 0.5 / BETA) ** 2 + (r - rr + 0.5 / BETA) ** 2).mean()   # sppo_hard


def _objective(loss_type, ref, comp, am):
    obj = DPOObjective(DPOSettings(beta=BETA, loss_type=[loss_type]))
    rc, rr = ref.chunk(2)
    return obj, PairBatch(rc, rr, comp.sum(1), int(am.sum()))


def _rel(engine, grads):
    worst = 0.0
    for name, g in engine.named_gradients():
        r = grads[name]
        worst = max(worst, float((g - r).norm() / (r.norm() + 1e-12)))
    return worst


@pytest.mark.parametrize("loss_type,k,chunk,tie", [("sigmoid", 1, 8, False), ("hinge", 0, 4096, True),
                                                  ("sppo_hard", 2, 5, False)])
def test_objective_gradients_match_hf_autograd(loss_type, k, chunk, tie):
    model = AutoModelForCausalLM.from_config(family_config("llama", tie=tie)).eval()
    ids, am, labels, comp, ref = _pairs()
    hf = copy.deepcopy(model)
    loss = _hf_loss(hf, ids, am, labels, ref, loss_type)
    loss.backward()
    grads = {n: p.grad for n, p in hf.named_parameters()}
    engine = StreamingEngine(model, EngineConfig(device="cpu", checkpoint_interval=k,
                                                  overrides={"loss_chunk_tokens": chunk}))
    obj, side = _objective(loss_type, ref, comp, am)
    obj.feed([side])
    engine.forward_backward(ids, attention_mask=am, labels=labels, loss_fn=obj)
    assert obj.losses[0] == pytest.approx(float(loss.detach()), rel=1e-5)
    assert _rel(engine, grads) <= 1e-4
    engine.close()


def test_objective_window_sums_micro_batches():
    """Two micro-batches in one layer-major window: the gradient of the sum of their losses."""
    model = AutoModelForCausalLM.from_config(family_config("llama")).eval()
    batches = [_pairs(seed=s) for s in (3, 4)]
    hf = copy.deepcopy(model)
    total = sum(_hf_loss(hf, ids, am, lab, ref, "sigmoid") for ids, am, lab, _, ref in batches) / 2
    total.backward()
    grads = {n: p.grad for n, p in hf.named_parameters()}
    engine = StreamingEngine(model, EngineConfig(device="cpu", overrides={"loss_chunk_tokens": 6}))
    obj = DPOObjective(DPOSettings(beta=BETA))
    obj.scale = 0.5
    obj.feed([_objective("sigmoid", ref, comp, am)[1] for _, am, _, comp, ref in batches])
    engine.forward_backward([{"input_ids": ids, "attention_mask": am, "labels": lab}
                             for ids, am, lab, _, _ in batches], loss_fn=obj)
    assert sum(obj.losses) == pytest.approx(float(total.detach()), rel=1e-5)
    assert _rel(engine, grads) <= 1e-4
    engine.close()


def test_objective_comparison_can_fail():
    """The check catches a wrong weighting: another beta gives other gradients."""
    model = AutoModelForCausalLM.from_config(family_config("llama")).eval()
    ids, am, labels, comp, ref = _pairs()
    hf = copy.deepcopy(model)
    _hf_loss(hf, ids, am, labels, ref, "sigmoid").backward()
    grads = {n: p.grad for n, p in hf.named_parameters()}
    engine = StreamingEngine(model, EngineConfig(device="cpu"))
    obj = DPOObjective(DPOSettings(beta=1.0))
    obj.feed([_objective("sigmoid", ref, comp, am)[1]])
    engine.forward_backward(ids, attention_mask=am, labels=labels, loss_fn=obj)
    assert _rel(engine, grads) > 1e-2
    engine.close()
