"""A long row within the device budget beside the layer slots the engine actually holds (issue
45 item 7): the engine plans its slots at one token, so one that took a third slot (it fit at one
token) must count that slot in the longest row it accepts (``plan.longest_seq``), refuse a longer
row by name (the row, the budget, ``device_slots=2``, max_vram_gb) rather than run past the
budget, and an engine told its rows (``workload=``, as mt.Trainer builds it) keeps the room for
them instead of taking the slot. Peaks are measured on a CPU "device" (memory_report)."""
import copy
import functools

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatrain_nb.engine import EngineConfig, StreamingEngine
from megatrain_nb.engine.planning.planner import GiB, Workload
from megatrain_nb.model_configs import FAMILY_VOCAB as VOCAB, family_config


@functools.lru_cache(maxsize=1)
def _setup():
    """(the model, the budget in bytes, one layer slot's bytes): a budget where a third layer
    slot fits beside the step at one token but leaves far less room for a row than two do."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config("llama", layers=4, hidden=64,
                                                           max_position_embeddings=4096))
    probe = StreamingEngine(copy.deepcopy(model), EngineConfig(device="cpu", overrides={"device_slots": 2}))
    try:
        least = probe.plan.device["total"]
        slot = max(u.numel for u in probe.layer_units) * 4
    finally:
        probe.close()
    return model, least + slot + 112 * 1024, slot


def _engine(budget: int, **kw) -> StreamingEngine:
    model, _, _ = _setup()
    return StreamingEngine(copy.deepcopy(model), EngineConfig(device="cpu", max_vram_gb=budget / GiB,
                                                              overrides=kw.pop("overrides", {})), **kw)


def _row(n: int, seed: int = 1):
    return torch.randint(1, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def _peak(engine: StreamingEngine, n: int) -> int:
    engine.forward_backward(_row(n), step_lr=1e-3)
    return engine.memory_report()["device"]["peak_bytes"]


@pytest.mark.slow   # (about 3 s: two engines' steps)
def test_a_row_longer_than_the_held_slots_leave_room_for_is_refused_not_run_past_the_budget():
    _, budget, slot = _setup()
    two = _engine(budget, overrides={"device_slots": 2})
    grown = _engine(budget)
    try:
        z2, z = two.plan.longest_seq, grown.plan.longest_seq
        assert grown.plan.layer_slots == 3 and 1 <= z < z2, (grown.plan.layer_slots, z, z2)
        # Before: longest_seq was counted at 2 slots, so the 3-slot engine took a row of z2 tokens;
        # the 2-slot engine's measured peak at that row plus the third slot is past the budget.
        peak2 = _peak(two, z2)
        assert peak2 <= budget < peak2 + slot, (peak2, slot, budget)
        with pytest.raises(ValueError, match=f"a micro-batch of {z2:,} tokens does not fit max_vram_gb=.*3 layer "
                                             f"slots.*the longest that fits is {z:,} tokens.*'device_slots': 2.*"
                                             "raise max_vram_gb"):
            grown.forward_backward(_row(z2), step_lr=1e-3)
        assert _peak(grown, z) <= budget            # the longest it accepts runs within the budget
    finally:
        two.close()
        grown.close()


def test_an_engine_told_its_rows_keeps_their_room_instead_of_a_third_slot():
    _, budget, _ = _setup()
    two = _engine(budget, overrides={"device_slots": 2})
    z2 = two.plan.longest_seq
    two.close()
    told = _engine(budget, workload=Workload(batch=1, seq=z2, accumulation=1))
    short = _engine(budget, workload=Workload(batch=1, seq=2, accumulation=1))
    try:
        assert told.plan.layer_slots == 2 and told.plan.longest_seq == z2
        assert short.plan.layer_slots == 3           # rows that short leave the third slot its room
        assert _peak(told, z2) <= budget
    finally:
        told.close()
        short.close()
