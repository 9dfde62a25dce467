"""A CPU device's compute in the step-time prediction (engine/planning/prediction.py, rates.py):
the team of torch's threads at its measured speed-up, the non-matmul work counted in element
accesses at its measured rate, the engine's other CPU work beside the team, and caches written
before those rates were measured. Made-up rates; nothing here is timed but the quick measurement."""
import json
import os

import pytest

import megatrain_nb as mt
from megatrain_nb.engine import measure
from megatrain_nb.engine.planning.rates import (FORWARD_PER_HIDDEN, FORWARD_PER_INTERMEDIATE, MachineRates,
                                                elementwise_accesses)
from megatrain_nb.engine.planning.prediction import GRAD_ACCESSES_PER_PARAM, step_amounts

from .test_prediction import H, LAYERS, N, SHAPE, UNITS, VOCAB, predict, rates


def cpu(**changes) -> MachineRates:
    return rates(**{"cores": 2, "compute_threads": 1, "matmul_flops": 1e11, "attention_flops": 1e11, **changes})


def test_the_compute_runs_at_the_measured_speed_up_of_torchs_threads_within_the_cores():
    old, *_ = predict(cpu(), cuda=False)                                  # not measured: every core but one
    team, *_ = predict(cpu(team_matmul_flops=1.8e11), cuda=False)
    wide, *_ = predict(cpu(team_matmul_flops=9e11), cuda=False)           # more than the cores can give
    slow, *_ = predict(cpu(team_matmul_flops=0.5e11), cuda=False)         # a team slower than one thread
    gpu, *_ = predict(cpu(team_matmul_flops=1.8e11), cuda=True)
    gpu0, *_ = predict(cpu(), cuda=True)
    for phase in ("forward", "backward", "recompute"):
        assert team.phases[phase] == pytest.approx(old.phases[phase] / 1.8)
        assert wide.phases[phase] == pytest.approx(old.phases[phase] / 2)
        assert slow.phases[phase] == pytest.approx(old.phases[phase])
        assert gpu.phases[phase] == pytest.approx(gpu0.phases[phase])    # a GPU's rates as they are
    assert cpu(team_matmul_flops=1.8e11).compute_team() == pytest.approx(1.8)
    assert cpu().compute_team() == 1 and cpu(cores=8).compute_team() == 7
    assert any("1.80x one thread's" in o for o in team.overlaps)


def test_the_non_matmul_work_is_its_element_accesses_at_the_measured_rate():
    base, c, plan, w = predict(cpu(team_matmul_flops=1.5e11), cuda=False, batch=2, seq=64)
    ew, *_ = predict(cpu(team_matmul_flops=1.5e11, elementwise_rate=1e9), cuda=False, batch=2, seq=64)
    a = step_amounts(UNITS, SHAPE, c, plan, w, cuda=False, cache_bytes=0)
    tokens = 2 * 64
    one = tokens * LAYERS * (FORWARD_PER_HIDDEN * H + FORWARD_PER_INTERMEDIATE * 4 * H)
    assert a["elementwise"]["forward"] == pytest.approx(one)
    assert a["elementwise"]["backward"] == pytest.approx(2 * one + GRAD_ACCESSES_PER_PARAM * N)
    assert a["elementwise"]["logits"] == tokens * VOCAB
    assert a["elementwise"]["recompute"] == pytest.approx(one * (a["recompute_flops"] / (2.0 * LAYERS * UNITS[1].numel
                                                                                         * tokens)))
    for phase in ("forward", "backward", "recompute"):   # at one thread's rate times the team's speed-up
        assert ew.phases[phase] - base.phases[phase] == pytest.approx(a["elementwise"][phase] / 1.5e9)
    # memory-bound: at the memcpy's measured speed-up on torch's threads, where measured
    mem, *_ = predict(cpu(team_matmul_flops=1.5e11, elementwise_rate=1e9, memory_speedup=0.9), cuda=False, batch=2,
                      seq=64)
    assert mem.phases["forward"] - base.phases["forward"] == pytest.approx(a["elementwise"]["forward"] / 0.9e9)
    assert cpu(memory_speedup=7.0).memory_team() == 2 and cpu(team_matmul_flops=1.5e11).memory_team() == 1.5
    # the loss head's log-softmax: its logits at their own rate, in the backward
    sm, *_ = predict(cpu(team_matmul_flops=1.5e11, elementwise_rate=1e9, softmax_rate=1e8), cuda=False, batch=2,
                     seq=64)
    assert sm.phases["backward"] - ew.phases["backward"] == pytest.approx(tokens * VOCAB / 1.5e8)
    assert sm.phases["forward"] == pytest.approx(ew.phases["forward"])
    assert ew.step_seconds > base.step_seconds
    # twice the tokens, twice the layers' accesses; the count is the one measure_machine's rate is in
    longer, c2, plan2, w2 = predict(cpu(team_matmul_flops=1.5e11, elementwise_rate=1e9), cuda=False, batch=4, seq=64)
    assert step_amounts(UNITS, SHAPE, c2, plan2, w2, cuda=False, cache_bytes=0)["elementwise"]["forward"] == \
        pytest.approx(2 * one)
    assert elementwise_accesses(tokens, H, 4 * H, passes=1.0) * LAYERS == pytest.approx(one)
    # a GPU's non-matmul kernels are not measured: not priced
    gpu, *_ = predict(cpu(elementwise_rate=1e9), cuda=True)
    gpu0, *_ = predict(cpu(), cuda=True)
    assert gpu.phases == pytest.approx(gpu0.phases)


def test_a_measured_cpu_without_the_elementwise_rate_says_it_is_not_priced():
    p, *_ = predict(cpu(source="measured"), cuda=False)
    assert any("elementwise_rate" in n and "softmax_rate" in n for n in p.notes)
    q, *_ = predict(cpu(source="measured", elementwise_rate=1e9, softmax_rate=1e8), cuda=False)
    assert not any("elementwise_rate" in n or "softmax_rate" in n for n in q.notes)


def test_the_engines_other_cpu_work_adds_to_a_measured_teams_compute():
    """AdamW and the copies beside a team on every core pre-empt one of its threads: their seconds add
    to the window's compute in full (with the team unmeasured they share the cores, as before)."""
    r = cpu(team_matmul_flops=2e11, adamw_per_thread=1e9, h2d_pageable=1e9, d2h_pageable=1e9)
    p, *_ = predict(r, cuda=False, clipped=True)
    ph = p.phases
    compute = ph["forward"] + ph["backward"] + ph["recompute"]
    assert p.streams["cpu"] == pytest.approx(compute + ph["optimizer"] + ph["h2d"] + ph["d2h"])
    assert p.bottleneck.startswith("compute")          # the cores' sharing, named by its largest user
    old, *_ = predict(cpu(adamw_per_thread=1e9, h2d_pageable=1e9, d2h_pageable=1e9), cuda=False, clipped=True)
    o = old.phases
    assert old.streams["cpu"] == pytest.approx((o["forward"] + o["backward"] + o["recompute"]) / 2
                                               + (o["optimizer"] + o["h2d"] + o["d2h"]) / 2)


def test_old_fields_missing_load_as_unmeasured():
    d = cpu().to_dict()
    for k in ("team_matmul_flops", "elementwise_rate", "softmax_rate", "memory_speedup"):
        d.pop(k)
    r = MachineRates.from_dict(d)
    assert r.team_matmul_flops == 0 and r.elementwise_rate == 0 and r.softmax_rate == 0 and r.compute_team() == 1


@pytest.mark.slow   # (two quick measurements: ~3 s)
def test_a_cache_written_before_the_team_rates_loads_and_gets_them_measured(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("MEGATRAIN_NB_CACHE", str(folder))
    first = mt.measure_machine(device="cpu", offload_dir=tmp_path, quick=True)
    assert first.team_matmul_flops > 0 and first.elementwise_rate > 0 and first.softmax_rate > 0
    assert first.compute_beside_disk > 0
    assert "non-matmul work" in first.table() and "on torch's threads" in first.table()
    (path,) = folder.glob("machine-*.json")
    d = json.loads(path.read_text())
    for k in ("team_matmul_flops", "elementwise_rate", "softmax_rate", "memory_speedup"):   # as older ones wrote it
        d["rates"].pop(k)
    path.write_text(json.dumps(d))
    os.chmod(path, 0o600)
    full = []
    monkeypatch.setattr(measure, "_measure_all", lambda *a, **k: full.append(a))
    again = mt.measure_machine(device="cpu", offload_dir=tmp_path, quick=True)
    assert full == []                                   # loaded, not measured again whole
    assert again.team_matmul_flops > 0 and again.elementwise_rate > 0 and again.softmax_rate > 0
    assert again.memory_speedup > 0
    assert again.adamw_per_thread == first.adamw_per_thread   # the rest as cached
    saved = json.loads(path.read_text())["rates"]
    assert saved["team_matmul_flops"] == again.team_matmul_flops and saved["elementwise_rate"] > 0
