"""Host RAM as a schedule-driven cache of the disk tier (engine/tiers/disk_cache.py)."""
import copy
import functools
import itertools

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatrain_nb.engine import EngineConfig, StreamingEngine
from megatrain_nb.engine.tiers.disk_cache import _LIVE, READ, WRITE, cache_budget, plan_cache

from megatrain_nb.model_configs import FAMILY_VOCAB as VOCAB, family_config


# ---------------------------------------------------------------------------- the simulator
def _brute_force_reads(seq, slots, steps):
    """Fewest misses any cache of ``slots`` equal-size keys can reach on ``seq`` repeated
    ``steps`` times, reads only (exhaustive search over which key to drop)."""
    full = [k for k, _, _ in seq] * steps

    @functools.lru_cache(maxsize=None)
    def best(p, resident):
        if p == len(full):
            return 0
        k = full[p]
        if k in resident:
            return best(p + 1, resident)
        now = resident | {k}
        if len(now) <= slots:
            return 1 + best(p + 1, frozenset(now))
        return 1 + min(best(p + 1, frozenset(now - {v})) for v in now)
    return best


@pytest.mark.parametrize("slots", [1, 2, 3])
def test_simulated_reads_are_the_minimum_for_equal_clean_keys(slots):
    # forward then backward (reverse) over five keys, as a step's weight reads
    keys = ["a", "b", "c", "d", "e"]
    seq = [(k, READ, 10) for k in keys + keys[::-1]]
    steps = 4
    plan = plan_cache(seq, slots * 10, steps=steps)
    # the minimum over `steps` steps from a cold cache, minus the minimum over `steps - 1`,
    # bounds the steady per-step cost from below; Belady's equals it
    best = _brute_force_reads(seq, slots, steps)
    best_less = _brute_force_reads(seq, slots, steps - 1)
    per_step_min = best(0, frozenset()) - best_less(0, frozenset())
    assert plan.read_bytes == 10 * per_step_min
    assert plan.write_bytes == 0


def test_simulator_extremes_and_dirty_data_written_once():
    seq = [("w", READ, 8), ("w", READ, 8), ("s", READ, 4), ("w", WRITE, 8), ("s", WRITE, 4)]
    none = plan_cache(seq, 0)
    assert (none.read_bytes, none.write_bytes, none.hits) == (8 + 8 + 4, 8 + 4, 0)
    everything = plan_cache(seq, 12)
    assert (everything.read_bytes, everything.write_bytes, everything.hits) == (0, 0, 3)
    # room for the states only: the weights stream, the states never touch the disk
    some = plan_cache(seq, 4)
    assert (some.read_bytes, some.write_bytes) == (16, 8)
    assert some.keep[("s", WRITE, 0)] and not some.keep[("w", WRITE, 0)]


def test_budget_from_config():
    G = 1 << 30
    assert cache_budget(2, None, 0, 10 * G) == 2 * G
    assert cache_budget(2, None, 0, G) == G                  # never more than the disk tier holds
    assert cache_budget(None, 3, G, 10 * G) == 2 * G         # max_host_gb less the engine's own needs
    assert cache_budget(None, 1, 2 * G, 10 * G) == 0
    assert cache_budget(0, None, 0, 10 * G) == 0
    with pytest.raises(ValueError, match="host_cache_gb=-1"):
        EngineConfig(host_cache_gb=-1)


def test_default_budget_leaves_room_for_other_open_caches(monkeypatch):
    """From free RAM: an open cache that has not filled yet still owns its budget."""
    import psutil

    from megatrain_nb.engine.tiers.disk_cache import HostCache

    G = 1 << 30

    class VM:
        total, available = 32 * G, 20 * G
    monkeypatch.setattr(psutil, "virtual_memory", lambda: VM)
    alone = cache_budget(None, None, G, 100 * G)
    assert alone == 20 * G - G - 8 * G                     # free RAM less needs and a quarter of RAM
    other = HostCache(store=None, capacity=3 * G)
    assert cache_budget(None, None, G, 100 * G) == alone - 3 * G
    other._copier.shutdown(); _LIVE.discard(other)
    assert cache_budget(None, None, G, 100 * G) == alone


# ---------------------------------------------------------------------------- in the engine
def _data(steps):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(1, VOCAB, (2, 12), generator=g) for _ in range(steps)]


def _drain(e):
    e.zero_grad()       # waits for the step's updates
    e.disk.flush()      # and their write-behind


def _run(model, tmp_path, cache_gb, clip, steps=4, codec="none"):
    e = StreamingEngine(model, EngineConfig(device="cpu", offload_dir=str(tmp_path), offload_params=True,
                                            host_cache_gb=cache_gb, optimizer_compression=codec,
                                            weight_decay=0.01))
    data = _data(steps)
    losses, per_step = [], []
    for i, ids in enumerate(data):
        # the cache counts every read and write it sends to the store (tensor bytes; the
        # store's own stats add file headers and padding)
        s0, n0 = e.disk.report(), e.disk.stats()
        losses.append(e.forward_backward(ids, step_lr=3e-3, max_grad_norm=clip).loss)
        _drain(e)
        s1, n1 = e.disk.report(), e.disk.stats()
        per_step.append((s1["disk_read_bytes"] - s0["disk_read_bytes"], s1["disk_write_bytes"] - s0["disk_write_bytes"]))
        if per_step[-1][0] == 0:
            assert n1["reads"] == n0["reads"]
        if per_step[-1][1] == 0:
            assert n1["writes"] == n0["writes"]
    params = {n: p.clone() for n, p in e.named_parameters()}
    return e, losses, params, per_step


@pytest.mark.parametrize("clip", [None, 1.0])
@pytest.mark.parametrize("fraction", [0.3, 0.7, 2.0])
def test_cached_disk_tier_moves_the_planned_bytes_and_trains_exactly(tmp_path, clip, fraction):
    model = AutoModelForCausalLM.from_config(family_config("llama", layers=4, hidden=64))
    twin = copy.deepcopy(model)
    (tmp_path / "a").mkdir(); (tmp_path / "b").mkdir()
    plain, l_plain, p_plain, io_plain = _run(twin, tmp_path / "b", 0, clip)
    total = sum(u.numel for u in plain.units) * 4 * 3   # weights + fp32 moments
    cached, l_cached, p_cached, io_cached = _run(model, tmp_path / "a", fraction * total / 2**30, clip)
    # exactly the same training
    assert l_cached == l_plain
    for n, p in p_plain.items():
        assert torch.equal(p_cached[n], p), n
    # from the second step on, each step moves exactly the simulator's bytes
    plan = cached.disk.plan
    assert plan is not None
    for read, written in io_cached[1:]:
        assert (read, written) == (plan.read_bytes, plan.write_bytes)
    # and no more than the uncached engine
    for (rc, wc), (rp, wp) in zip(io_cached[1:], io_plain[1:]):
        assert rc <= rp and wc <= wp
    if fraction >= 1.0:   # everything fits: after the first step nothing touches the disk
        assert io_cached[-1] == (0, 0)
    else:
        assert io_cached[-1][0] > 0
    rep = cached.telemetry()["disk_cache"]
    assert rep["hits"] > 0 and rep["bytes_saved"] > 0
    assert rep["ram_bytes"] <= rep["capacity_bytes"]
    host = cached.memory_report()["host"]
    # each kind the cache holds is counted as itself; "disk_cache" is only what no owner claims
    by_kind = host["disk_cache_stats"]["by_kind"]
    assert host["disk_cache"] + sum(by_kind.values()) == rep["ram_bytes"] == host["disk_cache_stats"]["ram_bytes"]
    assert host["optimizer_states"] >= by_kind.get("optimizer_states", 0)
    assert host["disk_cache_stats"]["capacity_bytes"] == rep["capacity_bytes"]
    assert host["disk_cache_stats"]["hits"] == rep["hits"]
    # a checkpoint sees the resident (dirty) data
    sd = cached.state_dict()
    for n, p in p_plain.items():
        assert torch.equal(sd[n], p), n
    cached.close(); plain.close()


@pytest.mark.parametrize("codec", ["none", "int8"])
def test_cached_states_are_swapped_not_copied_and_train_exactly(tmp_path, codec):
    """With the whole disk tier resident, an update's state write hands its tensors to the
    cache (fp32: the previous copy comes back to be read into; codes: the cache keeps them and
    lends them to the next decode) -- same training as without the cache, clipped."""
    model = AutoModelForCausalLM.from_config(family_config("llama", layers=3, hidden=64))
    twin = copy.deepcopy(model)
    (tmp_path / "a").mkdir(); (tmp_path / "b").mkdir()
    plain, l_plain, p_plain, _ = _run(twin, tmp_path / "b", 0, 1.0, codec=codec)
    cached, l_cached, p_cached, io = _run(model, tmp_path / "a", 1.0, 1.0, codec=codec)
    assert l_cached == l_plain
    for n, p in p_plain.items():
        assert torch.equal(p_cached[n], p), n
    assert io[-1] == (0, 0)
    entries = cached.disk._entries
    keys = [cached.states.key(u) for u in cached.units]
    rep = cached.disk.report()
    assert rep["adopted_writes"] >= 3 * len(keys)   # every update's state write after the first step's
    if codec == "int8":   # the decode's reads got the resident codes themselves
        assert rep["shared_reads"] >= 2 * len(keys)
    else:                 # the moments written are the very buffers the cache now holds
        pool_ptrs = {t.data_ptr() for ts in cached.states.pool._free.values() for t in ts}
        held = {t.data_ptr() for k in keys for t in entries[k]["t"].values()}
        assert held and not held & pool_ptrs
    # a checkpoint of the states sees the resident data
    for u in cached.units:
        got, want = cached.states.stored(u), plain.states.stored(u)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    cached.close(); plain.close()


def test_cache_off_is_a_pass_through(tmp_path):
    model = AutoModelForCausalLM.from_config(family_config("llama", layers=2))
    e = StreamingEngine(model, EngineConfig(device="cpu", offload_dir=str(tmp_path), offload_params=True,
                                            host_cache_gb=0))
    e.forward_backward(_data(1)[0], step_lr=1e-3)
    _drain(e)
    rep = e.telemetry()["disk_cache"]
    assert rep["capacity_bytes"] == 0 and rep["hits"] == 0 and rep["ram_bytes"] == 0
    assert rep["disk_read_bytes"] > 0 and e.telemetry()["bytes"]["disk_to_host"] == rep["disk_read_bytes"]
    e.close()


def test_failed_write_back_is_never_read_as_stale_data(tmp_path, monkeypatch):
    """A full disk while dirty keys leave RAM: the error surfaces, training is refused."""
    import errno
    import os

    from megatrain_nb.engine.tiers import disk_store
    from megatrain_nb.engine.tiers.disk_store import OffloadError

    model = AutoModelForCausalLM.from_config(family_config("llama", layers=4, hidden=64))
    total = sum(p.numel() for p in model.parameters()) * 12
    e = StreamingEngine(model, EngineConfig(device="cpu", offload_dir=str(tmp_path), offload_params=True,
                                            host_cache_gb=0.5 * total / 2**30))
    data = _data(4)
    e.forward_backward(data[0], step_lr=1e-3)
    _drain(e)

    def full(*a):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(disk_store.os, "write", full)
    if hasattr(disk_store.os, "pwrite"):
        monkeypatch.setattr(disk_store.os, "pwrite", full)
    with pytest.raises((OffloadError, RuntimeError)):
        for ids in data[1:]:
            e.forward_backward(ids, step_lr=1e-3)
            _drain(e)
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="failed earlier"):
        e.forward_backward(data[0], step_lr=1e-3)
    e.close()


def test_dashboard_memory_panel_shows_the_cache():
    from megatrain_nb.notebook.figures import memory_bars
    from megatrain_nb.notebook.run_log import disk_cache_line, tier_summary

    host = {"weights": 100, "grads": 50, "optimizer_states": 0, "buffers": 10, "disk_cache": 3 << 30,
            "used_bytes": 160 + (3 << 30), "peak_bytes": 200 + (3 << 30), "capacity_bytes": 8 << 30,
            "disk_cache_stats": {"capacity_bytes": 4 << 30, "hits": 12, "bytes_saved": 5 << 30,
                                 "disk_read_bytes": 0, "disk_write_bytes": 0}}
    line = disk_cache_line(host)
    assert "disk cache" in line and "12 hits" in line
    assert "disk_cache_stats" not in tier_summary({"host": host})["host"]["kinds"]
    assert line in " ".join(memory_bars({"host": host})["ticks"])
    assert disk_cache_line({"weights": 1}) == ""


@pytest.mark.parametrize("cache_gb", [0, 1.0])
@pytest.mark.parametrize("clip", [None, 1.0])
def test_back_to_back_overlapped_steps_read_the_updated_states(tmp_path, cache_gb, clip):
    """The next step's read-ahead of optimizer states can come while the last step's final
    update (the embedding's) still runs: it must not read the moments before that update's
    write. Regression: back to back, the disk tier drifted from the RAM run at step 4."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("llama", vocab_size=4096, hidden_size=128, intermediate_size=256,
                               num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=64)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    ids = torch.randint(0, 4096, (2, 32))
    ram = StreamingEngine(copy.deepcopy(model), EngineConfig(device="cpu"))
    disk = StreamingEngine(model, EngineConfig(device="cpu", offload_dir=str(tmp_path), offload_params=True,
                                               host_cache_gb=cache_gb))
    la = [ram.forward_backward(ids, step_lr=1e-3, max_grad_norm=clip).loss for _ in range(6)]
    lb = [disk.forward_backward(ids, step_lr=1e-3, max_grad_norm=clip).loss for _ in range(6)]  # no waits between
    assert lb == la
    pr = dict(ram.named_parameters())
    for n, p in disk.named_parameters():
        assert torch.equal(p, pr[n]), n
    ram.close(); disk.close()


def test_memory_report_counts_cached_states_as_optimizer_states(tmp_path):
    """Issue 25: with the host cache on (the default) the disk tier's states live in RAM; the
    report said optimizer_states 0 on every tier. They are optimizer states, counted once."""
    model = AutoModelForCausalLM.from_config(family_config("llama", layers=2, hidden=64))
    e = StreamingEngine(model, EngineConfig(device="cpu", offload_dir=str(tmp_path), optimizer_compression="int8",
                                            host_cache_gb=1.0))
    for ids in _data(2):
        e.forward_backward(ids, step_lr=1e-3)
    _drain(e)
    mem = e.memory_report()
    host, disk = mem["host"], mem["disk"]
    stored = sum(e.states.stored_nbytes(u) for u in e.units)
    assert e.telemetry()["disk_cache"]["ram_bytes"] >= stored          # the whole tier is cached
    assert host["optimizer_states"] == stored and host["disk_cache"] == 0
    assert host["disk_cache_stats"]["by_kind"] == {"optimizer_states": stored}
    assert disk["optimizer_states"] == 0   # nothing reached the disk: the report says so, not "states on disk"
    assert host["used_bytes"] == (host["weights"] + host["grads"] + host["optimizer_states"] + host["buffers"]
                                  + host["disk_cache"])
    # no byte came from the disk, so no wait is a wait for the disk (the cache and the decode are named)
    tel = e.telemetry()
    assert tel["disk_cache"]["disk_read_bytes"] == 0 and tel["stall_seconds"]["disk"] == 0.0
    assert tel["stall_seconds"]["host_cache"] + tel["stall_seconds"]["decode"] > 0
    fs = disk["filesystem"]   # issue 25 item 7: which filesystem the tier is on, how much is free
    assert fs["free_bytes"] > 0 and fs["mount"] and fs["path"].startswith(str(tmp_path))
    e.close()


def test_cache_futures_say_which_tier_a_wait_is_for(tmp_path):
    from megatrain_nb.engine.tiers.disk_cache import HostCache
    from megatrain_nb.engine.tiers.disk_store import DiskStore
    from megatrain_nb.engine.telemetry import Telemetry

    seq = [("k", WRITE, 4096), ("k", READ, 4096)]
    counters = Telemetry()
    with DiskStore(tmp_path) as store:
        cache = HostCache(store, 1 << 20, counters=counters)
        cache.set_schedule(seq)
        cache.write("k", {"t": torch.ones(1024)}).result()
        hit = cache.read("k")
        assert hit.stall_kind == "host_cache"
        counters.wait(hit)
        store.write("cold", {"t": torch.ones(1024)}).result()
        miss = cache.read("cold")
        assert miss.stall_kind == "disk"
        counters.wait(miss)
        stalls = counters.snapshot()["stall_seconds"]
        assert stalls["host_cache"] > 0 and stalls["disk"] > 0
        cache.close()


def test_a_read_during_write_back_all_never_sees_the_older_file(tmp_path, monkeypatch):
    """write_back_all (a snapshot taken in the AdamW worker while the next step reads) issues each
    dirty key's write before the key leaves RAM: a read in between gets the newest version, not
    the file the key had before (the race made a disk-tier run with snapshots not repeatable)."""
    model = AutoModelForCausalLM.from_config(family_config("llama", layers=2))
    e = StreamingEngine(model, EngineConfig(device="cpu", offload_dir=str(tmp_path), offload_params=True,
                                            host_cache_gb=1))
    for ids in _data(2):
        e.forward_backward(ids, step_lr=1e-2)
    e.zero_grad()
    cache = e.disk
    dirty = {k: {n: t.clone() for n, t in v["t"].items()} for k, v in cache._entries.items() if v["dirty"]}
    assert dirty, "the plan keeps some updated keys resident"
    seen = {}
    write = cache.store.write

    def slow_write(key, tensors):   # a read of every dirty key lands while the first write is issued
        if not seen:
            for k in dirty:
                seen[k] = cache.read(k, outside_plan=True).result()
        return write(key, tensors)
    monkeypatch.setattr(cache.store, "write", slow_write)
    cache.write_back_all()
    cache.flush()
    for k, want in dirty.items():
        assert all(torch.equal(seen[k][n], want[n]) for n in want), k
        got = cache.store.read(k).result()
        assert all(torch.equal(got[n], want[n]) for n in want), k
    e.close()
