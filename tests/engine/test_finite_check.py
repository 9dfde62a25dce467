"""finite.all_finite (the unclipped step's per-unit NaN/inf check, and the data-parallel vote)
against torch.isfinite(t).all(): a NaN, +inf or -inf anywhere (first, last, a vector tail, the
middle, past a parallel chunk's edge) in fp32, bf16 and fp16, on one torch thread and on two."""
import random

import pytest
import torch

from megatrain_nb.engine.updates.finite import StepGuard, all_finite

SIZES = (1, 7, 8, 9, 31, 64, 1000, 32769, 100003)


@pytest.mark.parametrize("threads, sizes, least", [(1, SIZES, 300), (2, (32769, 100003), 60)])
def test_all_finite_agrees_with_isfinite_all(threads, sizes, least):
    """(two threads: only sizes a parallel reduction splits; small ones run on one thread anyway)"""
    rng = random.Random(0)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        checked = 0
        for n in sizes:
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                for bad in (float("nan"), float("inf"), -float("inf"), None):
                    for pos in sorted({0, n - 1, n // 2, rng.randrange(n)}):
                        x = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype)
                        if bad is not None:
                            x[pos] = bad
                        assert all_finite(x) == bool(torch.isfinite(x).all()), (n, dtype, bad, pos)
                        checked += 1
        assert checked >= least
    finally:
        torch.set_num_threads(prev)


def test_all_finite_edges():
    assert all_finite(torch.empty(0))
    assert all_finite(torch.tensor([3.4e38, -3.4e38, 0.0, -0.0, 1e-45]))   # extremes, a denormal
    x = torch.zeros(4, 5)
    x[3, 4] = float("nan")
    assert not all_finite(x)                  # a matrix, the last element
    assert not all_finite(x.t())              # not contiguous


def test_step_guard_skips_from_the_first_bad_unit():
    g = StepGuard(step=3, policy="stop")
    ok = torch.ones(10)
    bad = torch.ones(10)
    bad[7] = -float("inf")
    assert g.check("a", ok) == (False, None)
    skip, err = g.check("b", bad)
    assert skip and err is not None and err.partial and "b" in str(err)
    assert g.check("c", ok) == (True, None)   # every unit after the first bad one is skipped
