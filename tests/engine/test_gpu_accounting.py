"""What the GPU path holds, counted as it holds it (issue 37 items 4, 5), checked on CPU: the
plan's device gradients include autograd's outputs; pinned blocks count at their whole pages
where CUDA registers them, else at the caching host allocator's power of two; the window's
device room is what mem_get_info leaves, less a headroom."""
from types import SimpleNamespace

import pytest
import torch

from megatrain_nb.engine import EngineConfig
from megatrain_nb.engine import memory
from megatrain_nb.engine import pinned as pinned_mod
from megatrain_nb.engine.pinned import PinnedPool, pinned_bytes
from megatrain_nb.engine.planner import ModelShape, Workload, make_plan, unit_specs_from_config

from megatrain_nb.model_configs import family_config


def test_device_plan_counts_staging_and_autograd_outputs_on_cuda():
    specs = unit_specs_from_config(family_config("llama", layers=2, hidden=64))
    u = max(s.numel for s in specs)
    shape = ModelShape(hidden_size=64, num_layers=2, intermediate_size=128, vocab_size=0)
    for precision, cb in (("bf16", 2), ("fp32", 4)):
        cfg = EngineConfig(precision=precision)
        cuda = make_plan(specs, shape, cfg, cuda=True, workload=Workload(batch=1, seq=8))
        cpu = make_plan(specs, shape, cfg, cuda=False, workload=Workload(batch=1, seq=8))
        assert cuda.device["grads"] == 2 * 4 * u + cb * u   # two fp32 staging buffers + autograd.grad outputs
        assert cpu.device["grads"] == 4 * u


def test_pinned_blocks_count_at_their_power_of_two():
    assert [pinned_bytes(n) for n in (1, 4096, 4097, 810 << 20)] == [1, 4096, 8192, 1 << 30]
    pool = PinnedPool(pin=False)   # (a CPU build cannot pin: plain buffers count as they are)
    t = pool.empty(1000, torch.bfloat16)
    assert t.dtype == torch.bfloat16 and t.numel() == 1000 and pool.held == 2000
    pool.close()
    assert pool.held == 0


def test_device_capacity_is_free_plus_held_less_headroom(monkeypatch):
    GiB = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * GiB, 141 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 10 * GiB)
    # headroom: 5% of 141 GiB (7.05 GiB) > 1 GiB
    assert memory.device_capacity(torch.device("cuda", 0)) == 70 * GiB - int(0.05 * 141 * GiB)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (0, 8 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    assert memory.device_capacity(torch.device("cuda", 0)) == 0


def test_close_drops_the_host_buffers_before_the_transport_hands_pinned_blocks_back(monkeypatch):
    """engine.close(): the recycled boundary buffers and the gradient staging are dropped first,
    then the transport's pool releases the cached pinned blocks (which it cannot while they are
    referenced)."""
    from transformers import AutoModelForCausalLM

    from megatrain_nb.engine import StreamingEngine
    from megatrain_nb.engine.transport import CpuTransport

    seen = []
    real = CpuTransport.close

    def close(self):
        seen.append(eng.boundary.free_bytes())
        real(self)
    monkeypatch.setattr(CpuTransport, "close", close)
    eng = StreamingEngine(AutoModelForCausalLM.from_config(family_config("llama")).eval(),
                          EngineConfig(device="cpu", checkpoint_interval=1, window_tier="host"))
    eng.forward_backward([torch.randint(1, 64, (2, 8)) for _ in range(2)])
    assert eng.boundary.free_bytes() > 0
    eng.close()
    assert seen == [0]


@pytest.fixture(params=[True, False], ids=["registered", "caching-allocator"])
def exact(request):
    """Pinned buffers registered at their exact size, or (registration failed) the caching host
    allocator's power-of-two blocks; the process-wide decision restored afterwards."""
    saved = dict(pinned_mod._state)
    pinned_mod.reset_for_tests(request.param)
    yield request.param
    pinned_mod._state.update(saved)


def test_planned_host_bytes_count_pinned_blocks_as_held(exact):
    """On CUDA the master weights in RAM (one pinned buffer per unit, HostStore), an accumulator
    and the pinned buffers in flight (gradient staging, the disk tier's weight staging, the bf16
    cast buffer) are planned as the process holds them: whole pages where they are registered,
    the caching host allocator's power of two where not; the engine's own count
    (HostStore.nbytes) the same; a CPU plan counts bytes."""
    from megatrain_nb.engine.host_store import HostStore
    from megatrain_nb.engine.pager import staging_buffers
    from megatrain_nb.engine.planner import UnitSpec, host_in_flight

    def held(n):
        return -(-n // 4096) * 4096 if exact else pinned_bytes(n)

    specs = unit_specs_from_config(family_config("llama", layers=2, hidden=64))
    shape = ModelShape(hidden_size=64, num_layers=2, intermediate_size=128, vocab_size=0)
    assert any(held(s.numel * 4) != pinned_bytes(s.numel * 4) for s in specs) == exact
    for gradients in ("held", "accumulator"):
        w = Workload(batch=1, seq=8, gradients=gradients)
        cuda = make_plan(specs, shape, EngineConfig(), cuda=True, workload=w)
        cpu = make_plan(specs, shape, EngineConfig(), cuda=False, workload=w)
        assert cuda.host["weights"] == sum(held(4 * s.numel) for s in specs)
        assert cpu.host["weights"] == 4 * sum(s.numel for s in specs)
        # an accumulator is HostStore's (pinned); gradients held for the norm are pool buffers (not)
        assert cuda.host["grads"] == (cuda.host["weights"] if gradients == "accumulator" else cpu.host["grads"])
    u = 3000   # 12,000 bytes: three pages (12,288), or a 16 KiB block
    units = [UnitSpec("e", 10, "embed"), UnitSpec("l", u, "layer"), UnitSpec("h", 10, "head")]
    kw = dict(states_on_disk=False, clipped=False, depth=1)
    for disk in (False, True):
        plain = host_in_flight(units, "none", weights_on_disk=disk, cuda=True, pinned=False, **kw)
        pinned = host_in_flight(units, "none", weights_on_disk=disk, cuda=True, **kw)
        n = staging_buffers(1) + (3 + 2 if disk else 0)   # gradient staging; compute and optimizer staging
        assert pinned - plain == n * ((12288 if exact else 16384) - 4 * u)
    bf16 = host_in_flight(units, "none", weights_on_disk=False, cuda=True, compute_bytes=2, **kw)
    assert bf16 - host_in_flight(units, "none", weights_on_disk=False, cuda=True, **kw) == held(2 * u)
    store = HostStore([], pin=True)   # (the count only)
    store.set_params(SimpleNamespace(index=0), torch.zeros(u))
    assert store.nbytes()["weights"] == held(4 * u) and HostStore([], pin=False).nbytes()["weights"] == 0
