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

    def __init__(self, engine, arm_at: int = 1):
        self.engine = engine
        self.order = []   # the units in the order the armed step's updates were queued
        self.armed = False
        self.applied, self.acquired = [], []
        self.seen = {u.index: threading.Event() for u in engine.units}
        self.gates_passed = self.gates_refused = 0
        self.waiting_on_own = []   # (unit, updates done when its forward load waited): the prefix it needs
        runner, pager = engine.updates.runner, engine.pager
        apply, acquire, ready = runner.apply, pager.acquire, runner.ready_weights
        after_norm, self.norms = runner.submit_after_norm, 0

        def armed_after_norm(order, *args, **kw):   # armed for one clipped step's updates only
            self.norms += 1
            self.armed = self.norms == arm_at
            if self.armed:
                self.order = list(order)
            return after_norm(order, *args, **kw)

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


def _run(tmp_path, tier: str, arm_at: int) -> Recorder:
    """Steps of a clipped run, the updates of step ``arm_at`` recorded and gated while the next
    forward runs."""
    e = _engine(tmp_path, **TIERS[tier])
    try:
        rec = Recorder(e, arm_at)
        ids = torch.randint(0, 256, (2, 16))
        for _ in range(arm_at + 1):   # (max_grad_norm small enough to clip: the coefficient is applied)
            e.forward_backward(ids, step_lr=1e-3, max_grad_norm=1e-3)
        e.updates.wait_all()
        assert rec.norms == arm_at + 1
        rec.head_late = e.runner.head_late
        return rec
    finally:
        e.close()


def _check_overlap(rec: Recorder) -> None:
    names = [u.name for u in rec.order]
    # every unit updated once, in the order queued
    assert rec.applied[:len(names)] == names, rec.applied
    # the next forward acquired them in that order too (then the recompute and the backward)
    assert list(dict.fromkeys(rec.acquired)) == names, rec.acquired
    # each update ran only after the forward had acquired the unit before it: the forward took
    # each unit as soon as its own update was done, never waiting for the ones after it
    assert (rec.gates_passed, rec.gates_refused) == (len(names) - 1, 0)
    # when a forward load went ahead, exactly the updates up to its unit had run
    for unit, done in rec.waiting_on_own:
        if unit in names:
            assert done == names[:names.index(unit) + 1], (unit, done)


@pytest.mark.parametrize("tier", [t if t == "ram" else pytest.param(t, marks=pytest.mark.slow) for t in TIERS])
def test_clipped_updates_run_in_the_next_forwards_order_and_each_unit_waits_for_its_own(tmp_path, tier):
    # the first step binds the embedding and the head before the layers (and learns that this
    # model's code uses no head module before its layers): its updates run embed, head, layers
    first = _run(tmp_path / "a", tier, arm_at=1)
    assert first.head_late is True
    assert [u.name for u in first.order][:2] == ["embed", "head"]
    _check_overlap(first)
    # from then on the forward binds the head after its last layer: the updates run embed,
    # layers, head, and the forward waits for the embedding's update only before its first layer
    later = _run(tmp_path / "b", tier, arm_at=2)
    assert [u.name for u in later.order] == ["embed"] + [f"model.layers.{i}" for i in range(4)] + ["head"]
    _check_overlap(later)


def test_a_model_using_a_head_module_before_its_layers_keeps_the_head_first(tmp_path):
    """A module registered after the layer list (so in the head unit) but called before the layers:
    the first capture sees it run, and the forward keeps binding the head first."""
    class Scaled(torch.nn.Module):   # registered after the layers, called on the embeddings
        def __init__(self, n):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(n))

        def forward(self, x):
            return x * self.scale

    model = AutoModelForCausalLM.from_config(CONFIG)
    base = model.model
    base.late_scale = Scaled(CONFIG.hidden_size)
    embed = base.embed_tokens
    base.embed_tokens = EmbedThen(embed, base.late_scale)
    e = StreamingEngine(model, EngineConfig(device="cpu"))
    try:
        assert "model.late_scale.scale" in [p.name for p in e.units[-1].params]
        rec = Recorder(e, arm_at=2)
        ids = torch.randint(0, 256, (2, 16))
        for _ in range(3):
            e.forward_backward(ids, step_lr=1e-3, max_grad_norm=1e-3)
        e.updates.wait_all()
        assert e.runner.head_late is False
        assert [u.name for u in rec.order][:2] == ["embed", "head"]
        _check_overlap(rec)
    finally:
        e.close()


class EmbedThen(torch.nn.Module):
    """An embedding followed by a module of the model's registered elsewhere."""
    def __init__(self, embed, then):
        super().__init__()
        self.embed = embed
        self.then = [then]   # (not a child: its parameters stay where the model registered them)
        self.weight = embed.weight

    def forward(self, ids):
        return self.then[0](self.embed(ids))
