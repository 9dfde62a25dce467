"""The disk tier, compressed optimizer states, disk prefetch, and models larger than RAM."""
import copy
import errno
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from megatrain_nb.engine import EngineConfig, StreamingEngine

from megatrain_nb.model_configs import FAMILY_VOCAB as VOCAB, family_config


def _data(steps, batch=2, seq=12):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(1, VOCAB, (batch, seq), generator=g) for _ in range(steps)]


def _train(engine, steps=4, overlap=False, during=None):
    losses = []
    for i, ids in enumerate(_data(steps)):
        if overlap:
            losses.append(engine.forward_backward(ids, step_lr=3e-3).loss)
        else:
            losses.append(engine.forward_backward(ids).loss)
            engine.optimizer_step(3e-3)
            engine.zero_grad()
        if during is not None:
            during(engine, i)
    return losses


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("offload_params", [False, True])
def test_disk_tier_matches_ram_and_cleans_up(tmp_path, overlap, offload_params):
    model = AutoModelForCausalLM.from_config(family_config("llama", tie=True)).eval()
    ram = StreamingEngine(copy.deepcopy(model), EngineConfig(device="cpu", weight_decay=0.01))
    # host_cache_gb=0: this test is about the files of the disk tier (with the default host
    # cache a model this small would stay in RAM; tests/engine/test_disk_cache.py covers that)
    disk = StreamingEngine(model, EngineConfig(device="cpu", weight_decay=0.01, offload_dir=str(tmp_path),
                                               offload_params=offload_params, host_cache_gb=0))
    assert disk.params_on_disk == offload_params
    seen = {}

    def during(engine, i):
        engine.zero_grad()      # waits for overlapped updates
        engine.disk.flush()     # and for their write-behind
        files = [os.path.join(r, f) for r, _, fs in os.walk(tmp_path) for f in fs]
        seen[i] = (len(files), sum(os.path.getsize(f) for f in files), engine.memory_report()["disk"])

    l_ram = _train(ram, overlap=overlap)
    l_disk = _train(disk, overlap=overlap, during=during)
    assert l_disk == pytest.approx(l_ram, abs=1e-6)
    pr = dict(ram.named_parameters())
    for name, p in disk.named_parameters():
        assert float((p - pr[name]).abs().max()) <= 1e-6, name
    n_files, n_bytes, rep = seen[3]
    assert n_files >= len(disk.units)
    assert rep["used_bytes"] > 0 and rep["optimizer_states"] >= 2 * 4 * disk.num_parameters()
    if offload_params:
        assert rep["weights"] >= 4 * disk.num_parameters()  # files: the data plus small headers
    assert rep["used_bytes"] <= n_bytes
    disk.close()
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


def test_compressed_codecs_use_fewer_disk_bytes_in_order(tmp_path):
    used = {}
    for codec in ("none", "int8", "int4"):
        model = AutoModelForCausalLM.from_config(family_config("qwen2"))
        e = StreamingEngine(model, EngineConfig(device="cpu", offload_dir=str(tmp_path), optimizer_compression=codec,
                                                host_cache_gb=0))   # the states' files are measured
        losses = _train(e, steps=6, overlap=True)
        assert all(torch.isfinite(torch.tensor(losses)))
        used[codec] = e.memory_report()["disk"]["optimizer_states"]
        e.close()
    assert used["none"] > used["int8"] > used["int4"] > 0
    assert used["int4"] * 3 < used["none"]


def test_compressed_states_round_trip_through_checkpoint(tmp_path):
    model = AutoModelForCausalLM.from_config(family_config("llama"))
    twin = copy.deepcopy(model)
    a = StreamingEngine(model, EngineConfig(device="cpu", optimizer_compression="int8", offload_dir=str(tmp_path)))
    _train(a, steps=2)
    a.save_checkpoint(tmp_path / "ckpt")
    b = StreamingEngine(twin, EngineConfig(device="cpu", optimizer_compression="int8"))
    b.load_checkpoint(tmp_path / "ckpt")
    la, lb = _train(a, steps=2), _train(b, steps=2)
    assert la == lb  # stored codes round-trip bit-exactly: resume is exact
    with pytest.raises(ValueError, match="codec 'int8'"):
        StreamingEngine(AutoModelForCausalLM.from_config(family_config("llama")),
                        EngineConfig(device="cpu")).load_checkpoint(tmp_path / "ckpt")


def test_disk_reads_issued_ahead_from_the_second_step(tmp_path):
    model = AutoModelForCausalLM.from_config(family_config("llama", layers=4))
    # host_cache_gb=0: the uncached read streams (fresh copies, handed buffers) are what is counted
    e = StreamingEngine(model, EngineConfig(device="cpu", offload_dir=str(tmp_path), offload_params=True,
                                            host_cache_gb=0))
    ids = _data(1)[0]
    e.forward_backward(ids, step_lr=1e-3)
    e.zero_grad()  # the first step's last update counts before the reset
    e.counters.reset()
    for _ in range(2):
        e.forward_backward(ids, step_lr=1e-3)
    e.zero_grad()  # waits for the overlapped updates of the last step
    tel = e.telemetry()
    pf = tel["prefetch"]["disk"]
    reads = pf["ahead"] + pf["late"]
    # Per step: weights for the forward (every unit but the three served fresh from the last
    # updates: embed, layers 0 and 1), for the backward (every layer, whose buffer then serves its
    # update), for the updates of embed and head; and the optimizer states of every unit.
    # Between these: a unit whose update is still running when the next forward asks for it is
    # handed its fresh copy instead of a read, and how many are depends on the threads' timing
    # (on a loaded machine a few more than the two, or none at all: seen 33 and 34 of 40 reads).
    n, layers = len(e.units), len(e.layer_units)
    assert 2 * (layers + n) <= reads <= 2 * (n + layers + 2 + n), pf
    assert pf["late"] == 0, pf
    # every weight a step asks for is read or saved: the forward's n units, the backward's layers,
    # the n updates' weights and the n units' states; a layer's update always reuses the buffer
    # its backward read (saved), the fresh copies the forward is handed are saved too, when in time
    saved = tel["weight_reads_saved"]
    assert reads + saved == 2 * (3 * n + layers), (reads, saved)
    assert saved >= 2 * layers, saved
    # bytes: a layer's weights cross disk->host twice per step at most (never three times), the
    # states once; the forward's reads are every unit's but those handed fresh copies; the
    # backward's every layer's but the last, whose forward buffer is carried across the head
    # (DiskReadStream's carry, when that buffer is still out as the backward's read is scheduled)
    w = sum(u.numel * 4 for u in e.units)
    fresh = 4 * (e.embed_unit.numel + e.layer_units[0].numel + e.layer_units[1].numel)
    bwd = sum(u.numel * 4 for u in e.layer_units)
    carried = 4 * e.layer_units[-1].numel
    upd = 4 * (e.embed_unit.numel + e.head_unit.numel)
    moved = tel["bytes"]["disk_to_host"]
    assert 2 * (w - fresh + bwd - carried + upd + 2 * w) <= moved <= 2 * (w + bwd + upd + 2 * w), moved
    assert moved % 4 == 0
    e.close()


# ---------------------------------------------------------------------------- bad offload_dir
def test_offload_dir_with_missing_parents_is_created_and_a_tier_too_big_refused(tmp_path, monkeypatch):
    """Issue 25: offload_dir inside an output_dir that does not exist yet is created (user-only,
    parents too); what protects an unmounted disk is the space check, with the numbers."""
    import collections
    import shutil

    from megatrain_nb.engine.tiers.disk_store import OffloadError

    missing = tmp_path / "run" / "outputs" / "offload"
    e = StreamingEngine(AutoModelForCausalLM.from_config(family_config("llama")),
                        EngineConfig(device="cpu", offload_dir=str(missing)))
    try:
        assert missing.is_dir() and (missing.stat().st_mode & 0o777) == 0o700
        assert (missing.parent.stat().st_mode & 0o777) == 0o700
        fs = e.memory_report()["disk"]["filesystem"]
        assert fs["path"] == str(missing) and fs["free_bytes"] > 0 and fs["type"]
    finally:
        e.close()
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10 << 20, 10 << 20, 1000))   # a full disk
    with pytest.raises(OffloadError, match=r"has 1000 bytes .* free but the disk tier needs \d+ bytes") as err:
        StreamingEngine(AutoModelForCausalLM.from_config(family_config("llama")),
                        EngineConfig(device="cpu", offload_dir=str(tmp_path / "other" / "offload")))
    assert str(tmp_path / "other" / "offload") in str(err.value) and "mounted at" in str(err.value)


def test_offload_dir_is_created_user_only_when_its_parent_exists(tmp_path):
    made = tmp_path / "nvme" / "cache"
    made.parent.mkdir()
    e = StreamingEngine(AutoModelForCausalLM.from_config(family_config("llama")),
                        EngineConfig(device="cpu", offload_dir=str(made)))
    try:
        assert made.is_dir() and (made.stat().st_mode & 0o777) == 0o700
        _train(e, steps=1)
        assert e.memory_report()["disk"]["used_bytes"] > 0  # the tier really lives there
        assert any(made.iterdir())
    finally:
        e.close()


def test_unwritable_offload_dir(tmp_path):
    """As root (CI) the engine is built by an unprivileged user in a forked child."""
    from megatrain_nb.engine.tiers.disk_store import OffloadError

    from ..privileges import as_user, shared_dir

    root = os.geteuid() == 0
    ro = Path(shared_dir(None, "ro") if root else tmp_path) / "ro"
    ro.mkdir(mode=0o500)
    model = AutoModelForCausalLM.from_config(family_config("llama"))

    def build():
        try:
            StreamingEngine(model, EngineConfig(device="cpu", offload_dir=str(ro)))
        except OffloadError as e:
            return str(e)
        return "accepted"
    if root:
        # everything the engine imports lazily is imported here first: the other user cannot
        # read this interpreter's files
        StreamingEngine(AutoModelForCausalLM.from_config(family_config("llama")),
                        EngineConfig(device="cpu", offload_dir=str(tmp_path))).close()
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # the forked child computes nothing in parallel
        try:
            ok, msg = as_user(build)
        finally:
            torch.set_num_threads(threads)
        assert ok, msg
    else:
        msg = build()
    assert str(ro) in msg, msg


def test_unwritable_offload_dir_even_as_root(tmp_path, monkeypatch):
    """As root every folder is writable, so make the OS refuse the store's folder creation."""
    from megatrain_nb.engine.tiers import disk_store
    from megatrain_nb.engine.tiers.disk_store import OffloadError

    def refuse(*a, **k):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(disk_store.tempfile, "mkdtemp", refuse)
    with pytest.raises(OffloadError, match=f"{tmp_path}.*(not writable|cannot use)|cannot use.*{tmp_path}"):
        StreamingEngine(AutoModelForCausalLM.from_config(family_config("llama")),
                        EngineConfig(device="cpu", offload_dir=str(tmp_path)))


@pytest.mark.parametrize("overlap", [False, True])
def test_full_disk_fails_clearly_and_leaves_no_half_written_state(tmp_path, monkeypatch, overlap):
    from megatrain_nb.engine.tiers import disk_store
    from megatrain_nb.engine.tiers.disk_store import OffloadError

    model = AutoModelForCausalLM.from_config(family_config("llama"))
    # host_cache_gb=0: every write reaches the disk at once (the cached case: test_disk_cache.py)
    e = StreamingEngine(model, EngineConfig(device="cpu", offload_dir=str(tmp_path), host_cache_gb=0))
    _train(e, steps=1)
    before = {n: p.clone() for n, p in e.named_parameters()}
    real_write = os.write

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_store.os, "write", full)
    if hasattr(disk_store.os, "pwrite"):
        monkeypatch.setattr(disk_store.os, "pwrite", lambda fd, data, off: full(fd, data))
    with pytest.raises(OffloadError, match=str(tmp_path)):
        _train(e, steps=1, overlap=overlap)
        e.zero_grad()  # overlapped: the updates' error surfaces where they are waited for
    monkeypatch.setattr(disk_store.os, "write", real_write)
    leftovers = [p.name for p in tmp_path.rglob("*") if p.is_file() and ".tmp" in p.name]
    assert leftovers == []
    with pytest.raises(RuntimeError, match="failed earlier.*load_checkpoint"):
        _train(e, steps=1, overlap=overlap)  # weights and states may be out of step: refused
    e.close()
    assert before  # the failure raised instead of silently continuing


# ---------------------------------------------------------------------------- bigger than RAM
_RSS_SCRIPT = textwrap.dedent("""
    import resource, sys, torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from megatrain_nb.engine import EngineConfig, StreamingEngine
    mode, folder, offload = sys.argv[1], sys.argv[2], sys.argv[3]
    cfg = AutoConfig.for_model("llama", vocab_size=1024, hidden_size=768, intermediate_size=2048,
                               num_hidden_layers=64, num_attention_heads=8, max_position_embeddings=64)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    # host_cache_gb=0: RAM must stay flat (a host cache of the disk tier would use free RAM)
    ec = EngineConfig(device="cpu", offload_dir=offload, offload_params=True, optimizer_compression="int8",
                      host_cache_gb=0)
    if mode == "meta":
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
        e = StreamingEngine(model, ec)
    else:
        e = StreamingEngine.from_pretrained(folder, ec)
    out = e.forward_backward(torch.randint(0, 1024, (1, 16)), step_lr=1e-4)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(e.num_parameters() * 4, peak - base, out.loss)
    e.close()
""")


def _make_sharded_folder(path):
    """The large model's checkpoint, written from this process (what the measured process reads is
    its files). Its weights are zeros, its norms ones: what the test measures is memory, which no
    value changes, and the loss stays finite (log 1024); the random init of 450M weights took ~8 s
    of CPU, a fresh interpreter's imports ~3 s more."""
    cfg = AutoConfig.for_model("llama", vocab_size=1024, hidden_size=768, intermediate_size=2048,
                               num_hidden_layers=64, num_attention_heads=8, max_position_embeddings=64)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0 if name.endswith("norm.weight") else 0.0)
    model.save_pretrained(str(path), max_shard_size="200MB")
    del model


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["meta", "safetensors"])
def test_large_model_never_whole_in_ram(tmp_path, mode):
    folder = tmp_path / "model"
    if mode == "safetensors":
        _make_sharded_folder(folder)
        assert len(list(folder.glob("*.safetensors"))) > 3  # really sharded
    offload = tmp_path / "offload"
    offload.mkdir()
    out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, mode, str(folder), str(offload)],
                         check=True, capture_output=True, text=True).stdout.split()
    model_bytes, grew, loss = int(out[0]), int(out[1]), float(out[2])
    assert model_bytes > 1.6e9  # about 450M params in 64 layers: large enough to see a whole copy
    assert grew < 0.5 * model_bytes, f"peak RSS grew by {grew / 2**20:.0f} MiB for a {model_bytes / 2**20:.0f} MiB model"
    assert loss == loss


def test_checkpoint_loads_into_weights_on_disk(tmp_path):
    model = AutoModelForCausalLM.from_config(family_config("llama"))
    twin = copy.deepcopy(model)
    a = StreamingEngine(model, EngineConfig(device="cpu"))
    _train(a, steps=2)
    a.save_checkpoint(tmp_path / "ckpt")
    (tmp_path / "off").mkdir()
    b = StreamingEngine(twin, EngineConfig(device="cpu", offload_dir=str(tmp_path / "off"), offload_params=True))
    b.load_checkpoint(tmp_path / "ckpt")
    assert _train(a, steps=2) == pytest.approx(_train(b, steps=2), abs=1e-6)
    b.close()


# ---------------------------------------------------------------------------- clipping, overlapped
@pytest.mark.parametrize("where", ["ram", "disk", "disk-uncached"])
@pytest.mark.parametrize("max_norm", [0.05, 100.0])   # clipping active / never reached
def test_clipped_overlapped_steps_match_torch(tmp_path, where, max_norm):
    """forward_backward(step_lr, max_grad_norm) over 2 micro-batches == torch AdamW after
    clip_grad_norm_; the updates run after the backward, the next forward waits per unit."""
    from transformers import Trainer

    model = AutoModelForCausalLM.from_config(family_config("llama", tie=True)).eval()
    ref = copy.deepcopy(model)
    decay = set(Trainer.get_decay_parameter_names(None, ref))
    groups = [{"params": [p for n, p in ref.named_parameters() if n in decay], "weight_decay": 0.1},
              {"params": [p for n, p in ref.named_parameters() if n not in decay], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    opts = dict(offload_dir=str(tmp_path), offload_params=True) if where.startswith("disk") else {}
    if where == "disk-uncached":   # the read streams: backward buffers handed to the first updates, fresh copies
        opts["host_cache_gb"] = 0
    e = StreamingEngine(model, EngineConfig(device="cpu", adam_betas=(0.9, 0.95), weight_decay=0.1, **opts))
    batches = _data(6)
    for step in range(3):
        window = batches[2 * step:2 * step + 2]
        n_items = sum(int(b[:, 1:].numel()) for b in window)
        for b in window:
            out = ref(input_ids=b, labels=b)
            (out.loss * b[:, 1:].numel() / n_items).backward()
        ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm))
        opt.step()
        opt.zero_grad()
        e.forward_backward(window[0], num_items_in_batch=n_items)
        out = e.forward_backward(window[1], num_items_in_batch=n_items, step_lr=3e-3, max_grad_norm=max_norm)
        assert out.grad_norm == pytest.approx(ref_norm, rel=1e-4)
        if max_norm < 1:
            assert out.grad_norm > max_norm  # clipping really happened
    refp = dict(ref.named_parameters())
    for name, p in e.named_parameters():  # waits for the last step's updates
        assert float((p - refp[name].detach()).abs().max()) <= 1e-5, name
    if where.startswith("disk"):
        tel = e.telemetry()
        # updated buffers fed the next forward: fresh copies, or hits of the host cache
        assert tel["weight_reads_saved"] + tel["disk_cache"]["hits"] > 0
    e.close()


def _clipped_optimizer_reads(tmp_path, held, steps=3):
    """The optimizer stream's weight reads (the store's non-urgent ones) over ``steps`` clipped
    steps without a host cache, ``held`` more backward reads held (None: the budget's)."""
    model = AutoModelForCausalLM.from_config(family_config("llama", layers=4))
    e = StreamingEngine(model, EngineConfig(device="cpu", offload_dir=str(tmp_path), offload_params=True,
                                            host_cache_gb=0, overrides={"held_weight_units": held}))
    reads = []
    read = e.disk.read

    def counted(key, out=None, **kw):
        reads.append((key, kw.get("urgent", False)))
        return read(key, out, **kw)
    ids = _data(1)[0]
    e.forward_backward(ids, step_lr=1e-3, max_grad_norm=1.0)
    e.zero_grad()
    e.disk.read = counted
    for _ in range(steps):
        e.forward_backward(ids, step_lr=1e-3, max_grad_norm=1.0)
    e.zero_grad()   # the last step's updates done
    from megatrain_nb.engine.tiers.disk_params import weights_key

    keys = {weights_key(u): u.name for u in e.units}
    return e, [keys[k] for k, urgent in reads if k in keys and not urgent]


def test_clipped_updates_read_only_the_weights_the_backward_did_not_hand_them(tmp_path):
    # Without a host cache, clipped updates run after the backward in the next forward's order:
    # the first ones want the units the backward read last, whose buffers (all the compute
    # stream's but one: 3 + depth - 1 = 3) are handed to them; the optimizer's own read stream
    # (the store's non-urgent reads) reads the weights of every other updated unit, once.
    steps = 3
    e, optimizer_reads = _clipped_optimizer_reads(tmp_path, held=0, steps=steps)
    handed = {u.name for u in e.layer_units[:3]}   # layers 0, 1 and 2: the backward's last three
    assert sorted(set(optimizer_reads)) == sorted(u.name for u in e.units if u.name not in handed)
    assert len(optimizer_reads) == steps * (len(e.units) - 3), optimizer_reads
    assert e.telemetry()["weight_reads_saved"] >= 2 * steps
    e.close()


def test_clipped_updates_take_every_held_backward_read(tmp_path):
    # With room in the host budget (the default here: tiny units, no cache), every layer's
    # backward read is held for its update: only the units read once (the embedding at the
    # forward's start, the head) are read again for their updates; the compute stream's
    # staging grew by the held reads only: its own 4 buffers (3 handed) + 1 for 4 layers.
    steps = 3
    e, optimizer_reads = _clipped_optimizer_reads(tmp_path, held=None, steps=steps)
    assert sorted(optimizer_reads) == sorted(["embed", "head"] * steps), optimizer_reads
    unit_bytes = max(u.numel for u in e.units) * 4
    assert e.weights._fetch.staging_bytes == (3 + 2) * unit_bytes
    e.close()
    e, optimizer_reads = _clipped_optimizer_reads(tmp_path / "two", held=2, steps=steps)
    handed = {u.name for u in e.layer_units}   # 2 + 2 held: all four layers
    assert sorted(set(optimizer_reads)) == sorted(u.name for u in e.units if u.name not in handed)
    e.close()


@pytest.mark.parametrize("codec,held", [("none", None), ("int4", None), ("int4", 2)])
def test_the_prediction_reads_what_a_clipped_step_without_a_cache_reads(tmp_path, codec, held):
    """The prediction's disk reads of a clipped step without a host cache (``disk_cache.step_accesses``
    given ``held``, from ``held_after_backward``) against the engine's own: the held units' updates read nothing
    and the next forward's first load of each takes its fresh copy, so each layer is read once a
    step (the backward's read), not three times (the tenth session's 301 MB priced against 188 read).
    Within one unit: a fresh copy of an update that was not held (fp32 states: the embedding's,
    from the optimizer stream) may survive too, or not, as timing has it."""
    from megatrain_nb.engine.planning.prediction_check import engine_prediction

    from .test_prediction import rates

    model = AutoModelForCausalLM.from_config(family_config("llama", layers=4))
    e = StreamingEngine(model, EngineConfig(device="cpu", offload_dir=str(tmp_path), offload_params=True,
                                            host_cache_gb=0, optimizer_compression=codec,
                                            overrides={"held_weight_units": held}))
    ids = _data(1)[0]
    for _ in range(3):   # the first clipped step grows the held buffers; then the steady state
        e.forward_backward(ids, step_lr=1e-3, max_grad_norm=1.0)
    e.zero_grad()
    before, steps = e.telemetry()["bytes"]["disk_to_host"], 3
    for _ in range(steps):
        e.forward_backward(ids, step_lr=1e-3, max_grad_norm=1.0)
    e.zero_grad()
    read = (e.telemetry()["bytes"]["disk_to_host"] - before) / steps
    p = engine_prediction(e, rates=rates())
    predicted = p.bytes["disk_read"]
    weights = sum(4 * u.numel for u in e.units)
    # the weights about once a step (every layer's three times: over 2.2x here)
    assert predicted - p.bytes["disk_state_read"] < 1.3 * weights
    assert abs(read - predicted) <= 4 * max(u.numel for u in e.units), (read, predicted)
    e.close()


def test_max_grad_norm_needs_step_lr():
    e = StreamingEngine(AutoModelForCausalLM.from_config(family_config("llama")), EngineConfig(device="cpu"))
    ids = _data(1)[0]
    with pytest.raises(ValueError, match="step_lr"):
        e.forward_backward(ids, max_grad_norm=1.0)
    with pytest.raises(ValueError, match="max_grad_norm=-1.0: must be a finite number >= 0"):
        e.forward_backward(ids, step_lr=1e-3, max_grad_norm=-1.0)
    e.close()


def test_an_engine_dropped_without_close_cleans_up_without_joining(tmp_path):
    """__del__ may run inside the garbage collector anywhere (even within an executor's own
    locks): it only sets flags; the disk folder goes with the store, idle workers exit."""
    import gc
    import time

    e = StreamingEngine(AutoModelForCausalLM.from_config(family_config("llama")),
                        EngineConfig(device="cpu", offload_dir=str(tmp_path), offload_params=True))
    _train(e, steps=1, overlap=True)
    e.zero_grad()
    e.disk.flush()
    workers = list(e.disk._pool._threads)
    assert workers and all(t.is_alive() for t in workers)
    del e
    gc.collect()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (list(tmp_path.rglob("*.mtd")) or any(t.is_alive() for t in workers)):
        time.sleep(0.1)
    assert list(tmp_path.rglob("*.mtd")) == []
    assert not any(t.is_alive() for t in workers)


def test_memory_report_counts_read_ahead_and_recycled_buffers(tmp_path):
    e = StreamingEngine(AutoModelForCausalLM.from_config(family_config("llama")),
                        EngineConfig(device="cpu", offload_dir=str(tmp_path), offload_params=True))
    _train(e, steps=2, overlap=True)
    e.zero_grad()
    e.disk.flush()
    host = e.memory_report()["host"]
    moments = 2 * 4 * max(u.numel for u in e.units)
    assert host["buffers"] >= moments  # the last updates' moments, kept for the next step
    assert host["used_bytes"] == (host["weights"] + host["grads"] + host["optimizer_states"] + host["buffers"]
                                  + host["disk_cache"])
    e.states.schedule(e.units)  # the next step's state reads start (all fit the budget): counted
    assert e.memory_report()["host"]["buffers"] >= sum(8 * u.numel for u in e.units)
    e.close()


def test_engine_threads_share_one_name_prefix(tmp_path):
    """docs/INTERNALS.md "Threads and locks": every thread the engine starts is named mtnb-*."""
    import threading

    before = set(threading.enumerate())
    model = AutoModelForCausalLM.from_config(family_config("llama")).eval()
    e = StreamingEngine(model, EngineConfig(device="cpu", offload_dir=str(tmp_path), offload_params=True))
    _train(e, steps=2, overlap=True)
    e.forward_backward(_data(1)[0], step_lr=1e-3, max_grad_norm=1.0)
    started = [t.name for t in set(threading.enumerate()) - before]
    e.close()
    assert {n.split("_")[0] for n in started} >= {"mtnb-h2d", "mtnb-d2h", "mtnb-adamw", "mtnb-disk"}
    assert all(n.startswith("mtnb-") for n in started), started
