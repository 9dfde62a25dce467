"""Every engine thread starts on the engine's device (issue 37 item 6): a fresh thread's current
CUDA device is cuda:0, so a rank on cuda:1 would otherwise make a context on GPU 0 the first
time one of its threads enters a stream. The thread registry sets the device where each pool's
threads start; the compute thread sets it on entering the engine. (On CPU the hook sees the CPU
device and does nothing; here it is replaced by one that records its calls.)"""
import threading

import torch
from transformers import AutoModelForCausalLM

from megatrain_nb import threads
from megatrain_nb.engine import EngineConfig, StreamingEngine

from megatrain_nb.model_configs import FAMILY_VOCAB as VOCAB, family_config


def _recording(monkeypatch):
    calls = []
    monkeypatch.setattr(threads, "set_thread_device",
                        lambda device: calls.append((threading.current_thread().name, device)))
    return calls


def test_a_pool_made_under_thread_device_starts_its_threads_on_it(monkeypatch):
    calls = _recording(monkeypatch)
    dev = torch.device("cuda", 1)   # (never touched: the hook only records)
    with threads.thread_device(torch.device("cpu")):
        ex = threads.executor(threads.H2D)
        assert threads.current_thread_device() == torch.device("cpu")
    assert threads.current_thread_device() is None
    explicit = threads.executor(threads.D2H, device=dev)
    for e in (ex, explicit):
        e.submit(lambda: None).result()
        e.shutdown(wait=True)
    assert (("mtnb-h2d_0", torch.device("cpu")) in calls) and (("mtnb-d2h_0", dev) in calls)


def test_every_engine_thread_and_the_compute_thread_set_the_engine_device(monkeypatch, tmp_path):
    calls = _recording(monkeypatch)
    model = AutoModelForCausalLM.from_config(family_config("llama")).eval()
    engine = StreamingEngine(model, EngineConfig(device="cpu", offload_dir=str(tmp_path), optimizer_compression="int8"))
    try:
        engine.forward_backward(torch.randint(1, VOCAB, (2, 8)), step_lr=1e-3, max_grad_norm=1.0)
    finally:
        engine.close()
    started = {name for name, _ in calls}
    assert all(d == torch.device("cpu") for _, d in calls), calls
    for prefix in ("mtnb-h2d", "mtnb-d2h", "mtnb-adamw", "mtnb-decode", "mtnb-encode", "mtnb-disk"):
        assert any(n.startswith(prefix) for n in started), (prefix, sorted(started))
    assert threading.current_thread().name in started   # the compute thread, on entering the engine


def test_a_gpu_without_an_index_is_the_current_one_wherever_a_thread_sets_it(monkeypatch):
    """``device="cuda"`` (and EngineConfig's default on a GPU machine) names no index, and
    ``torch.cuda.set_device`` refuses such a device (ValueError): every engine thread failed on
    starting. The config, the threads' hook and a rank's group give it the index."""
    from torch.cuda._utils import _get_device_index

    from megatrain_nb.engine.ranks.dist import Dist

    set_to = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # torch's own check (what set_device does first), then recorded instead of touching a GPU
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: set_to.append(_get_device_index(d)))
    assert EngineConfig(device="cuda").torch_device == torch.device("cuda", 1)
    assert EngineConfig().torch_device == torch.device("cuda", 1)   # the default on a GPU machine
    assert EngineConfig(device="cuda:0").torch_device == torch.device("cuda", 0)
    assert EngineConfig(device="cpu").torch_device == torch.device("cpu")
    threads.set_thread_device(torch.device("cuda"))
    threads.set_thread_device("cuda:0")
    threads.set_thread_device(torch.device("cpu"))
    assert set_to == [1, 0]
    assert Dist(_single=True, device="cuda", local_rank=3).device == torch.device("cuda", 3)
