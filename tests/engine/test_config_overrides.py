"""EngineConfig: user knobs as fields, planner and test settings in EngineOverrides; make_plan
takes the config."""
import pytest

from megatrain_nb.engine import EngineConfig, EngineOverrides
from megatrain_nb.engine.planning.planner import ModelShape, UnitSpec, Workload, make_plan


def test_overrides_are_nested_and_validated():
    cfg = EngineConfig(overrides={"device_slots": 3, "loss_chunk_tokens": 8})
    assert isinstance(cfg.overrides, EngineOverrides)
    assert (cfg.overrides.device_slots, cfg.overrides.loss_chunk_tokens) == (3, 8)
    assert EngineConfig().overrides == EngineOverrides()
    with pytest.raises(ValueError, match="device_slots=1"):
        EngineConfig(overrides={"device_slots": 1})
    with pytest.raises(TypeError, match="unknown engine override"):
        EngineConfig(overrides={"slots": 3})
    with pytest.raises(TypeError):
        EngineConfig(device_slots=3)   # not a user knob any more: overrides=...


def test_options_and_replace_route_override_names():
    cfg = EngineConfig.from_options(device="cpu", device_slots=3, update_chunk_numel=4096)
    assert cfg.device == "cpu" and cfg.overrides.device_slots == 3 and cfg.overrides.update_chunk_numel == 4096
    again = cfg.replace(loss_chunk_tokens=16, weight_decay=0.1)
    assert again.overrides.loss_chunk_tokens == 16 and again.overrides.device_slots == 3
    assert again.weight_decay == 0.1 and cfg.overrides.loss_chunk_tokens == 1024   # a copy
    with pytest.raises(TypeError, match="unknown engine option"):
        EngineConfig.from_options(slots=3)


def test_make_plan_reads_the_config():
    units = [UnitSpec("embed", 1000, "embed"), UnitSpec("layers.0", 4000, "layer"),
             UnitSpec("layers.1", 4000, "layer"), UnitSpec("head", 1000, "head")]
    shape = ModelShape(hidden_size=32, num_layers=2, intermediate_size=64, vocab_size=100)
    plan = make_plan(units, shape, EngineConfig(overrides={"device_slots": 3}), cuda=False, workload=Workload(seq=8))
    assert plan.layer_slots == 3 and plan.placement["optimizer_states"] == "host"
    disk = make_plan(units, shape, EngineConfig(offload_dir="/nonexistent", optimizer_compression="int8"),
                     cuda=False, workload=Workload(seq=8, gradients="none"))
    assert disk.placement["optimizer_states"] == "disk" and disk.host["optimizer_states"] == 0
    assert disk.host["buffers"] > 0 and disk.host["total"] == sum(v for k, v in disk.host.items() if k != "total")
