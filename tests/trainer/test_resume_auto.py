"""resume_from_checkpoint="auto": the latest complete checkpoint when there is one, else a fresh
start (one script for the first launch and every restart); a torchrun restart that asked for no
resume is warned that it starts over."""
import pytest

from megatrain_nb.trainer import checkpoint as ckpt
from megatrain_nb.trainer import Trainer

from .helpers import args, micro_model, token_dataset


def test_auto_is_none_without_checkpoints_and_the_latest_with(tmp_path):
    assert ckpt.resolve_resume("auto", tmp_path) is None
    with pytest.raises(ckpt.CheckpointError, match="no complete checkpoint"):
        ckpt.resolve_resume(True, tmp_path)
    t = Trainer(model=micro_model(), train_dataset=token_dataset(8),
                args=args(tmp_path, max_steps=3, save_strategy="steps", save_steps=1,
                          resume_from_checkpoint="auto"), device="cpu")
    for r in t.iter_steps():                    # fresh: nothing to resume; stopped after step 2
        if r["step"] == 2:
            t.request_stop()
    assert ckpt.resolve_resume("auto", tmp_path) == tmp_path / "checkpoint-2"
    records = list(t.iter_steps())              # args' "auto": continues from checkpoint-2
    assert [r["step"] for r in records] == [3]
    t.close()


def test_restart_without_resume_warns(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    t = Trainer(model=micro_model(), train_dataset=token_dataset(4), args=args(tmp_path, max_steps=1), device="cpu")
    with pytest.warns(UserWarning, match="torchrun restart 1: no resume was asked.*resume_from_checkpoint='auto'"):
        t.train()
    t.close()
