"""FinalGradients (engine/updates/final_grads.py): a clipped step's final gradients held on the disk tier
are read back one unit ahead of the update that claims them."""
from types import SimpleNamespace

import torch

from megatrain_nb.engine.tiers.disk_store import DiskStore
from megatrain_nb.engine.updates.final_grads import FinalGradients
from megatrain_nb.engine.tiers.host_store import BufferPool


class CountedReads(DiskStore):
    """A DiskStore that counts its reads."""

    reads = 0

    def read(self, *args, **kwargs):
        self.reads += 1
        return super().read(*args, **kwargs)


def units(*sizes):
    return [SimpleNamespace(index=i, numel=n, name=f"u{i}") for i, n in enumerate(sizes)]


def held(final, us, seed=0):
    g = torch.Generator().manual_seed(seed)
    grads = [torch.randn(u.numel, generator=g) for u in us]
    for u, t in zip(us, grads):
        final.write_held(u, t.clone()).result()
    return grads


def test_a_gradient_read_ahead_is_the_one_its_update_claims(tmp_path):
    a, b = units(1000, 3000)
    with CountedReads(tmp_path) as disk:
        final = FinalGradients(BufferPool(), disk)
        ga, gb = held(final, [a, b])
        final.read_ahead(b)                     # while a's update runs
        assert disk.reads == 1
        got_a, give_a = final.claim(a)          # not read ahead: read now
        assert disk.reads == 2 and torch.equal(got_a, ga)
        got_b, give_b = final.claim(b)          # read ahead: no second read
        assert disk.reads == 2 and torch.equal(got_b, gb)
        give_a(got_a), give_b(got_b)
        assert final.claim(b) == (None, None)   # claimed once


def test_a_read_ahead_nobody_claimed_is_dropped_before_the_key_is_written_again(tmp_path):
    (a,) = units(2048)
    with CountedReads(tmp_path) as disk:
        final = FinalGradients(BufferPool(), disk)
        held(final, [a], seed=1)
        final.read_ahead(a)                     # then the step failed: its update never ran
        fresh = held(final, [a], seed=2)[0]     # the next step holds a new gradient
        got, give = final.claim(a)
        assert torch.equal(got, fresh)          # the new one, read again, not the stale read
        assert disk.reads == 2
        give(got)


def test_ranged_reads_without_a_host_cache_are_not_read_ahead(tmp_path):
    (a,) = units(4096)
    with CountedReads(tmp_path) as disk:
        final = FinalGradients(BufferPool(), disk)
        g = held(final, [a])[0]
        final.read_ahead(a, ranged=True)        # (read a chunk ahead of AdamW instead)
        assert disk.reads == 0
        got, close = final.claim(a, ranged=True)
        out = torch.empty(a.numel)
        assert torch.equal(got.read(0, out), g)
        close()
