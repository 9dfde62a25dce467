"""How many times a training step runs the vision tower (engine/vision.ImageFeatures): once in
the capture and once in the embedding's backward per micro-batch -- the head's replay is served
the capture's features -- with the model's own gradients all the same."""
import pytest

from megatrain_nb.engine import EngineConfig, StreamingEngine
from tests.engine.test_vlm import _batch, _max_rel_err, _model, _reference

TOWER = {"qwen2_vl": "visual", "llava": "vision_tower", "gemma3": "vision_tower", "idefics3": "vision_model"}


@pytest.mark.parametrize("family", sorted(TOWER))
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
