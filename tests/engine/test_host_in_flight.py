"""Host RAM in flight, as the engine allocates it and as the planner counts it
(``planner.host_in_flight``): a straight update runs on the staging buffer its gradient arrived
in (no unit-sized copy beside it), and the results stay bitwise those of the path with a copy."""
import copy
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatrain_nb.engine import EngineConfig, StreamingEngine, parts
from megatrain_nb.engine.transport.pager import staging_buffers
from megatrain_nb.engine.planning.planner import UnitSpec, host_in_flight
from megatrain_nb.engine.tiers.host_store import HostStore, wants_shadows
from megatrain_nb.engine.units import Unit
from megatrain_nb.engine.transport.transport import CpuTransport

from megatrain_nb.model_configs import FAMILY_VOCAB as VOCAB, family_config


class StagingCpuTransport(CpuTransport):
    """The CPU "device" with CUDA's staging discipline: a unit's gradient is copied into a
    device buffer of the pager's, then out into a host staging buffer (as pinned memory)."""

    stages = True
    made = 0

    def host_buffer(self, numel: int, dtype=torch.float32) -> torch.Tensor:
        StagingCpuTransport.made += 1
        return torch.full((numel,), float("nan"), dtype=dtype)


def _ids(steps, seed=7):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (2, 12), generator=g) for _ in range(steps)]


@pytest.mark.parametrize("clip", [None, 1.0])
@pytest.mark.parametrize("codec", ["none", "int8"])
def test_straight_updates_run_on_the_staging_buffer_bitwise(monkeypatch, clip, codec):
    model = AutoModelForCausalLM.from_config(family_config("llama", layers=3, hidden=64))
    cfg = dict(device="cpu", optimizer_compression=codec, weight_decay=0.01)
    ref = StreamingEngine(copy.deepcopy(model), EngineConfig(**cfg))
    StagingCpuTransport.made = 0
    monkeypatch.setattr(parts, "make_transport", lambda device, sharded=None: StagingCpuTransport())
    staged = StreamingEngine(model, EngineConfig(**cfg))
    assert staged.updates.intake.staged and not ref.updates.intake.staged
    assert StagingCpuTransport.made == staging_buffers(1) == 2   # the updated one and the one next in line
    real = staged.adam.fused

    def slow(*a, **kw):   # updates slower than a unit's backward: a reused buffer would show
        time.sleep(0.01)
        return real(*a, **kw)
    monkeypatch.setattr(staged.adam, "fused", slow)
    pool = staged.updates.intake.pool
    takes, lends = [], []
    real_take, real_lend = pool.take, pool.lend
    monkeypatch.setattr(pool, "take", lambda n: takes.append(n) or real_take(n))
    # (a CPU "device" forms each unit's sum in a lent pool buffer: device memory here)
    monkeypatch.setattr(pool, "lend", lambda n, slot=False: lends.append(n) or real_lend(n, slot))
    for ids in _ids(3):
        a = ref.forward_backward(ids, step_lr=3e-3, max_grad_norm=clip)
        b = staged.forward_backward(ids, step_lr=3e-3, max_grad_norm=clip)
        assert a.loss == b.loss
    ref.updates.wait_all()
    staged.updates.wait_all()
    pr = dict(ref.named_parameters())
    for n, p in staged.named_parameters():
        assert torch.equal(p, pr[n]), n
    # unclipped: no final-gradient buffer besides the staging ones; clipped: held ones (copies)
    assert lends and (len(takes) == len(lends)) == (clip is None), (takes, lends)
    for e in (ref, staged):
        e.close()


def test_a_ram_tier_load_casts_nothing_and_the_planner_counts_no_cast_buffer():
    """With a bf16 compute dtype on CUDA (shadows) a RAM-tier load's source is already bf16 --
    ``CudaTransport.copy_in`` casts only where the source's dtype differs -- so the planner counts
    no host-side cast buffer for it (it once counted one unit-sized pinned buffer, never made)."""
    units = [Unit(n, k, i, [], m, m) for i, (n, k, m) in enumerate([("embed", "embed", 4096), ("layers.0", "layer", 8192),
                                                                    ("head", "head", 4096)])]
    store = HostStore(units, pin=False, compute_dtype=torch.bfloat16, shadows=wants_shadows(True, torch.bfloat16))
    flats = {u.index: torch.randn(u.numel) for u in units}
    for u in units:
        store.set_params(u, flats[u.index])
    assert store.shadowed
    assert all(store.source(u).dtype == torch.bfloat16 for u in units)   # the load's source: no cast
    assert all(torch.equal(store.source(u), flats[u.index].to(torch.bfloat16)) for u in units)
    specs = [UnitSpec(u.name, u.numel, u.kind) for u in units]
    kw = dict(weights_on_disk=False, states_on_disk=False, cuda=True, clipped=True)
    assert host_in_flight(specs, "none", compute_bytes=2, **kw) == host_in_flight(specs, "none", compute_bytes=4, **kw)


def test_planner_counts_the_staging_buffers_as_the_gradients_in_flight():
    u = 1 << 20
    units = [UnitSpec("e", u // 2, "embed"), UnitSpec("l", u, "layer"), UnitSpec("h", u // 2, "head")]
    kw = dict(weights_on_disk=False, states_on_disk=False)
    for depth in (1, 2, 3):
        cuda = host_in_flight(units, "none", cuda=True, clipped=False, depth=depth, **kw)
        assert cuda == staging_buffers(depth) * 4 * u          # no pool buffer besides them
        held = host_in_flight(units, "none", cuda=True, clipped=True, depth=depth, **kw)
        assert held == cuda + 3 * 4 * u                        # a copy out of staging + 2 writes
        # held on the disk tier: written from the staging buffers; read back whole (fp32 states)
        # or a chunk at a time (compressed states, ``RING`` chunks of the update)
        assert host_in_flight(units, "none", cuda=True, clipped=True, depth=depth, hold_disk=True, **kw) == \
            cuda + 4 * u
        chunked = host_in_flight(units, "int8", cuda=True, clipped=False, depth=depth, chunk_numel=4096, **kw)
        assert host_in_flight(units, "int8", cuda=True, clipped=True, depth=depth, chunk_numel=4096, hold_disk=True,
                              **kw) == chunked + 3 * 4096 * 4
        # bf16 slots on the RAM tier: a load copies the unit's bf16 shadow, so no cast buffer (issue 45)
        assert host_in_flight(units, "none", cuda=True, clipped=False, depth=depth, compute_bytes=2, **kw) == cuda
        assert host_in_flight(units, "none", cuda=False, clipped=False, depth=depth, compute_bytes=2, **kw) == \
            host_in_flight(units, "none", cuda=False, clipped=False, depth=depth, **kw)


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_the_disk_tiers_buffers_in_flight_are_what_the_planner_counts(tmp_path, codec):
    """Weights and compressed states on the disk tier, no host cache: the staging and chunk
    buffers the engine allocates are exactly ``host_in_flight``'s figure for them (the compute
    stream's staging, one chunk of weights, the ring's moments and codes), with no unit-sized
    buffer for the optimizer's weights or codes."""
    model = AutoModelForCausalLM.from_config(family_config("llama", layers=2, hidden=64))
    eng = StreamingEngine(model, EngineConfig(device="cpu", optimizer_compression=codec, offload_dir=str(tmp_path),
                                              offload_params=True, host_cache_gb=0, overrides={"update_chunk_numel": 768}))
    for ids in _ids(2):
        eng.forward_backward(ids, step_lr=3e-3)
    eng.updates.wait_all()
    specs = [UnitSpec(u.name, u.numel, u.kind, u.tied_output) for u in eng.units]
    u = max(s.numel for s in specs)
    counted = host_in_flight(specs, codec, weights_on_disk=True, states_on_disk=True, cuda=False, clipped=False,
                             depth=1, chunk_numel=768)
    grads = (1 + 1 + int(any(s.tied_output for s in specs))) * 4 * u   # the final-gradient pool's part
    allocated = eng.weights.nbytes()["host"] + eng.states.nbytes()["host_buffers"]
    assert allocated == counted - grads, (allocated, counted - grads)
    # (the engine's plan is made for any step: a clipped one's held gradients too)
    assert eng.plan.host["buffers"] == host_in_flight(specs, codec, weights_on_disk=True, states_on_disk=True,
                                                      cuda=False, clipped=True, depth=1, chunk_numel=768)
    eng.close()


def test_clipped_gradients_held_on_disk_leave_the_staging_buffers_and_come_back_in_chunks(monkeypatch, tmp_path):
    """clip_hold='disk' with weights and int8 states on the disk tier (no host cache), CUDA's
    staging discipline: each held gradient is written straight from its staging buffer and each
    update reads it back a chunk at a time, so no unit-sized gradient buffer exists besides the
    staging pair; the host buffers the engine allocates are ``host_in_flight``'s CUDA figure
    with ``hold_disk``, and the weights are bitwise those of holding the gradients in RAM."""
    model = AutoModelForCausalLM.from_config(family_config("llama", layers=3, hidden=64))
    cfg = dict(device="cpu", optimizer_compression="int8", weight_decay=0.01, offload_params=True, host_cache_gb=0,
               overrides={"update_chunk_numel": 768, "held_weight_units": 0})   # (no spare room used)
    (tmp_path / "ref").mkdir()
    (tmp_path / "held").mkdir()
    ref = StreamingEngine(copy.deepcopy(model), EngineConfig(offload_dir=str(tmp_path / "ref"), clip_hold="host",
                                                             **cfg))
    StagingCpuTransport.made = 0
    monkeypatch.setattr(parts, "make_transport", lambda device, sharded=None: StagingCpuTransport())
    held = StreamingEngine(model, EngineConfig(offload_dir=str(tmp_path / "held"), clip_hold="disk", **cfg))
    pool = held.updates.intake.pool
    takes, lends, reads = [], [], []
    real_take, real_lend, real_read = pool.take, pool.lend, held.updates.final.disk.read_ranged
    monkeypatch.setattr(pool, "take", lambda n: takes.append(n) or real_take(n))
    # (a CPU "device" forms each unit's sum in a lent pool buffer: device memory here)
    monkeypatch.setattr(pool, "lend", lambda n, slot=False: lends.append(n) or real_lend(n, slot))
    monkeypatch.setattr(held.updates.final.disk, "read_ranged", lambda key: reads.append(key) or real_read(key))
    for ids in _ids(3):
        a = ref.forward_backward(ids, step_lr=3e-3, max_grad_norm=0.05)
        b = held.forward_backward(ids, step_lr=3e-3, max_grad_norm=0.05)
        assert a.loss == b.loss and a.grad_norm == b.grad_norm and a.grad_norm > 0.05   # clipped
    for e in (ref, held):
        e.updates.wait_all()
    pr = dict(ref.named_parameters())
    for n, p in held.named_parameters():
        assert torch.equal(p, pr[n]), n
    # no pool buffer but the sums' (device memory here); every update read its gradient in chunks
    assert lends and takes == lends and len(reads) == 3 * len(held.units), (takes, lends, reads)
    assert held.updates.held_disk_bytes() >= 4 * held.num_parameters()
    specs = [UnitSpec(u.name, u.numel, u.kind, u.tied_output) for u in held.units]
    u = max(s.numel for s in specs)
    counted = host_in_flight(specs, "int8", weights_on_disk=True, states_on_disk=True, cuda=True, clipped=True,
                             depth=1, chunk_numel=768, hold_disk=True, pinned=False)   # (these buffers are not pinned)
    allocated = held.weights.nbytes()["host"] + held.states.nbytes()["host_buffers"] + StagingCpuTransport.made * 4 * u
    assert allocated == counted, (allocated, counted)
    assert counted == host_in_flight(specs, "int8", weights_on_disk=True, states_on_disk=True, cuda=True,
                                     clipped=False, depth=1, chunk_numel=768, pinned=False) + 3 * 768 * 4   # ring
    for e in (ref, held):
        e.close()


def test_llama100b_least_host_ram_buffers_with_clipping_are_those_without():
    """The seed's configuration (llama-100b, 80 GiB device, batch 1 x 2048 x accumulation 128),
    everything that may leave RAM on the disk tier: with clipping, the held gradients pass
    through the staging buffers and come back a chunk at a time, so the buffers in flight are
    those of the unclipped plan plus the ring's gradient chunks (40.6 GiB before), and they are
    the least host RAM: four unit-sized buffers (the compute stream's two weight staging
    buffers, pinned, each 5.8 GiB held as 8 GiB by the caching host allocator where registration
    fails: issue 37 item 4; the two gradient landing buffers, pageable behind the pinned ring of
    chunks they land through: issue 45, engine/transport/landing.py), and chunks."""
    from megatrain_nb import estimate
    from megatrain_nb.engine.updates.chunk_ring import RING
    from megatrain_nb.engine.transport import pinned as pinned_mod
    from megatrain_nb.engine.transport.landing import landing_pinned_bytes
    from megatrain_nb.engine.transport.pinned import pinned_bytes
    from megatrain_nb.engine.planning.planner import unit_specs_from_config
    from megatrain_nb.engine.planning.estimator import resolve_config

    kw = dict(vram_gb=80, ram_gb=1 / 2 ** 30, disk_gb=4096, seq=2048, accumulation=128)
    clipped, plain = estimate("llama-100b", **kw), estimate("llama-100b", clipping=False, **kw)
    assert clipped.plan.host["buffers"] == plain.plan.host["buffers"] + RING * (1 << 20) * 4
    # one window group (no host accumulator), the held gradients on the disk tier: the buffers are all
    assert clipped.plan.window["groups"] == 1 and clipped.plan.placement["gradients"] == "disk"
    assert clipped.host_min == clipped.plan.host["total"] == clipped.plan.host["buffers"]
    u = max(s.numel for s in unit_specs_from_config(resolve_config("llama-100b")[0]))
    pinned = 4 * -(-4 * u // 4096) * 4096
    ring = landing_pinned_bytes(u)   # (3 x 32 MiB)
    assert 0 < clipped.host_min - pinned - ring < 64 << 20 and clipped.host_min <= 24 * 2 ** 30   # 23.3 GiB
    saved = dict(pinned_mod._state)
    try:   # registration failed: each staging buffer held at 8 GiB
        pinned_mod.reset_for_tests(False)
        fallback = estimate("llama-100b", **kw)
    finally:
        pinned_mod._state.update(saved)
    assert 2 * pinned_bytes(4 * u) == 16 * 2 ** 30 and fallback.host_min - clipped.host_min == 16 * 2 ** 30 - pinned // 2
