"""The device room generation gets between the engine's steps (``decode.device_left``) counts what
stays on the device beside the engine's plan: a reference engine's slots and buffers (DPO/GRPO with
``beta`` > 0, ``decode.share_device``) and a streamed vision tower's block slots (memory_report's
``vision_block_slots``, not in the engine's plan); the estimate's ``plan_generation`` likewise."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from megatrain_nb.engine import EngineConfig, StreamingEngine
from megatrain_nb.engine.compute.decode import decode_bytes, device_left, kept_on_device, kv_place, share_device
from megatrain_nb.engine.compute.vision_stream import PLACEMENT_ENV
from megatrain_nb.engine.planning.estimator_grpo import plan_generation
from megatrain_nb.engine.planning.planner import (GiB, ModelShape, Workload, make_plan, persistent_device_bytes,
                                                  unit_specs_from_config)
from megatrain_nb.model_configs import family_config
from megatrain_nb.sweep.vision import tiny_vlm

BUDGET = 4 * 2 ** 20


def _engine(model=None, **cfg):
    torch.manual_seed(0)
    model = model or AutoModelForCausalLM.from_config(family_config("llama", layers=2, hidden=64))
    return StreamingEngine(model, EngineConfig(device="cpu", max_vram_gb=BUDGET / GiB, **cfg))


def test_a_reference_engine_on_the_device_is_counted_in_the_policys_room():
    """A second engine sharing the device (the reference model's, built with the policy's config)
    takes its own weight slots and gradient buffers out of the policy's room; once closed it
    takes nothing. The KV cache's placement follows: a cache that fit beside the policy alone
    is split or moved where the reference's slots take the room."""
    policy, ref = _engine(), _engine()
    try:
        alone = device_left(policy)
        assert alone == BUDGET - persistent_device_bytes(policy.plan) > 0
        rows = 1
        while decode_bytes(policy, rows + 1, 64) <= alone:   # as many rows as fit beside the policy alone
            rows += 1
        assert kv_place(policy, rows, 64).batches == 1
        share_device(policy, ref)
        share_device(policy, policy)   # (an engine is never counted beside itself)
        assert kept_on_device(ref) == persistent_device_bytes(ref.plan) > 0
        assert device_left(policy) == alone - kept_on_device(ref)
        assert device_left(ref) == BUDGET - kept_on_device(ref)   # (the reference's own room: not shared back)
        place = kv_place(policy, rows, 64)
        assert place.tier == "host" or place.batches > 1, place
        ref.close()
        assert kept_on_device(ref) == 0 and device_left(policy) == alone
    finally:
        policy.close()
        ref.close()


def test_a_streamed_vision_towers_block_slots_are_counted_in_the_room(monkeypatch):
    """A streamed vision tower keeps two block slots and a block's gradient buffer on the device
    (memory_report's vision_block_slots, among its weights) that the engine's plan does not have:
    device_left takes them out (before: the plan's slots and buffers only)."""
    monkeypatch.setenv(PLACEMENT_ENV, "streamed")
    engine = _engine(tiny_vlm("qwen2_vl"))
    try:
        tower = engine.runner.tower.pager
        slots = engine.memory_report()["device"]["vision_block_slots"]
        assert slots == tower.slot_bytes > 0
        assert kept_on_device(engine) == persistent_device_bytes(engine.plan) + slots + tower.grad_buf_bytes
        assert device_left(engine) == BUDGET - kept_on_device(engine)
    finally:
        engine.close()


def test_plan_generation_counts_the_reference_engine_and_what_else_is_kept():
    """The estimate's generation room: the device budget less the plan's persistent bytes, the
    reference engine's (``reference``: beta > 0, a second engine of the same plan) and any other
    bytes kept between steps (``kept_beside``: a streamed tower's block slots)."""
    config = family_config("llama", layers=2, hidden=64)
    units = unit_specs_from_config(config)
    plan = make_plan(units, ModelShape.of(config), EngineConfig(max_vram_gb=BUDGET / GiB), cuda=True,
                     workload=Workload(batch=1, seq=64))
    budgets = {"device": BUDGET, "host": None}
    kept = persistent_device_bytes(plan)
    alone = plan_generation(config, units, plan, budgets, 8, 32, 32, precision="fp32")
    ref = plan_generation(config, units, plan, budgets, 8, 32, 32, precision="fp32", reference=True)
    more = plan_generation(config, units, plan, budgets, 8, 32, 32, precision="fp32", reference=True,
                           kept_beside=1000)
    assert alone.room_bytes == BUDGET - kept
    assert ref.room_bytes == BUDGET - 2 * kept and more.room_bytes == BUDGET - 2 * kept - 1000
    assert any("reference" in n for n in ref.notes)
    with pytest.raises(ValueError, match="kept_beside"):
        plan_generation(config, units, plan, budgets, 8, 32, 32, precision="fp32", kept_beside=-1)
