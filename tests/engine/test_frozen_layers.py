"""A frozen part inside the decoder layers (``EngineConfig.frozen`` naming a layer's MLP, a whole
layer, or a vision-language model's language model) takes no weight-gradient work in the layer's
backward: autograd is asked for the input's gradient and the trained weights' only (counted: the
backward's inputs and the matmul FLOPs, which drop by exactly the frozen weights' gradient
products), the other gradients are the Hugging Face model's own with ``requires_grad=False`` on
those parameters, and the frozen weights stay bit-identical through AdamW steps that match
``torch.optim.AdamW``."""
import contextlib
import copy

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM

from megatrain_nb.engine import EngineConfig, StreamingEngine
from megatrain_nb.engine.vision import frozen_names
from megatrain_nb.model_configs import FAMILY_VOCAB as VOCAB, family_config
from tests.engine.test_vision_lr import BETAS, WD, _groups, _train_both
from tests.engine.test_vlm import _batch, _max_rel_err, _model, _reference

ROWS, SEQ = 2, 12


def _llama():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(family_config("llama", layers=2))


def _batch_llm(seed=0):
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def _counted(engine, batch, monkeypatch, flops: bool = True):
    """(the step's FLOPs -- None unless ``flops`` --, the number of tensors each layer backward
    asked autograd for)."""
    asked, backward = [], torch.autograd.backward

    def counting(*args, **kw):
        if kw.get("inputs") is not None:   # a layer's backward names its inputs; the outer ones do not
            asked.append(len(kw["inputs"]))
        return backward(*args, **kw)

    monkeypatch.setattr(torch.autograd, "backward", counting)
    with FlopCounterMode(display=False) if flops else contextlib.nullcontext() as counter:
        engine.forward_backward(batch)
    monkeypatch.setattr(torch.autograd, "backward", backward)
    return (counter.get_total_flops() if flops else None), asked


@pytest.mark.slow   # (two engines under the FLOP counter: ~2 s; the next test is the fast check)
@pytest.mark.parametrize("entry,asked", [("model.layers.*.mlp", [7, 7]), ("model.layers.1", [1, 10])])
def test_a_frozen_weight_takes_no_weight_gradient_work(entry, asked, monkeypatch):
    """Llama, two layers: the unfrozen backward asks each layer for 10 tensors (the input and its 9
    weights); the MLPs frozen, 7 (gate, up, down left out); layer 1 wholly frozen, its input's
    gradient only. The FLOPs drop by exactly 2 x tokens x each frozen matrix's size: the weight
    gradients' matmuls, and nothing else (the input gradients still flow through them)."""
    model = _llama()
    whole = StreamingEngine(copy.deepcopy(model), EngineConfig(device="cpu"))
    full_flops, full_asked = _counted(whole, _batch_llm(), monkeypatch)
    whole.close()
    engine = StreamingEngine(copy.deepcopy(model), EngineConfig(device="cpu", frozen=(entry,)))
    got_flops, got_asked = _counted(engine, _batch_llm(), monkeypatch)
    engine.close()
    frozen = frozen_names(model, [entry])
    matrices = sum(p.numel() for n, p in model.named_parameters() if n in frozen and p.dim() == 2)
    assert full_asked == [10, 10] and got_asked == asked
    assert full_flops - got_flops == 2 * ROWS * SEQ * matrices > 0


def test_a_layer_backward_asks_for_its_input_and_trained_weights_only(monkeypatch):
    """The MLPs frozen: each Llama layer's backward asks autograd for 7 tensors (its input, the
    attention's 4 matrices, the 2 norms), not 10."""
    engine = StreamingEngine(_llama(), EngineConfig(device="cpu", frozen=("model.layers.*.mlp",)))
    assert _counted(engine, _batch_llm(), monkeypatch, flops=False)[1] == [7, 7]
    engine.close()


def _hf_frozen(model, names):
    ref = copy.deepcopy(model)
    for n, p in ref.named_parameters():
        p.requires_grad_(n not in names)
    return ref


@pytest.mark.parametrize("k", [0, 1, 2])
@pytest.mark.parametrize("entry", ["model.layers.*.mlp", "model.layers.0"])
def test_gradients_are_the_models_own_with_the_part_frozen(entry, k):
    """Loss and every gradient against HF's forward and backward with requires_grad=False on the
    frozen part (its gradient None there, zero here), checkpoint intervals 0 (graphs kept), 1, 2."""
    model = _llama()
    names = frozen_names(model, [entry])
    loss, grads = _reference(_hf_frozen(model, names), _batch_llm())
    engine = StreamingEngine(model, EngineConfig(device="cpu", frozen=(entry,), checkpoint_interval=k))
    out = engine.forward_backward(_batch_llm())
    assert out.loss == pytest.approx(loss, rel=1e-6)
    assert _max_rel_err(engine, grads) <= 1e-5
    assert all(float(g.abs().max()) == 0 for n, g in engine.named_gradients() if n in names)
    engine.close()


def test_adamw_steps_keep_the_frozen_weights_bit_for_bit():
    """Three AdamW steps (weight decay 0.1) with the MLPs frozen against torch.optim.AdamW over
    the HF model with requires_grad=False there: the frozen weights bit-identical to the start,
    the rest equal to torch's to round-off (and moved)."""
    model = _llama()
    names = frozen_names(model, ["model.layers.*.mlp"])
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    ref = _hf_frozen(model, names)
    opt = _groups(ref, {})   # (a parameter whose gradient is None: torch leaves it alone)
    engine = StreamingEngine(model, EngineConfig(device="cpu", frozen=("model.layers.*.mlp",), weight_decay=WD,
                                                 adam_betas=BETAS))
    _train_both(engine, ref, opt, [_batch_llm(seed) for seed in range(3)])
    mine, theirs = dict(engine.named_parameters()), dict(ref.named_parameters())
    for n in names:
        assert torch.equal(mine[n], start[n]) and torch.equal(theirs[n], start[n])
    moved = [n for n in start if n not in names]
    assert all(not torch.equal(mine[n], start[n]) for n in moved)
    assert max(float((mine[n] - theirs[n]).abs().max()) for n in moved) <= 1e-5
    engine.close()


@pytest.mark.slow   # (the FLOP counter over two Qwen2-VL steps: ~2 s)
def test_only_the_vision_tower_trains_and_the_language_model_runs_input_gradients_only(monkeypatch):
    """Qwen2-VL with its language model frozen (the tower and projector train): every decoder
    layer's backward asks autograd for its input only (and the arguments needing gradients), the
    tower's and projector's gradients are HF's own with the language model's requires_grad off."""
    model = _model("qwen2_vl")
    names = frozen_names(model, ["language_model"])
    loss, grads = _reference(_hf_frozen(model, names), _batch("qwen2_vl"))
    engine = StreamingEngine(model, EngineConfig(device="cpu", frozen=("language_model",)))
    _, asked = _counted(engine, _batch("qwen2_vl"), monkeypatch)
    layers = model.config.text_config.num_hidden_layers
    assert asked == [1] * layers
    engine.zero_grad()
    assert engine.forward_backward(_batch("qwen2_vl")).loss == pytest.approx(loss, rel=1e-6)
    assert _max_rel_err(engine, grads) <= 1e-4
    engine.close()
