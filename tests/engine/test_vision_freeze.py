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


def test_a_frozen_part_takes_no_gradient_and_no_adamw_state():
    """The vision tower frozen: its elements leave the embed unit's gradient and AdamW states
    (counted in bytes), the other gradients are the model's own, and the states shrink by its size."""
    from tests.engine.test_vlm import _max_rel_err, _reference

    model = _model("qwen2_vl")
    batch = _batch("qwen2_vl")
    names = frozen_names(model, ["vision_tower"])
    tower = sum(p.numel() for n, p in model.named_parameters() if n in names)
    whole = StreamingEngine(copy.deepcopy(model), EngineConfig(device="cpu"))
    whole.forward_backward(batch, step_lr=1e-3)
    for p in model.parameters():
        p.requires_grad_(True)
    ref = copy.deepcopy(model)
    for n, p in ref.named_parameters():
        p.requires_grad_(n not in names)
    _, ref_grads = _reference(ref, batch)
    engine = StreamingEngine(model, EngineConfig(device="cpu", frozen=("vision_tower",)))
    embed = engine.units[0]
    assert embed.numel - embed.train_numel == tower
    engine.forward_backward(batch)
    assert engine.store.grad(embed).numel() == embed.train_numel
    assert _max_rel_err(engine, ref_grads) <= 1e-4
    assert all(float(g.abs().max()) == 0 for n, g in engine.named_gradients() if n in names)
    engine.optimizer_step(1e-3)
    assert whole.memory_report()["host"]["optimizer_states"] - engine.memory_report()["host"]["optimizer_states"] \
        == 8 * tower
    whole.close()
    engine.close()


@pytest.mark.parametrize("options", [dict(optimizer_compression="int8"), dict(offload_dir=True),
                                     dict(offload_dir=True, offload_params=True, optimizer_compression="int8")])
def test_frozen_parts_through_every_tier_and_a_clipped_window(options, tmp_path):
    """Compressed states, states and weights on the disk tier, a clipped window: the frozen
    vision tower stays bit for bit, the rest moves as in RAM with the same codec."""
    if options.get("offload_dir"):
        options = dict(options, offload_dir=tmp_path)
    model = _model("qwen2_vl")
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    names = frozen_names(model, ["vision_tower"])
    for p in model.parameters():
        p.requires_grad_(True)
    codec = options.get("optimizer_compression", "none")
    plain = StreamingEngine(copy.deepcopy(model), EngineConfig(device="cpu", frozen=("vision_tower",),
                                                               optimizer_compression=codec,
                                                               overrides=dict(plan_by="rules")))
    engine = StreamingEngine(model, EngineConfig(device="cpu", frozen=("vision_tower",),
                                                 overrides=dict(plan_by="rules"), **options))
    window = [_batch("qwen2_vl", seed=1), _batch("qwen2_vl", seed=2)]
    for e in (plain, engine):
        for _ in range(2):
            e.forward_backward(window, step_lr=1e-2, max_grad_norm=0.5)
    mine, theirs = dict(engine.named_parameters()), dict(plain.named_parameters())
    for n, w in mine.items():
        if n in names:
            assert torch.equal(w, start[n]), n
        else:
            assert not torch.equal(w, start[n]), n
            assert float((w - theirs[n]).abs().max()) <= 1e-6, n
    plain.close()
    engine.close()
