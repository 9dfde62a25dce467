"""The disk's cost a file beyond its bytes (``MachineRates.disk_read_file_s``,
``disk_write_file_s``; issue 45 item 8): each file the disk tier writes is opened, synced and
renamed, each read opened and its header read -- measured on a 2-core VM's ext4, 0.7-1.1 ms a
file written when quiet and ~2.6 ms beside a test suite, so a 1 MiB file went at 130-250 MB/s where 64 MiB ones went at 440-470, and a step of
small units moved its bytes slower than the layer-sized files' rate said. Made-up rates and
counts; nothing here is timed but the quick measurement."""
import json

import pytest

import megatrain_nb as mt
from megatrain_nb.engine import measure
from megatrain_nb.engine.planning.prediction import step_amounts
from megatrain_nb.engine.planning.rates import MachineRates, check_rates
from megatrain_nb.engine.tiers.disk_cache import step_accesses

from .test_prediction import SHAPE, UNITS, predict, rates


def test_the_cost_a_file_and_the_bandwidth_are_solved_from_two_sizes_of_files():
    a, bw = 2.5e-3, 400e6
    big, small = 4 * a + 128e6 / bw, 16 * a + 32e6 / bw    # 4 files of 32 MB, 16 of 2 MB
    got_bw, got_a = measure._file_cost(big, small, 4, 16, 128_000_000, 32_000_000)
    assert got_a == pytest.approx(a, rel=1e-9) and got_bw == pytest.approx(bw, rel=1e-9)
    # small files no slower a byte than large ones (noise): no cost a file, the large files' rate
    assert measure._file_cost(0.32, 0.07, 4, 16, 128_000_000, 32_000_000) == (pytest.approx(128e6 / 0.32, rel=1e-4), 1e-6)
    # a cost that would leave the large files almost no time for their bytes is noise too
    assert measure._file_cost(0.1, 10.0, 4, 16, 128_000_000, 32_000_000)[1] == 1e-6


def _disk_tier(r, **kw):
    return predict(r, offload_dir="/nowhere", offload_params=True, **kw)


@pytest.mark.parametrize("clipped", [False, True], ids=["unclipped", "clipped"])
def test_each_file_a_step_moves_adds_its_cost_to_the_disk_phases(clipped):
    base = rates(disk_read=1e9, disk_write=5e8)
    plain, c, plan, w = _disk_tier(base, clipped=clipped)
    costly, *_ = _disk_tier(rates(disk_read=1e9, disk_write=5e8, disk_read_file_s=0.003, disk_write_file_s=0.011),
                            clipped=clipped)
    d = step_amounts(UNITS, SHAPE, c, plan, w, cuda=True, cache_bytes=0)["disk"]
    assert d["read_files"] > len(UNITS) and d["write_files"] >= len(UNITS)   # weights and states, each unit
    assert costly.phases["disk_read"] - plain.phases["disk_read"] == pytest.approx(0.003 * d["read_files"])
    assert costly.phases["disk_write"] - plain.phases["disk_write"] == pytest.approx(0.011 * d["write_files"])
    assert costly.step_seconds > plain.step_seconds
    # no cost measured (an older cache, a profile): the bytes at the rates, as before
    again, *_ = _disk_tier(rates(disk_read=1e9, disk_write=5e8, disk_read_file_s=0.0), clipped=clipped)
    assert again.phases == plain.phases and again.step_seconds == plain.step_seconds


def test_the_files_counted_are_the_schedules_accesses():
    """Unclipped, weights and states on the disk tier, no host cache: each unit's weights file
    read by its forward and by its backward, its states file read once, both written once by its
    update -- the schedule's accesses (``disk_cache.step_accesses``), a file each."""
    n = len(UNITS)
    p, c, plan, w = _disk_tier(rates())
    d = step_amounts(UNITS, SHAPE, c, plan, w, cuda=True, cache_bytes=0)["disk"]
    assert (d["read_files"], d["write_files"], d["state_read_files"], d["state_write_files"]) == (3 * n, 2 * n, n, n)
    # behind a host cache that keeps a share of the reads, that share of the files is not read
    p, c, plan, w = _disk_tier(rates(), cache=10 ** 12)
    cached = step_amounts(UNITS, SHAPE, c, plan, w, cuda=True, cache_bytes=10 ** 12)["disk"]
    assert cached["read_files"] == pytest.approx(3 * n * cached["read"] / cached["raw_read"])
    assert cached["read_files"] < 3 * n


def test_an_older_cache_gets_the_cost_a_file_measured_once_and_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATRAIN_NB_CACHE", str(tmp_path / "cache"))
    first = mt.measure_machine(device="cpu", offload_dir=tmp_path, quick=True)
    assert first.disk_read_file_s > 0 and first.disk_write_file_s > 0 and check_rates(first.to_dict()) == []
    assert "each file beyond its bytes" in first.table()
    (path,) = [p for p in (tmp_path / "cache").iterdir() if p.name.startswith("machine-")]
    old = json.loads(path.read_text())   # a cache written before the cost a file was measured
    for k in ("disk_read_file_s", "disk_write_file_s"):
        del old["rates"][k]
    path.write_text(json.dumps(old))
    calls = []
    real = measure.measure_disk
    monkeypatch.setattr(measure, "measure_disk", lambda *a: calls.append(a) or real(*a))
    upgraded = mt.measure_machine(device="cpu", offload_dir=tmp_path, quick=True)
    assert len(calls) == 1 and upgraded.disk_read_file_s > 0 and upgraded.disk_write_file_s > 0
    mt.measure_machine(device="cpu", offload_dir=tmp_path, quick=True)
    assert len(calls) == 1                         # kept in the cache: not measured again
    assert json.loads(path.read_text())["rates"]["disk_write_file_s"] == upgraded.disk_write_file_s


@pytest.mark.parametrize("value", [-1e-3, 11.0, float("nan"), "2 ms"])
def test_a_cost_a_file_out_of_range_is_refused_by_name(value):
    bad = check_rates(MachineRates(disk_write_file_s=value).to_dict() | {"disk_write_file_s": value})
    assert any(b.startswith("disk_write_file_s=") for b in bad)


def test_the_compute_beside_the_disk_is_a_mean_over_a_stretch_not_a_median_of_calls(monkeypatch):
    """The disk tier's I/O threads take a core in bursts: most single calls run clean. On a fake
    clock, a call that takes 1 ms and every fourth 21 ms: a median of calls says 1 ms a call (what
    ``compute_beside_disk`` read, 0.97-1.00, once the I/O threads' CPU fell), the stretch's mean
    6 ms (what a step sees: measured 0.63-0.79 beside the disk)."""
    now = [0.0]
    calls = [0]

    def call():
        calls[0] += 1
        now[0] += 0.021 if calls[0] % 4 == 0 else 0.001

    monkeypatch.setattr(measure.time, "perf_counter", lambda: now[0])
    sizes = measure.sizes_for(False, False)
    assert measure._rate(call, 1.0, sizes) == pytest.approx(1000.0)            # the median: clean calls
    calls[0] = 0
    assert measure._mean_rate(call, 1.0, sizes) == pytest.approx(1000.0 / 6, rel=0.05)   # the mean


@pytest.mark.parametrize("weights_on_disk", [True, False], ids=["weights-on-disk", "weights-in-ram"])
def test_compressed_states_without_a_cache_leave_the_embeddings_ranged_update_exposed(weights_on_disk):
    """Unclipped, int8 states on the disk tier, no host cache: the states are read and written range
    by range inside each update (``OptimizerStates.ranged_io``), and so are the weights of the
    embedding (no backward hands it its buffer: ``DiskWeights.ranged_update``). The embedding's
    update, the next forward's first need, then waits in the open for its codes and weights read
    and written and the weights read back: the tenth session's quiet run measured the forward
    waiting 0.066-0.107 s a step for it where 0.005-0.009 was priced. fp32 states (read ahead,
    written behind), a host cache and a clipped step price none of it."""
    r = rates(disk_read=1e9, disk_write=5e8, disk_read_file_s=0.001, disk_write_file_s=0.002)
    kw = dict(offload_dir="/nowhere", offload_params=weights_on_disk)
    p, c, plan, w = predict(r, optimizer_compression="int8", **kw)
    d = step_amounts(UNITS, SHAPE, c, plan, w, cuda=True, cache_bytes=0)["disk"]
    n = UNITS[0].numel
    codes, wb = int(2.03125 * n), (4 * n if weights_on_disk else 0)
    assert (d["start_read"], d["start_write"]) == (codes + 2 * wb, codes + wb)
    assert (d["start_read_files"], d["start_write_files"]) == ((3.0, 2.0) if weights_on_disk else (1.0, 1.0))
    disk_s = (codes + 2 * wb) / 1e9 + d["start_read_files"] * 0.001 + (codes + wb) / 5e8 + d["start_write_files"] * 0.002
    # the same step on a disk twice as fast with no cost a file: the exposed update is shorter by
    # what the disk's part of it saves (its CPU part, the chain's share, is the same)
    fast, *_ = predict(rates(disk_read=2e9, disk_write=1e9), optimizer_compression="int8", **kw)
    saved = disk_s - (codes + 2 * wb) / 2e9 - (codes + wb) / 1e9
    assert p.windows["exposed update"] - fast.windows["exposed update"] == pytest.approx(saved, rel=1e-6)
    fp32, *_ = predict(r, **kw)
    assert p.windows["exposed update"] > disk_s and fp32.windows["exposed update"] < disk_s / 4
    # none of it with fp32 states, behind a host cache, or clipped (the updates run in the forward's window)
    for other in (step_amounts(UNITS, SHAPE, *predict(r, **kw)[1:], cuda=True, cache_bytes=0)["disk"],
                  step_amounts(UNITS, SHAPE, *predict(r, optimizer_compression="int8", clipped=True, **kw)[1:],
                               cuda=True, cache_bytes=0)["disk"]):
        assert other["start_read"] == other["start_write"] == 0
    cached = step_amounts(UNITS, SHAPE, *predict(r, optimizer_compression="int8", cache=10 ** 12, **kw)[1:],
                          cuda=True, cache_bytes=10 ** 12)["disk"]
    assert cached["start_read"] <= 4 * n and cached["start_write"] <= 4 * n   # (the cache's own start: weights only)
