"""Vision-language models through the streaming engine (engine/vision.py): the loss and every
parameter's gradient (vision tower and projector included) against the model's own forward and
backward, AdamW steps against torch.optim.AdamW, a frozen vision tower, and the refusals."""
import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

from megatrain_nb.engine import EngineConfig, StreamingEngine
from megatrain_nb.model_configs import family_config
from megatrain_nb.sweep.vision import TINY_TEXT, tiny_vlm, vlm_batch

# The tiny configs and processor-shaped batches are the registry sweep's (megatrain_nb/sweep/vision.py).
_TEXT = TINY_TEXT


def _llava(feature_layer=-2):
    return tiny_vlm("llava", vision_feature_layer=feature_layer)


def _batch(family, seed=1):
    """Two rows (the second right-padded) with one image each, as the family's processor gives them."""
    return vlm_batch(family, seed)


def _model(family):
    return tiny_vlm(family)


def _reference(model, batch):
    ref = copy.deepcopy(model)
    out = ref(**batch)
    out.loss.backward()
    return float(out.loss), {n: p.grad for n, p in ref.named_parameters()}


def _max_rel_err(engine, grads):
    worst, seen = 0.0, set()
    for name, g in engine.named_gradients():
        seen.add(name)
        r = grads[name] if grads[name] is not None else torch.zeros_like(g)   # a part the forward does not use
        worst = max(worst, float((g - r).norm() / (r.norm() + 1e-12)))
    assert seen == set(grads), f"names differ: {seen ^ set(grads)}"
    return worst


def _vision_names(model):
    return [n for n, _ in model.named_parameters()
            if any(part in n for part in (".visual.", "vision_tower", "projector", "vision_model", "connector"))]


@pytest.mark.parametrize("family", ["llava", "llava_next", "qwen2_vl", "qwen2_5_vl", "gemma3", "idefics3", "smolvlm"])
@pytest.mark.parametrize("k", [1, 2])
def test_gradients_match_the_models_own(family, k):
    model = _model(family)
    batch = _batch(family)
    ref_loss, ref_grads = _reference(model, batch)
    vision = _vision_names(model)
    used = [n for n in vision if ref_grads[n] is not None]   # (LLaVA's CLIP layer after vision_feature_layer is not)
    assert len(used) >= len(vision) // 2
    engine = StreamingEngine(model, EngineConfig(device="cpu", checkpoint_interval=k))
    out = engine.forward_backward(batch)
    assert out.loss == pytest.approx(ref_loss, rel=1e-5)
    assert _max_rel_err(engine, ref_grads) <= 1e-4
    grads = dict(engine.named_gradients())
    assert sum(float(grads[n].norm()) for n in vision) > 0   # the images reached the loss
    engine.close()


def test_images_change_the_gradients():
    """The comparison can fail: other pixels give other vision-tower gradients."""
    model = _model("qwen2_vl")
    batch = _batch("qwen2_vl")
    _, ref_grads = _reference(model, dict(batch, pixel_values=batch["pixel_values"].flip(0)))
    engine = StreamingEngine(model, EngineConfig(device="cpu"))
    engine.forward_backward(batch)
    assert _max_rel_err(engine, ref_grads) > 1e-2
    engine.close()


def _adamw(model, wd):
    from transformers import Trainer

    decay = set(Trainer.get_decay_parameter_names(None, model))
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return torch.optim.AdamW([{"params": [p for n, p in params if n in decay], "weight_decay": wd},
                              {"params": [p for n, p in params if n not in decay], "weight_decay": 0.0}],
                             lr=3e-3, betas=(0.9, 0.95), eps=1e-8)


@pytest.mark.parametrize("family,frozen", [("llava", False), ("qwen2_vl", False), ("qwen2_vl", True),
                                           ("qwen2_vl", "all but the projector")])
def test_adamw_steps_match_torch_adamw(family, frozen):
    """Three steps on two batches; with ``frozen`` the vision tower is frozen by the user: its
    weights stay bit-identical and the rest trains as torch's AdamW trains it. "all but the
    projector": the first stage of the usual two-stage recipe (only the merger trains)."""
    model = _llava(feature_layer=-1) if family == "llava" else _model(family)   # every parameter used
    vision = _vision_names(model)
    if frozen:
        for n, p in model.named_parameters():
            if n in vision if frozen is True else ".merger." not in n:
                p.requires_grad_(False)
    ref = copy.deepcopy(model)
    opt = _adamw(ref, 0.1)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = StreamingEngine(model, EngineConfig(device="cpu", adam_betas=(0.9, 0.95), weight_decay=0.1))
    for step in range(3):
        batch = _batch(family, seed=step % 2)
        out = ref(**batch)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        assert engine.forward_backward(batch).loss == pytest.approx(float(out.loss), rel=1e-5)
        engine.optimizer_step(3e-3)
        engine.zero_grad()
    mine, refp = dict(engine.named_parameters()), dict(ref.named_parameters())
    for n, p in refp.items():
        if n.endswith("self_attn.k_proj.bias"):   # CLIP's key bias: its gradient is 0 (softmax takes no shift),
            # so AdamW normalises round-off on either side; each step moves it by at most the learning rate
            assert float((mine[n] - start[n]).abs().max()) <= 3 * 3e-3 * 1.01, n
            continue
        assert float((mine[n] - p).abs().max()) <= 1e-5 * max(1.0, float(p.abs().max())), n
    moved = [n for n in mine if not torch.equal(mine[n], start[n])]
    if frozen == "all but the projector":
        assert sorted(moved) == sorted(n for n in mine if ".merger." in n)
    else:
        moved = [n for n in vision if n in moved]   # (CLIP's post_layernorm is never used)
        assert moved == [] if frozen else len(moved) >= len(vision) - 2, moved
    engine.close()


def test_unsupported_family_refused_by_name():
    cfg = AutoConfig.for_model("paligemma", text_config=dict(model_type="gemma", **_TEXT),
                               vision_config=dict(model_type="siglip_vision_model", hidden_size=32,
                                                  intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                                  image_size=16, patch_size=4))
    model = AutoModelForImageTextToText.from_config(cfg)
    with pytest.raises(TypeError, match=r"PaliGemmaForConditionalGeneration \(model_type 'paligemma'\).*llava"):
        StreamingEngine(model, EngineConfig(device="cpu"))


def test_inputs_the_model_does_not_take_are_refused():
    text = StreamingEngine(AutoModelForCausalLM.from_config(family_config("llama")), EngineConfig(device="cpu"))
    ids = torch.randint(1, 100, (1, 8))
    with pytest.raises(ValueError, match=r"takes no extra inputs \['pixel_values'\]"):
        text.forward_backward({"input_ids": ids, "pixel_values": torch.randn(1, 3, 16, 16)})
    text.close()
    engine = StreamingEngine(_model("llava"), EngineConfig(device="cpu"))
    batch = _batch("llava")
    with pytest.raises(ValueError, match=r"forward takes no \['image_grid_thw'\]"):
        engine.forward_backward(dict(batch, image_grid_thw=torch.tensor([[1, 4, 4]])))
    with pytest.raises(ValueError, match="image tokens .* but no pixel_values"):
        engine.forward_backward({k: v for k, v in batch.items() if k != "pixel_values"})
    engine.close()


def test_evaluate_and_logits_take_the_images_and_training_goes_on_after_a_refusal():
    model = _model("qwen2_vl")
    batch = _batch("qwen2_vl")
    ref = copy.deepcopy(model)
    with torch.no_grad():
        out = ref(**batch)
    engine = StreamingEngine(model, EngineConfig(device="cpu"))
    with pytest.raises(ValueError, match=r"forward takes no \['image_sizes'\]"):
        engine.forward_backward(dict(batch, image_sizes=torch.tensor([[16, 16]])))
    assert engine.evaluate(batch).loss == pytest.approx(float(out.loss), rel=1e-5)
    logits = engine.forward_logits({k: v for k, v in batch.items() if k != "labels"})
    torch.testing.assert_close(logits, out.logits, rtol=1e-5, atol=1e-5)
    _, ref_grads = _reference(ref, batch)
    assert engine.forward_backward([batch]).loss == pytest.approx(float(out.loss), rel=1e-5)
    assert _max_rel_err(engine, ref_grads) <= 1e-4
    engine.close()


@pytest.mark.parametrize("family", ["qwen2_vl", "gemma3"])
def test_a_window_of_image_batches_matches_accumulated_hf_gradients(family):
    """Two micro-batches with their images, layer-major (checkpoint interval 0 for gemma3, so
    every layer's graph is kept): the gradient of the window's summed token loss over its target
    tokens, as transformers.Trainer accumulates it."""
    model = _model(family)
    window = [_batch(family, seed=1), _batch(family, seed=2)]
    counts = [int((b["labels"][:, 1:] != -100).sum()) for b in window]
    ref = copy.deepcopy(model)
    total = 0.0
    for b, n in zip(window, counts):
        out = ref(**b)
        (out.loss * n / sum(counts)).backward()
        total += float(out.loss) * n
    engine = StreamingEngine(model, EngineConfig(device="cpu", checkpoint_interval=0 if family == "gemma3" else 1))
    out = engine.forward_backward(window)
    assert out.num_tokens == sum(counts)
    assert out.loss == pytest.approx(total / sum(counts), rel=1e-5)
    assert _max_rel_err(engine, {n: p.grad for n, p in ref.named_parameters()}) <= 1e-4
    engine.close()


def test_save_pretrained_loads_back_as_the_vision_language_model(tmp_path):
    engine = StreamingEngine(_model("llava"), EngineConfig(device="cpu"))
    engine.forward_backward(_batch("llava"), step_lr=1e-2)
    engine.save_pretrained(tmp_path / "out")
    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "out")
    assert type(loaded).__name__ == "LlavaForConditionalGeneration"
    mine = dict(engine.named_parameters())
    theirs = dict(loaded.named_parameters())
    assert set(mine) == set(theirs)
    assert all(torch.equal(mine[n], theirs[n]) for n in mine)
    engine.close()
