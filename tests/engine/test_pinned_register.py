"""Pinned host buffers registered at their exact size (issue 37 item 4, issue 31 item 5), checked
on CPU with a fake cudart: the CUDA branch of ``pinned`` forced, every cudaHostRegister paired
with a cudaHostUnregister when the memory's last tensor dies, exact sizes counted; a failed
registration falls back to the caching host allocator, counted at its power of two, with one
warning."""
import gc
import threading
import warnings
from types import SimpleNamespace

import pytest
import torch

from megatrain_nb.engine.transport import pinned


class FakeCudart:
    """Records registrations (and the thread of each, and of each error read); ``fail_at``: the
    call numbers (from 1) that return an error."""

    def __init__(self, fail_at=()):
        self.fail_at, self.calls, self.live = set(fail_at), 0, {}
        self.unregistered, self.threads, self.cleared = [], [], []

    def get_last_error(self):   # the runtime's cudaGetLastError (torch.cuda.cudart() has none)
        self.cleared.append(threading.current_thread().name)
        return 0

    def cudaHostRegister(self, ptr, size, flags):
        self.threads.append(threading.current_thread().name)
        self.calls += 1
        if self.calls in self.fail_at:
            return 2   # cudaErrorMemoryAllocation
        assert flags == 0 and ptr % 4096 == 0 and size % 4096 == 0 and ptr not in self.live
        self.live[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr):
        if ptr not in self.live:   # registered under an earlier test's fake, collected only now: the
            return 0               # process's one runtime would know it (its counts are not this test's)
        self.unregistered.append(self.live.pop(ptr))
        return 0


@pytest.fixture
def fake(monkeypatch):
    """A CUDA machine with the fake cudart, the registration decision undecided; restored after."""
    saved = dict(pinned._state)
    rt = FakeCudart()
    monkeypatch.setattr(pinned, "_cudart", lambda: rt)
    monkeypatch.setattr(pinned, "_runtime_library", lambda: SimpleNamespace(cudaGetLastError=rt.get_last_error))
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
    """HostStore's master weights (fp32 compute: the load's source), the transport's pool
    (gradient staging, the cast buffer): each registered at whole pages, counted so,
    unregistered once dropped. The gradient accumulator is never pinned (issue 45)."""
    from megatrain_nb.engine.tiers.host_store import HostStore

    unit = SimpleNamespace(index=0, numel=3000, params=[])
    store = HostStore([unit], pin=True)
    store.set_params(unit, store.alloc(3000))
    store.grad(unit)
    pool = pinned.PinnedPool(pin=True)
    bufs = [pool.empty(3000), pool.empty(5000, torch.bfloat16)]
    assert bufs[1].dtype == torch.bfloat16 and bufs[1].numel() == 5000
    assert store.nbytes() == {"weights": 12288, "grads": 12000} and pool.held == 12288 + 12288
    assert store.pinned_bytes() == {"weights": 12288, "grads": 0} and not store.grads[0].is_pinned()
    assert sorted(fake.live.values()) == [12288] * 3 and pinned.registered["bytes"] == 3 * 12288
    pool.close()
    del store, bufs
    gc.collect()
    assert fake.live == {} and fake.unregistered == [12288] * 3 and pool.held == 0


def test_bf16_pins_the_shadow_only_and_the_update_writes_it(fake):
    """bf16 compute on CUDA: the fp32 masters and the accumulator are pageable, the bf16 shadow
    (the load's source) is the one registered buffer; an update (update_done) rewrites it."""
    from megatrain_nb.engine.tiers.host_store import HostStore
    from megatrain_nb.engine.tiers.weight_store import RamWeights

    unit = SimpleNamespace(index=0, numel=3000, params=[])
    store = HostStore([unit], pin=True, compute_dtype=torch.bfloat16)
    weights = RamWeights([unit], store)
    flat = store.alloc(3000)
    flat.copy_(torch.linspace(-1, 1, 3000))
    weights.put_initial(unit, flat)
    store.grad(unit)
    assert list(fake.live.values()) == [8192]   # 6,000 bytes of bf16: two pages
    src = weights.for_transfer(unit)
    assert src.dtype == torch.bfloat16 and torch.equal(src, flat.to(torch.bfloat16))
    assert weights.for_update(unit) is flat and weights.read_now(unit) is flat
    flat.add_(1e-2)   # AdamW, in place
    weights.update_done(unit, flat)
    assert torch.equal(weights.for_transfer(unit), flat.to(torch.bfloat16))
    weights.overwrite(unit, torch.zeros(3000))
    assert not weights.for_transfer(unit).any()
    assert store.pinned_bytes() == {"weights": 8192, "grads": 0}


def test_pinned_layout_of_a_7b_in_bf16_is_the_shadow_and_the_landing_ring():
    """The accounting (host_store.pinned_layout) for Llama-2-7B's units: 2 B/param of shadows,
    the ring of pinned chunks the gradients land through (3 x 32 MiB, not two 810 MB landing
    buffers: engine/transport/landing.py), nothing for the accumulators or the fp32 masters:
    at most 2.2 B/param (issue 45's figure)."""
    from megatrain_nb.engine.tiers.host_store import pinned_layout

    layer = 4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096
    numels = [32000 * 4096] + [layer] * 32 + [32000 * 4096 + 4096]
    n = sum(numels)
    bf16 = pinned_layout(numels, compute_bytes=2)
    fp32 = pinned_layout(numels, compute_bytes=4)
    assert bf16["grad_accumulators"] == bf16["masters_fp32"] == 0
    assert bf16["grad_landing"] == fp32["grad_landing"] == 3 * (32 << 20)
    assert 2.0 <= bf16["total"] / n <= 2.2 and 4.0 <= fp32["total"] / n <= 4.2
    disk = pinned_layout(numels, compute_bytes=2, params_on_disk=True)
    # the compute stream's staging buffers of the bf16 copy, as the engine makes them (parts.build_parts):
    # 2 for units over 256 MiB, 3 + the gradients in flight for smaller ones (staging.disk_staging_buffers:
    # a spare beyond the forward's 2 + depth); a clipped step's held reads
    assert disk["weights"] == 2 * pinned.held_bytes(layer * 2, True)
    held = pinned_layout(numels, compute_bytes=2, params_on_disk=True, held_units=3)["weights"]
    assert held == 5 * pinned.held_bytes(layer * 2, True)
    small = [1 << 20] * 4
    assert pinned_layout(small, compute_bytes=2, params_on_disk=True, grads_in_flight=2)["weights"] == \
        5 * pinned.held_bytes(2 << 20, True)


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


class FakeEvent:
    def __init__(self, name, order):
        self.name, self.order = name, order

    def synchronize(self):
        self.order.append(("wait", self.name))


def test_the_copies_that_used_a_buffer_are_waited_for_before_it_is_unregistered(fake, monkeypatch):
    """A copy may still use a dropped buffer: the finalizer waits for the last event noted per
    stream for that buffer (the transport notes one after each copy), never for the device."""
    order = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: order.append(("device sync", device)))
    real = fake.cudaHostUnregister
    fake.cudaHostUnregister = lambda ptr: order.append(("unregister", real(ptr))) or 0
    t = pinned.pinned_empty(3000)
    other = pinned.pinned_empty(3000)
    pinned.note_use(t[10:], FakeEvent("h2d 1", order), "h2d")   # a view: the same registration
    pinned.note_use(t, FakeEvent("h2d 2", order), "h2d")        # later on the same stream: replaces it
    pinned.note_use(t, FakeEvent("d2h 1", order), "d2h")
    pinned.note_use(other, FakeEvent("other", order), "h2d")
    pinned.note_use(torch.empty(10), FakeEvent("not registered", order))   # ignored
    del t
    gc.collect()
    assert order == [("wait", "h2d 2"), ("wait", "d2h 1"), ("unregister", 0)]


def test_a_failed_registration_clears_cudas_sticky_error(fake):
    """cudaHostRegister's failure is CUDA's last error until read: it is read at once, so the
    next kernel on the thread does not raise it."""
    fake.fail_at = {1}
    with pytest.warns(RuntimeWarning, match="cudaHostRegister failed"):
        pinned.pinned_empty(3000)
    assert fake.cleared == [threading.current_thread().name]


def _vm_flags(ptr: int) -> str:
    """The VmFlags of the mapping that holds ``ptr`` (/proc/self/smaps)."""
    found = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                found = lo <= ptr < hi
            elif found and line.startswith("VmFlags:"):
                return line
    return ""


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="madvise(MADV_DONTFORK): Linux")
def test_registered_memory_is_not_inherited_by_forks_and_given_back_when_freed(fake, monkeypatch):
    """MADV_DONTFORK on the registered pages (a forked child neither inherits nor copies them:
    VmFlags "dc"); MADV_DOFORK again before the memory is freed (the allocator may reuse it)."""
    t = pinned.pinned_empty(1 << 20)
    ptr = t.data_ptr()
    assert " dc" in _vm_flags(ptr)
    calls, real = [], pinned._madvise
    monkeypatch.setattr(pinned, "_madvise", lambda p, n, a: calls.append((p, n, a)) or real(p, n, a))
    del t
    gc.collect()
    assert calls == [(ptr, 4 << 20, pinned.MADV_DOFORK)] and fake.live == {}


def test_cudas_last_error_is_read_from_the_runtime_torch_loaded_never_a_second_one():
    """torch.cuda.cudart() binds no cudaGetLastError: pinned opens the runtime already loaded
    through ctypes (RTLD_NOLOAD), and on a machine without one (this CPU build) opens nothing."""
    import ctypes.util

    libc = ctypes.util.find_library("c")
    assert pinned.open_loaded([libc, "libc.so.6"], "getpid") is not None   # loaded: found
    assert pinned.open_loaded(["libc.so.6"], "no_such_symbol") is None
    assert pinned.open_loaded(["/nonexistent/libcudart.so.12"], "cudaGetLastError") is None
    if not torch.cuda.is_available():
        assert pinned._runtime_library() is None
        with open("/proc/self/maps") as f:
            assert "libcudart" not in f.read()   # nothing loaded by asking


def test_a_failed_unregistration_clears_the_error_on_the_thread_that_collects(fake):
    t = pinned.pinned_empty(5000, torch.uint8)
    real = fake.cudaHostUnregister
    fake.cudaHostUnregister = lambda ptr: real(ptr) or 1   # cudaErrorInvalidValue
    before = pinned.registered["buffers"]
    del t
    gc.collect()
    assert fake.live == {} and fake.cleared == [threading.current_thread().name]
    assert pinned.registered["buffers"] == before - 1


def test_a_registration_that_succeeds_after_one_failed_keeps_the_fallback(fake):
    fake.fail_at = {1}
    with pytest.warns(RuntimeWarning, match="cudaHostRegister failed"):
        assert pinned._register_block(5000) is None
    kept = pinned._register_block(5000)   # (one queued before the failure, done after it)
    assert kept is not None and not pinned.exact_pinned()
    assert pinned.held_bytes(5000, True) == pinned.pinned_bytes(5000)
