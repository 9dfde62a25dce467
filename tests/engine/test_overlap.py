"""A clipped step's updates overlap the next forward (issue 45 item 7, bench_overlap's clipped figure).

With global-norm clipping no update can start before the last gradient, so they run after the
backward, in the NEXT forward's order (the embedding, the head, then the layers: the order the
forward acquires them), and each forward unit waits for its own update only. Checked by counts,
not seconds: the order the updates ran in against the order the forward acquired its units, and a
gate that lets each update run only once the forward has acquired the unit before it -- a forward
that waited for every update (or updates in another order) can never open it, so the gate counts
a refusal instead of a pass. On the RAM tier and on the disk tier without a host cache (the
benchmark's case: weights and states read and written per update), fp32 and int8 states.
"""
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from megatrain_nb.engine import EngineConfig, StreamingEngine
from megatrain_nb.engine.units import forward_order

CONFIG = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
GATE_SECONDS = 60   # only a broken order ever waits this long (the gate is then counted as refused)

TIERS = {
    "ram": dict(),
    "disk_nocache": dict(offload_params=True, host_cache_gb=0.0),
    "ram_int8": dict(optimizer_compression="int8"),
    "disk_nocache_int8": dict(offload_params=True, host_cache_gb=0.0, optimizer_compression="int8"),
}


class Recorder:
    """Wraps the engine's update runner and pager (instance attributes, this test's engine only):
    the units whose updates ran after the norm, in order; the units the compute acquired, in order;
    and, once armed, each update held until the forward has acquired the unit before it."""

    def __init__(self, engine):
        self.engine = engine
        self.order = [u for u in forward_order(engine.units) if u.numel > 0]
        self.armed = False
        self.applied, self.acquired = [], []
        self.seen = {u.index: threading.Event() for u in engine.units}
        self.gates_passed = self.gates_refused = 0
        self.waiting_on_own = []   # (unit, updates done when its forward load waited): the prefix it needs
        runner, pager = engine.updates.runner, engine.pager
        apply, acquire, ready = runner.apply, pager.acquire, runner.ready_weights
        after_norm, self.norms = runner.submit_after_norm, 0

        def armed_after_norm(*args, **kw):   # armed for the first clipped step's updates only
            self.norms += 1
            self.armed = self.norms == 1
            return after_norm(*args, **kw)

        def gated_apply(unit, lr, grad=None, **kw):
            if self.armed:
                i = self.order.index(unit)
                if i > 0:
                    if self.seen[self.order[i - 1].index].wait(GATE_SECONDS):
                        self.gates_passed += 1
                    else:
                        self.gates_refused += 1
                self.applied.append(unit.name)
            return apply(unit, lr, grad, **kw)

        def recorded_acquire(unit):
            out = acquire(unit)
            if self.armed:
                self.acquired.append(unit.name)
                self.seen[unit.index].set()
            return out

        def recorded_ready(unit):
            out = ready(unit)
            if self.armed and unit.name not in [u for u, _ in self.waiting_on_own]:
                self.waiting_on_own.append((unit.name, list(self.applied)))
            return out

        runner.apply, pager.acquire, runner.ready_weights = gated_apply, recorded_acquire, recorded_ready
        runner.submit_after_norm = armed_after_norm


def _engine(tmp_path, **options):
    torch.manual_seed(0)
    return StreamingEngine(AutoModelForCausalLM.from_config(CONFIG),
                           EngineConfig(device="cpu", offload_dir=str(tmp_path / "disk"), **options))


@pytest.mark.parametrize("tier", [t if t == "ram" else pytest.param(t, marks=pytest.mark.slow) for t in TIERS])
def test_clipped_updates_run_in_the_next_forwards_order_and_each_unit_waits_for_its_own(tmp_path, tier):
    e = _engine(tmp_path, **TIERS[tier])
    try:
        rec = Recorder(e)
        ids = torch.randint(0, 256, (2, 16))
        # step 1's updates wait for the norm and run while step 2's forward runs (armed from the
        # moment they are queued to step 2's own); the coefficient clips (applied)
        e.forward_backward(ids, step_lr=1e-3, max_grad_norm=1e-3)
        e.forward_backward(ids, step_lr=1e-3, max_grad_norm=1e-3)
        e.updates.wait_all()
        assert rec.norms == 2
        names = [u.name for u in rec.order]
        # every unit updated once, in the forward's order: the embedding, the head, the layers
        assert rec.applied[:len(names)] == names, rec.applied
        # the forward acquired them in that order too (then the recompute and the backward)
        first = list(dict.fromkeys(rec.acquired))
        assert first == names, rec.acquired
        # each update ran only after the forward had acquired the unit before it: the forward took
        # each unit as soon as its own update was done, never waiting for the ones after it
        assert (rec.gates_passed, rec.gates_refused) == (len(names) - 1, 0)
        # a forward load took its unit once that unit's update had run, and no update after it had to
        for unit, done in rec.waiting_on_own:
            if unit in names:
                k = names.index(unit)
                assert done == names[:k + 1], (unit, done)
    finally:
        e.close()
