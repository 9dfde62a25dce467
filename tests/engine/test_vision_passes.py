"""How many times a training step runs the vision tower (engine/vision.ImageFeatures): once in
the capture and once in the embedding's backward per micro-batch -- the head's replay is served
the capture's features -- with the model's own gradients all the same."""
import pytest

from megatrain_nb.engine import EngineConfig, StreamingEngine
from tests.engine.test_vlm import _batch, _max_rel_err, _model, _reference

TOWER = {"qwen2_vl": "visual", "llava": "vision_tower", "gemma3": "vision_tower", "idefics3": "vision_model"}


@pytest.mark.parametrize("family", [f if f == "qwen2_vl" else pytest.param(f, marks=pytest.mark.slow)
                                    for f in sorted(TOWER)])
def test_the_vision_tower_runs_twice_per_micro_batch(family):
    model = _model(family)
    window = [_batch(family, seed=1), _batch(family, seed=2)]
    _, ref_grads = _reference(model, window[0])
    runs = []
    getattr(model.model, TOWER[family]).register_forward_hook(lambda *_: runs.append(1))
    engine = StreamingEngine(model, EngineConfig(device="cpu", checkpoint_interval=2))
    engine.forward_backward(window[0])
    assert len(runs) == 2
    assert _max_rel_err(engine, ref_grads) <= 1e-4
    engine.zero_grad()
    runs.clear()
    engine.forward_backward(window, step_lr=1e-3)
    assert len(runs) == 4
    runs.clear()
    engine.evaluate(window[0])
    assert len(runs) == 1
    engine.close()


def test_a_frozen_vision_tower_runs_no_backward():
    """Frozen (its blocks; Qwen-VL's merger is the projector and trains), the vision tower builds no
    graph in the embedding's backward (its blocks' output needs no gradient: nothing of them runs
    backward), and the other gradients stay the model's own."""
    import torch
    from torch.utils._pytree import tree_leaves

    from megatrain_nb.engine.vision import frozen_names

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
    assert graphs == [False, False]
    assert _max_rel_err(engine, ref_grads) <= 1e-4
    engine.close()
