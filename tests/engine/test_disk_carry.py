"""The compute stream's carry (disk_params.DiskReadStream, CARRY_GAP): a unit read again within
two reads -- the last layer's forward, the head, then that layer's backward -- is served by its
first read's buffer, held meanwhile, not read from disk again. Counted in bytes and reads; the
weights stay the RAM tier's bit for bit."""
import torch
from transformers import AutoModelForCausalLM

from megatrain_nb.engine import EngineConfig, StreamingEngine
from megatrain_nb.engine.tiers import disk_params
from megatrain_nb.model_configs import FAMILY_VOCAB as VOCAB, family_config


def _run(model, tmp_path, carry: bool, monkeypatch, disk: bool = True):
    real = disk_params.DiskReadStream.__init__

    def init(self, *a, **k):
        real(self, *a, **k)
        self.carry = self.carry and carry
    monkeypatch.setattr(disk_params.DiskReadStream, "__init__", init)
    opts = dict(offload_dir=str(tmp_path), offload_params=True, host_cache_gb=0) if disk else {}
    e = StreamingEngine(model, EngineConfig(device="cpu", **opts))
    torch.manual_seed(1)
    batches = [torch.randint(0, VOCAB, (2, 24)) for _ in range(4)]
    reads = []
    for b in batches:
        r0 = e.disk.report()["disk_read_bytes"] if disk else 0
        e.forward_backward(b, step_lr=1e-3)
        e.updates.wait_all()
        if disk:
            e.disk.flush()
            reads.append(e.disk.report()["disk_read_bytes"] - r0)
    weights = [t.detach().clone() for _, t in e.named_parameters()]
    last = max(u.numel for u in e.units[1:-1] if u.kind == "layer") if disk else 0
    e.close()
    return reads, weights, last


def test_last_layer_read_once_a_step_and_weights_unchanged(tmp_path, monkeypatch):
    model = AutoModelForCausalLM.from_config(family_config("llama"))
    twin = AutoModelForCausalLM.from_config(family_config("llama"))
    twin.load_state_dict(model.state_dict())
    ram_model = AutoModelForCausalLM.from_config(family_config("llama"))
    ram_model.load_state_dict(model.state_dict())
    on, w_on, layer = _run(model, tmp_path / "on", True, monkeypatch)
    off, w_off, _ = _run(twin, tmp_path / "off", False, monkeypatch)
    _, w_ram, _ = _run(ram_model, tmp_path / "ram", True, monkeypatch, disk=False)
    # steady steps (after the first, whose order is not yet recorded): one layer's fp32 weights fewer
    assert [o - n for o, n in zip(off[2:], on[2:])] == [4 * layer] * 2
    for a, b, c in zip(w_on, w_off, w_ram):
        assert torch.equal(a, b) and torch.equal(a, c)
