"""The vision tower run by blocks (engine/vision.ImageFeatures ``by_blocks``), the engine's
placement where the tower's whole graph does not fit the device budget
(planning/vision_plan.place_vision): each block under activation checkpointing, its input kept
from the capture and the block run again in the embedding's backward. The gradients are the
model's own, every parameter, at checkpoint intervals 1 and 2; each block runs twice per
micro-batch; the held bytes are the blocks' inputs, not the whole graph; the planner's decision
switches it on and the run header says so."""
import pytest

from megatrain_nb.engine import EngineConfig, StreamingEngine
from megatrain_nb.engine.planning.planner import ModelShape, UnitSpec, Workload, make_plan
from megatrain_nb.engine.vision import tower_blocks
from tests.engine.test_vlm import _batch, _max_rel_err, _model, _reference

FAMILIES = ["llava", "llava_next", "qwen2_vl", "qwen2_5_vl", "gemma3", "idefics3", "smolvlm"]


def _count_block_runs(model):
    """Runs of the tower's blocks: a pre-hook on each block's first submodule (a recompute under
    checkpointing calls the block's forward directly, not the block's hooks)."""
    runs = []
    for block in tower_blocks(model.model):
        next(block.children()).register_forward_pre_hook(lambda *_: runs.append(1))
    return runs


@pytest.mark.parametrize("family", [f if f in ("qwen2_vl", "llava") else pytest.param(f, marks=pytest.mark.slow)
                                    for f in FAMILIES])
@pytest.mark.parametrize("k", [1, 2])
def test_the_tower_by_blocks_gives_the_models_own_gradients(family, k):
    model = _model(family)
    batch = _batch(family)
    ref_loss, ref_grads = _reference(model, batch)
    blocks = len(tower_blocks(model.model))
    assert blocks >= 2
    # (the blocks the loss reaches: LLaVA's CLIP layer after vision_feature_layer is not, and is not re-run)
    ids = {id(p): n for n, p in model.named_parameters()}
    used = sum(1 for b in tower_blocks(model.model) if any(ref_grads[ids[id(p)]] is not None for p in b.parameters()))
    runs = _count_block_runs(model)
    engine = StreamingEngine(model, EngineConfig(device="cpu", checkpoint_interval=k))
    engine.runner.images.by_blocks = True   # (the planner's choice under a tight budget: below)
    out = engine.forward_backward(batch)
    assert out.loss == pytest.approx(ref_loss, rel=1e-5)
    assert _max_rel_err(engine, ref_grads) <= 1e-4
    assert len(runs) == blocks + used   # the capture, then each block again in the embedding's backward
    engine.close()


def _held_in_capture(engine, model, batch) -> int:
    seen = []
    hook = model.model.language_model.layers[0].register_forward_hook(lambda *_: seen.append(engine.runner.meter.held))
    engine.forward_backward(batch)
    hook.remove()
    return seen[0]


def test_by_blocks_holds_the_blocks_inputs_not_the_whole_graph():
    """Qwen2-VL: held from the capture, by blocks, the blocks' inputs (depth x patches x width x
    4 bytes) and what the patch embedding and merger save, well under the whole graph."""
    family = "qwen2_vl"
    batch = _batch(family)
    whole_model, blocks_model = _model(family), _model(family)
    whole = StreamingEngine(whole_model, EngineConfig(device="cpu"))
    held_whole = _held_in_capture(whole, whole_model, batch)
    whole.close()
    engine = StreamingEngine(blocks_model, EngineConfig(device="cpu"))
    engine.runner.images.by_blocks = True
    held = _held_in_capture(engine, blocks_model, batch)
    engine.close()
    vc = blocks_model.config.vision_config
    inputs = vc.depth * batch["pixel_values"].shape[0] * vc.embed_dim * 4
    assert inputs <= held < held_whole / 2


def test_the_planner_runs_the_tower_by_blocks_where_its_graph_does_not_fit():
    """A device budget just under the plan with the whole graph resident: the planner picks by
    blocks, the engine runs it so (each block twice) and the run header says which and why; with
    room, resident (each block once)."""
    work = Workload(batch=2, seq=64, image_tokens=16)
    probe = StreamingEngine(_model("qwen2_vl"), EngineConfig(device="cpu"))
    specs = [UnitSpec(u.name, u.numel, u.kind, u.tied_output) for u in probe.parts.units]
    cfg = probe.parts.config.replace(checkpoint_interval=probe.runner.checkpoint_interval)
    total = None
    for _ in range(3):   # (the plan under a budget tiles the MLP by it: the total at the budget it is under)
        at = cfg if total is None else cfg.replace(max_vram_gb=(total - 1) / 2 ** 30)
        total = make_plan(specs, ModelShape.of(probe.model_config), at, cuda=False, workload=work).device["total"]
    probe.close()
    for budget, placed, twice in ((total - 1, "blocks", True), (2 * total, "resident", False)):
        model = _model("qwen2_vl")
        batch = _batch("qwen2_vl")
        _, ref_grads = _reference(model, batch)
        runs = _count_block_runs(model)
        engine = StreamingEngine(model, EngineConfig(device="cpu", max_vram_gb=budget / 2 ** 30), workload=work)
        assert f": {placed} -- resident" in engine.plan.chosen_by
        assert engine.runner.images.by_blocks is twice
        if twice:
            assert "by blocks it needs" in engine.plan.chosen_by
        engine.forward_backward(batch)
        assert len(runs) == (4 if twice else 2)
        assert _max_rel_err(engine, ref_grads) <= 1e-4
        engine.close()
