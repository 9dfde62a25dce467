"""Gradients and losses of the streaming engine against Hugging Face autograd."""
import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatrain_nb.engine import EngineConfig, StreamingEngine

from megatrain_nb.model_configs import FAMILIES, FAMILY_VOCAB as VOCAB, family_config


def _batch(padding: str):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (2, 12), generator=g)
    am = torch.ones_like(ids)
    if padding == "right":
        am[1, 8:] = 0
    elif padding == "left":
        am[1, :4] = 0
    return ids, am


def _reference(model, ids, am):
    ref = copy.deepcopy(model)
    out = ref(input_ids=ids, attention_mask=am, labels=ids.masked_fill(am == 0, -100))
    out.loss.backward()
    return float(out.loss), {n: p.grad for n, p in ref.named_parameters()}


def _max_rel_err(engine, grads):
    worst, seen = 0.0, set()
    for name, g in engine.named_gradients():
        seen.add(name)
        r = grads[name]
        worst = max(worst, float((g - r).norm() / (r.norm() + 1e-12)))
    assert seen == set(grads), f"names differ: {seen ^ set(grads)}"
    return worst


# Hugging Face's loss and gradients per (family, tie, padding): the same model (seed 0, the
# autouse fixture) for every checkpoint interval k, so computed once for the four
_REFERENCES = {}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("k", [0, 1, 2, 3])
@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("tie", [False, True])
def test_gradients_match_hf(family, k, padding, tie):
    model = AutoModelForCausalLM.from_config(family_config(family, tie=tie)).eval()
    ids, am = _batch(padding)
    key = (family, tie, padding)
    if key not in _REFERENCES:
        _REFERENCES[key] = (_reference(model, ids, am), {n: p.clone() for n, p in model.state_dict().items()})
    (ref_loss, ref_grads), weights = _REFERENCES[key]
    assert all(torch.equal(p, weights[n]) for n, p in model.state_dict().items())   # the model it was computed on
    engine = StreamingEngine(model, EngineConfig(device="cpu", checkpoint_interval=k))
    out = engine.forward_backward(ids, attention_mask=am)
    assert out.num_tokens == int((am[:, 1:] == 1).sum())
    assert out.loss == pytest.approx(ref_loss, rel=1e-5)
    assert _max_rel_err(engine, ref_grads) <= 1e-4
    engine.close()


def test_comparison_detects_wrong_gradients():
    """The parity check itself can fail: a different batch gives different gradients."""
    model = AutoModelForCausalLM.from_config(family_config("llama")).eval()
    ids, am = _batch("none")
    _, ref_grads = _reference(model, ids.flip(1), am)
    engine = StreamingEngine(model, EngineConfig(device="cpu"))
    engine.forward_backward(ids, attention_mask=am)
    assert _max_rel_err(engine, ref_grads) > 1e-2


def test_dropout_recompute_matches_hf_in_train_mode():
    cfg = family_config("gpt2")
    cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.2
    model = AutoModelForCausalLM.from_config(cfg).train()
    ids, am = _batch("none")
    torch.manual_seed(123)
    ref_loss, ref_grads = _reference(model, ids, am)
    engine = StreamingEngine(model, EngineConfig(device="cpu", checkpoint_interval=2))
    torch.manual_seed(123)
    out = engine.forward_backward(ids, attention_mask=am)
    assert out.loss == pytest.approx(ref_loss, rel=1e-5)
    assert _max_rel_err(engine, ref_grads) <= 1e-4


def test_gradients_accumulate_over_micro_batches_and_zero_grad():
    model = AutoModelForCausalLM.from_config(family_config("qwen2")).eval()
    ids, am = _batch("right")
    ref = copy.deepcopy(model)
    for _ in range(2):
        ref(input_ids=ids, attention_mask=am, labels=ids.masked_fill(am == 0, -100)).loss.backward()
    engine = StreamingEngine(model, EngineConfig(device="cpu"))
    engine.forward_backward(ids, attention_mask=am)
    engine.forward_backward(ids, attention_mask=am)
    assert _max_rel_err(engine, {n: p.grad for n, p in ref.named_parameters()}) <= 1e-4
    engine.zero_grad()
    assert all(float(g.abs().max()) == 0 for _, g in engine.named_gradients())


def test_custom_loss_fn_and_num_items_in_batch():
    model = AutoModelForCausalLM.from_config(family_config("llama")).eval()
    ids, am = _batch("none")
    ref = copy.deepcopy(model)
    logits = ref(input_ids=ids).logits
    # Custom loss: squared error of the logit of the right token; normalised by 10 tokens.
    tgt = ids[:, 1:]
    ref_sum = ((logits[:, :-1].gather(-1, tgt.unsqueeze(-1)) - 1.0) ** 2).sum()
    (ref_sum / 10).backward()

    def loss_fn(lg, lab):
        mask = lab != -100
        picked = lg.gather(-1, lab.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        return (((picked - 1.0) ** 2) * mask).sum()

    engine = StreamingEngine(model, EngineConfig(device="cpu", overrides={"loss_chunk_tokens": 8}))
    out = engine.forward_backward(ids, loss_fn=loss_fn, num_items_in_batch=10)
    assert out.loss * out.num_tokens == pytest.approx(float(ref_sum), rel=1e-5)
    assert _max_rel_err(engine, {n: p.grad for n, p in ref.named_parameters()}) <= 1e-4
