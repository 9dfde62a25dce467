"""The transport seam (engine/transport/transport.py): the CPU transport's adversarial mode turns a missing
wait or release into an error or a wrong gradient, and the engine's own step keeps the
discipline (parity and layer-major tests under it)."""
import copy
from concurrent.futures import Future

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatrain_nb.engine import EngineConfig, StreamingEngine
from megatrain_nb.engine.transport import transport
from megatrain_nb.engine.transport.transport import ADVERSARIAL_ENV, CpuTransport, FutureHandle, TransportError

from . import test_layer_major, test_parity
from megatrain_nb.model_configs import FAMILY_VOCAB as VOCAB, family_config


def _slot(n=64):
    return torch.zeros(n)


def test_a_copy_in_is_late_until_waited_for():
    """(``after``: a transfer the copy must follow, still running here: the copy cannot have
    landed, however the threads are scheduled.)"""
    t = CpuTransport(adversarial=True)
    src, dst = torch.arange(64, dtype=torch.float32), _slot()
    t.release(dst)   # a new slot starts released: poisoned
    before = Future()
    ready = t.copy_in(None, src, dst, after=FutureHandle(before))
    assert torch.isnan(dst).all() and not ready.done()   # read without waiting: the poison
    before.set_result(None)
    ready.wait()
    assert torch.equal(dst, src)
    t.close()


def test_release_poisons_and_reuse_before_release_raises():
    from megatrain_nb.engine.units import Unit

    unit = Unit(name="layers.0", kind="layer", index=1, params=[], numel=64, decay_numel=0)
    t = CpuTransport(adversarial=True)
    dst = _slot()
    t.copy_in(unit, torch.ones(64), dst).wait()
    with pytest.raises(TransportError, match="not released"):
        t.copy_in(unit, torch.ones(64), dst)
    t.release(dst)
    assert torch.isnan(dst).all() and t.poisoned == 1
    t.copy_in(unit, torch.full((64,), 2.0), dst).wait()   # released: may be filled again
    assert float(dst.sum()) == 128.0
    t.close()


def test_a_copy_out_is_done_only_at_its_result():
    t = CpuTransport(adversarial=True)
    src, host = torch.arange(8, dtype=torch.float32), torch.zeros(8)
    before = Future()   # the compute that makes ``src``, still running
    done = t.copy_out(None, src, host, after=FutureHandle(before))
    assert float(host.abs().sum()) == 0.0 and not done.done()   # not there yet
    before.set_result(None)
    assert torch.equal(done.result(), src)
    t.close()


def _grads_error(engine, ref_grads) -> float:
    worst = 0.0
    for name, g in engine.named_gradients():
        r = ref_grads[name]
        err = float((g - r).norm() / (r.norm() + 1e-12))
        worst = max(worst, err if err == err else float("inf"))
    return worst


@pytest.mark.parametrize("adversarial", [False, True])
def test_a_missing_wait_is_caught_only_by_the_adversarial_transport(monkeypatch, adversarial):
    """Break the step on purpose: the compute no longer waits for the copies it reads (every
    ready handle's wait() does nothing). The ordinary CPU transport copies inline, so nothing
    shows; the adversarial one lands the copies late, into poisoned slots: NaN or wrong
    gradients, or an error."""
    monkeypatch.setenv(ADVERSARIAL_ENV, "1" if adversarial else "0")
    # copies land up to 50 ms late, one after another: far later than a compute that does not
    # wait reads them, however slow a loaded machine makes the compute (3 ms was absorbed by
    # the prefetch's lead when the machine was busy)
    monkeypatch.setattr(transport, "ADVERSARIAL_MAX_DELAY_S", 0.05)
    model = AutoModelForCausalLM.from_config(family_config("llama", layers=3)).eval()
    ids = torch.randint(1, VOCAB, (2, 12))
    ref = copy.deepcopy(model)
    ref(input_ids=ids, labels=ids).loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    monkeypatch.setattr(FutureHandle, "wait", lambda self: None)
    engine = StreamingEngine(model, EngineConfig(device="cpu"))
    try:
        engine.forward_backward(ids)
        err = _grads_error(engine, ref_grads)
    except (TransportError, RuntimeError) as e:
        err = float("inf") if adversarial else pytest.fail(f"ordinary transport failed: {e}")
    finally:
        monkeypatch.undo()   # (close() waits properly)
        engine.close()
    if adversarial:
        assert err > 1e-2, err
    else:
        assert err <= 1e-4, err


# ---------------------------------------------------------------- the step under the adversarial transport
@pytest.fixture
def adversarial(monkeypatch):
    monkeypatch.setenv(ADVERSARIAL_ENV, "1")


@pytest.mark.parametrize("family,k,padding,tie", [("llama", 1, "right", True), ("gpt2", 0, "left", False),
                                                   ("qwen2", 2, "left", True), ("gemma2", 3, "right", False)])
def test_parity_under_adversarial_transport(adversarial, family, k, padding, tie):
    test_parity.test_gradients_match_hf(family, k, padding, tie)


def test_dropout_parity_under_adversarial_transport(adversarial):
    test_parity.test_dropout_recompute_matches_hf_in_train_mode()


def test_accumulation_parity_under_adversarial_transport(adversarial):
    test_parity.test_gradients_accumulate_over_micro_batches_and_zero_grad()


def test_layer_major_under_adversarial_transport(adversarial):
    test_layer_major.test_20_steps_match_micro_batch_major("llama", True, 1)


def test_layer_major_host_tier_under_adversarial_transport(adversarial):
    test_layer_major.test_host_tier_same_result_counted_on_host()


def test_layer_major_interval_0_under_adversarial_transport(adversarial):
    test_layer_major.test_keep_all_activations_interval_0()


def test_layer_major_groups_under_adversarial_transport(adversarial):
    test_layer_major.test_split_into_groups_loads_twice_per_group()


# ---------------------------------------------------------------- the compute side late, host buffers in flight
def test_a_fresh_buffer_copy_not_ordered_after_the_compute_is_overwritten():
    """The caching allocator hands back a block whose last owner's kernels are still queued on
    the compute stream: a copy into it not ordered after ``record()`` lands first and is then
    overwritten (NaN); ordered after it, it holds the data."""
    from megatrain_nb.engine.transport.transport import all_of

    t = CpuTransport(adversarial=True)
    src = torch.arange(16, dtype=torch.float32)
    bad = t.device_empty((16,), torch.float32)
    t.copy_in(None, src, bad).wait()
    assert torch.isnan(bad).all() and t.late_writes == 1
    good = t.device_empty((16,), torch.float32)
    t.copy_in(None, src, good, after=all_of(None, t.record())).wait()
    assert torch.equal(good, src) and t.late_writes == 2
    t.close()


def test_a_host_buffer_written_before_its_transfer_is_waited_for_raises():
    """A host buffer released after a copy from it stays in flight (on a GPU the copy engine may
    still read it) until its release handle is waited for: written before that, the next copy
    from it raises; a copy out into it raises at once."""
    t = CpuTransport(adversarial=True)
    h = torch.arange(8, dtype=torch.float32)
    t.copy_in(None, h, t.device_empty((8,), torch.float32)).wait()
    last = t.release(h)
    assert torch.isnan(h).all() and not last.done()
    with pytest.raises(TransportError, match="may still be reading"):
        t.copy_out(None, torch.ones(8), h, after=t.record())
    h.copy_(torch.ones(8))   # a disk read into the recycled buffer, not waiting
    with pytest.raises(TransportError, match="written while the transfer"):
        t.copy_in(None, h, t.device_empty((8,), torch.float32))
    last.result()            # waited for: the buffer is the host's again
    t.copy_in(None, h, t.device_empty((8,), torch.float32)).wait()
    t.close()


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_window_tiers_interval_2_under_adversarial_transport(adversarial, tmp_path, tier):
    """Boundary activations restored from host RAM or the disk tier into fresh device buffers
    (checkpoint_interval=2): gradients equal the device tier's under the adversarial transport
    (the restore's copy ordered after the compute; a recycled host buffer reused for a disk read
    only once its last transfer is done)."""
    model = AutoModelForCausalLM.from_config(family_config("llama", layers=4)).eval()
    w = [torch.randint(1, VOCAB, (2, 12)) for _ in range(3)]
    ref = StreamingEngine(copy.deepcopy(model), EngineConfig(device="cpu", checkpoint_interval=2))
    eng = StreamingEngine(copy.deepcopy(model), EngineConfig(device="cpu", checkpoint_interval=2, window_tier=tier,
                                                             offload_dir=str(tmp_path)))
    try:
        for step in range(2):   # the second window reuses the first's recycled host buffers
            a = ref.forward_backward(w, step_lr=1e-3 if step == 0 else None)
            b = eng.forward_backward(w, step_lr=1e-3 if step == 0 else None)
            assert eng.telemetry()["last_step"]["boundary_tier"] == tier
            assert a.loss == b.loss
        ga = dict(ref.named_gradients())
        for name, g in eng.named_gradients():
            assert torch.equal(g, ga[name]), name
    finally:
        ref.close()
        eng.close()


def test_recycled_boundary_buffers_of_shapes_no_longer_used_are_freed():
    """Variable sequence lengths: the host tier's recycled (pinned, on CUDA) buffers of a length
    that the last passes did not use are freed, not kept per exact shape for good."""
    model = AutoModelForCausalLM.from_config(family_config("llama", layers=2)).eval()
    eng = StreamingEngine(model, EngineConfig(device="cpu", checkpoint_interval=1, window_tier="host"))
    try:
        shapes = set()
        for seq in (8, 9, 10, 11, 12):
            eng.forward_backward([torch.randint(1, VOCAB, (2, seq)) for _ in range(2)])
            shapes = {k[0] for k, v in eng.boundary._free.items() if v}
        # the window just run and the KEEP_PASSES before it: the first lengths are gone
        assert {s[1] for s in shapes} == {10, 11, 12}, shapes
        row = 2 * 12 * 32 * 4   # one micro-batch's hidden state at the longest length
        assert eng.boundary.free_bytes() <= 3 * 2 * 2 * row   # 3 lengths x 2 micro-batches x 2 layers
    finally:
        eng.close()


def _bf16_run(monkeypatch, shadows: bool, adversarial: bool):
    """Three bf16 steps on the CPU device (a single batch, a clipped one, a window), with or
    without compute-dtype shadows (host_store.SHADOWS_ON_CPU: CUDA's path on the CPU transport)."""
    from megatrain_nb.engine.tiers import host_store

    monkeypatch.setattr(host_store, "SHADOWS_ON_CPU", shadows)
    monkeypatch.setenv(ADVERSARIAL_ENV, "1" if adversarial else "0")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config("llama"))
    engine = StreamingEngine(model, EngineConfig(device="cpu", precision="bf16"))
    assert bool(engine.store.shadows) == shadows
    ids = torch.randint(1, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    losses = [engine.forward_backward(ids, step_lr=1e-3).loss,
              engine.forward_backward(ids.flip(1), step_lr=1e-3, max_grad_norm=0.5).loss,
              engine.forward_backward([ids, ids.flip(1)], step_lr=1e-3).loss]
    engine.forward_backward(ids)   # gradients of the updated weights, not applied
    grads = {n: g.clone() for n, g in engine.named_gradients()}
    weights = {n: p.clone() for n, p in engine.named_parameters()}
    if shadows:   # each shadow is its unit's masters cast once, after the last update
        for u in engine.state_units:
            assert torch.equal(engine.store.shadows[u.index], engine.store.params[u.index].to(torch.bfloat16))
    engine.close()
    return losses, grads, weights


@pytest.mark.parametrize("adversarial", [False, True])
def test_bf16_loads_from_shadows_written_by_the_updates_are_bit_identical(monkeypatch, adversarial):
    """Issue 45 item 2: a load copies the unit's bf16 shadow, written once by its update, instead
    of casting the fp32 masters at every load: losses, gradients and weights bit for bit the same."""
    base = _bf16_run(monkeypatch, False, adversarial)
    got = _bf16_run(monkeypatch, True, adversarial)
    assert got[0] == base[0]
    for a, b in ((got[1], base[1]), (got[2], base[2])):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
