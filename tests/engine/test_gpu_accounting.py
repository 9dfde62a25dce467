"""What the GPU path costs the host, counted on CPU where the same code runs (issue 45): no host
sync per loss chunk; what the engine pins is only what crosses the link (the accounting)."""
import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatrain_nb.engine import EngineConfig, StreamingEngine
from megatrain_nb.engine.tiers.host_store import HostStore, pinned_layout
from megatrain_nb.engine.compute.loss_head import LossHead
from megatrain_nb.model_configs import FAMILY_VOCAB as VOCAB, family_config


def test_the_loss_is_read_once_per_micro_batch_not_once_per_chunk(monkeypatch):
    """The chunked loss head sums its chunks on the device and reads the sum once (float() of a
    CUDA tensor waits for the device): counted, one read per loss call over 8 chunks; the loss
    equals Hugging Face's."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config("llama"))
    ids = torch.randint(1, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))
    ref = copy.deepcopy(model)(input_ids=ids, labels=ids).loss
    reads, inside, real_float, real_loss = [], [], torch.Tensor.__float__, LossHead.loss

    def counting_float(self):
        if inside:
            reads.append(1)
        return real_float(self)

    def loss(self, *a, **kw):
        inside.append(1)
        try:
            return real_loss(self, *a, **kw)
        finally:
            inside.pop()
    monkeypatch.setattr(torch.Tensor, "__float__", counting_float)
    monkeypatch.setattr(LossHead, "loss", loss)
    engine = StreamingEngine(model, EngineConfig(device="cpu", overrides={"loss_chunk_tokens": 8}))
    out = engine.forward_backward(ids)
    engine.close()
    assert reads == [1]   # 2 x 32 tokens in chunks of 4 positions: 8 chunks, one read
    assert out.loss == pytest.approx(float(ref.detach()), rel=1e-6)


def test_a_cuda_engines_host_store_pins_the_load_sources_only(monkeypatch):
    """HostStore on CUDA (``pin``): fp32 compute pins the masters (the load's source) and never
    the accumulators; bf16 pins the shadows only; the counts agree with pinned_layout."""
    from megatrain_nb.engine.transport import pinned

    monkeypatch.setattr(pinned, "pinned_empty", lambda shape, dtype=torch.float32: torch.empty(shape, dtype=dtype))
    monkeypatch.setattr("megatrain_nb.engine.tiers.host_store.pinned_empty",
                        lambda shape, dtype=torch.float32: torch.empty(shape, dtype=dtype))
    pinned.reset_for_tests(True)
    from types import SimpleNamespace

    units = [SimpleNamespace(index=i, numel=n, params=[]) for i, n in enumerate((5000, 3000, 3000, 4000))]
    for dtype, per in ((torch.float32, 4), (torch.bfloat16, 2)):
        store = HostStore(units, pin=True, compute_dtype=dtype)
        for u in units:
            store.set_params(u, store.alloc(u.numel).fill_(0.5))
            store.grad(u)
        got = store.pinned_bytes()
        layout = pinned_layout([u.numel for u in units], compute_bytes=per)
        assert got["grads"] == 0 and got["weights"] == layout["weights"]
        assert bool(store.shadows) == (dtype == torch.bfloat16)
        assert layout["grad_landing"] == 2 * pinned.held_bytes(5000 * 4, True)
    pinned.reset_for_tests(None)


def test_fp32_compute_on_cuda_with_tf32_off_is_said_and_kept():
    """Issue 45 item 6: the note says the GPU mostly idles in fp32 without TF32 and what bf16 or
    TF32 would give (measured rates where there are, an H100's otherwise); nothing for bf16, TF32
    on, or a CPU device."""
    from types import SimpleNamespace

    from megatrain_nb.engine.memory import precision_note

    note = precision_note("cuda", "fp32", tf32=False)
    assert "TF32 off" in note and "15x" in note and "kept as set" in note and "H100" in note
    rates = SimpleNamespace(matmul_flops=50e12, bf16_matmul_flops=800e12)
    assert "16x" in precision_note("cuda:0", "fp32", rates, tf32=False)
    assert "measured here" in precision_note("cuda:0", "fp32", rates, tf32=False)
    assert precision_note("cuda", "bf16", tf32=False) is None and precision_note("cuda", "fp32", tf32=True) is None
    assert precision_note("cpu", "fp32", tf32=False) is None
