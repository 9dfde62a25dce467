"""What a layer-major window keeps alive, counted: the fresh gradients of a layer's backward,
the final-gradient buffers between the sums and their updates, and the plan's device figure."""
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import AutoModelForCausalLM

from megatrain_nb.engine import EngineConfig, StreamingEngine
from megatrain_nb.engine.step import StepRunner
from megatrain_nb.engine.updates.updates import final_gradient_pool_bytes

from megatrain_nb.model_configs import FAMILY_VOCAB as VOCAB, family_config


def _storages(tree) -> set:
    return {t.untyped_storage().data_ptr() for t in tree_leaves(tree) if isinstance(t, torch.Tensor)}


class LiveBytes(TorchDispatchMode):
    """The peak bytes of tensor storages allocated inside the mode and alive at once (views and
    in-place results of existing tensors are not new; a storage lives as long as its tensor:
    torch keeps the Python object while C++ holds the tensor)."""

    def __init__(self):
        super().__init__()
        self.live = {}   # storage data_ptr -> (weakref to a tensor on it, bytes)
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        old = _storages((args, kwargs))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                st = t.untyped_storage()
                if st.data_ptr() and st.data_ptr() not in self.live and st.data_ptr() not in old:
                    self.live[st.data_ptr()] = (weakref.ref(t), st.nbytes())
        self.live = {p: (r, n) for p, (r, n) in self.live.items() if r() is not None}
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def _window(A, seq=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (1, seq), generator=g) for _ in range(A)]


def _fill_pool(eng) -> None:
    """Put the steady state's final-gradient buffers in the pool (the unit being updated and the
    sum being formed: ``final_gradient_pool_bytes``). How many one warm-up step leaves there
    depends on its timing: where the head's update was done before the first layer's sum was
    taken, one buffer served every unit, and a slower measured step (a loaded machine: the
    whole fast subset) then took its second one fresh inside the measurement."""
    pool = eng.updates.intake.pool
    n = final_gradient_pool_bytes(eng.units, eng.updates.depth, False) // (4 * pool.slot_numel)
    bufs = [pool.take(pool.slot_numel) for _ in range(n)]
    pool.give(*bufs)
    assert pool.nbytes() >= n * 4 * pool.slot_numel


@pytest.mark.parametrize("k", [1, 0])
def test_layer_backward_adds_gradients_straight_into_the_sum(monkeypatch, k):
    """Each micro-batch's backward of a layer adds every parameter's gradient into the unit's
    fp32 sum as autograd makes it: no unit's worth of fresh gradients beside the sum (before:
    ``autograd.grad`` returned them all at once, one unit-sized transient per micro-batch)."""
    model = AutoModelForCausalLM.from_config(family_config("llama", layers=2, hidden=128)).eval()
    eng = StreamingEngine(model, EngineConfig(device="cpu", checkpoint_interval=k))
    eng.forward_backward(_window(2), step_lr=1e-3)   # warm-up: the sums come from the pool after this
    eng.updates.wait_all()
    _fill_pool(eng)
    unit_bytes = 4 * max(u.numel for u in eng.layer_units)
    largest_param = 4 * max(p.numel for u in eng.layer_units for p in u.params)
    peaks = []
    real = StepRunner.backward_layers

    def measured(self, *a, **kw):
        with LiveBytes() as live:
            out = real(self, *a, **kw)
        peaks.append(live.peak)
        return out
    monkeypatch.setattr(StepRunner, "backward_layers", measured)
    eng.forward_backward(_window(2, seed=1), step_lr=1e-3)
    eng.updates.wait_all()
    assert len(peaks) == 1
    # one parameter's gradient at a time and the activations of 8 tokens: well below one unit
    # (measured 190 kB at k = 1, 152 kB at k = 0; before: 620 kB, over the unit's 591 kB)
    assert largest_param < unit_bytes // 4
    assert peaks[0] < unit_bytes // 2, (peaks, unit_bytes, largest_param)
    eng.close()


def test_final_gradient_buffers_are_the_update_and_the_sum_being_formed(monkeypatch):
    """CPU "device", unclipped window: the final-gradient buffers are the unit being updated and
    the sum being formed, two of the largest unit's size, whatever the unit sizes and however
    slow the updates (before: a third sum waiting in line behind a slow update, plus the head's
    and the embedding's own-sized buffers kept idle through the layers' backward)."""
    import time

    model = AutoModelForCausalLM.from_config(family_config("llama", layers=4, hidden=64)).eval()
    eng = StreamingEngine(model, EngineConfig(device="cpu"))
    real_step = eng.adam.step_unit

    def slow_step(*a, **kw):   # updates slower than a unit's backward: sums would queue up
        time.sleep(0.05)
        return real_step(*a, **kw)
    monkeypatch.setattr(eng.adam, "step_unit", slow_step)
    pool = eng.updates.intake.pool
    largest = 4 * max(u.numel for u in eng.units)
    out, most = {}, [0]   # buffers handed out and not back (by storage) -> bytes; the most at once
    real_take, real_give = pool.take, pool.give

    def take(n):
        t = real_take(n)
        out[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        most[0] = max(most[0], sum(out.values()) + pool.nbytes())
        return t

    def give(*ts):
        for t in ts:
            out.pop(t.untyped_storage().data_ptr(), None)
        real_give(*ts)
    monkeypatch.setattr(pool, "take", take)
    monkeypatch.setattr(pool, "give", give)
    for seed in range(3):
        eng.forward_backward(_window(3, seed=seed), step_lr=1e-3)
        eng.updates.wait_all()
    slack = 4096   # aligned_empty's alignment room per buffer
    assert most[0] <= 2 * (largest + slack), (most[0], largest)
    assert pool.nbytes() <= 2 * largest and not out   # all back, two kept for the next step
    eng.close()


@pytest.mark.parametrize("tie", [False, True])
def test_plan_counts_the_window_gradient_sums_on_the_device(tie):
    """make_plan's device figure of a layer-major window includes its fp32 gradient sums (one
    unit's at a time; a tied embedding's from the head pass on, beside each layer's), so the
    estimator's device total and the room left for boundary activations account for them."""
    from megatrain_nb.engine.planning.planner import GiB, ModelShape, Workload, make_plan, unit_specs_from_config, window_sum_bytes

    specs = unit_specs_from_config(family_config("llama", layers=4, hidden=64, tie=tie))
    emb = next(u for u in specs if u.kind == "embed")
    assert emb.tied_output is tie
    layer = max(u.numel for u in specs if u.kind == "layer")
    head = next(u for u in specs if u.kind == "head").numel
    want = 4 * (emb.numel + max(layer, head)) if tie else 4 * max(emb.numel, layer, head)
    assert window_sum_bytes(specs) == want
    shape = ModelShape(hidden_size=64, num_layers=4, intermediate_size=128, vocab_size=VOCAB)

    def plan(accumulation=1, vram_bytes=None):
        cfg = EngineConfig(max_vram_gb=vram_bytes / GiB if vram_bytes else None, overrides={"device_slots": 2})
        return make_plan(specs, shape, cfg, cuda=True, workload=Workload(batch=2, seq=16, accumulation=accumulation))
    one = plan()
    win = plan(4)
    assert "grad_sums" not in one.device and one.window_sum_bytes == want
    assert win.device["grad_sums"] == want
    assert win.device["total"] == (win.device["weights"] + win.device["grads"] + want + win.device["activations"])
    # a device budget that holds the window's boundary activations only if the sums are left out
    room = one.device["total"] + win.window["device_work_bytes"] + win.window["boundary_bytes"]
    tight = plan(4, room)
    assert tight.window["tier"] == "host" and tight.device["grad_sums"] == want
    roomy = plan(4, room + want)
    assert roomy.window["tier"] == "device"


def test_bf16_window_adds_cast_gradients_and_matches_micro_batch_major():
    """bf16 weights cannot take an fp32 ``.grad``: their layers' gradients are added into the
    fp32 sums cast (the path before), and the window still trains as the micro-batch-major
    path does."""
    import copy

    from .test_layer_major import _micro_batch_major, _rel, _windows

    model = AutoModelForCausalLM.from_config(family_config("llama")).eval()
    ref, lm = (StreamingEngine(copy.deepcopy(model), EngineConfig(device="cpu", precision="bf16")) for _ in range(2))
    for w in _windows(4, 3):
        _micro_batch_major(ref, w, 3e-3)
        lm.forward_backward(w, step_lr=3e-3)
    assert _rel(lm, ref) <= 1e-5
    for e in (ref, lm):
        e.close()


@pytest.mark.parametrize("k", [1, 0])
def test_window_with_unused_parameters_matches_micro_batch_major(k):
    """Mixtral routes each token to 2 of 4 experts: an expert no token of a micro-batch reached
    gets no gradient from it (autograd leaves its ``.grad`` view of the sum as it was), as the
    micro-batch-major path adds nothing for it."""
    import copy

    from .test_layer_major import _micro_batch_major, _rel, _windows

    model = AutoModelForCausalLM.from_config(family_config("mixtral")).eval()
    ref, lm = (StreamingEngine(copy.deepcopy(model), EngineConfig(device="cpu", checkpoint_interval=k))
               for _ in range(2))
    for w in _windows(3, 3, batch=1, seq=2, pad=False):   # 2 tokens x 2 experts: some expert idle
        _micro_batch_major(ref, w, 3e-3)
        lm.forward_backward(w, step_lr=3e-3)
    assert _rel(lm, ref) <= 1e-5
    for e in (ref, lm):
        e.close()


def test_engine_window_plan_leaves_the_device_room_for_the_sums():
    """The engine's window layout (engine_window_plan) takes the window's gradient sums out of
    the device room before placing boundary activations there."""
    from megatrain_nb.engine.planning.planner import GiB, LayerDims, engine_window_plan

    eng = StreamingEngine(AutoModelForCausalLM.from_config(family_config("llama", layers=4, hidden=64)),
                          EngineConfig(device="cpu"))
    plan, A, tokens = eng.plan, 3, 24
    row = tokens * 64 * 4
    need = A * (4 * row + 2 * row)   # every layer's input + the front and one block input, per micro-batch
    base = plan.device["weights"] + plan.device["grads"] + LayerDims.of(eng.model_config).work_bytes(tokens, tokens, 4)
    assert plan.window_sum_bytes == 4 * max(u.numel for u in eng.units)

    def layout(room):
        cfg = eng.config.replace(max_vram_gb=(base + room) / GiB)
        w = engine_window_plan(plan, eng.model_config, cfg, 4, tokens=tokens, micro_batches=A)
        return w.tier, w.group_size
    sums = plan.window_sum_bytes
    assert layout(sums + need + 64) == ("device", A)
    # room for the sums and the fronts only: the boundary activations go to host RAM (before, the
    # sums' room was taken for them: the whole window on the device)
    assert sums > A * 4 * row and layout(sums + A * 2 * row + 64) == ("host", A)
    eng.close()
