"""How many times a training step runs the vision tower (engine/vision.ImageFeatures): once per
micro-batch -- the capture keeps the tower's autograd graph, the head's replay is served its
features detached and the embedding's backward back-propagates through the kept graph -- with
the model's own gradients all the same; a frozen tower runs once and builds no graph; a group
with room for fewer graphs than micro-batches runs the tower again for the others."""
import pytest
import torch
from torch.utils._pytree import tree_leaves

from megatrain_nb.engine import EngineConfig, StreamingEngine
from megatrain_nb.engine.vision import frozen_names
from tests.engine.test_vlm import _batch, _max_rel_err, _model, _reference

TOWER = {"qwen2_vl": "visual", "llava": "vision_tower", "gemma3": "vision_tower", "idefics3": "vision_model"}


@pytest.mark.parametrize("family", [f if f == "qwen2_vl" else pytest.param(f, marks=pytest.mark.slow)
                                    for f in sorted(TOWER)])
@pytest.mark.parametrize("k", [1, 2])
def test_the_vision_tower_runs_once_per_micro_batch(family, k):
    model = _model(family)
    window = [_batch(family, seed=1), _batch(family, seed=2)]
    _, ref_grads = _reference(model, window[0])
    runs = []
    getattr(model.model, TOWER[family]).register_forward_hook(lambda *_: runs.append(1))
    engine = StreamingEngine(model, EngineConfig(device="cpu", checkpoint_interval=k))
    engine.forward_backward(window[0])
    assert len(runs) == 1
    assert _max_rel_err(engine, ref_grads) <= 1e-4
    assert engine.runner.images.kept == 0 and engine.runner.meter.held == 0   # the graph was taken
    engine.zero_grad()
    runs.clear()
    engine.forward_backward(window, step_lr=1e-3)
    assert len(runs) == 2
    runs.clear()
    engine.evaluate(window[0])
    assert len(runs) == 1
    engine.close()


def test_the_kept_graph_is_counted_as_held_activations():
    """The capture's graph is the meter's ``held`` bytes between the capture and the embedding's
    backward (the memory report's device activations count it)."""
    model = _model("qwen2_vl")
    batch = _batch("qwen2_vl")
    engine = StreamingEngine(model, EngineConfig(device="cpu"))
    meter, seen = engine.runner.meter, []
    model.model.language_model.layers[0].register_forward_hook(lambda *_: seen.append(meter.held))
    engine.forward_backward(batch)
    # (the layer list's proxy runs in each pass of the model's forward: the capture and the head's
    # replay hold the graph, the embedding's backward has taken it)
    assert len(seen) == 3 and seen[0] == seen[1] > 0 and seen[2] == 0
    assert meter.held == 0 and meter.peak >= seen[0]
    engine.close()


def test_a_group_without_room_for_every_graph_runs_the_tower_again_for_the_rest():
    """``keep=1`` (the plan's room for one micro-batch's graph): of a window of two, the second
    micro-batch's tower runs again in the embedding's backward (3 runs), the gradients the same."""
    model = _model("qwen2_vl")
    window = [_batch("qwen2_vl", seed=1), _batch("qwen2_vl", seed=2)]
    ref_all = StreamingEngine(__import__("copy").deepcopy(model), EngineConfig(device="cpu"))
    ref_all.forward_backward(window)
    want = {n: g.clone() for n, g in ref_all.named_gradients()}
    ref_all.close()
    runs = []
    model.model.visual.register_forward_hook(lambda *_: runs.append(1))
    engine = StreamingEngine(model, EngineConfig(device="cpu"))
    engine.runner.images.keep = 1
    engine.forward_backward(window)
    assert len(runs) == 3
    assert _max_rel_err(engine, want) <= 1e-5
    engine.close()


def test_a_frozen_vision_tower_runs_once_and_keeps_no_graph():
    """Frozen (its blocks; Qwen-VL's merger is the projector and trains), the vision tower runs once
    per micro-batch and its blocks build no graph (their output needs no gradient), and the other
    gradients stay the model's own."""
    model = _model("qwen2_vl")
    batch = _batch("qwen2_vl")
    names = frozen_names(model, ["vision_tower"])
    ref = __import__("copy").deepcopy(model)
    for n, p in ref.named_parameters():
        p.requires_grad_(n not in names)
    _, ref_grads = _reference(ref, batch)
    graphs = []
    model.model.visual.blocks[-1].register_forward_hook(
        lambda m, a, out: graphs.append(torch.is_grad_enabled() and any(
            t.requires_grad for t in tree_leaves(out) if torch.is_tensor(t))))
    engine = StreamingEngine(model, EngineConfig(device="cpu", frozen=("vision_tower",)))
    engine.forward_backward(batch)
    assert graphs == [False]
    assert _max_rel_err(engine, ref_grads) <= 1e-4
    engine.close()


def test_a_frozen_tower_and_projector_keep_no_graph_at_all():
    """Nothing of the tower and projector trains: the features are kept without a graph (no held
    bytes), the tower runs once, the language model's gradients are the model's own."""
    model = _model("qwen2_vl")
    batch = _batch("qwen2_vl")
    names = frozen_names(model, ["vision_tower", "projector"])
    ref = __import__("copy").deepcopy(model)
    for n, p in ref.named_parameters():
        p.requires_grad_(n not in names)
    _, ref_grads = _reference(ref, batch)
    held, runs = [], []
    engine = StreamingEngine(model, EngineConfig(device="cpu", frozen=("vision_tower", "projector")))
    meter = engine.runner.meter
    model.model.visual.register_forward_hook(lambda *_: runs.append(1))
    model.model.language_model.layers[0].register_forward_hook(lambda *_: held.append(meter.held))
    engine.forward_backward(batch)
    assert runs == [1] and held and set(held) == {0}
    assert _max_rel_err(engine, ref_grads) <= 1e-4
    engine.close()
