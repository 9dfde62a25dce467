"""The update runner works on a unit in chunks (OptimizerStates.update): decode a slice of the
moments, AdamW on that slice, encode it. Chunks are whole codec blocks, so any chunk size gives
bitwise the result of the whole unit at once (the path before chunking, still used for states
that are not block codes), and no fp32 moments larger than a chunk ever exist."""
import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatrain_nb.engine import EngineConfig, StreamingEngine

from megatrain_nb.engine.updates import fused_update
from megatrain_nb.model_configs import FAMILY_VOCAB as VOCAB, family_config


def _ids(steps, seed=7):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (2, 12), generator=g) for _ in range(steps)]


def _engine(model, codec, chunk, **kw):
    overrides = {"update_chunk_numel": chunk} if chunk else {}
    return StreamingEngine(model, EngineConfig(device="cpu", optimizer_compression=codec, weight_decay=0.01,
                                               overrides=overrides, **kw))


@pytest.mark.parametrize("codec", ["none", "int8", "int4"])
@pytest.mark.parametrize("clip", [None, 1.0])
@pytest.mark.parametrize("fused", [True, False])
def test_chunked_updates_equal_the_whole_unit_bitwise(codec, clip, fused):
    """The whole unit decoded, stepped by torch's fused AdamW and encoded, against the chunked
    update: the fused kernel's one pass (``fused``) or the ring's decode / AdamW / encode."""
    if codec == "none" and not fused:
        pytest.skip("fp32 states are not chunked")
    model = AutoModelForCausalLM.from_config(family_config("llama", layers=2, hidden=64))
    whole = _engine(copy.deepcopy(model), codec, None)
    if whole.states.chunked:
        whole.states.chunked = False       # the whole-unit path: decode all, AdamW, encode all
    small = _engine(model, codec, 1280)    # 5 int8 blocks, 40 int4 blocks: many chunks per unit
    small.states.fused = fused
    assert small.states.chunk_numel == (1280 if codec != "none" else 0)
    # the decayed part of a layer does not end on a chunk boundary: a chunk is split there
    assert all(u.decay_numel % 1280 for u in small.units)
    seen = []
    if small.states.chunked:
        c = small.states.codecs["exp_avg"]
        real = c.decode
        c.decode = lambda enc, out: seen.append(out.numel()) or real(enc, out)
    for ids in _ids(4):
        a = whole.forward_backward(ids, step_lr=3e-3, max_grad_norm=clip)
        b = small.forward_backward(ids, step_lr=3e-3, max_grad_norm=clip)
        assert a.loss == b.loss
    pw = dict(whole.named_parameters())
    for n, p in small.named_parameters():
        assert torch.equal(p, pw[n]), n
    for u in small.units:
        got, want = small.states.stored(u), whole.states.stored(u)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), u.name
    if small.states.chunked and fused and fused_update.kernels() is not None:
        assert seen == []          # the fused update decodes no fp32 moments at all
    elif small.states.chunked:     # only chunk-sized fp32 moments were ever decoded
        assert seen and max(seen) <= 1280
    whole.close(); small.close()


def test_chunk_size_is_aligned_to_the_codec_blocks():
    model = AutoModelForCausalLM.from_config(family_config("llama", layers=1, hidden=32))
    e = _engine(model, "int8", 1000)      # int8 blocks of 256: rounded down to 768
    assert e.states.chunk_numel == 768
    e.close()
    for asked, got in ((100, 96), (10, 32)):   # int4 blocks of 32; at least one block
        e = _engine(AutoModelForCausalLM.from_config(family_config("llama", layers=1, hidden=32)), "int4", asked)
        assert e.states.chunk_numel == got
        e.close()


@pytest.mark.parametrize("codec", ["int8", "int4"])
@pytest.mark.parametrize("clip", [None, 1.0])
def test_chunked_updates_on_the_disk_tier_equal_ram(tmp_path, codec, clip):
    """Master weights and states on the disk tier, no host cache: an update not handed its
    backward's buffer reads and writes its weights range by range (no optimizer staging
    buffer exists); weights and states stay bitwise those of RAM."""
    model = AutoModelForCausalLM.from_config(family_config("llama", layers=2, hidden=64))
    ram = _engine(copy.deepcopy(model), codec, 768)
    disk = _engine(model, codec, 768, offload_dir=str(tmp_path), offload_params=True, host_cache_gb=0)
    # the compute stream's staging (3 + depth for small units) and nothing for the optimizer
    assert disk.weights.ranged and disk.weights.nbytes()["host"] == (3 + 1) * 4 * max(u.numel for u in disk.units)
    ranged = []
    real = disk.weights.disk.ranged
    disk.weights.disk.ranged = lambda key, *a, **k: ranged.append(key) or real(key, *a, **k)
    for ids in _ids(3):
        a = ram.forward_backward(ids, step_lr=3e-3, max_grad_norm=clip)
        b = disk.forward_backward(ids, step_lr=3e-3, max_grad_norm=clip)
        assert a.loss == b.loss
    disk.updates.wait_all()
    # the updates not handed a buffer are ranged: unclipped, the units the backward read once;
    # clipped, those after the last units the backward read (their buffers go to the first updates)
    weight_keys = [k for k in ranged if k.startswith("weights-")]
    assert 0 < len(weight_keys) < 3 * len(disk.units), weight_keys
    assert len(set(weight_keys)) * 3 == len(weight_keys), weight_keys   # the same units each step
    pr = dict(ram.named_parameters())
    for n, p in disk.named_parameters():
        assert torch.equal(p, pr[n]), n
    for u in disk.units:
        got, want = disk.states.stored(u), ram.states.stored(u)
        assert all(torch.equal(got[k], want[k]) for k in want), u.name
    disk.configure(layer_stats=True)   # layer statistics need whole units: the next updates read them whole
    ram.configure(layer_stats=True)
    for ids in _ids(2, seed=8):
        assert ram.forward_backward(ids, step_lr=3e-3).loss == disk.forward_backward(ids, step_lr=3e-3).loss
    pr = dict(ram.named_parameters())
    for n, p in disk.named_parameters():
        assert torch.equal(p, pr[n]), n
    ram.close(); disk.close()


@pytest.mark.parametrize("codec", ["int8", "int4"])
@pytest.mark.parametrize("clip", [None, 1.0])
def test_codes_on_the_disk_tier_are_read_and_written_range_by_range_bitwise(tmp_path, codec, clip):
    """Without a host cache, a chunked update reads each chunk's codes from the unit's file and
    writes its new codes to the file's next version (DiskStore.ranged): no unit's codes are
    ever read whole, and weights and states are bitwise those of RAM-held states."""
    model = AutoModelForCausalLM.from_config(family_config("llama", layers=2, hidden=64))
    ram = _engine(copy.deepcopy(model), codec, 1280)
    disk = _engine(model, codec, 1280, offload_dir=str(tmp_path), host_cache_gb=0)
    assert disk.states.ranged_io() and not ram.states.ranged_io()
    whole_reads = []
    real_read = disk.states.disk.read
    disk.states.disk.read = lambda key, *a, **k: (whole_reads.append(key) if key.startswith("adam-") else None) \
        or real_read(key, *a, **k)
    for ids in _ids(3):
        a = ram.forward_backward(ids, step_lr=3e-3, max_grad_norm=clip)
        b = disk.forward_backward(ids, step_lr=3e-3, max_grad_norm=clip)
        assert a.loss == b.loss
    disk.updates.wait_all()
    assert whole_reads == []   # every state read was a chunk's range
    pr = dict(ram.named_parameters())
    for n, p in disk.named_parameters():
        assert torch.equal(p, pr[n]), n
    for u in disk.units:
        got, want = disk.states.stored(u), ram.states.stored(u)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), u.name
    # RAM: the ring's moments and codes, nothing unit-sized
    assert disk.states.nbytes()["host_buffers"] < min(8 * u.numel for u in disk.units if u.kind == "layer")
    ram.close(); disk.close()


def test_a_corrupted_state_file_is_refused_by_the_ranged_update(tmp_path):
    from megatrain_nb.engine.tiers.disk_store import OffloadError

    model = AutoModelForCausalLM.from_config(family_config("llama", layers=1, hidden=64))
    e = _engine(model, "int8", 768, offload_dir=str(tmp_path), host_cache_gb=0)
    ids = _ids(2)
    e.forward_backward(ids[0], step_lr=3e-3)
    e.updates.wait_all()
    e.states.disk.flush()
    unit = e.units[1]
    path = e.states.disk.key_path(e.states.key(unit))
    with open(path, "r+b") as f:   # flip a byte of the last tensor's payload
        f.seek(-4096 - 1, 2)
        byte = f.read(1)
        f.seek(-4096 - 1, 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(OffloadError, match="does not match its checksum"):
        e.forward_backward(ids[1], step_lr=3e-3)
        e.updates.wait_all()
    e.close()
