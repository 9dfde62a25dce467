"""A vision-language model in the plan (engine/planning/vision_plan.py): image tokens per row or a
pixel budget through the family's patch size and merge, the vision tower's graph in the
embedding's backward counted on the device, image tokens counted as sequence."""
import pytest
from transformers import AutoConfig

import megatrain_nb as mt
from megatrain_nb.model_configs import published_config
from megatrain_nb.engine.planning.vision_plan import VisionShape, patches_per_token
from tests.engine.test_vlm import _model


def _qwen25_vl_7b():
    """Qwen2.5-VL-7B-Instruct's config.json, its numbers (built here: nothing downloads)."""
    return published_config("qwen2.5-vl-7b")


def _gemma3_27b():
    """Gemma-3-27B-it's config.json, its numbers."""
    return published_config("gemma-3-27b")


def test_the_families_patches_per_image_token():
    assert patches_per_token(_qwen25_vl_7b()) == 4             # 2x2 merge: one token per 28x28 pixels
    assert patches_per_token(_gemma3_27b()) == 16              # 64x64 patches pooled to 256 tokens
    assert patches_per_token(AutoConfig.for_model("idefics3", scale_factor=2)) == 4
    assert patches_per_token(AutoConfig.for_model("smolvlm", scale_factor=4)) == 16
    assert patches_per_token(AutoConfig.for_model("llava")) == 1
    assert VisionShape.of(_qwen25_vl_7b()).tokens_of_pixels(1280 * 28 * 28) == 1280
    assert VisionShape.of(AutoConfig.for_model("llama")) is None


@pytest.mark.slow   # (three estimates of an 8B model built on the meta device)
def test_image_tokens_add_the_vision_graph_to_the_device_plan():
    """Same seq, more of it image tokens: the device activations grow by the vision graph
    (batch x tokens x patches per token x (depth x (14 x width + 3 x MLP) + the projector's and the
    patch embedding's) x bytes), and
    max_pixels gives the same plan as the image tokens it makes."""
    cfg = _qwen25_vl_7b()
    shape = VisionShape.of(cfg)
    base = mt.estimate(cfg, vram_gb=80, ram_gb=None, disk_gb=None, seq=4096, precision="bf16")
    img = mt.estimate(cfg, vram_gb=80, ram_gb=None, disk_gb=None, seq=4096, precision="bf16", image_tokens=1280)
    graph = shape.work_bytes(batch=1, image_tokens=1280, compute_bytes=2)
    assert graph == 1280 * 4 * (32 * (14 * 1280 + 3 * 3420) + 6 * 1280 + 3 * 2 * 14 * 14) * 2
    # (the graph is kept from the capture to the embedding's backward: held beside a decoder layer's re-run)
    assert img.plan.device["activations"] - base.plan.device["activations"] == graph
    pix = mt.estimate(cfg, vram_gb=80, ram_gb=None, disk_gb=None, seq=4096, precision="bf16",
                      max_pixels=1280 * 28 * 28)
    assert pix.plan.device == img.plan.device
    assert base.num_parameters == img.num_parameters > 8.2e9   # the vision tower's weights are the model's


def test_bad_image_inputs_are_refused_by_name():
    cfg = _model("qwen2_vl").config
    with pytest.raises(ValueError, match="image tokens per row do not fit seq=128"):
        mt.estimate(cfg, seq=128, image_tokens=200)
    with pytest.raises(ValueError, match="image_tokens or max_pixels, not both"):
        mt.estimate(cfg, image_tokens=10, max_pixels=10000)
    with pytest.raises(ValueError, match="has no vision tower"):
        mt.estimate("tiny", image_tokens=10)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "llava", "llava_next", "gemma3", "idefics3", "smolvlm"])
def test_the_towers_parameters_from_the_config(family):
    """tower_params (torch-free, from the config) within 2% of the model's own count of its vision
    tower and projector."""
    from megatrain_nb.engine.planning.vision_plan import tower_params
    from megatrain_nb.engine.vision import frozen_names

    model = _model(family)
    names = frozen_names(model, ["vision_tower", "projector"])
    real = sum(p.numel() for n, p in model.named_parameters() if n in names)
    assert abs(tower_params(model.config) - real) <= 0.02 * real


def _placed(budget_gib, **kw):
    from megatrain_nb.engine.planning.vision_plan import place_vision

    args = dict(batch=1, image_tokens=1280, compute_bytes=2, embed_numel=545_000_000 + 676_515_200,
                largest_other=233_000_000, device_total=int(25 * 2 ** 30), cuda=True)
    args.update(kw)
    return place_vision(_qwen25_vl_7b(), device_budget=None if budget_gib is None else int(budget_gib * 2 ** 30),
                        **args)


def test_the_planner_counts_the_placements_of_the_tower_and_says_which():
    """Qwen2.5-VL-7B, 1,280 image tokens, bf16 on CUDA: resident costs the tower's weights, the
    gradient staging the larger embed unit takes and its whole graph; by blocks the same weights
    and staging, the blocks' inputs and one block's graph, and one more forward a micro-batch;
    streamed by blocks two block slots, one block's gradient, the blocks' inputs and one block's
    re-run, but one more load of the tower and one more forward a micro-batch. Resident where the
    plan fits (it moves least), by blocks where that fits, streamed where only it fits (the engine
    runs it: compute/vision_stream.py), by blocks where nothing fits."""
    from megatrain_nb.engine.planning.vision_plan import VisionShape, tower_params

    cfg = _qwen25_vl_7b()
    p, shape = tower_params(cfg), VisionShape.of(cfg)
    graph = shape.work_bytes(batch=1, image_tokens=1280, compute_bytes=2)
    boundary = shape.boundary_bytes(batch=1, image_tokens=1280, compute_bytes=2)
    assert boundary == 32 * 1280 * 4 * 1280 * 2
    roomy = _placed(80)
    assert roomy.params == p and roomy.choice == "resident" and roomy.built and roomy.runs == "resident"
    assert roomy.resident_bytes == p * 2 + p * (2 * 4 + 2) + graph
    assert roomy.blocks_bytes == p * 2 + p * (2 * 4 + 2) + boundary + graph // 33
    assert roomy.streamed_bytes < roomy.resident_bytes / 10
    assert roomy.extra_h2d_bytes == 2 * p and roomy.extra_flops == 2.0 * p * 1280 * 4
    assert roomy.extra_seconds is None and "it fits the device budget" in roomy.words()
    blocks = _placed(24)   # (the rest of the plan: 25 GiB less the resident tower, 8.8 GiB)
    assert blocks.choice == "blocks" and blocks.built and blocks.runs == "blocks"
    assert "over the 24.0 GiB budget; by blocks it needs 17.0 GiB" in blocks.words()
    tight = _placed(12)
    assert tight.choice == "streamed" and tight.built and tight.runs == "streamed"
    assert "over the 12.0 GiB budget" in tight.words() and "the engine streams it: two block slots" in tight.words()
    assert "not built" not in tight.words()
    assert _placed(8).choice == "blocks" and "nothing fits" in _placed(8).reason
    assert _placed(None).choice == "resident"
    timed = _placed(80, h2d_bytes_per_s=25e9, flops_per_s=400e12)
    assert timed.extra_seconds == pytest.approx(2 * p / 25e9 + 2.0 * p * 1280 * 4 / 400e12)


@pytest.mark.slow   # (two estimates: ~10 s loaded; the header's test below is the fast check)
def test_the_estimate_says_where_the_tower_goes():
    cfg = _model("qwen2_vl").config
    line = [n for n in mt.estimate(cfg, seq=64, image_tokens=16, vram_gb=8).notes if n.startswith("vision tower")]
    assert len(line) == 1 and ": resident --" in line[0] and "streamed by blocks" in line[0]
    assert not [n for n in mt.estimate(cfg, seq=64, vram_gb=8).notes if n.startswith("vision tower")]


def test_the_run_header_says_where_the_tower_goes():
    """An engine built with a workload of image tokens: its plan's chosen_by (the run header's
    plan line) carries the tower's placement; without image tokens it does not."""
    from megatrain_nb.engine import EngineConfig, StreamingEngine
    from megatrain_nb.engine.planning.planner import Workload

    engine = StreamingEngine(_model("qwen2_vl"), EngineConfig(device="cpu", max_vram_gb=1),
                             workload=Workload(batch=2, seq=64, image_tokens=16))
    assert "vision tower (0.04M parameters with its projector): resident -- resident" in engine.plan.chosen_by
    engine.close()
    plain = StreamingEngine(_model("qwen2_vl"), EngineConfig(device="cpu"))
    assert "vision tower" not in plain.plan.chosen_by
    plain.close()


def test_the_graphs_a_group_keeps_follow_the_plans_room():
    """``graphs_kept``: all without a device budget, the one the plan counts when the plan fills the
    budget, one more per graph's bytes of room; none of it for a text-only model."""
    from megatrain_nb.engine.planning.planner import Workload
    from megatrain_nb.engine.planning.vision_plan import graphs_kept

    cfg = _model("qwen2_vl").config
    work = Workload(batch=2, seq=64, image_tokens=16)
    graph = VisionShape.of(cfg).work_bytes(batch=2, image_tokens=16, compute_bytes=4)
    assert graph > 0
    kept = lambda budget: graphs_kept(cfg, work, device_total=10 * graph, device_budget=budget,  # noqa: E731
                                      precision="fp32")
    assert kept(None) is None
    assert kept(10 * graph) == 1 and kept(9 * graph) == 1   # (over the budget: the plan says so elsewhere)
    assert kept(12 * graph) == 3 and kept(12 * graph + graph - 1) == 3
    assert graphs_kept(cfg, work, device_total=0, device_budget=1, precision="bf16") == 1 + 1 // (graph // 2)
    text = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, vocab_size=256)
    assert graphs_kept(text, work, device_total=0, device_budget=1 << 30, precision="fp32") is None


def test_by_blocks_the_room_counts_the_block_run_again_in_the_backward():
    """By blocks, a micro-batch's kept graph is the blocks' inputs, and the one whose backward runs
    holds one block's graph, run again, beside them (``VisionShape.block_bytes``): a second graph
    is kept only with room for both past the plan's."""
    from megatrain_nb.engine.planning.planner import Workload
    from megatrain_nb.engine.planning.vision_plan import graphs_kept

    cfg = _model("qwen2_vl").config
    work = Workload(batch=2, seq=64, image_tokens=16)
    shape = VisionShape.of(cfg)
    size = dict(batch=2, image_tokens=16, compute_bytes=4)
    graph, inputs, block = shape.work_bytes(**size), shape.boundary_bytes(**size), shape.block_bytes(**size)
    assert 0 < inputs < graph and 0 < block < graph
    kept = lambda budget: graphs_kept(cfg, work, device_total=10 * graph, device_budget=budget,  # noqa: E731
                                      precision="fp32", by_blocks=True)
    by_blocks_total = 10 * graph - graph + inputs + block   # the plan's device bytes by blocks
    assert kept(by_blocks_total + inputs) == 2 and kept(by_blocks_total + inputs - 1) == 1
    assert kept(by_blocks_total + 3 * inputs) == 4

