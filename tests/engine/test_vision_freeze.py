"""EngineConfig.frozen (engine/vision.py ``frozen_names``): parts of a vision-language model and
parameter-name prefixes frozen by name; a frozen parameter's weights stay bit-identical, it takes
no gradient and no AdamW state; AdamW leaves alone what a step's backward never reached, as
torch.optim.AdamW skips a parameter whose gradient is None."""
import copy

import pytest
import torch

from megatrain_nb.engine import EngineConfig, StreamingEngine
from megatrain_nb.engine.vision import frozen_names
from tests.engine.test_vlm import _batch, _model


@pytest.mark.parametrize("family,part,expect", [
    ("qwen2_vl", "vision_tower", ("model.visual.patch_embed", "model.visual.blocks")),
    ("qwen2_vl", "projector", ("model.visual.merger",)),
    ("llava", "projector", ("model.multi_modal_projector",)),
    ("llava_next", "projector", ("model.multi_modal_projector", "model.image_newline")),
    ("idefics3", "vision_tower", ("model.vision_model",)),
    ("idefics3", "projector", ("model.connector",)),
    ("gemma3", "language_model", ("model.language_model",)),
    ("llava", "language_model", ("model.language_model", "lm_head"))])
def test_parts_resolve_per_family(family, part, expect):
    model = _model(family)
    names = frozen_names(model, [part])
    assert names and all(n.startswith(expect) for n in names)
    assert {n for n, _ in model.named_parameters() if n.startswith(expect)} == names


def test_an_entry_naming_nothing_is_refused_by_name():
    model = _model("qwen2_vl")
    with pytest.raises(ValueError, match=r"'model.vision'.*vision_tower, projector, language_model"):
        StreamingEngine(model, EngineConfig(device="cpu", frozen=("model.vision",)))
    with pytest.raises(ValueError, match="EngineConfig.frozen"):
        EngineConfig(frozen=("",))
    assert EngineConfig(frozen="projector").frozen == ("projector",)


def test_frozen_parts_keep_their_weights_bit_for_bit_and_the_rest_trains():
    """Stage 1 of the two-stage recipe by name: only Qwen2-VL's merger (the projector) moves."""
    model = _model("qwen2_vl")
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = StreamingEngine(model, EngineConfig(device="cpu", weight_decay=0.1,
                                                 frozen=("vision_tower", "language_model")))
    for seed in (1, 2):
        engine.forward_backward(_batch("qwen2_vl", seed=seed), step_lr=1e-2)
    moved = sorted(n for n, w in engine.named_parameters() if not torch.equal(w, start[n]))
    assert moved == sorted(n for n in start if ".merger." in n)
    engine.close()
