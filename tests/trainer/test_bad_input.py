"""Bad input gets an error naming the value and what to do -- not a raw torch error, and not
silence."""
import errno

import pytest
import torch

from megatrain_nb.engine import EngineConfig, StreamingEngine
from megatrain_nb.trainer import Trainer, checkpoint as ckpt
from megatrain_nb.trainer.data import DataError

from .helpers import VOCAB, args, micro_model, token_dataset


@pytest.fixture(scope="module")
def engine():
    e = StreamingEngine(micro_model(), EngineConfig(device="cpu"))
    yield e
    e.close()


@pytest.mark.parametrize("ids", [torch.zeros(0, 8, dtype=torch.long), torch.zeros(2, 0, dtype=torch.long)],
                         ids=["empty-batch", "seq-len-0"])
def test_empty_batches_are_named(engine, ids):
    with pytest.raises(ValueError, match=r"input_ids is empty \(shape .*at least one"):
        engine.forward_backward(ids)


def test_a_label_outside_the_vocabulary_is_named(engine):
    ids = torch.randint(0, VOCAB, (2, 8))
    labels = ids.clone()
    labels[1, 3] = VOCAB + 7
    with pytest.raises(ValueError, match=f"label {VOCAB + 7} is outside the model's vocabulary"):
        engine.forward_backward(ids, labels=labels)
    labels[1, 3] = -100  # the ignore index is fine
    engine.forward_backward(ids, labels=labels)
    engine.zero_grad()


def test_a_negative_learning_rate_is_refused(engine):
    engine.forward_backward(torch.randint(0, VOCAB, (1, 8)))
    with pytest.raises(ValueError, match="step_lr=-0.001: must be a finite number >= 0"):
        engine.optimizer_step(-1e-3)
    engine.zero_grad()


def test_float_input_ids_in_a_dataset_are_refused_not_truncated(tmp_path):
    from datasets import Dataset
    ds = Dataset.from_list([{"input_ids": [float(i) + 0.7 for i in range(16)]} for _ in range(4)])
    tr = Trainer(model=micro_model(), train_dataset=ds, args=args(tmp_path, max_steps=1), device="cpu")
    with pytest.raises(DataError, match=r"input_ids holds torch.float\d+ values .*must be integers"):
        tr.train()
    tr.close()


@pytest.mark.parametrize("how", ["safetensors", "python"])
def test_a_checkpoint_on_a_full_disk_names_path_and_bytes(tmp_path, how):
    from safetensors import SafetensorError

    out = tmp_path / "run"
    ckpt.write_checkpoint(out / "checkpoint-1", lambda d: ((d / ckpt.STATE_FILE).write_text("{}"),
                                                           (d / "trainer_state.json").write_text("{}")))

    def write(d):
        (d / "model.safetensors").write_bytes(b"x" * 4096)
        if how == "safetensors":
            raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                                  'message: "No space left on device" })')
        raise OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(OSError, match=r"disk is full: writing checkpoint .*checkpoint-2.* after 4096 bytes "
                                      r"\(\d+ bytes free") as e:
        ckpt.write_checkpoint(out / "checkpoint-2", write)
    assert e.value.errno == errno.ENOSPC
    assert [c.name for c in ckpt.list_checkpoints(out)] == ["checkpoint-1"]
