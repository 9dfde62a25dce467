"""Packed rows (several documents per row, per-document position ids, no attention mask): the
engine hands ``position_ids`` to the model's own forward, so its gradients match Hugging Face
autograd on the same packed input, and equal those of the documents run one by one."""
import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatrain_nb.engine import EngineConfig, StreamingEngine

from megatrain_nb.model_configs import FAMILY_VOCAB as VOCAB, family_config

LENGTHS = (5, 7, 4)


def _packed():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCAB, (1, sum(LENGTHS)), generator=g)
    pos = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    labels = ids.clone()
    labels[pos == 0] = -100   # no target across a document boundary (TRL's padding-free collator)
    return ids, pos, labels


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _worst(engine, ref):
    return max(float((g - ref[n]).norm() / (ref[n].norm() + 1e-12)) for n, g in engine.named_gradients())


@pytest.mark.parametrize("k", [0, 1])
def test_packed_rows_match_hf_and_separate_documents(k):
    model = AutoModelForCausalLM.from_config(family_config("llama")).eval()
    ids, pos, labels = _packed()
    ref = copy.deepcopy(model)
    out = ref(input_ids=ids, position_ids=pos, labels=labels, use_cache=False)
    n_targets = int((labels[:, 1:] != -100).sum())
    (out.loss * n_targets).backward()
    packed_grads = _grads(ref)

    sep = copy.deepcopy(model)   # each document alone: the sum of its token losses
    start = 0
    for n in LENGTHS:
        d = ids[:, start:start + n]
        o = sep(input_ids=d, labels=d, use_cache=False)
        (o.loss * (n - 1)).backward()
        start += n
    for name, g in _grads(sep).items():   # packing keeps the documents apart
        assert torch.allclose(g, packed_grads[name], rtol=1e-4, atol=1e-6), name

    engine = StreamingEngine(model, EngineConfig(device="cpu", checkpoint_interval=k))
    got = engine.forward_backward(ids, labels=labels, position_ids=pos, num_items_in_batch=1)
    assert got.num_tokens == n_targets
    assert got.loss == pytest.approx(float(out.loss), rel=1e-5)
    assert _worst(engine, packed_grads) <= 1e-4
    # a window of packed micro-batches (layer-major) gives the same sums
    engine.zero_grad()
    engine.forward_backward([{"input_ids": ids, "labels": labels, "position_ids": pos}] * 2, num_items_in_batch=2)
    assert _worst(engine, packed_grads) <= 1e-4
    engine.close()


def test_without_position_ids_documents_would_mix():
    """The check can fail: the same row without its position ids is one long document."""
    model = AutoModelForCausalLM.from_config(family_config("llama")).eval()
    ids, pos, labels = _packed()
    ref = copy.deepcopy(model)
    (ref(input_ids=ids, position_ids=pos, labels=labels, use_cache=False).loss).backward()
    engine = StreamingEngine(model, EngineConfig(device="cpu"))
    engine.forward_backward(ids, labels=labels)
    assert _worst(engine, _grads(ref)) > 1e-2
    engine.close()


def test_bad_position_ids_are_refused():
    model = AutoModelForCausalLM.from_config(family_config("llama")).eval()
    ids, pos, labels = _packed()
    engine = StreamingEngine(model, EngineConfig(device="cpu"))
    with pytest.raises(ValueError, match="shaped like input_ids"):
        engine.forward_backward(ids, labels=labels, position_ids=pos[:, :-1])
    with pytest.raises(ValueError, match="carry no attention mask"):
        engine.forward_backward(ids, attention_mask=torch.ones_like(ids), labels=labels, position_ids=pos)
    engine.close()
