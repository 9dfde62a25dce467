"""StepGuard's per-unit check (finite.StepGuard.check) equals torch.isfinite(grad).all() on every
kind of value, with one reduction and no unit-sized temporaries (the disk tier's page faults)."""
import resource

import pytest
import torch

from megatrain_nb.engine.updates.finite import StepGuard


def _cases():
    g = torch.randn(10_000)
    yield "finite", g
    yield "huge but finite", torch.full((1000,), 3.0e38)
    for bad in (float("nan"), float("inf"), float("-inf")):
        t = g.clone()
        t[1234] = bad
        yield f"one {bad}", t
    t = g.clone()
    t[3], t[9] = float("nan"), float("inf")
    yield "nan and inf", t
    yield "empty", torch.empty(0)
    yield "bf16 inf", torch.tensor([1.0, float("inf")], dtype=torch.bfloat16)


@pytest.mark.parametrize("name,grad", list(_cases()))
def test_check_matches_isfinite(name, grad):
    skip, err = StepGuard(1, "stop").check("u", grad)
    assert (not skip) == bool(torch.isfinite(grad).all()), name
    assert (err is None) == (not skip)


def test_check_makes_no_unit_sized_temporary():
    grad = torch.randn(4 << 20)   # 16 MiB: faulted in page by page if a temporary of its size were made
    guard = StepGuard(1, "stop")
    guard.check("u", grad)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        guard.check("u", grad)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < 1024, f"{faults} page faults: a temporary of the gradient's size was made"
