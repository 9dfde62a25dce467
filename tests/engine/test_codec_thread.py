"""Compressed optimizer states on the disk tier: decoded ahead and encoded behind in the codec
thread (states.OptimizerStates, mtnb-codec) -- same training as in RAM, failures delivered."""
import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatrain_nb.engine import EngineConfig, StreamingEngine

from .families import VOCAB, family_config


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
    assert disk.states._codec is not None and ram.states._codec is None
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


def test_a_failed_encode_behind_is_delivered_and_refuses_training(tmp_path, monkeypatch):
    model = AutoModelForCausalLM.from_config(family_config("llama", layers=2, hidden=64))
    e = StreamingEngine(model, EngineConfig(device="cpu", optimizer_compression="int8", offload_dir=str(tmp_path),
                                            offload_params=True, host_cache_gb=0))
    data = _ids(3)
    e.forward_backward(data[0], step_lr=1e-3, max_grad_norm=1.0)
    e.zero_grad()
    codec = e.states.codecs["exp_avg"]

    def broken(x):
        raise ValueError("cannot encode exp_avg with the int8 codec: it contains NaN or Inf")
    monkeypatch.setattr(codec, "encode", broken)
    with pytest.raises(ValueError, match="NaN or Inf"):
        e.forward_backward(data[1], step_lr=1e-3, max_grad_norm=1.0)
        e.zero_grad()
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="failed earlier"):
        e.forward_backward(data[2], step_lr=1e-3, max_grad_norm=1.0)
    e.close()
