"""The engine's guards: a non-finite step never reaches the weights, a half-applied step is
never handed out, and bad input is refused by value."""
import errno
import math
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from megatrain_nb.engine import EngineConfig, StreamingEngine
from megatrain_nb.engine.updates.finite import NonFiniteError

from megatrain_nb.model_configs import FAMILY_VOCAB as VOCAB, family_config


def _engine(tmp_path=None, **kw):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config("llama"))
    if tmp_path is not None:
        kw["offload_dir"] = str(tmp_path)
    return StreamingEngine(model, EngineConfig(device="cpu", **kw))


def _ids(seed=0, batch=2, seq=16):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _snapshot(e):
    return {n: p.clone() for n, p in e.named_parameters()}


def _same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


def _nan_loss(logits, labels):
    return logits.sum() * float("nan")


def _nan_grad(logits, labels):  # a finite loss whose gradient is NaN
    logits.register_hook(lambda g: g * float("nan"))
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                             ignore_index=-100, reduction="sum")


@pytest.mark.parametrize("poison", [_nan_loss, _nan_grad], ids=["nan-loss", "nan-grad"])
@pytest.mark.parametrize("clip", [None, 1.0], ids=["no-clip", "clip"])
@pytest.mark.parametrize("mode", ["fused", "explicit"])
def test_non_finite_step_stops_before_any_weight_or_state_moves(tmp_path, clip, mode, poison):
    e = _engine(tmp_path, optimizer_compression="int8")
    e.forward_backward(_ids(), labels=_ids(), step_lr=1e-3)
    before, states = _snapshot(e), e.adam.state_dict()
    with pytest.raises(NonFiniteError, match="non-finite loss/gradient at step 2"):
        if mode == "fused":  # without clipping the check runs in the update worker: it surfaces where
            e.forward_backward(_ids(1), labels=_ids(1), step_lr=1e-3, max_grad_norm=clip, loss_fn=poison)
            e.zero_grad()    # the updates are waited for
        else:
            e.forward_backward(_ids(1), labels=_ids(1), loss_fn=poison)
            e.optimizer_step(1e-3)
    assert _same(before, _snapshot(e))
    after = e.adam.state_dict()
    assert all(torch.equal(states[k], after[k]) for k in states)  # the AdamW step count too
    # the engine goes on: the next finite step is applied
    e.zero_grad()
    e.forward_backward(_ids(2), labels=_ids(2), step_lr=1e-3)
    assert not _same(before, _snapshot(e))
    e.close()


def test_huge_lr_stops_with_a_plain_error_and_no_nan_weight():
    e = _engine()
    with pytest.raises(NonFiniteError, match="non-finite loss/gradient at step"):
        for i in range(6):
            e.forward_backward(_ids(i), labels=_ids(i), step_lr=1e10)
    assert all(torch.isfinite(p).all() for _, p in e.named_parameters())
    e.close()


def test_skip_policy_drops_the_step_and_counts_it():
    e = _engine(on_nonfinite="skip")
    e.forward_backward(_ids(), labels=_ids(), step_lr=1e-3)
    before = _snapshot(e)

    out = e.forward_backward(_ids(1), labels=_ids(1), step_lr=1e-3, loss_fn=_nan_loss, max_grad_norm=1.0)
    assert out.skipped and math.isnan(out.loss)
    assert _same(before, _snapshot(e)) and e.telemetry()["skipped_steps"] == 1
    out = e.forward_backward(_ids(1), labels=_ids(1), step_lr=1e-3, loss_fn=_nan_grad)  # overlapped: no clip
    assert math.isfinite(out.loss)
    assert _same(before, _snapshot(e)) and e.telemetry()["skipped_steps"] == 2
    out = e.forward_backward(_ids(2), labels=_ids(2), step_lr=1e-3)
    assert not out.skipped and not _same(before, _snapshot(e))
    e.close()


def test_on_nonfinite_must_be_stop_or_skip():
    with pytest.raises(ValueError, match="on_nonfinite='ignore'"):
        EngineConfig(on_nonfinite="ignore")


def test_after_a_failed_disk_write_weights_are_refused_until_a_checkpoint_is_loaded(tmp_path, monkeypatch):
    from megatrain_nb.engine.tiers import disk_store
    from megatrain_nb.engine.tiers.disk_store import OffloadError

    (tmp_path / "off").mkdir()
    # no host cache: every update's write goes to the disk (a failing write-back with the cache
    # on: test_disk_cache.test_failed_write_back_is_never_read_as_stale_data)
    e = _engine(tmp_path / "off", offload_params=True, host_cache_gb=0)
    e.forward_backward(_ids(), labels=_ids(), step_lr=1e-3)
    e.save_checkpoint(str(tmp_path / "ck"))
    saved = _snapshot(e)

    def full(*a):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(disk_store.os, "write", full)
    monkeypatch.setattr(disk_store.os, "pwrite", full)
    with pytest.raises(OffloadError):
        e.forward_backward(_ids(1), labels=_ids(1), step_lr=1e-3)
        e.zero_grad()
    monkeypatch.undo()
    for call in (lambda: dict(e.named_parameters()), lambda: e.state_dict(),
                 lambda: e.save_pretrained(str(tmp_path / "out")), lambda: e.save_checkpoint(str(tmp_path / "c2"))):
        with pytest.raises(RuntimeError, match="refused.*half-applied.*load_checkpoint"):
            call()
    assert not os.path.exists(tmp_path / "out") or not os.listdir(tmp_path / "out")
    e.load_checkpoint(str(tmp_path / "ck"))
    assert _same(saved, _snapshot(e))
    e.close()


@pytest.mark.parametrize("lr", [-1e-3, float("nan"), float("inf"), "fast"])
def test_optimizer_step_refuses_a_bad_learning_rate(lr):
    e = _engine()
    e.forward_backward(_ids(), labels=_ids())
    with pytest.raises(ValueError, match="learning rate"):
        e.optimizer_step(lr)
    with pytest.raises(ValueError, match="learning rate"):
        e.forward_backward(_ids(), labels=_ids(), step_lr=lr)
    e.close()


@pytest.mark.parametrize("hold", ["host", "disk"])
def test_a_layer_major_window_is_checked_too(tmp_path, hold):
    """A window of micro-batches (layer-major) with clipping: a NaN gradient stops it before
    any update (its final gradients waiting in RAM or on the disk tier), or is skipped."""
    def window(seed):
        return [{"input_ids": _ids(seed + k), "labels": _ids(seed + k)} for k in range(2)]
    for policy in ("stop", "skip"):
        e = _engine(tmp_path / policy, clip_hold=hold, on_nonfinite=policy)
        e.forward_backward(window(0), step_lr=1e-3, max_grad_norm=1.0)
        before, states = _snapshot(e), e.adam.state_dict()
        if policy == "stop":
            with pytest.raises(NonFiniteError, match="at step 2"):
                e.forward_backward(window(10), step_lr=1e-3, max_grad_norm=1.0, loss_fn=_nan_grad)
        else:
            out = e.forward_backward(window(10), step_lr=1e-3, max_grad_norm=1.0, loss_fn=_nan_grad)
            assert out.skipped and e.telemetry()["skipped_steps"] == 1
        assert _same(before, _snapshot(e))
        assert all(torch.equal(states[k], v) for k, v in e.adam.state_dict().items())  # AdamW step counts
        out = e.forward_backward(window(20), step_lr=1e-3, max_grad_norm=1.0)  # training goes on
        assert not out.skipped and math.isfinite(out.grad_norm) and not _same(before, _snapshot(e))
        e.close()
