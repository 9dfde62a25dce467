"""A layer-major window's plan within the device budget: a plan called feasible fits it (the
window's gradient sums and one micro-batch's work counted when the slots and the interval are
chosen), a window that fits no tier is refused by name, and the engine's measured device peak on
a CPU "device" stays within the plan."""
import copy
import functools

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatrain_nb.engine import EngineConfig, StreamingEngine
from megatrain_nb.engine.planning.planner import (GiB, ModelShape, Workload, make_plan, unit_specs_from_config,
                                                  window_plan)
from megatrain_nb.model_configs import FAMILY_VOCAB as VOCAB, family_config

SEQ = 64


def _model_config():
    return family_config("llama", layers=4, hidden=64)


@functools.lru_cache(maxsize=1)
def _specs():
    mc = _model_config()
    return unit_specs_from_config(mc), ModelShape.of(mc)


def _plan(kib: int, accumulation: int, **cfg):
    specs, shape = _specs()
    return make_plan(specs, shape,
                     EngineConfig(device="cpu", max_vram_gb=kib * 1024 / GiB, **cfg), cuda=False,
                     workload=Workload(batch=1, seq=SEQ, accumulation=accumulation))


@pytest.mark.parametrize("accumulation", [2, 4])
def test_every_feasible_window_plan_fits_its_device_budget(accumulation):
    """Across a sweep of budgets (300 KiB-1.4 MiB on a 4-layer Llama of hidden 64): a feasible
    plan's device total is within the budget, and a refused one says max_vram_gb. Before, at
    925-1000 KiB the window planner fell back to a group of one on the device and called the plan
    feasible at 1.08 MiB (its gradient sums and work were not counted when the slots were chosen),
    and at 1075-1150 KiB a third layer slot took the window's room (1.2 MiB)."""
    verdicts = []
    for kib in range(300, 1450, 50):
        plan = _plan(kib, accumulation)
        verdicts.append(plan.feasible)
        if plan.feasible:
            assert plan.device["total"] <= kib * 1024, (kib, plan.device, plan.window)
            assert plan.window["fits"] and plan.device["grad_sums"] == plan.window_sum_bytes
        else:
            assert plan.limiting_tier == "device" and "max_vram_gb" in plan.reason, plan.reason
    assert not verdicts[0] and verdicts[-1]   # the sweep crosses from refused to feasible
    first = verdicts.index(True)
    assert all(verdicts[first:]), verdicts    # a larger budget never refuses what a smaller one fits


def test_a_window_whose_boundaries_fit_no_tier_is_refused():
    """With the host budget too small for the boundary activations and no disk tier, not even one
    micro-batch fits: window_plan says so (``fits`` False) and make_plan refuses on the device
    (before: a group of one on the device, the plan feasible over the budget)."""
    wp = window_plan(4, tokens=SEQ, hidden_size=64, num_layers=4, checkpoint_interval=1, compute_bytes=4,
                     device_free=20_000, host_free=1_000, layer_work_bytes_per_token=0)
    assert not wp.fits and wp.group_size == 1 and "not even one micro-batch fits" in wp.reason
    room = window_plan(4, tokens=SEQ, hidden_size=64, num_layers=4, checkpoint_interval=1, compute_bytes=4,
                       device_free=4 * 6 * SEQ * 64 * 4, host_free=1_000, layer_work_bytes_per_token=0)
    assert room.fits and room.tier == "device" and room.group_size == 4


def _window(A: int, seed: int = 1, seq: int = SEQ):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (1, seq), generator=g) for _ in range(A)]


def test_the_engines_window_peak_stays_within_the_plan():
    """The engine built with the plan's slots and interval at a feasible budget trains a window
    with a measured device peak (memory_report: slots, gradient buffers, the meter's activations,
    the gradient sums) within the plan's device total and the budget; at a budget the plan refuses
    the engine refuses the window with the numbers and the way out, never running past it."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_model_config())
    A = 2
    for kib in (1050, 1400, 2000):
        plan = _plan(kib, A)
        assert plan.feasible
        eng = StreamingEngine(copy.deepcopy(model), EngineConfig(
            device="cpu", max_vram_gb=kib * 1024 / GiB, checkpoint_interval=plan.checkpoint_interval,
            overrides={"device_slots": plan.layer_slots}))
        try:
            eng.forward_backward(_window(A), step_lr=1e-3)
            dev = eng.memory_report()["device"]
            assert eng.last_window_plan.fits
            assert 0 < dev["peak_bytes"] <= plan.device["total"] <= kib * 1024, (kib, dev, plan.device)
        finally:
            eng.close()
    kib = 1000
    assert not _plan(kib, A).feasible
    eng = StreamingEngine(copy.deepcopy(model), EngineConfig(device="cpu", max_vram_gb=kib * 1024 / GiB,
                                                             overrides={"device_slots": 2}))
    try:
        with pytest.raises(ValueError, match="max_vram_gb=.*cannot hold a window of 2 micro-batches") as err:
            eng.forward_backward(_window(A), step_lr=1e-3)
        assert "raise max_vram_gb to at least" in str(err.value)
    finally:
        eng.close()


def test_an_engine_told_of_its_window_leaves_the_sums_their_room():
    """An engine built for a workload of several micro-batches (``workload=``, as mt.Trainer builds
    it) grows its layer slots only where the window's gradient sums still fit beside them; one
    built without it takes the room for slots, and the window it cannot hold is refused naming
    ``device_slots`` as a way out."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_model_config())
    budget, seq = 850 * 1024, 8
    cfg = EngineConfig(device="cpu", max_vram_gb=budget / GiB)
    told = StreamingEngine(copy.deepcopy(model), cfg, workload=Workload(batch=1, seq=seq, accumulation=2))
    blind = StreamingEngine(copy.deepcopy(model), cfg)
    try:
        assert told.plan.layer_slots < blind.plan.layer_slots, (told.plan.device, blind.plan.device)
        assert told.plan.device["total"] <= budget and told.plan.device["grad_sums"] == told.plan.window_sum_bytes
        told.forward_backward(_window(2, seq=seq), step_lr=1e-3)
        assert told.memory_report()["device"]["peak_bytes"] <= budget
        with pytest.raises(ValueError, match="device_slots"):
            blind.forward_backward(_window(2, seq=seq), step_lr=1e-3)
    finally:
        told.close()
        blind.close()
