"""A processor's extra inputs by keyword (API.md: ``forward_backward(input_ids, attention_mask=...,
labels=..., pixel_values=..., image_grid_thw=...)``) and ``StreamingEngine.from_pretrained`` of a
vision-language model's folder: the model's own gradients."""
import pytest
import torch
from transformers import AutoModelForImageTextToText

from megatrain_nb.engine import EngineConfig, StreamingEngine
from tests.engine.test_vlm import _batch, _max_rel_err, _model, _reference


@pytest.mark.parametrize("family", ["qwen2_vl", "llava_next"])
def test_extra_inputs_by_keyword_give_the_models_own_gradients(family):
    model = _model(family)
    batch = _batch(family)
    ref_loss, ref_grads = _reference(model, batch)
    engine = StreamingEngine(model, EngineConfig(device="cpu"))
    out = engine.forward_backward(**batch)   # input_ids, attention_mask, labels, pixel_values, ...
    assert out.loss == pytest.approx(ref_loss, rel=1e-5)
    assert _max_rel_err(engine, ref_grads) <= 1e-4
    assert engine.evaluate(**batch).loss == pytest.approx(ref_loss, rel=1e-5)
    keys = {k: v for k, v in batch.items() if k != "labels"}
    assert engine.forward_logits(**keys).shape == (*batch["input_ids"].shape, model.config.get_text_config().vocab_size)
    engine.close()


def test_keywords_beside_a_window_or_a_dict_are_refused_by_name():
    engine = StreamingEngine(_model("qwen2_vl"), EngineConfig(device="cpu"))
    batch = _batch("qwen2_vl")
    with pytest.raises(ValueError, match="pixel_values; put each micro-batch's in its dict"):
        engine.forward_backward([batch], pixel_values=batch["pixel_values"])
    with pytest.raises(ValueError, match="model.*forward takes no \\['pixel_sizes'\\]"):
        engine.forward_backward(**batch, pixel_sizes=torch.tensor([[16, 16]]))
    engine.close()


def test_from_pretrained_loads_a_vision_language_folder(tmp_path):
    """save_pretrained of a tiny Qwen2-VL, then StreamingEngine.from_pretrained: the same model
    (AutoModelForImageTextToText), the same loss and gradients as the model's own."""
    model = _model("qwen2_vl")
    model.save_pretrained(tmp_path / "vlm")
    batch = _batch("qwen2_vl")
    ref_loss, ref_grads = _reference(AutoModelForImageTextToText.from_pretrained(tmp_path / "vlm"), batch)
    engine = StreamingEngine.from_pretrained(tmp_path / "vlm", EngineConfig(device="cpu", checkpoint_interval=2))
    assert type(engine.model).__name__ == "Qwen2VLForConditionalGeneration"
    mine = dict(engine.named_parameters())
    assert all(torch.equal(mine[n], p) for n, p in model.named_parameters())
    assert engine.forward_backward(**batch).loss == pytest.approx(ref_loss, rel=1e-5)
    assert _max_rel_err(engine, ref_grads) <= 1e-4
    engine.close()
