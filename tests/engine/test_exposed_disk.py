"""A forward's wait for its clipped updates, told apart by what the updates waited for: the part
they spent waiting for the disk tier (their states' ranged reads and writes, in the chunk ring's
decode and encode) is ``optimizer_exposed_disk_seconds``, the rest the optimizer's own."""
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatrain_nb.engine import EngineConfig, StreamingEngine
from megatrain_nb.engine.tiers import disk_ranged
from megatrain_nb.model_configs import FAMILY_VOCAB as VOCAB, family_config

SLOW_S = 0.03   # added to each ranged read of the codes: a disk far slower than the updates' CPU work


def _exposed(monkeypatch, *, slow: bool, **cfg):
    real = disk_ranged.pread_all

    def pread_slowly(fd, arr, offset):
        time.sleep(SLOW_S)
        return real(fd, arr, offset)
    if slow:
        monkeypatch.setattr(disk_ranged, "pread_all", pread_slowly)
    model = AutoModelForCausalLM.from_config(family_config("llama", layers=4))
    e = StreamingEngine(model, EngineConfig(device="cpu", **cfg))
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    for _ in range(2):   # the first step's updates create the states: the next reads them
        e.forward_backward(ids, step_lr=1e-3, max_grad_norm=1.0)
    e.zero_grad()
    t0 = e.telemetry()
    for _ in range(3):
        e.forward_backward(ids, step_lr=1e-3, max_grad_norm=1.0)
    e.zero_grad()
    t1 = e.telemetry()
    e.close()
    return tuple(t1[k] - t0[k] for k in ("optimizer_exposed_seconds", "optimizer_exposed_disk_seconds"))


def test_updates_waiting_for_the_disk_make_the_forwards_wait_the_disks(tmp_path, monkeypatch):
    """int4 states on the disk tier without a host cache: each update reads and writes its codes
    range by range. With each read slowed, most of the forward's wait is the disk's."""
    cfg = dict(offload_params=True, host_cache_gb=0, optimizer_compression="int4")
    exposed, disk = _exposed(monkeypatch, slow=True, offload_dir=str(tmp_path / "slow"), **cfg)
    assert exposed > 0.3   # (3 steps x 6 units x at least 4 reads x 30 ms, behind the forward's first layer)
    assert 0.5 * exposed < disk <= exposed   # (~0.85 alone or beside two busy cores; 0.56 at 10 ms beside a suite)
    monkeypatch.undo()
    exposed, disk = _exposed(monkeypatch, slow=False, offload_dir=str(tmp_path / "fast"), **cfg)
    assert 0.0 <= disk <= exposed


@pytest.mark.parametrize("codec", ["int4", "none"])
def test_updates_with_their_states_in_ram_wait_for_no_disk(tmp_path, monkeypatch, codec):
    """No disk tier: the updates' states are in RAM, so none of the forward's wait for them is the disk's."""
    exposed, disk = _exposed(monkeypatch, slow=True, optimizer_compression=codec)
    assert disk == 0.0 and exposed > 0.0


def test_waits_by_cause_take_the_updates_wait_out_of_the_devices():
    from megatrain_nb.engine.telemetry import Telemetry, waits_by_cause

    tel = Telemetry()
    tel.stall("device", 3.0)
    tel.stall("disk", 0.5)
    before = tel.snapshot()
    tel.stall("device", 4.0)   # of it, 2.5 s a forward waiting for pending updates, 1 s of theirs for the disk
    tel.stall("grad_return", 0.25)
    tel.add("optimizer_exposed_seconds", 2.5)
    tel.add("optimizer_exposed_disk_seconds", 1.0)
    waits = waits_by_cause(tel.snapshot(), before)
    assert waits["device"] == pytest.approx(1.5) and waits["disk"] == 0.0 and waits["grad_return"] == 0.25
    assert waits["optimizer_exposed"] == pytest.approx(1.5) and waits["optimizer_exposed_disk"] == 1.0
    whole = waits_by_cause(tel.snapshot())
    assert whole["device"] == pytest.approx(4.5) and whole["disk"] == 0.5
    # a wait for updates never makes the device's negative (the counters are read apart)
    assert waits_by_cause({"stall_seconds": {"device": 0.1}, "optimizer_exposed_seconds": 0.3})["device"] == 0.0
