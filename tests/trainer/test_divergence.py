"""Divergence end to end: a NaN run stops by step number before touching the weights, never
writes a non-finite checkpoint, and can skip such steps instead (counted)."""
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatrain_nb.engine.updates.finite import NonFiniteError
from megatrain_nb.trainer import Trainer, checkpoint as ckpt, list_checkpoints

from .helpers import args, micro_model, token_dataset


def _trainer(out, lr=3e-3, steps=6, **kw):
    torch.set_num_threads(1)
    a = args(out, max_steps=steps, save_strategy="steps", save_steps=1, learning_rate=lr, max_grad_norm=0.0,
             lr_scheduler_type="constant")
    return Trainer(model=micro_model(), train_dataset=token_dataset(16), args=a, device="cpu", **kw)


def _finite(folder):
    return all(bool(torch.isfinite(t).all()) for t in load_file(folder / "model.safetensors").values())


def test_huge_lr_stops_by_step_number_and_every_checkpoint_is_finite(tmp_path):
    tr = _trainer(tmp_path)
    # 1e10 is refused as an argument (a typo, issue 23's learning-rate rule): the run is made to
    # diverge on purpose here, past that check
    tr.args.learning_rate = 1e10
    with pytest.raises(NonFiniteError, match=r"non-finite loss/gradient at step \d+") as e:
        tr.train()
    saved = list_checkpoints(tmp_path)
    # the bad step was not saved (its update was never applied), nothing non-finite was
    assert [c.name for c in saved] == [f"checkpoint-{k}" for k in range(1, e.value.step)]
    assert all(_finite(c) for c in saved)
    assert all(torch.isfinite(p).all() for _, p in tr.engine.named_parameters())
    tr.close()


def test_a_non_finite_checkpoint_is_never_written(tmp_path):
    tr = _trainer(tmp_path / "a", steps=2)
    tr.train()
    tr.close()
    good = tmp_path / "a" / "checkpoint-2"
    weights = load_file(good / "model.safetensors")
    name = next(iter(weights))
    weights[name][0] = float("nan")  # a poisoned checkpoint (manifest refreshed to match)
    save_file(weights, good / "model.safetensors", metadata={"format": "pt"})
    ckpt.write_manifest(good)
    tr = _trainer(tmp_path / "b", steps=4, on_nonfinite="skip")
    with pytest.raises(FloatingPointError, match=r"refusing to save checkpoint .*checkpoint-3.*NaN"):
        tr.train(resume_from_checkpoint=str(good))  # every step is skipped (NaN loss); the save refuses
    assert list_checkpoints(tmp_path / "b") == []
    tr.close()


def test_skip_policy_skips_and_counts(tmp_path):
    calls = {"n": 0}

    def sometimes_nan(logits, labels):
        calls["n"] += 1
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                 ignore_index=-100, reduction="sum")
        return loss * float("nan") if calls["n"] in (3, 4) else loss
    tr = _trainer(tmp_path, steps=5, on_nonfinite="skip", loss_fn=sometimes_nan)
    records = list(tr.iter_steps())
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert records[-1]["skipped_steps"] >= 1
    assert all(math.isfinite(float(p.sum())) for _, p in tr.engine.named_parameters())
    tr.close()
