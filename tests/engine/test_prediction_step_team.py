"""A CPU step's compute priced at the team's speed-up measured on a step-like chain of operations
at two sizes (``MachineRates.step_team``, issue 45 item 8), and the unclipped disk tier's exposed
update as the engine overlaps it. Made-up rates and counts; nothing here is timed but the quick
measurement."""
import json
import math
import os

import pytest

import megatrain_nb as mt
from megatrain_nb.engine import measure
from megatrain_nb.engine.planning.prediction import step_amounts
from megatrain_nb.engine.planning.rates import MachineRates, check_rates

from .test_prediction import H, SHAPE, UNITS, predict, rates


def cpu(**changes) -> MachineRates:
    return rates(**{"cores": 2, "compute_threads": 1, "matmul_flops": 1e11, "attention_flops": 5e10,
                    "team_matmul_flops": 1.8e11, "elementwise_rate": 2e9, "softmax_rate": 1e8,
                    "memory_speedup": 0.9, **changes})


def test_the_step_team_is_interpolated_in_log_size_between_the_measured_sizes():
    r = MachineRates(step_team={"64x256": 1.2, "512x1024": 1.8})
    assert r.step_speedup(64, 256) == 1.2 and r.step_speedup(512, 1024) == 1.8
    mid = math.sqrt(64 * 256 * 512 * 1024)             # halfway in log(tokens x hidden)
    assert r.step_speedup(int(mid), 1) == pytest.approx(1.5, rel=1e-4)
    assert r.step_speedup(8, 8) == 1.2 and r.step_speedup(4096, 4096) == 1.8   # the nearest outside them
    assert MachineRates().step_speedup(512, 1024) == 0.0   # not measured


def test_a_measured_step_team_prices_the_layers_work_at_the_one_thread_count_over_it():
    r = cpu(step_team={"128x256": 1.25})              # one size: the same everywhere
    p, c, plan, w = predict(r, cuda=False, batch=2, seq=64)
    a = step_amounts(UNITS, SHAPE, c, plan, w, cuda=False, cache_bytes=0)
    at = a["attention_flops"]
    assert p.phases["forward"] == pytest.approx(
        (a["forward_flops"] / 1e11 + at["forward"] / 5e10 + a["elementwise"]["forward"] / 2e9) / 1.25)
    # the loss head's log-softmax is not in the chain: at the memcpy's team, as before
    assert p.phases["backward"] == pytest.approx(
        (a["backward_flops"] / 1e11 + at["backward"] / 5e10 + a["elementwise"]["backward"] / 2e9) / 1.25
        + a["elementwise"]["logits"] / (1e8 * 0.9))
    assert any("step_team" in o for o in p.overlaps)
    # a smaller step where the team gives less: slower by the ratio of the factors
    r2 = cpu(step_team={"64x256": 1.0, "4096x256": 2.0})
    small, *_ = predict(r2, cuda=False, batch=1, seq=64)
    big, *_ = predict(r2, cuda=False, batch=64, seq=64)
    one, *_ = predict(cpu(step_team={"64x256": 1.0}), cuda=False, batch=64, seq=64)
    assert small.phases["forward"] == pytest.approx(predict(cpu(step_team={"1x1": 1.0}), cuda=False, batch=1,
                                                            seq=64)[0].phases["forward"])
    assert big.phases["forward"] == pytest.approx(one.phases["forward"] / 2)


def test_rates_without_the_step_team_price_as_before_and_a_gpu_or_bf16_ignores_it():
    old, *_ = predict(cpu(), cuda=False)
    again, *_ = predict(cpu(step_team={}), cuda=False)
    assert old.phases == again.phases
    # the matmul's team (1.8x) and the memcpy's (0.9x), as the rates before step_team priced it
    p, c, plan, w = predict(cpu(), cuda=False)
    a = step_amounts(UNITS, SHAPE, c, plan, w, cuda=False, cache_bytes=0)
    assert p.phases["forward"] == pytest.approx(a["forward_flops"] / 1.8e11 + a["attention_flops"]["forward"] / 9e10
                                                + a["elementwise"]["forward"] / 1.8e9)
    gpu, *_ = predict(cpu(step_team={"1x1": 3.0}), cuda=True)
    gpu0, *_ = predict(cpu(), cuda=True)
    assert gpu.phases == gpu0.phases
    bf, *_ = predict(cpu(step_team={"1x1": 3.0}, bf16_matmul_flops=1e11), cuda=False, precision="bf16")
    bf0, *_ = predict(cpu(bf16_matmul_flops=1e11), cuda=False, precision="bf16")
    assert bf.phases == bf0.phases


def test_a_file_with_a_bad_step_team_is_refused_by_name_and_one_without_it_loads():
    d = cpu().to_dict()
    d.pop("step_team")
    assert MachineRates.from_dict(d).step_team == {}
    assert not check_rates(d)
    assert any("step_team['64-256']" in b for b in check_rates({**d, "step_team": {"64-256": 1.5}}))
    assert any("step_team['64x256']=0" in b for b in check_rates({**d, "step_team": {"64x256": 0}}))
    assert not check_rates({**d, "step_team": {"64x256": 1.5}})


def test_the_chains_count_is_its_matmuls_attention_and_element_accesses():
    big = 1e30
    r = MachineRates(matmul_flops=1e11, attention_flops=big, elementwise_rate=big)
    params = 2 * (4 * 256 * 256 + 3 * 256 * 672)
    assert measure.chain_count_seconds(r, 64, 256, 672, 4, 2) == pytest.approx(6 * params * 64 / 1e11)
    r = MachineRates(matmul_flops=big, attention_flops=1e10, elementwise_rate=big)
    assert measure.chain_count_seconds(r, 64, 256, 672, 4, 2) == pytest.approx(3 * 2 * 64 * 64 * 256 * 2 / 1e10)
    r = MachineRates(matmul_flops=big, attention_flops=big, elementwise_rate=1e9)
    assert measure.chain_count_seconds(r, 64, 256, 672, 4, 2) == pytest.approx(
        (2 * 64 * 3 * (44 * 256 + 5 * 672) + 4 * params) / 1e9)


def test_the_unclipped_disk_tier_waits_for_the_compute_when_its_disk_time_hides_behind_it():
    """What a step's telemetry shows (0.01-0.06 s of disk waits a step, issue 45): the embedding's
    states read ahead and written behind, its weights a fresh copy, so a disk stream shorter than
    the compute leaves the step bound by the compute, not the disk."""
    r = cpu(disk_read=4e9, disk_write=4e9, adamw_per_thread=1e9, h2d_pageable=1e10, d2h_pageable=1e10)
    p, *_ = predict(r, cuda=False, offload_dir="/nowhere", offload_params=True)
    assert p.bytes["disk_state_read"] > 0 and p.phases["disk_read"] > 0
    assert p.streams["disk"] < p.streams["compute"]
    assert p.bottleneck.startswith("compute")
    assert p.windows["exposed update"] == pytest.approx(p.phases["optimizer"] * UNITS[0].numel
                                                        / sum(u.numel for u in UNITS))


@pytest.mark.slow   # (quick measurements: ~3 s)
def test_a_cache_written_before_the_step_team_loads_and_gets_it_measured(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("MEGATRAIN_NB_CACHE", str(folder))
    first = mt.measure_machine(device="cpu", offload_dir=tmp_path, quick=True)
    keys = {f"{t}x{h}" for t, h, *_ in measure.QUICK_CHAINS}
    assert set(first.step_team) == keys and all(v > 0 for v in first.step_team.values())
    assert "tokens x hidden" in first.table()
    (path,) = folder.glob("machine-*.json")
    d = json.loads(path.read_text())
    d["rates"].pop("step_team")                         # as the sixth session's caches were written
    path.write_text(json.dumps(d))
    os.chmod(path, 0o600)
    full, team = [], []
    monkeypatch.setattr(measure, "_measure_all", lambda *a, **k: full.append(a))
    real = measure.measure_team_beside_disk
    monkeypatch.setattr(measure, "measure_team_beside_disk", lambda *a: team.append(a) or real(*a))
    again = mt.measure_machine(device="cpu", offload_dir=tmp_path, quick=True)
    assert full == [] and team == []                    # loaded; only the missing rate measured
    assert set(again.step_team) == keys
    assert again.team_matmul_flops == first.team_matmul_flops and again.adamw_per_thread == first.adamw_per_thread
    assert json.loads(path.read_text())["rates"]["step_team"] == again.step_team


def test_the_step_team_is_the_team_or_one_thread_whichever_ran_the_chain_faster(monkeypatch):
    """A loaded machine's team waits at every small operation's barrier; one thread stays steady:
    the measured speed-up is the faster of the two (calls a second: team, then one thread, per size)."""
    calls = iter([1.0, 4.0, 10.0, 2.0])
    monkeypatch.setattr(measure, "_rate", lambda fn, work, sizes, *a: next(calls))
    monkeypatch.setattr(measure, "decoder_chain", lambda *a: (lambda: None))
    r = MachineRates(matmul_flops=1e11, attention_flops=1e11, elementwise_rate=1e9)
    out = measure.measure_step_team(r, measure.sizes_for(False, True))
    (small, large) = measure.QUICK_CHAINS
    assert out == pytest.approx({f"{small[0]}x{small[1]}": measure.chain_count_seconds(r, *small) * 4.0,
                                 f"{large[0]}x{large[1]}": measure.chain_count_seconds(r, *large) * 10.0})
