"""The engine's helper threads run torch on their own counts without changing anyone else's:
the codec threads on one, and a thread started after a step (a notebook session's compute
thread) still gets torch's default count. torch.set_num_threads in a
worker used to set the count every later thread starts from: after an int8 engine's first step
a new thread ran on one thread of this machine's cores."""
import threading

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from megatrain_nb.engine import EngineConfig, StreamingEngine
from megatrain_nb.threads import torch_threads_here


def _in_new_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


@pytest.fixture
def two_threads():
    """A default of 2 torch threads for the test (the suite runs on 1), put back after it."""
    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    yield 2
    torch.set_num_threads(prev)


def test_torch_threads_here_sets_this_thread_only(two_threads):
    default = _in_new_thread(torch.get_num_threads)
    assert default == two_threads
    assert _in_new_thread(lambda: (torch_threads_here(1), torch.get_num_threads())[1]) == 1
    assert _in_new_thread(torch.get_num_threads) == default     # a later thread: the default
    assert torch.get_num_threads() == default                    # this one too


@pytest.mark.slow   # (an engine, two steps: ~2-5 s)
def test_engine_workers_counts_and_a_later_thread(two_threads):
    default = _in_new_thread(torch.get_num_threads)
    assert default == two_threads
    cfg = AutoConfig.for_model("llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=4)
    torch.manual_seed(0)
    engine = StreamingEngine(AutoModelForCausalLM.from_config(cfg),
                             EngineConfig(device="cpu", optimizer_compression="int8"))
    try:
        ids = torch.randint(0, 256, (1, 16))
        engine.forward_backward(ids, step_lr=1e-3)                     # unclipped: updates in the backward
        engine.zero_grad()
        engine.forward_backward(ids, step_lr=1e-3, max_grad_norm=1.0)  # clipped: after it
        engine.zero_grad()
        states = engine.updates.runner.states
        assert states._decoder.submit(torch.get_num_threads).result() == 1   # one_torch_thread
        assert states._codec.submit(torch.get_num_threads).result() == 1
        # the AdamW worker at a team of 1 and the copy threads keep torch's default (their OpenMP
        # teams keep libgomp's spin-wait throttled: update_runner.UpdateRunner's comment)
        assert engine.adam.team.threads == 1
        for worker in (engine.updates.runner._worker, engine.pager._h2d, engine.pager._d2h):
            assert worker.submit(torch.get_num_threads).result() == default
        assert _in_new_thread(torch.get_num_threads) == default
        assert torch.get_num_threads() == default
    finally:
        engine.close()
