"""mt.measure_machine (engine/measure.py) and the rates it returns (engine/planning/rates.py): every rate
measured positive and finite at tiny sizes, the cache (atomic, reused, refreshed, per filesystem,
re-measured when damaged), a model's shapes added to it, the published profiles' sources, and
``megatrain-nb machine``. No assertion on a speed beyond > 0."""
import dataclasses
import json
import math
import os

import pytest
import torch

import megatrain_nb as mt
from megatrain_nb.cli import main
from megatrain_nb.engine import measure
from megatrain_nb.engine.tiers.diskspace import filesystem_of
from megatrain_nb.engine.planning.rates import PROFILES, MachineRates, profile_names, rates_for, shape_key


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A private cache folder, and a count of the full measurements (measure._measure_all)."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("MEGATRAIN_NB_CACHE", str(folder))
    calls = []
    real = measure._measure_all

    def counted(*args, **kw):
        calls.append(args)
        return real(*args, **kw)

    monkeypatch.setattr(measure, "_measure_all", counted)
    return folder, calls


def _quick(offload_dir, **kw):
    return mt.measure_machine(device="cpu", offload_dir=offload_dir, quick=True, **kw)


def test_every_rate_is_measured_positive_and_finite_on_cpu(cache, tmp_path):
    threads_before = torch.get_num_threads()
    r = _quick(tmp_path, model="micro")
    assert measure.check_finite(r) == []
    assert r.device == "cpu" and r.source == "measured" and r.cores >= 1
    assert set(r.codec_per_thread) == {"int8", "int4"}
    # micro: hidden 64, intermediate 192, vocab 512, 4 heads of 16; at 2048 tokens
    assert set(r.matmul_by_shape) == {"2048x64x64", "2048x64x192", "2048x192x64", "2048x64x512"}
    assert set(r.attention_by_head) == {"64", "16"}
    assert r.disk_path == str(tmp_path) and "I/O" in r.filesystem
    assert r.seconds_taken > 0 and r.measured_at > 0
    assert r.compute_threads == 1 and "matmul fp32 per thread" in r.table()   # a CPU's: one thread's
    assert set(r.update_chain) == {"int8", "int4"} and all(v > 0 for v in r.update_chain.values())
    assert 0 < r.compute_beside_disk <= 1 and "compute beside the disk" in r.table()   # a CPU device's
    assert torch.get_num_threads() == threads_before                        # and the threads as they were
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("megatrain-")]   # the store's folder went away


def test_cache_is_written_atomically_and_reused(cache, tmp_path, monkeypatch):
    folder, calls = cache
    renames = []
    real_replace = os.replace
    def replace(a, b):
        if os.path.dirname(b) == str(folder):          # (the disk measurement renames its files too)
            renames.append((a, b))
        real_replace(a, b)

    monkeypatch.setattr(measure.os, "replace", replace)
    first = _quick(tmp_path)
    files = sorted(os.listdir(folder))
    assert len(files) == 1 and files[0].startswith("machine-") and files[0].endswith("-quick.json")
    assert len(renames) == 1 and renames[0][1] == str(folder / files[0])
    assert os.path.dirname(renames[0][0]) == str(folder) and renames[0][0].endswith(".tmp")
    assert json.loads((folder / files[0]).read_text())["version"] == measure.CACHE_VERSION
    second = _quick(tmp_path)
    assert len(calls) == 1 and len(renames) == 1      # read back, not measured or written again
    assert second == first


def test_refresh_measures_again(cache, tmp_path):
    _, calls = cache
    first = _quick(tmp_path)
    again = _quick(tmp_path, refresh=True)
    assert len(calls) == 2 and again.measured_at >= first.measured_at


def test_a_model_s_missing_shapes_are_added_to_the_cache(cache, tmp_path, monkeypatch):
    _, calls = cache
    plain = _quick(tmp_path)
    assert plain.matmul_by_shape == {}
    shaped = _quick(tmp_path, model="micro", tokens=128)
    assert len(calls) == 1 and shape_key(128, 64, 512) in shaped.matmul_by_shape
    matmuls = []
    monkeypatch.setattr(measure, "measure_matmul", lambda *a, **k: matmuls.append(a) or 1.0)
    again = _quick(tmp_path, model="micro", tokens=128)
    assert matmuls == [] and again.matmul_by_shape == shaped.matmul_by_shape


def test_cache_key_differs_per_offload_filesystem(cache, tmp_path):
    ext4 = {"mount": "/", "type": "ext4", "device": "/dev/vda"}
    tmpfs = {"mount": "/dev/shm", "type": "tmpfs", "device": "tmpfs"}
    assert measure.cache_key("cpu", ext4) != measure.cache_key("cpu", tmpfs)
    assert measure.cache_key("cpu", ext4) != measure.cache_key("cuda:0 NVIDIA H200", ext4)
    assert measure.cache_key("cpu", ext4) == measure.cache_key("cpu", dict(ext4))
    if not os.path.isdir("/dev/shm") or filesystem_of("/dev/shm")["mount"] == filesystem_of(tmp_path)["mount"]:
        pytest.skip("no second filesystem here")
    folder, calls = cache
    _quick(tmp_path)
    _quick("/dev/shm")
    assert len(calls) == 2 and len(os.listdir(folder)) == 2


@pytest.mark.parametrize("damage", ["not json {", json.dumps({"version": 1, "rates": {"warp_speed": 9}}),
                                    json.dumps({"version": 999, "rates": {}})])
def test_a_damaged_cache_file_is_measured_again_with_a_warning(cache, tmp_path, damage):
    folder, calls = cache
    _quick(tmp_path)
    (path,) = folder.iterdir()
    path.write_text(damage)
    with pytest.warns(UserWarning, match="cannot be read"):
        r = _quick(tmp_path)
    assert len(calls) == 2 and measure.check_finite(r) == []
    assert measure.load_cached(str(path)) == r         # and the file is good again


def test_bad_device_and_offload_dir_are_refused_by_name(cache, tmp_path):
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(ValueError, match="a-file/sub' cannot be made"):
        _quick(tmp_path / "a-file" / "sub")
    with pytest.raises(ValueError, match=r"offload_dir=5: must be a folder's path"):
        _quick(5)
    with pytest.raises(ValueError, match="'tpu'"):
        mt.measure_machine(device="tpu", offload_dir=tmp_path, quick=True)


def test_every_nonzero_profile_number_has_a_source():
    assert {"h100-pcie5-gen4nvme", "h200-pcie5-gen5nvme", "gh200"} <= set(PROFILES)
    numeric = ("cores", "h2d_pageable", "h2d_pinned", "d2h_pageable", "d2h_pinned", "matmul_flops", "attention_flops",
               "bf16_matmul_flops", "bf16_attention_flops", "disk_read", "disk_write", "adamw_per_thread")
    for name, r in PROFILES.items():
        assert r.source == name and r.measured_at is None
        for key in numeric:
            v = getattr(r, key)
            assert math.isfinite(v) and v >= 0
            if v:
                assert len(r.sources.get(key, "")) > 20, (name, key)
        assert not r.matmul_by_shape and not r.codec_per_thread   # nothing unpublished filled in
        assert "PUBLISHED FIGURES, not measured" in r.table()


def test_rates_for_profiles_and_the_cpu_rates_they_lack():
    r = rates_for("h200-pcie5-gen5nvme")
    assert r == PROFILES["h200-pcie5-gen5nvme"] and r is not PROFILES["h200-pcie5-gen5nvme"]
    assert rates_for(None) is None and rates_for(r) is r
    here = MachineRates(adamw_per_thread=5e8, codec_per_thread={"int8": 1e9}, update_chain={"int8": 3e8})
    filled = rates_for("gh200", cpu=here)
    assert filled.adamw_per_thread == 5e8 and filled.codec_per_thread == {"int8": 1e9}
    assert filled.update_chain == {"int8": 3e8} and "measured" in filled.sources["update_chain"]
    assert "measured" in filled.sources["adamw_per_thread"] and PROFILES["gh200"].adamw_per_thread == 0
    with pytest.raises(ValueError, match="unknown machine profile 'h300'.*gh200, h100-pcie5-gen4nvme"):
        rates_for("h300")
    with pytest.raises(TypeError):
        rates_for(3)


def test_matmul_and_attention_look_ups():
    r = MachineRates(matmul_flops=10.0, matmul_by_shape={"2048x64x512": 30.0, "512x64x192": 20.0},
                     attention_flops=5.0, attention_by_head={"128": 7.0}, bf16_matmul_flops=99.0)
    assert r.matmul_rate(2048, 64, 512) == 30.0
    assert r.matmul_rate(100, 64, 192) == 20.0          # same K x N, other tokens
    assert r.matmul_rate(2048, 4096, 4096) == 10.0      # not measured: the default
    assert r.matmul_rate(2048, 64, 512, bf16=True) == 99.0
    assert r.attention_rate(128) == 7.0 and r.attention_rate(64) == 5.0
    assert MachineRates.from_dict(r.to_dict()) == r


def test_cli_prints_the_table_and_refuses_an_unknown_profile(cache, tmp_path, monkeypatch, capsys):
    real = measure.measure_machine
    monkeypatch.setattr(measure, "measure_machine", lambda **kw: real(quick=True, **kw))
    assert main(["machine", "--device", "cpu", "--offload-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Machine rates of cpu: measured" in out and "disk write" in out and "AdamW per thread" in out
    assert "measured now" in out
    assert main(["machine", "--device", "cpu", "--offload-dir", str(tmp_path)]) == 0
    assert "cached" in capsys.readouterr().out and len(cache[1]) == 1
    assert main(["machine", "--profile", "gh200"]) == 0
    assert "NVLink-C2C" in capsys.readouterr().out
    assert main(["machine", "--profiles"]) == 0
    assert set(profile_names()) <= set(capsys.readouterr().out.split())
    assert main(["machine", "--profile", "h300"]) == 2
    err = capsys.readouterr().err
    assert "h300" in err and "h100-pcie5-gen4nvme" in err and "Traceback" not in err


# ---------------------------------------------------------------------------------------- a cache to trust
def _good_file(path, **changes):
    """A cache file of made-up, plausible rates at ``path`` (``changes``: fields written over)."""
    from tests.engine.test_prediction import rates

    measure.save_cached(str(path), rates())
    d = json.loads(path.read_text())
    d["rates"].update(changes)
    path.write_text(json.dumps(d))
    os.chmod(path, 0o600)
    return path


@pytest.mark.parametrize("field,value", [("disk_read", -1e9), ("matmul_flops", 0), ("disk_write", float("nan")),
                                         ("h2d_pinned", 1e300), ("attention_flops", 1e-300), ("cores", "abc"),
                                         ("cores", -4), ("adamw_per_thread", True),
                                         ("update_chain", {"int8": -5}), ("compute_beside_disk", 2.0),
                                         ("codec_per_thread", "fast")])
def test_absurd_values_in_the_cache_are_refused_naming_the_file_and_the_field(tmp_path, field, value):
    path = _good_file(tmp_path / "machine-x.json", **{field: value})
    with pytest.warns(UserWarning, match="cannot be read") as seen:
        assert measure.load_cached(str(path)) is None
    text = str(seen[0].message)
    assert str(path) in text and field in text and "measuring again" in text, text


def test_a_good_file_is_read(tmp_path):
    from tests.engine.test_prediction import rates

    assert measure.load_cached(str(_good_file(tmp_path / "machine-x.json"))) == rates()


def test_a_cache_file_others_can_write_a_link_or_a_fifo_is_refused(tmp_path):
    good = _good_file(tmp_path / "good.json")
    shared = _good_file(tmp_path / "shared.json")
    os.chmod(shared, 0o666)
    link = tmp_path / "link.json"
    link.symlink_to(good)
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    for path, why in ((shared, "others can write it (mode 0666)"), (link, "symbolic link"),
                      (fifo, "not a regular file")):
        with pytest.warns(UserWarning, match="cannot be read") as seen:
            assert measure.load_cached(str(path)) is None
        assert why in str(seen[0].message) and str(path) in str(seen[0].message)


def test_a_fifo_at_the_cache_path_returns_at_once(tmp_path, monkeypatch):
    """A FIFO where the engine's cached rates would be: building a plan does not hang (a reader of a
    FIFO without a writer waits forever), it says why and plans by the rules."""
    import threading
    import warnings as w

    monkeypatch.setenv("MEGATRAIN_NB_CACHE", str(tmp_path))
    import tempfile
    path = tmp_path / (measure.cache_key("cpu", filesystem_of(tempfile.gettempdir())) + ".json")
    os.mkfifo(path)
    out = {}

    def read():
        with w.catch_warnings(record=True) as seen:
            w.simplefilter("always")
            out["rates"] = measure.cached_rates("cpu")
            out["said"] = [str(x.message) for x in seen]

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(5)
    assert not t.is_alive(), "reading a FIFO at the cache path hung"
    assert out["rates"] is None and "not a regular file" in out["said"][0] and "planner's rules" in out["said"][0]


def test_another_users_world_writable_cache_file_is_refused(tmp_path_factory):
    from tests.privileges import NOBODY, as_user, shared_dir

    folder = shared_dir(tmp_path_factory, "rates")
    path = os.path.join(folder, "machine-foreign.json")
    from tests.engine.test_prediction import rates

    text = json.dumps({"version": measure.CACHE_VERSION, "rates": rates(cores=64, disk_read=1e11).to_dict()})

    def plant():
        with open(path, "w") as f:
            f.write(text)
        os.chmod(path, 0o666)
        return os.stat(path).st_uid

    ok, uid = as_user(plant)
    assert ok and uid == NOBODY
    with pytest.warns(UserWarning, match="cannot be read") as seen:
        assert measure.load_cached(path) is None
    assert f"owned by user id {NOBODY}" in str(seen[0].message)
    os.chmod(path, 0o644)   # (not writable by others now: still another user's)
    with pytest.warns(UserWarning, match=f"owned by user id {NOBODY}"):
        assert measure.load_cached(path) is None


def test_a_refused_cache_is_measured_again_and_replaced(cache, tmp_path):
    folder, calls = cache
    first = _quick(tmp_path)
    (path,) = folder.iterdir()
    d = json.loads(path.read_text())
    d["rates"]["disk_read"] = float("nan")
    path.write_text(json.dumps(d))
    with pytest.warns(UserWarning, match="disk_read=nan"):
        again = _quick(tmp_path)
    assert len(calls) == 2 and measure.check_finite(again) == [] and again.measured_at >= first.measured_at
    assert measure.load_cached(str(path)) == again


def test_check_finite_names_what_a_measurement_got_wrong():
    from tests.engine.test_prediction import rates

    assert measure.check_finite(rates()) == []
    bad = measure.check_finite(rates(disk_read=float("inf"), cores=0, matmul_by_shape={"1x2x3": -1.0}))
    assert any(b.startswith("disk_read=inf") for b in bad) and any(b.startswith("cores=0") for b in bad)
    assert any("matmul_by_shape['1x2x3']" in b for b in bad)


def test_a_missing_offload_dir_is_made_as_the_engine_makes_it(cache, tmp_path, monkeypatch):
    """Issue 44: measure_machine refused a folder that EngineConfig(offload_dir=...) creates."""
    seen = []

    def stop(dev, name, root, *a, **kw):
        seen.append(root)
        raise KeyboardInterrupt   # (the folder is what is checked, not a measurement)

    monkeypatch.setattr(measure, "_measure_all", stop)
    with pytest.raises(KeyboardInterrupt):
        _quick(tmp_path / "new" / "tier", refresh=True)
    assert seen == [str(tmp_path / "new" / "tier")] and (tmp_path / "new" / "tier").is_dir()


def _contradicting(**kw) -> MachineRates:
    """Rates whose AdamW reading its update chain contradicts (plain AdamW 100 M params/s, the int8
    chain, which runs the same AdamW on fewer bytes, 500: more than 2.5x) and whose one-thread
    matmul its team does (10 GFLOP/s, two threads 100: more than 1.25x two)."""
    fields = dict(device="cpu", cores=2, compute_threads=1, adamw_per_thread=100e6, update_chain={"int8": 500e6},
                  matmul_flops=10e9, team_matmul_flops=100e9, step_team={"64x256": 9.0})
    fields.update(kw)
    return MachineRates(**fields)


def test_a_contradicted_reading_is_taken_again_and_its_largest_kept(monkeypatch):
    adamw, matmul = iter([150e6, 600e6]), iter([40e9, 30e9])
    took = []
    monkeypatch.setattr(measure, "measure_adamw", lambda *a: took.append("adamw") or next(adamw))
    monkeypatch.setattr(measure, "measure_matmul", lambda *a, **k: took.append("matmul") or next(matmul))
    monkeypatch.setattr(measure, "measure_step_team", lambda *a: took.append("step team") or {"64x256": 1.5})
    r = _contradicting()
    assert len(measure._contradicted(r)) == 2
    left = measure.retake_contradicted(r, torch.device("cpu"), measure.sizes_for(False, True))
    # 150 M is still below 500 / 2.5: taken once more; 40 GFLOP/s agrees with a team of 100 at once,
    # and the step's team, counted at the one-thread rates, is measured again at the new one
    assert left == [] and took == ["adamw", "matmul", "adamw", "step team"]
    assert r.adamw_per_thread == 600e6 and r.matmul_flops == 40e9 and r.step_team == {"64x256": 1.5}
    # readings that agree are not taken again: a chain up to 2.5x a plain AdamW (memory-bound, it
    # moves fewer bytes), a team up to 1.25x its cores
    took.clear()
    fine = _contradicting(adamw_per_thread=300e6, matmul_flops=45e9)
    assert measure.retake_contradicted(fine, torch.device("cpu"), measure.sizes_for(False, True)) == []
    assert took == [] and fine.step_team == {"64x256": 9.0}


def test_a_reading_still_contradicted_is_named_in_a_warning_and_not_cached(cache, tmp_path, monkeypatch):
    folder, _ = cache
    base = _quick(tmp_path)   # (every other rate plausible: cached apart, as tiny sizes are)
    bad = dataclasses.replace(base, adamw_per_thread=100e6, update_chain={"int8": 500e6})
    took = []
    monkeypatch.setattr(measure, "_measure_all", lambda *a, **k: bad)
    monkeypatch.setattr(measure, "measure_adamw", lambda *a: took.append(1) or 120e6)
    with pytest.warns(UserWarning, match=r"not cached: adamw_per_thread=120 M params/s .*measured 500\)"):
        r = mt.measure_machine(device="cpu", offload_dir=tmp_path, refresh=True)
    assert len(took) == measure.RETAKES and r.adamw_per_thread == 120e6   # used once, as measured
    assert [f for f in os.listdir(folder) if not f.endswith("-quick.json")] == []
