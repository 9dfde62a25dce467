"""Gradients landing on the host through a bounded ring of pinned chunks (issue 45 item 4,
engine/transport/landing.py), on CPU with a fake cudart: the CUDA path's registration and the
transport's landing logic run as they would on a GPU (only the copies are memcpys). The landing
buffers the updates run in are pageable; what is pinned is the ring (3 chunks), counted as the
plan counts it (``host_store.pinned_layout``, ``planner.host_in_flight``), and the weights after
a few steps are bitwise those of the CPU engine's own path."""
import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatrain_nb.engine import EngineConfig, StreamingEngine, parts
from megatrain_nb.engine.planning.planner import UnitSpec, host_in_flight
from megatrain_nb.engine.tiers.host_store import pinned_layout
from megatrain_nb.engine.transport import landing, pinned
from megatrain_nb.engine.transport.landing import LandingRing, landing_pinned_bytes, lands_in_chunks
from megatrain_nb.engine.transport.transport import CpuTransport
from megatrain_nb.model_configs import FAMILY_VOCAB as VOCAB, family_config
from tests.engine.test_pinned_register import fake  # noqa: F401 - the fake cudart's fixture


class Copy:
    """A chunk copy issued (the fake's event): its synchronize is logged."""

    def __init__(self, log, slot):
        self.log, self.slot = log, slot

    def synchronize(self):
        self.log.append(("drained", self.slot))


def test_the_ring_lands_a_gradient_bitwise_and_reuses_a_chunk_only_once_it_is_copied_out():
    bufs = [torch.full((1000,), float("nan")) for _ in range(3)]
    log = []

    def issue(chunk, src):
        slot = next(i for i, b in enumerate(bufs) if b.data_ptr() == chunk.data_ptr())
        log.append(("issued", slot))
        chunk.copy_(src)
        return Copy(log, slot)
    ring = LandingRing(bufs, issue)
    src = torch.randn(10_500, generator=torch.Generator().manual_seed(0))   # 10 full chunks and a tail
    dst = torch.full((12_000,), float("nan"))
    out = ring.land(src, dst)
    assert torch.equal(out, src) and out.data_ptr() == dst.data_ptr() and torch.isnan(dst[10_500:]).all()
    assert ring.landed == {"gradients": 1, "chunks": 11, "bytes": 10_500 * 4}
    # each chunk is drained (copied out) before it is issued again; at most 3 in flight
    in_flight = set()
    for what, slot in log:
        if what == "issued":
            assert slot not in in_flight
            in_flight.add(slot)
        else:
            in_flight.remove(slot)
        assert len(in_flight) <= 3
    assert log[:4] == [("issued", 0), ("issued", 1), ("issued", 2), ("drained", 0)] and not in_flight


def test_small_units_land_straight_in_pinned_buffers_large_ones_through_the_ring():
    """The ring only where it pins less: a 7B layer (202M params) lands through 3 x 32 MiB,
    a unit of a chunk's size or less in its two pinned landing buffers, as before."""
    layer = 4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096
    assert lands_in_chunks(layer) and landing_pinned_bytes(layer) == 3 * (32 << 20)
    assert not lands_in_chunks(5000) and landing_pinned_bytes(5000) == 2 * pinned.held_bytes(20_000, True)
    assert landing_pinned_bytes(layer, pin=False) == 0


class PinnedStagingTransport(CpuTransport):
    """The CPU "device" with CUDA's staging discipline and its pinned pool (registered through
    the fake cudart): gradients are staged in a device buffer and land on the host as on a GPU."""

    stages = True

    def __init__(self):
        super().__init__()
        self.pinned = pinned.PinnedPool(pin=True)


def _ids(steps, seed=7):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (2, 12), generator=g) for _ in range(steps)]


@pytest.mark.parametrize("clip", [None, 1.0])
def test_gradients_land_through_the_ring_bitwise_and_only_the_ring_is_pinned(fake, monkeypatch, clip):
    monkeypatch.setattr(landing, "LANDING_CHUNK_BYTES", 4096)   # chunks of 1024 params: units of ~20k
    model = AutoModelForCausalLM.from_config(family_config("llama", layers=3, hidden=64))
    cfg = dict(device="cpu", weight_decay=0.01)
    ref = StreamingEngine(copy.deepcopy(model), EngineConfig(**cfg))
    made = []
    monkeypatch.setattr(parts, "make_transport", lambda device, sharded=None: made.append(PinnedStagingTransport())
                        or made[-1])
    eng = StreamingEngine(model, EngineConfig(**cfg))
    tr = made[0]
    big = max(u.numel for u in eng.units)
    assert eng.pager.lands_in_chunks and eng.updates.intake.staged
    for ids in _ids(3):
        a = ref.forward_backward(ids, step_lr=3e-3, max_grad_norm=clip)
        b = eng.forward_backward(ids, step_lr=3e-3, max_grad_norm=clip)
        assert a.loss == b.loss
    for e in (ref, eng):
        e.updates.wait_all()
    pr = dict(ref.named_parameters())
    for n, p in eng.named_parameters():
        assert torch.equal(p, pr[n]), n
    # every gradient crossed in chunks: 3 steps x the trained units, each in ceil(numel / 1024)
    trained = [u for u in eng.units if u.numel]
    assert tr._ring.landed["gradients"] == 3 * len(trained)
    assert tr._ring.landed["chunks"] == 3 * sum(-(-u.numel // 1024) for u in trained)
    # pinned: the ring's three 4 KiB chunks and nothing else; the landing buffers pageable
    assert sorted(fake.live.values()) == [4096] * 3 and tr.pinned.held == 3 * 4096
    assert all(h.data_ptr() not in fake.live for h in eng.pager._grad_host)
    specs = [UnitSpec(u.name, u.numel, u.kind, u.tied_output) for u in eng.units]
    assert pinned_layout([u.numel for u in eng.units])["grad_landing"] == tr.pinned.held
    # the plan's landing (pinned ring + pageable landing buffers) is the pager's
    assert eng.pager.grad_host_bytes == 3 * 4096 + 2 * big * 4 == \
        host_in_flight(specs, "none", weights_on_disk=False, states_on_disk=False, cuda=True, clipped=False)
    for e in (ref, eng):
        e.close()
