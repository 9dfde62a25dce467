"""The vision tower streamed by blocks (engine/compute/vision_stream.py, the "streamed" placement
of planning/vision_plan.place_vision, forced here by MEGATRAIN_NB_VISION_PLACEMENT): the tower's
blocks are not in the embed unit's device copy; each block is loaded into one of two block slots
for its forward in the capture and again for its re-run in the embedding's backward; its weight
gradients go back to the host into the embed unit's gradient. The gradients and the AdamW steps
are bit-identical to the "blocks" placement (the tower's weights resident, its blocks re-run) and
the model's own; the loads, the slots and the gradients returned are the engine's counts."""
import copy

import pytest
import torch

from megatrain_nb.engine import EngineConfig, StreamingEngine
from megatrain_nb.engine.compute.vision_stream import PLACEMENT_ENV, forced_placement
from megatrain_nb.engine.planning.planner import ModelShape, UnitSpec, Workload, make_plan
from megatrain_nb.engine.planning.vision_plan import vision_placement
from megatrain_nb.engine.vision import tower_blocks
from megatrain_nb.sweep.vision import tiny_vlm
from tests.engine.test_vlm import _batch, _max_rel_err, _model, _reference


def _engine(monkeypatch, placement, model, **config):
    monkeypatch.setenv(PLACEMENT_ENV, placement)
    return StreamingEngine(model, EngineConfig(device="cpu", **config))


def _block_loads(engine, model):
    names = {id(m): n for n, m in model.named_modules()}
    loads = engine.pager.telemetry.loads_per_unit
    return [loads.get(names[id(b)], 0) for b in tower_blocks(model.model)]


def _tower_numels(model):
    return [sum(p.numel() for p in b.parameters()) for b in tower_blocks(model.model)]


def _blocks_run(monkeypatch, family, batch, **config):
    """The "blocks" placement's gradients (and the engine, for its counts; closed)."""
    engine = _engine(monkeypatch, "blocks", _model(family), **config)
    assert engine.runner.images.by_blocks and engine.runner.tower is None
    engine.forward_backward(batch)
    grads = {n: g.clone() for n, g in engine.named_gradients()}
    slot_bytes = engine.pager.slot_bytes
    engine.close()
    return grads, slot_bytes


@pytest.mark.parametrize("family", ["qwen2_vl", pytest.param("gemma3", marks=pytest.mark.slow)])
@pytest.mark.parametrize("k", [1, 2])
def test_streamed_gives_the_blocks_placements_gradients_and_the_models_own(monkeypatch, family, k):
    """Every parameter's gradient bit-identical to the "blocks" placement's, within 1e-4 of the
    model's own; each block loaded twice (capture, backward), at most two block slots held, the
    embed unit's device slot without the tower's blocks."""
    batch = _batch(family)
    want, blocks_slot_bytes = _blocks_run(monkeypatch, family, batch, checkpoint_interval=k)
    model = _model(family)
    ref_loss, ref_grads = _reference(model, batch)
    engine = _engine(monkeypatch, "streamed", model, checkpoint_interval=k)
    assert "vision tower: streamed (forced by" in engine.plan.chosen_by
    tower = engine.runner.tower
    out = engine.forward_backward(batch)
    assert out.loss == pytest.approx(ref_loss, rel=1e-5)
    got = dict(engine.named_gradients())
    assert set(got) == set(want) and all(torch.equal(got[n], want[n]) for n in want)
    assert _max_rel_err(engine, ref_grads) <= 1e-4
    numels = _tower_numels(model)
    assert len(numels) >= 2 and _block_loads(engine, model) == [2] * len(numels)
    assert tower.peak_slots == 2 and tower.slot_bytes == max(numels) * 4   # (fp32 compute on a CPU "device")
    assert tower.grads_returned == len(numels)
    # the engine's device slots: the embed unit's without the tower's blocks, two block slots beside
    embed = engine.units[0]
    assert engine.pager.pools["embed"][0].buf.numel() == tower.trunk.numel == embed.numel - sum(numels)
    assert engine.pager.slot_bytes == blocks_slot_bytes - sum(numels) * 4
    device = engine.memory_report()["device"]   # (the engine's accounting: the block slots among the weights)
    assert device["vision_block_slots"] == 2 * max(numels) * 4
    assert device["weights"] == engine.pager.slot_bytes + 2 * max(numels) * 4
    engine.close()


def test_a_window_of_two_micro_batches_and_its_adamw_steps_match_the_blocks_placement(monkeypatch):
    """Qwen2-VL, two micro-batches a step, two steps with AdamW: each block loaded twice per
    micro-batch, each block's gradient sent once per micro-batch, and the weights after the
    steps bit-identical to the "blocks" placement's."""
    windows = [[_batch("qwen2_vl", seed=1), _batch("qwen2_vl", seed=2)],
               [_batch("qwen2_vl", seed=3), _batch("qwen2_vl", seed=1)]]
    model = _model("qwen2_vl")
    weights = {}
    for placement in ("blocks", "streamed"):
        engine = _engine(monkeypatch, placement, copy.deepcopy(model), weight_decay=0.1)
        losses = [engine.forward_backward(w, step_lr=1e-2).loss for w in windows]
        weights[placement] = ({n: p.clone() for n, p in engine.named_parameters()}, losses)
        if placement == "streamed":
            assert _block_loads(engine, model) == [2 * 2 * 2] * len(_tower_numels(model))
            assert engine.runner.tower.grads_returned == 2 * 2 * len(_tower_numels(model))
        engine.close()
    (a, la), (b, lb) = weights["blocks"], weights["streamed"]
    assert la == lb
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert any(not torch.equal(a[n], p.detach()) for n, p in model.named_parameters() if ".visual.blocks." in n)


def test_a_micro_batch_without_room_for_its_graph_streams_its_tower_three_times(monkeypatch):
    """keep=1 of a window of two: the second micro-batch's tower runs again in the embedding's
    backward (capture without a graph, the forward again with its blocks' inputs, the re-run):
    its blocks are loaded three times; the gradients the same as the "blocks" placement's."""
    window = [_batch("qwen2_vl", seed=1), _batch("qwen2_vl", seed=2)]
    want, _ = _blocks_run(monkeypatch, "qwen2_vl", window)
    model = _model("qwen2_vl")
    engine = _engine(monkeypatch, "streamed", model)
    engine.runner.images.keep = 1
    engine.forward_backward(window)
    got = dict(engine.named_gradients())
    assert all(torch.equal(got[n], want[n]) for n in want)
    assert _block_loads(engine, model) == [2 + 3] * len(_tower_numels(model))
    engine.close()


def test_a_frozen_tower_streams_its_weights_and_returns_no_gradient(monkeypatch):
    """The vision tower frozen (EngineConfig.frozen): its blocks are loaded for the capture only
    (no graph, no re-run), send no gradient, and stay bit-identical through a step; the merger
    (the projector) and the language model train as under the "blocks" placement."""
    batch = _batch("qwen2_vl")
    model = _model("qwen2_vl")
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    after = {}
    for placement in ("blocks", "streamed"):
        engine = _engine(monkeypatch, placement, copy.deepcopy(model), frozen=["vision_tower"])
        engine.forward_backward(batch, step_lr=1e-2)
        after[placement] = {n: p.clone() for n, p in engine.named_parameters()}
        if placement == "streamed":
            assert _block_loads(engine, model) == [1] * len(_tower_numels(model))
            assert engine.runner.tower.grads_returned == 0
        engine.close()
    assert all(torch.equal(after["blocks"][n], after["streamed"][n]) for n in start)
    tower = [n for n in start if ".visual.blocks." in n]
    assert tower and all(torch.equal(after["streamed"][n], start[n]) for n in tower)
    assert not torch.equal(after["streamed"]["model.visual.merger.mlp.0.weight"], start["model.visual.merger.mlp.0.weight"])


def test_evaluation_and_logits_stream_the_tower_too(monkeypatch):
    """Without gradients (evaluation, logits) the blocks are loaded once each a pass, as the
    forward reaches them; the loss and the logits are the "blocks" placement's."""
    batch = _batch("qwen2_vl")
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    got = {}
    for placement in ("blocks", "streamed"):
        model = _model("qwen2_vl")
        engine = _engine(monkeypatch, placement, model)
        got[placement] = (engine.evaluate(**batch), engine.forward_logits(**inputs))
        if placement == "streamed":
            assert _block_loads(engine, model) == [2] * len(_tower_numels(model))
        engine.close()
    assert got["blocks"][0] == got["streamed"][0]
    assert torch.equal(got["blocks"][1], got["streamed"][1])


def test_a_placement_not_known_is_refused(monkeypatch):
    monkeypatch.setenv(PLACEMENT_ENV, "sideways")
    with pytest.raises(ValueError, match="resident, blocks, streamed"):
        forced_placement()


#: A Qwen2-VL tower of 3 blocks (the tiny config's 2 blocks stream no cheaper than by blocks)
_DEEP = dict(depth=3, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=2, spatial_merge_size=2,
             temporal_patch_size=2, in_channels=3, out_hidden_size=32, intermediate_size=64)


@pytest.mark.slow   # (~7 s at load 8: a probe engine, then the engine the planner streams)
def test_the_planner_streams_the_tower_where_only_streamed_fits_and_the_engine_runs_it(monkeypatch):
    """A device budget of the plan with the tower resident, less the resident tower, plus the
    streamed one: the planner picks "streamed", the run header says the engine streams it, and the
    engine does (each of the 3 blocks loaded twice), with the model's own gradients."""
    monkeypatch.delenv(PLACEMENT_ENV, raising=False)
    work = Workload(batch=2, seq=64, image_tokens=16)
    probe = StreamingEngine(tiny_vlm("qwen2_vl", vision_config=_DEEP), EngineConfig(device="cpu"))
    specs = [UnitSpec(u.name, u.numel, u.kind, u.tied_output) for u in probe.parts.units]
    cfg = probe.parts.config.replace(checkpoint_interval=probe.runner.checkpoint_interval)
    total = make_plan(specs, ModelShape.of(probe.model_config), cfg, cuda=False, workload=work).device["total"]
    placed = vision_placement(probe.model_config, specs, work, device_total=total, device_budget=total - 1,
                              precision="fp32", cuda=False)
    probe.close()
    assert placed.choice == "blocks" and placed.streamed_bytes < placed.blocks_bytes
    budget = total - placed.resident_bytes + placed.streamed_bytes
    model = tiny_vlm("qwen2_vl", vision_config=_DEEP)
    batch = _batch("qwen2_vl")
    _, ref_grads = _reference(model, batch)
    engine = StreamingEngine(model, EngineConfig(device="cpu", max_vram_gb=budget / 2 ** 30), workload=work)
    assert ": streamed -- resident" in engine.plan.chosen_by and "the engine streams it" in engine.plan.chosen_by
    assert engine.runner.tower is not None and engine.runner.images.by_blocks
    assert all(".language_model.layers." in u.name for u in engine.layer_units)   # (the decoder's, not the tower's)
    engine.forward_backward(batch)
    assert _max_rel_err(engine, ref_grads) <= 1e-4
    assert _block_loads(engine, model) == [2] * 3 and engine.runner.tower.peak_slots == 2
    engine.close()


@pytest.mark.slow   # (~4 s at load 8: the disk tier opened)
def test_streamed_falls_back_to_by_blocks_with_the_master_weights_on_disk(monkeypatch, tmp_path):
    """Each block's load gathers its weights from the embed unit's host copy: with the master
    weights on the disk tier the engine runs the tower by blocks instead, and says so."""
    model = _model("qwen2_vl")
    engine = _engine(monkeypatch, "streamed", model, offload_dir=str(tmp_path / "tier"), offload_params=True,
                     host_cache_gb=0)
    assert engine.plan.placement["master_weights"] == "disk"
    assert engine.runner.tower is None and engine.runner.images.by_blocks
    assert "streamed needs one rank and the master weights in RAM: by blocks" in engine.plan.chosen_by
    engine.close()


@pytest.mark.slow   # (~5 s at load 8: bf16 on a CPU)
def test_bf16_clipped_steps_match_the_blocks_placement(monkeypatch):
    """bf16 compute (the blocks' bf16 copies gathered from the embed unit's), two clipped AdamW
    steps: the norms, the losses and the weights bit-identical to the "blocks" placement's."""
    model = _model("qwen2_vl")
    got = {}
    for placement in ("blocks", "streamed"):
        engine = _engine(monkeypatch, placement, copy.deepcopy(model), precision="bf16")
        outs = [engine.forward_backward(_batch("qwen2_vl", seed=s), step_lr=1e-2, max_grad_norm=0.5) for s in (1, 2)]
        got[placement] = ([(o.loss, o.grad_norm) for o in outs], {n: p.clone() for n, p in engine.named_parameters()})
        engine.close()
    assert got["blocks"][0] == got["streamed"][0] and got["blocks"][0][0][1] > 0.5   # (clipped)
    assert all(torch.equal(got["blocks"][1][n], got["streamed"][1][n]) for n in got["blocks"][1])
