"""A window's host-tier boundary activations: the buffers a new size class needs are registered
ahead in the transport's registrar once the window knows its shapes (``BoundaryStore.expect``),
so the forward's puts register nothing on the compute thread (issue 45 item 4), counted with the
fake cudart of test_pinned_register."""
import torch

from megatrain_nb.engine.transport.pinned import PinnedPool
from megatrain_nb.engine.transport.transport import CpuTransport
from megatrain_nb.engine.window import BoundaryStore
from tests.engine.test_pinned_register import fake  # noqa: F401 - the fake cudart's fixture


class PinningCpuTransport(CpuTransport):
    """The CPU "device" with CUDA's host buffers: size-class blocks of a pinning pool."""

    def __init__(self):
        super().__init__()
        self.pinned = PinnedPool(pin=True)

    def host_buffer(self, numel, dtype=torch.float32):
        return self.pinned.recycled(numel, dtype)

    def reserve_host(self, numel, dtype, count):
        self.pinned.reserve(numel * torch.empty((), dtype=dtype).element_size(), count)


def _window(store, acts, per_micro_batch, expect):
    store.start("host")
    if expect:
        store.expect(acts, per_micro_batch)
        store.transport.pinned.classes.run(lambda: None).result()   # (the registrar's queue drained)
    for i in range(per_micro_batch):
        for a, t in enumerate(acts):
            store.put((i, a), t + i)
    for i in reversed(range(per_micro_batch)):
        for a, t in enumerate(acts):
            assert torch.equal(store.pop((i, a)), t + i)


def _mainthread(fake):
    return fake.threads.count("MainThread")


def test_expected_boundaries_register_off_the_compute_thread(fake):
    acts = [torch.randn(2, 37, 64), torch.randn(2, 37, 64), torch.randn(1, 37, 64)]
    store = BoundaryStore(torch.device("cpu"), PinningCpuTransport())
    _window(store, acts, 3, expect=True)
    assert fake.threads and _mainthread(fake) == 0   # 9 puts, every block registered ahead
    counts = store.transport.pinned.classes.counts
    taken = counts["taken"]
    _window(store, acts, 3, expect=True)   # the same shapes: the store's free list has them all
    assert counts["taken"] == taken and _mainthread(fake) == 0
    store.close()
    store.transport.close()


def test_without_expect_the_first_put_of_a_class_registers_inline(fake):
    """The case expect() exists for: the test above fails without it."""
    store = BoundaryStore(torch.device("cpu"), PinningCpuTransport())
    _window(store, [torch.randn(2, 41, 64)], 2, expect=False)
    assert _mainthread(fake) >= 1
    store.close()
    store.transport.close()


def test_expect_does_nothing_off_the_host_tier(fake):
    store = BoundaryStore(torch.device("cpu"), PinningCpuTransport())
    store.start("device")
    store.expect([torch.randn(2, 8, 64)], 4)
    assert fake.threads == []
    store.close()
    store.transport.close()
