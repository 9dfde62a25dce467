"""Compressed optimizer states, in RAM or on the disk tier: decoded ahead and encoded behind in
the codec threads (states.OptimizerStates, mtnb-decode / mtnb-encode) -- same training as the
codec in line, failures delivered."""
import contextlib
import copy
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatrain_nb.engine import EngineConfig, StreamingEngine

from megatrain_nb.engine.updates import fused_update
from megatrain_nb.model_configs import FAMILY_VOCAB as VOCAB, family_config


def _ids(steps):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(1, VOCAB, (2, 12), generator=g) for _ in range(steps)]


@pytest.mark.parametrize("cache_gb", [0, 1.0])
@pytest.mark.parametrize("clip", [None, 1.0])
def test_disk_codec_thread_trains_like_ram(tmp_path, cache_gb, clip):
    model = AutoModelForCausalLM.from_config(family_config("llama", layers=3, hidden=64))
    ram = StreamingEngine(copy.deepcopy(model), EngineConfig(device="cpu", optimizer_compression="int8",
                                                             weight_decay=0.01))
    disk = StreamingEngine(model, EngineConfig(device="cpu", optimizer_compression="int8", weight_decay=0.01,
                                               offload_dir=str(tmp_path), offload_params=True,
                                               host_cache_gb=cache_gb))
    assert disk.states._codec is not None and ram.states._codec is not None
    data = _ids(5)
    la = [ram.forward_backward(ids, step_lr=3e-3, max_grad_norm=clip).loss for ids in data]
    lb = [disk.forward_backward(ids, step_lr=3e-3, max_grad_norm=clip).loss for ids in data]  # back to back
    assert lb == la
    pr = dict(ram.named_parameters())
    for n, p in disk.named_parameters():
        assert torch.equal(p, pr[n]), n
    for u in disk.units:   # the stored codes too (a checkpoint waits for pending encodes)
        got, want = disk.states.stored(u), ram.states.stored(u)
        assert all(torch.equal(got[k], want[k]) for k in want), u.name
    ram.close(); disk.close()


def _in_line(engine):
    """The codec run in line by the AdamW worker (the path before the codec threads)."""
    for pool in (engine.states._codec, engine.states._decoder):
        pool.shutdown()
    engine.states._codec = engine.states._decoder = None
    return engine


@pytest.mark.parametrize("codec", ["int8", "int4"])
@pytest.mark.parametrize("clip", [None, 1.0])
def test_ram_codec_threads_train_like_the_codec_in_line(codec, clip):
    model = AutoModelForCausalLM.from_config(family_config("llama", layers=3, hidden=64))
    cfg = dict(device="cpu", optimizer_compression=codec, weight_decay=0.01)
    ref = _in_line(StreamingEngine(copy.deepcopy(model), EngineConfig(**cfg)))
    e = StreamingEngine(model, EngineConfig(**cfg))
    ref.states.fused = e.states.fused = False   # the ring's decode / AdamW / encode (the fused
    threads = set()                              # kernel runs in the AdamW worker: test_fused_*)
    codec = e.states.codecs["exp_avg"]
    for name in ("encode", "decode"):
        def spy(*a, _f=getattr(codec, name), **k):
            threads.add(threading.current_thread().name.rsplit("_", 1)[0])
            return _f(*a, **k)
        setattr(codec, name, spy)
    data = _ids(5)
    la = [ref.forward_backward(ids, step_lr=3e-3, max_grad_norm=clip).loss for ids in data]
    lb = [e.forward_backward(ids, step_lr=3e-3, max_grad_norm=clip).loss for ids in data]
    assert lb == la
    assert {"mtnb-decode", "mtnb-encode"} <= threads, threads   # the codec ran beside the AdamW worker
    pr = dict(ref.named_parameters())
    for n, p in e.named_parameters():
        assert torch.equal(p, pr[n]), n
    for u in e.units:
        got, want = e.states.stored(u), ref.states.stored(u)
        assert all(torch.equal(got[k], want[k]) for k in want), u.name
    ref.close(); e.close()


@pytest.mark.parametrize("tier", ["ram", "disk"])
def test_a_failed_encode_behind_is_delivered_and_refuses_training(tmp_path, monkeypatch, tier):
    model = AutoModelForCausalLM.from_config(family_config("llama", layers=2, hidden=64))
    disk = dict(offload_dir=str(tmp_path), offload_params=True, host_cache_gb=0) if tier == "disk" else {}
    e = StreamingEngine(model, EngineConfig(device="cpu", optimizer_compression="int8", **disk))
    data = _ids(3)
    e.forward_backward(data[0], step_lr=1e-3, max_grad_norm=1.0)
    e.zero_grad()
    codec = e.states.codecs["exp_avg"]

    def broken(*a, **k):
        raise ValueError("cannot encode exp_avg with the int8 codec: it contains NaN or Inf")
    monkeypatch.setattr(codec, "encode", broken)
    monkeypatch.setattr(fused_update.Kernels, "update", broken)   # (RAM: the fused kernel encodes)
    with pytest.raises(ValueError, match="NaN or Inf"):
        e.forward_backward(data[1], step_lr=1e-3, max_grad_norm=1.0)
        e.zero_grad()
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="failed earlier"):
        e.forward_backward(data[2], step_lr=1e-3, max_grad_norm=1.0)
    e.close()


@pytest.mark.parametrize("codec", ["int8", "int4"])
@pytest.mark.parametrize("clip", [None, 1.0])
def test_fused_update_trains_like_the_ring(codec, clip):
    """RAM states: the fused kernel's one pass per chunk (in the AdamW worker) against the ring's
    decode (mtnb-decode) / torch's fused AdamW / encode (mtnb-encode): the same losses, weights
    and stored codes, bit for bit."""
    if fused_update.kernels() is None:
        pytest.skip(f"no fused kernels here: {fused_update.disabled_reason()}")
    model = AutoModelForCausalLM.from_config(family_config("llama", layers=3, hidden=64))
    cfg = dict(device="cpu", optimizer_compression=codec, weight_decay=0.01)
    ring = StreamingEngine(copy.deepcopy(model), EngineConfig(**cfg))
    ring.states.fused = False
    e = StreamingEngine(model, EngineConfig(**cfg))
    stepped = []
    real = fused_update.Kernels.update
    data = _ids(5)
    la = [ring.forward_backward(ids, step_lr=3e-3, max_grad_norm=clip).loss for ids in data]
    fused_update.Kernels.update = lambda self, *a, **k: stepped.append(a[1].numel()) or real(self, *a, **k)
    try:
        lb = [e.forward_backward(ids, step_lr=3e-3, max_grad_norm=clip).loss for ids in data]
        e.updates.wait_all()
    finally:
        fused_update.Kernels.update = real
    assert lb == la
    assert stepped and sum(stepped) == 5 * sum(u.numel for u in e.units if u.numel)
    pr = dict(ring.named_parameters())
    for n, p in e.named_parameters():
        assert torch.equal(p, pr[n]), n
    for u in e.units:
        got, want = e.states.stored(u), ring.states.stored(u)
        assert all(torch.equal(got[k], want[k]) for k in want), u.name
    ring.close(); e.close()


def _trained(model, cfg, data, torch_path=False):
    """An engine trained on ``data`` (clipped, lr 3e-3): the fused kernels, or today's torch path
    (``fused_update.torch_path()``: the codecs on torch ops, MKL's square roots)."""
    with (fused_update.torch_path() if torch_path else contextlib.nullcontext()):
        e = StreamingEngine(copy.deepcopy(model), EngineConfig(**cfg))
        losses = [e.forward_backward(ids, step_lr=LR, max_grad_norm=1.0).loss for ids in data]
        e.updates.wait_all()
        stored = {u.index: e.states.stored(u) for u in e.units}
    return e, losses, stored


def _code_levels(got, want, codec):
    """Per stored code array: the levels by which two engines' codes differ."""
    for k in want:
        if k.endswith("codes"):
            a, b = got[k].view(torch.uint8).int(), want[k].view(torch.uint8).int()
            if codec == "int4":
                a, b = torch.stack([a & 15, a >> 4]), torch.stack([b & 15, b >> 4])
            yield k, (a - b).abs()


LR = 3e-3


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_fused_update_trains_as_the_torch_path_within_the_codec_error(codec):
    """The fused kernels against today's torch path. After one step: codes equal or one level
    apart (a root rounded one ulp apart at a code boundary: MKL's square root is one ulp low on
    some inputs, the kernel's is correctly rounded), on at most 1 in 10,000 codes, and weights
    equal up to what such a code moves. Over five steps the two runs drift apart as any two
    roundings of one training do (a code one level apart moves its weight's next update, the
    weights move every gradient; how fast depends on the CPU's vector width: on an AVX2 machine
    2 codes of 175k differ after the first step, 167 after the fifth): the losses stay equal to
    1e-4, no weight is more than one update's size (lr) apart and no code more than 2 levels."""
    if fused_update.kernels() is None:
        pytest.skip(f"no fused kernels here: {fused_update.disabled_reason()}")
    model = AutoModelForCausalLM.from_config(family_config("llama", layers=2, hidden=64))
    cfg = dict(device="cpu", optimizer_compression=codec, weight_decay=0.01)
    data = _ids(5)
    for steps, weight_tol, levels, share in ((1, 1e-4, 1, 10_000), (5, LR, 2, 200)):
        e, la, got = _trained(model, cfg, data[:steps])
        ref, lb, want = _trained(model, cfg, data[:steps], torch_path=True)
        assert la == pytest.approx(lb, rel=1e-4)
        pr = dict(ref.named_parameters())
        for n, p in e.named_parameters():
            assert torch.allclose(p, pr[n], rtol=0, atol=weight_tol), (steps, n)
        differ = total = 0
        for u in e.units:
            for k, d in _code_levels(got[u.index], want[u.index], codec):
                assert int(d.max()) <= levels, (steps, u.name, k)
                differ, total = differ + int((d > 0).sum()), total + d.numel()
        assert differ <= max(2, total // share), (steps, differ, total)
        ref.close(); e.close()
