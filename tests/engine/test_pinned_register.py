"""Pinned host buffers registered at their exact size (issue 37 item 4, issue 31 item 5), checked
on CPU with a fake cudart: the CUDA branch of ``pinned`` forced, every cudaHostRegister paired
with a cudaHostUnregister when the memory's last tensor dies, exact sizes counted; a failed
registration falls back to the caching host allocator, counted at its power of two, with one
warning."""
import gc
import warnings
from types import SimpleNamespace

import pytest
import torch

from megatrain_nb.engine import pinned


class FakeCudart:
    """Records registrations; ``fail_at``: the call numbers (from 1) that return an error."""

    def __init__(self, fail_at=()):
        self.fail_at, self.calls, self.live = set(fail_at), 0, {}
        self.unregistered = []

    def cudaHostRegister(self, ptr, size, flags):
        self.calls += 1
        if self.calls in self.fail_at:
            return 2   # cudaErrorMemoryAllocation
        assert flags == 0 and ptr % 4096 == 0 and size % 4096 == 0 and ptr not in self.live
        self.live[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr):
        self.unregistered.append(self.live.pop(ptr))
        return 0


@pytest.fixture
def fake(monkeypatch):
    """A CUDA machine with the fake cudart, the registration decision undecided; restored after."""
    saved = dict(pinned._state)
    rt = FakeCudart()
    monkeypatch.setattr(pinned, "_cudart", lambda: rt)
    monkeypatch.setattr(pinned, "_cuda_present", lambda: True)
    monkeypatch.setattr(pinned, "_cached_pinned", lambda shape, dtype: torch.empty(shape, dtype=dtype))
    pinned.reset_for_tests(None)
    yield rt
    gc.collect()
    pinned._state.update(saved)


def test_registered_buffers_are_exact_and_unregistered_when_freed(fake):
    t = pinned.pinned_empty((10, 300), torch.float32)   # 12,000 bytes: three pages, not a 16 KiB block
    assert fake.calls == 1 and fake.unregistered == []
    assert t.shape == (10, 300) and t.data_ptr() % 4096 == 0 and list(fake.live.values()) == [12288]
    assert pinned.exact_pinned() and pinned.held_bytes(12000, True) == 12288 and pinned.held_bytes(12000, False) == 12000
    t.fill_(1.5)
    row = t[3]   # a view keeps the memory, and its registration, alive
    del t
    gc.collect()
    assert fake.live and row.sum().item() == 450.0
    del row
    gc.collect()
    assert fake.live == {} and fake.unregistered == [12288] and pinned.registered["buffers"] == 0


def test_engine_buffers_register_pair_on_close(fake):
    """HostStore's master weights and accumulators, the transport's pool (gradient staging, the
    cast buffer): each registered at whole pages, counted so, unregistered once dropped."""
    from megatrain_nb.engine.host_store import HostStore

    unit = SimpleNamespace(index=0, numel=3000, params=[])
    store = HostStore([unit], pin=True)
    store.set_params(unit, store.alloc(3000))
    store.grad(unit)
    pool = pinned.PinnedPool(pin=True)
    bufs = [pool.empty(3000), pool.empty(5000, torch.bfloat16)]
    assert bufs[1].dtype == torch.bfloat16 and bufs[1].numel() == 5000
    assert store.nbytes() == {"weights": 12288, "grads": 12288} and pool.held == 12288 + 12288
    assert sorted(fake.live.values()) == [12288] * 4 and pinned.registered["bytes"] == 4 * 12288
    pool.close()
    del store, bufs
    gc.collect()
    assert fake.live == {} and fake.unregistered == [12288] * 4 and pool.held == 0


def test_failed_registration_falls_back_to_powers_of_two_with_one_warning(fake):
    fake.fail_at = {1}
    assert pinned.held_bytes(12000, True) == 12288   # (asking touches no device)
    with pytest.warns(RuntimeWarning, match="cudaHostRegister failed .error 2.*power of two"):
        t = pinned.pinned_empty(3000)   # the caching allocator's block (here a plain tensor)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no second warning
        u = pinned.pinned_empty(3000)
    assert t.numel() == u.numel() == 3000 and fake.calls == 1 and fake.live == {}
    assert pinned.held_bytes(12000, True) == 16384 and pinned.PinnedPool(pin=True).empty(3000).numel() == 3000


def test_failed_registration_later_falls_back_for_good(fake):
    a = pinned.pinned_empty(3000)
    fake.fail_at = {2}
    with pytest.warns(RuntimeWarning, match="cudaHostRegister failed"):
        b = pinned.pinned_empty(3000)
    c = pinned.pinned_empty(3000)
    assert fake.calls == 2 and len(fake.live) == 1 and b.numel() == c.numel() == 3000
    assert not pinned.exact_pinned() and pinned.held_bytes(12000, True) == 16384
    del a
    gc.collect()
    assert fake.live == {}


def test_llama100b_least_host_ram_with_registration_on_a_cuda_machine(fake):
    """The seed's configuration on a CUDA machine where registration works: <= 24 GiB clipped."""
    from megatrain_nb import estimate

    e = estimate("llama-100b", vram_gb=80, ram_gb=1024, disk_gb=4096, seq=2048, accumulation=128)
    assert e.host_min <= 24 * 2 ** 30 and fake.calls == 0 and pinned.exact_pinned()   # (planning touches no device)


def test_the_device_is_waited_for_before_the_memory_is_unregistered(fake, monkeypatch):
    """A copy may still use a dropped buffer (the caching allocator would hold its block back):
    the finalizer synchronizes the device the buffer was registered on, then unregisters."""
    order = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: order.append(("sync", device)))
    real = fake.cudaHostUnregister
    fake.cudaHostUnregister = lambda ptr: order.append(("unregister", real(ptr)))
    t = pinned.pinned_empty(3000)
    del t
    gc.collect()
    assert order == [("sync", 1), ("unregister", 0)]
