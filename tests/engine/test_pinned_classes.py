"""Host buffers whose shapes vary (a window's host activations, one shape per sequence length)
registered once per size class and off the compute thread (issue 45 item 4:
``pinned.SizeClasses``, ``PinnedPool.recycled``), counted on CPU with a fake cudart that records
which thread registers; a failed registration in the registrar clears CUDA's error there, warns
once and falls back."""
import gc
import warnings

import pytest
import torch

from megatrain_nb.engine.transport import pinned
from megatrain_nb.engine.transport.pinned import PAGE, PinnedPool, size_class
from tests.engine.test_pinned_register import fake  # noqa: F401 - the fake cudart's fixture


def test_size_classes_are_whole_pages_within_an_eighth():
    assert [size_class(n) for n in (1, PAGE, PAGE + 1, 8 * PAGE)] == [PAGE, PAGE, 2 * PAGE, 8 * PAGE]
    for n in range(1, 3000 * PAGE, 104729):
        c = size_class(n)
        assert c % PAGE == 0 and n <= c <= max(8 * PAGE, n * 1.125 + PAGE)
    # 2 x seq x 512 bf16 for every sequence length 1000..2000: a handful of classes, not 1001
    assert len({size_class(2 * s * 512 * 2) for s in range(1000, 2001)}) == 9


def _window_pass(pool, seq, buffers=6, hidden=256):
    """One window's host activations of one sequence length, all alive at once, then dropped."""
    held = [pool.recycled((2, seq, hidden), torch.bfloat16) for _ in range(buffers)]
    for i, t in enumerate(held):
        t.fill_(i)
    assert all(bool((t == i).all()) for i, t in enumerate(held))
    del held   # (each block back to its class at once: its tensors' last reference)


def test_every_sequence_length_reuses_its_classes_registered_off_the_callers_thread(fake):
    """60 sequence lengths x 6 buffers a pass: the registrations are a few per size class (the
    first pass of a class, and one ahead), all but a class's very first in the registrar thread;
    once warm (``reserve``), a pass of a new length registers nothing on the caller's thread."""
    pool = PinnedPool(pin=True)
    for seq in range(100, 160):
        _window_pass(pool, seq)
    classes = {size_class(2 * s * 256 * 2) for s in range(100, 160)}
    c = pool.classes.counts
    assert len(classes) == 6 and c["taken"] == 360
    assert c["registered"] == len(fake.threads) <= len(classes) * 7 < 360 / 4   # not one per shape
    assert c["inline"] == len(classes)   # each class's first take; every other one in mtnb-pin
    assert fake.threads.count("MainThread") == c["inline"] and all(
        t == "MainThread" or t.startswith("mtnb-pin") for t in fake.threads)
    assert pool.total_held() == sum(fake.live.values()) and pool.held == 0
    # a new size class, reserved ahead: its pass registers nothing here, nothing afresh at all
    before = len(fake.threads)
    pool.reserve(2 * 400 * 256 * 2, count=6)
    pool.classes.run(lambda: None).result()   # (the registrar's queue drained)
    _window_pass(pool, 400)
    _window_pass(pool, 401)
    assert fake.threads[before:].count("MainThread") == 0 and len(fake.threads) - before <= 7
    pool.close()
    gc.collect()
    assert fake.live == {}


def test_a_block_is_reused_only_once_its_last_copy_is_done(fake):
    """A buffer's last copies (noted by the transport) are waited for before its block serves
    another buffer; a class's longest free block serves first (its copies the likeliest done)."""
    pool = PinnedPool(pin=True)
    waited = []

    class Ev:
        def synchronize(self):
            waited.append(1)
    t = pool.recycled(3000)
    pinned.note_use(t, Ev(), "h2d")
    ptr = t.data_ptr()
    pool.classes.run(lambda: None).result()   # (the block registered ahead is in: t's goes back last)
    del t
    gc.collect()
    first = pool.recycled(2900)   # the same class: the longest free block first (the one registered ahead) ...
    assert first.data_ptr() != ptr and waited == []
    u = pool.recycled(2900)   # ... then t's, once its last copy is done
    assert u.data_ptr() == ptr and waited == [1]
    pool.close()


def test_a_failed_registration_in_the_registrar_is_cleared_there_warned_once_and_falls_back(fake):
    fake.fail_at = {2}   # the first take's own registration works, the one ahead of it fails
    pool = PinnedPool(pin=True)
    # (the registrar may run the failing registration ahead as soon as ``a`` is taken: the warning
    # is expected from then on; it is raised in the registrar, caught by the process's warnings filter)
    with pytest.warns(RuntimeWarning, match="cudaHostRegister failed"):
        a = pool.recycled(3000)
        pool.classes.run(lambda: None).result()   # the registrar ran the failing one
        b = pool.recycled(3000)
    assert fake.cleared and all(n.startswith("mtnb-pin") for n in fake.cleared)   # not the caller's thread
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = pool.recycled(5000)   # fallen back: no registration, no second warning
    assert not pinned.exact_pinned() and fake.calls == 2 and b.numel() == 3000 and c.numel() == 5000
    del a, b, c
    pool.close()
