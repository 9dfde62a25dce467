"""The attention priced by row length, its backward apart (``MachineRates.attention_by_seq``,
``attention_backward_by_seq``; issue 45 item 8): one thread ran a causal SDPA forward ~1.7x as
fast at 2048 tokens as at 512 and its backward at 0.7-0.8x the forward's rate, where the
prediction priced every row at one rate. Made-up rates and counts; nothing here is timed but the
quick measurement."""
import json
import math
import os

import pytest

import megatrain_nb as mt
from megatrain_nb.engine import measure
from megatrain_nb.engine.planning.planner import LayerDims, ModelShape
from megatrain_nb.engine.planning.prediction import head_dim, step_amounts
from megatrain_nb.engine.planning.rates import MachineRates, check_rates, log_interp

from .test_prediction import SHAPE, UNITS, predict
from .test_prediction_step_team import cpu

ROWS = {"attention_by_seq": {"128": 2e10, "512": 4e10, "2048": 8e10},
        "attention_backward_by_seq": {"128": 1e10, "512": 3e10, "2048": 6e10}}


def test_the_rates_are_interpolated_in_log_row_length_and_scaled_by_the_head_size():
    r = MachineRates(attention_flops=4e10, attention_by_head={"64": 4e10, "128": 6e10}, **ROWS)
    assert r.attention_rates(64, 512) == (4e10, 3e10)
    assert r.attention_rates(64, 1024) == pytest.approx((6e10, 4.5e10))     # halfway in log(seq)
    assert r.attention_rates(64, 16) == (2e10, 1e10) and r.attention_rates(64, 8192) == (8e10, 6e10)
    assert r.attention_rates(128, 2048) == pytest.approx((12e10, 9e10))     # head 128's rate over head 64's
    assert r.attention_rates(64, 2048, bf16=True) == (0.0, 0.0)             # bf16: its own rate, one for both
    plain = MachineRates(attention_flops=4e10, attention_by_head={"64": 4e10, "128": 6e10})
    assert plain.attention_rates(128, 2048) == (6e10, 6e10)                 # not measured by row: as before
    only_forward = MachineRates(attention_flops=4e10, attention_by_seq=ROWS["attention_by_seq"])
    assert only_forward.attention_rates(64, 2048) == (8e10, 8e10)
    assert log_interp([(1, 1.0), (100, 3.0)], 10) == pytest.approx(2.0) and log_interp([], 5) == 0.0


def test_a_step_prices_its_forward_recompute_and_backward_attention_at_its_rows_rates():
    r = cpu(step_team={"1x1": 1.0}, **ROWS)   # (a team of one: the phases are the one-thread count)
    for seq in (64, 256, 1024, 2048):
        p, c, plan, w = predict(r, cuda=False, batch=1, seq=seq)
        base, *_ = predict(cpu(step_team={"1x1": 1.0}, attention_flops=1e300), cuda=False, batch=1, seq=seq)
        a = step_amounts(UNITS, SHAPE, c, plan, w, cuda=False, cache_bytes=0)["attention_flops"]
        fwd, bwd = r.attention_rates(64, seq)
        for phase, rate in (("forward", fwd), ("backward", bwd), ("recompute", fwd)):
            assert p.phases[phase] - base.phases[phase] == pytest.approx(a[phase] / rate, rel=1e-9), (seq, phase)


def test_without_the_rows_a_step_prices_as_before_and_the_width_is_the_heads():
    old, *_ = predict(cpu(step_team={"1x1": 1.0}), cuda=False, seq=512)
    again, *_ = predict(cpu(step_team={"1x1": 1.0}, attention_by_seq={}), cuda=False, seq=512)
    assert old.phases == again.phases
    assert head_dim(SHAPE) == 64
    wide = ModelShape(256, 4, 1024, 1000, dims=LayerDims(256, 1024, heads=4, kv_heads=4, head_dim=128))
    assert head_dim(wide) == 128
    p, c, plan, w = predict(cpu(), cuda=False, seq=512)
    a = step_amounts(UNITS, SHAPE, c, plan, w, cuda=False, cache_bytes=0)
    b = step_amounts(UNITS, wide, c, plan, w, cuda=False, cache_bytes=0)
    assert b["attention_flops"]["forward"] == 2 * a["attention_flops"]["forward"]   # 4 heads x 128 = 2 x 256


def test_the_chains_count_takes_the_rows_forward_and_backward_rates():
    big = 1e30
    r = MachineRates(matmul_flops=big, attention_flops=4e10, elementwise_rate=big, **ROWS)
    fwd, bwd = r.attention_rates(64, 512)
    assert measure.chain_count_seconds(r, 512, 256, 672, 4, 2) == pytest.approx(
        2 * 512 * 512 * 256 * 2 * (1 / fwd + 2 / bwd))


def test_a_file_with_bad_rows_is_refused_by_name_and_one_without_them_loads():
    d = cpu().to_dict()
    for k in ROWS:
        d.pop(k)
    assert MachineRates.from_dict(d).attention_by_seq == {} and not check_rates(d)
    assert not check_rates({**d, **ROWS})
    assert any("attention_by_seq['2k']" in b for b in check_rates({**d, "attention_by_seq": {"2k": 1e10}}))
    assert any("attention_backward_by_seq['512']=-1" in b
               for b in check_rates({**d, "attention_backward_by_seq": {"512": -1}}))


@pytest.mark.slow   # (quick measurements: ~3 s)
def test_a_cache_written_before_the_rows_gets_them_and_its_step_team_measured_again(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("MEGATRAIN_NB_CACHE", str(folder))
    first = mt.measure_machine(device="cpu", offload_dir=tmp_path, quick=True)
    keys = {str(s) for s, _ in measure.QUICK_ROWS}
    assert set(first.attention_by_seq) == keys == set(first.attention_backward_by_seq)
    assert all(v > 0 and math.isfinite(v) for v in first.attention_by_seq.values())
    assert "rows of 64 tokens: forward / backward" in first.table()
    (path,) = folder.glob("machine-*.json")
    d = json.loads(path.read_text())
    for k in ROWS:
        d["rates"].pop(k)                               # as the seventh session's caches were written
    path.write_text(json.dumps(d))
    os.chmod(path, 0o600)
    full, team = [], []
    monkeypatch.setattr(measure, "_measure_all", lambda *a, **k: full.append(a))
    real = measure.measure_step_team
    monkeypatch.setattr(measure, "measure_step_team", lambda *a: team.append(a) or real(*a))
    again = mt.measure_machine(device="cpu", offload_dir=tmp_path, quick=True)
    assert full == [] and len(team) == 1                # loaded; the rows measured, the chains counted again
    assert set(again.attention_by_seq) == keys and set(again.step_team) == set(first.step_team)
    assert again.adamw_per_thread == first.adamw_per_thread
    assert json.loads(path.read_text())["rates"]["attention_by_seq"] == again.attention_by_seq
