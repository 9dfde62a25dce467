"""on_nonfinite="rewind": a run whose loss turns non-finite goes back to its newest snapshot,
lowers the learning rate, steps over the data window that diverged and ends all its steps with
finite weights, reproducibly (trainer/recovery.py)."""
import json
import math

import pytest
import torch

from megatrain_nb.trainer import Trainer
from megatrain_nb.trainer.recovery import RecoveryError, robust_z

from .helpers import args, micro_model, token_rows

MARK = 7   # rows made of this token make the test loss NaN


def _dataset(n=16, marked=(3, 9)):
    from datasets import Dataset

    rows = token_rows(n, 16)
    for i, r in enumerate(rows):
        r["input_ids"] = [MARK if i in marked else (t if t != MARK else MARK + 1) for t in r["input_ids"]]
    return Dataset.from_list(rows)


def nan_on_marked_rows(logits, labels):
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                                             ignore_index=-100, reduction="sum")
    return loss * float("nan") if bool((labels == MARK).any()) else loss


def _trainer(out, steps=12, marked=(3, 9), **kw):
    torch.set_num_threads(1)
    a = args(out, max_steps=steps, per_device_train_batch_size=1, max_grad_norm=1.0, lr_scheduler_type="constant")
    return Trainer(model=micro_model(), train_dataset=_dataset(marked=marked), args=a, device="cpu",
                   loss_fn=nan_on_marked_rows, on_nonfinite="rewind", **kw)


def _events(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


TIERS = {"ram": {}, "disk": {"offload_params": True, "optimizer_compression": "int8", "host_cache_gb": 0}}


@pytest.mark.parametrize("tier", sorted(TIERS))
def test_a_run_that_diverges_twice_recovers_and_ends_reproducibly(tmp_path, tier):
    finals = []
    for k in ("a", "b"):
        opts = dict(TIERS[tier], offload_dir=str(tmp_path / f"offload-{k}")) if TIERS[tier] else {}
        tr = _trainer(tmp_path / k, **opts)
        tr.train()
        assert tr.state.global_step == 12
        w = {n: p.clone() for n, p in tr.engine.named_parameters()}
        assert all(bool(torch.isfinite(p).all()) for p in w.values())
        rec = [e for e in _events(tmp_path / k) if e.get("event") == "recovery"]
        assert len(rec) == 2, rec
        for e in rec:
            assert "non-finite" in e["reason"] and e["to_step"] < e["step"]
            assert e["skipped_window"]["step"] == e["step"] and len(e["skipped_window"]["batches"]) == 1
        assert [e["attempt"] for e in rec] == [1, 2] and rec[1]["lr_factor"] == pytest.approx(0.25)
        assert rec[1]["lr"] == pytest.approx(3e-3 * 0.25)
        # each recovery is a branch: a new run id whose parent is the snapshot's run
        steps = [e for e in _events(tmp_path / k) if "loss" in e and e.get("event") is None]
        assert steps[-1]["parent_run_id"] is not None and steps[-1]["step"] == 12
        assert all(math.isfinite(e["loss"]) for e in steps)
        finals.append(w)
        tr.close()
    assert all(torch.equal(finals[0][n], finals[1][n]) for n in finals[0])


def test_after_max_recoveries_the_run_stops_listing_every_attempt(tmp_path):
    tr = _trainer(tmp_path, marked=(2, 5, 8), max_recoveries=2)
    with pytest.raises(RecoveryError, match=r"after 2 recoveries.*1\. non-finite.*2\. non-finite") as err:
        tr.train()
    assert err.value.step is not None and isinstance(err.value, FloatingPointError)
    assert all(bool(torch.isfinite(p).all()) for _, p in tr.engine.named_parameters())
    tr.close()


def test_robust_z_and_the_settings_are_checked():
    hist = [2.0, 2.1, 1.9, 2.05, 1.95, 2.0, 2.02, 1.98]
    assert robust_z(2.0, hist) == pytest.approx(0.0)
    assert robust_z(4.0, hist) > 20
    assert robust_z(4.0, hist[:5]) is None
    from megatrain_nb.engine import EngineConfig

    for bad in (dict(recover_lr_factor=0), dict(recover_lr_factor=1.5), dict(max_recoveries=-1),
                dict(loss_spike=-2, on_nonfinite="rewind"), dict(loss_spike_window=2), dict(loss_spike=3)):
        with pytest.raises(ValueError):
            EngineConfig(**bad)
    EngineConfig(on_nonfinite="rewind", loss_spike=6.0)


def spike_on_marked_rows(logits, labels):
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                                             ignore_index=-100, reduction="sum")
    return loss * 40.0 if bool((labels == MARK).any()) else loss


def test_a_loss_spike_is_recovered_from_like_a_nan(tmp_path):
    torch.set_num_threads(1)
    a = args(tmp_path, max_steps=14, per_device_train_batch_size=1, max_grad_norm=1.0, lr_scheduler_type="constant",
             train_sampling_strategy="sequential")
    tr = Trainer(model=micro_model(), train_dataset=_dataset(marked=(11,)), args=a, device="cpu",
                 loss_fn=spike_on_marked_rows, on_nonfinite="rewind", loss_spike=6.0, loss_spike_window=10)
    tr.train()
    rec = [e for e in _events(tmp_path) if e.get("event") == "recovery"]
    assert len(rec) == 1 and rec[0]["step"] == 12 and "loss spike at step 12" in rec[0]["reason"]
    assert rec[0]["skipped_window"]["batches"] == [11] and rec[0]["to_step"] == 11
    assert tr.state.global_step == 14
    losses = [e["loss"] for e in _events(tmp_path) if e.get("event") is None and "loss" in e
              and e.get("run_id") == tr.run_id]
    assert max(losses) < 10
    tr.close()
