"""The optimizer-state codec as a plan choice (engine/planning/codec_choice.py, docs/TIERS.md): the
rules keep exact fp32 states in RAM when they fit, then int8 in RAM, then int8 on the disk tier;
with rates the fastest predicted plan unless the rules' is within the margin; ``mt.estimate`` takes
the pick with ``compression="auto"`` and says when another codec would keep the states off the disk."""
import pytest

import megatrain_nb as mt
from megatrain_nb.engine.config import EngineConfig
from megatrain_nb.engine.planning.codec_choice import choose_codec, codec_advice
from megatrain_nb.engine.planning.planner import GiB, Workload, make_plan

from .test_prediction import SHAPE, UNITS, rates

WORK = Workload(batch=2, seq=64)


def _cfg(host_bytes=None, disk=True, **kw):
    return EngineConfig(device="cpu", max_host_gb=None if host_bytes is None else host_bytes / GiB,
                        offload_dir="/nowhere" if disk else None, **kw)


def _host_need(codec):   # the host RAM of the plan with every state in RAM
    return make_plan(UNITS, SHAPE, _cfg(disk=False, optimizer_compression=codec), cuda=True, workload=WORK).host["total"]


def _choose(host_bytes, disk=True, r=None):
    return choose_codec(UNITS, SHAPE, _cfg(host_bytes, disk), WORK, cuda=True, rates=r)


def test_the_rules_keep_exact_states_in_ram_then_int8_then_the_disk_tier():
    fp32, int8 = _host_need("none"), _host_need("int8")
    assert int8 < fp32
    roomy, middle, tight = _choose(fp32 + (1 << 20)), _choose((fp32 + int8) // 2), _choose(int8 - (1 << 20))
    assert (roomy.codec, roomy.states_on_disk, roomy.by) == ("none", False, "rules")
    assert (middle.codec, middle.states_on_disk) == ("int8", False)
    assert (tight.codec, tight.states_on_disk) == ("int8", True)
    assert "before it: fp32 (exact) optimizer states in host RAM" in tight.reason()
    assert middle.plan.placement["optimizer_states"] == "host" and tight.plan.placement["optimizer_states"] == "disk"
    # no disk tier: only the RAM candidates -- the coarser codec where the finer does not fit, then nothing
    coarse = _choose(int8 - (1 << 20), disk=False)
    assert (coarse.codec, coarse.states_on_disk) == ("int4", False)
    assert _choose(_host_need("int4") - (1 << 20), disk=False) is None


def test_with_rates_the_fastest_predicted_plan_unless_the_rules_are_within_the_margin():
    fp32, int8 = _host_need("none"), _host_need("int8")
    budget = (fp32 + int8) // 2   # the rules: int8 in RAM
    slow_codec = rates(codec_per_thread={"int8": 1e5, "int4": 1e5}, disk_read=100e9, disk_write=100e9)
    picked = _choose(budget, r=slow_codec)
    assert (picked.codec, picked.states_on_disk, picked.by) == ("none", True, "prediction")
    rules = next(c for c in picked.candidates if (c.codec, c.states_on_disk) == ("int8", False))
    assert picked.chosen.step_seconds * 1.1 < rules.step_seconds
    even = _choose(budget, r=rates())   # nothing much faster: the rules' pick stays
    assert (even.codec, even.states_on_disk, even.by) == ("int8", False, "rules")
    assert codec_advice(even, "int8", False) is None
    assert "fit host RAM beside the rest" in codec_advice(even, "int8", True)


def test_estimate_takes_the_pick_with_auto_and_says_so_otherwise():
    auto = mt.estimate("tiny", seq=256, compression="auto", ram_gb=64, disk_gb=100)
    assert auto.compression == "none" and auto.placement["optimizer_states"] == "host"
    assert any("optimizer_compression='auto'): fp32 (exact) optimizer states in host RAM" in n for n in auto.notes)
    told = mt.estimate("tiny", seq=256, compression="int8", ram_gb=64, disk_gb=100)
    assert told.compression == "int8" and told.placement["optimizer_states"] == "disk"
    assert any(n.startswith("codec: fp32 (exact) optimizer states in host RAM fit host RAM") for n in told.notes)
    assert "codec: fp32" in str(told)


@pytest.mark.parametrize("codec", ["none", "int8", "int4"])
def test_every_candidate_is_the_planners_own_plan(codec):
    c = _choose(None)   # no host budget: every candidate fits
    mine = next(x for x in c.candidates if (x.codec, x.states_on_disk) == (codec, True))
    assert mine.plan == make_plan(UNITS, SHAPE, _cfg(None, optimizer_compression=codec), cuda=True, workload=WORK)


def test_the_command_line_takes_auto():
    from megatrain_nb.estimate_words import estimate_from_words

    est = estimate_from_words(["tiny", "--seq", "256", "--compression", "auto", "--ram", "64", "--disk", "100"])
    assert est.compression == "none" and "codec (--compression='auto')" in str(est)
