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


@pytest.mark.slow   # (two engines, two windows each, the disk tier: seconds)
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


def _text_only(seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 140, (2, 16), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


_SLOW = pytest.mark.slow


@pytest.mark.parametrize("family,wd", [("qwen2_vl", 0.0), pytest.param("qwen2_vl", 0.1, marks=_SLOW),
                                       pytest.param("llava", 0.1, marks=_SLOW)])
def test_what_a_step_never_reached_stays_as_torch_adamw_leaves_it(family, wd):
    """Image, text-only, text-only, image batches, a step each: torch.optim.AdamW over the
    model skips a parameter whose gradient is None (the vision tower and projector in a
    text-only step: no move, no weight decay, no step counted), and so does the engine; with
    weight decay 0 a text-only step leaves the vision tower bit for bit. LLaVA's CLIP layer
    after vision_feature_layer=-2 is never reached: it never moves, even with weight decay."""
    from tests.engine.test_vlm import _adamw, _vision_names

    model = _model(family)
    ref = copy.deepcopy(model)
    opt = _adamw(ref, wd)
    vision = _vision_names(model)
    engine = StreamingEngine(model, EngineConfig(device="cpu", adam_betas=(0.9, 0.95), weight_decay=wd))
    batches = [_batch(family, seed=1), _text_only(2), _text_only(3), _batch(family, seed=4)]
    for i, batch in enumerate(batches):
        before = {n: w.clone() for n, w in engine.named_parameters()}
        out = ref(**batch)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        engine.forward_backward(batch, step_lr=3e-3)
        mine, theirs = dict(engine.named_parameters()), dict(ref.named_parameters())
        for n, p in theirs.items():
            if n.endswith("self_attn.k_proj.bias"):   # (a zero gradient: AdamW normalises round-off; test_vlm)
                continue
            assert float((mine[n] - p).abs().max()) <= 1e-5 * max(1.0, float(p.abs().max())), (i, n)
        if "pixel_values" not in batch:
            assert all(torch.equal(mine[n], before[n]) for n in vision), i
    engine.close()


@pytest.mark.slow   # (three steps of two engines and a checkpoint)
def test_a_checkpoint_keeps_the_step_counts_of_what_a_step_left_alone(tmp_path):
    """After an image step and a text-only step the vision tower has taken one step fewer than
    the rest (its own bias correction): a checkpoint keeps that, so the run resumed steps the
    same weights as the run that went on."""
    model = _model("qwen2_vl")
    twin = copy.deepcopy(model)
    engine = StreamingEngine(model, EngineConfig(device="cpu"))
    for batch in (_batch("qwen2_vl", seed=1), _text_only(2)):
        engine.forward_backward(batch, step_lr=3e-3)
    engine.zero_grad()   # (waits for the step's updates, which run behind the call)
    assert any(engine.adam.lags.values())
    engine.save_checkpoint(tmp_path / "ck")
    resumed = StreamingEngine(twin, EngineConfig(device="cpu"))
    resumed.load_checkpoint(tmp_path / "ck")
    assert resumed.adam.lags == {i: lags for i, lags in engine.adam.lags.items()}
    for e in (engine, resumed):
        e.forward_backward(_batch("qwen2_vl", seed=3), step_lr=3e-3)
    theirs = dict(resumed.named_parameters())
    assert all(torch.equal(w, theirs[n]) for n, w in engine.named_parameters())
    engine.close()
    resumed.close()
