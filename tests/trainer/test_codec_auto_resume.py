"""A Trainer with optimizer_compression="auto" resuming a checkpoint builds its engine with the
checkpoint's codec (never a new pick) and lands on the uninterrupted run's weights (docs/TIERS.md)."""
import pytest
import torch

from megatrain_nb.trainer import Trainer

from .helpers import args, micro_model, token_dataset


@pytest.mark.slow   # (three short runs)
def test_auto_resume_keeps_the_checkpoints_codec(tmp_path):
    def run(out, compression, max_steps, **kw):
        return Trainer(model=micro_model(), train_dataset=token_dataset(12), device="cpu",
                       optimizer_compression=compression,
                       args=args(out, max_steps=max_steps, save_strategy="steps", save_steps=2, **kw))

    full = run(tmp_path / "full", "int8", 4)
    full.train()
    want = full.engine.state_dict()
    first = run(tmp_path / "split", "int8", 4)
    for record in first.iter_steps():
        if record["step"] == 2:
            break   # "stopped after checkpoint 2"
    first.close()
    ckpt = tmp_path / "split" / "checkpoint-2"
    # without the checkpoint, "auto" picks exact fp32 states here (RAM is roomy for this model)
    fresh = run(tmp_path / "fresh", "auto", 4)
    assert fresh.engine.config.optimizer_compression == "none" and fresh.engine.codec.by == "rules"
    fresh.close()
    resumed = run(tmp_path / "split", "auto", 4, resume_from_checkpoint=str(ckpt))
    assert resumed.engine.config.optimizer_compression == "int8"
    assert (resumed.engine.codec.asked, resumed.engine.codec.by) == ("auto", "checkpoint")
    resumed.train()
    got = resumed.engine.state_dict()
    assert resumed.state.global_step == 4 and got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
