"""A bare Trainer whose train() raised leaves no threads behind: released by its ``with`` block,
by ``close()``, or by its finalizer once it is dropped."""
import gc
import threading

import pytest
import torch

from megatrain_nb.trainer import Trainer

from .helpers import args, micro_model, token_dataset


def _failing_trainer(tmp_path, i):
    calls = {"n": 0}

    def loss_fn(logits, labels):   # fails in the second optimizer step, mid-step
        calls["n"] += 1
        if calls["n"] > 2:
            raise RuntimeError("boom in the loss")
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                 ignore_index=-100, reduction="sum")

    out = tmp_path / f"run{i}"
    return Trainer(model=micro_model(), train_dataset=token_dataset(12), args=args(out, max_steps=4),
                   device="cpu", offload_dir=str(tmp_path), offload_params=True, loss_fn=loss_fn)


def _threads():
    return sorted(t.name for t in threading.enumerate() if t.is_alive())


def _offload_folders(tmp_path):
    return sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("run"))


def test_five_failing_trainers_leave_the_thread_count_flat(tmp_path):
    torch.set_num_threads(1)
    gc.collect()
    before = _threads()
    for i in range(5):
        tr = _failing_trainer(tmp_path, i)
        assert any(n.startswith("mtnb-disk") for n in _threads())   # the disk tier's workers run
        with pytest.raises(RuntimeError, match="boom in the loss"):
            tr.train()
        del tr
        gc.collect()
        assert _threads() == before, f"after failed trainer {i}"   # joined, not left to exit later
        assert _offload_folders(tmp_path) == []


def test_a_with_block_releases_the_threads_when_train_raises(tmp_path):
    torch.set_num_threads(1)
    gc.collect()
    before = _threads()
    with pytest.raises(RuntimeError, match="boom in the loss"):
        with _failing_trainer(tmp_path, 0) as tr:
            tr.train()
    assert _threads() == before and tr.engine.closed


def test_an_engine_handed_in_is_not_closed_with_the_trainer(tmp_path):
    from megatrain_nb.engine import EngineConfig, StreamingEngine

    torch.set_num_threads(1)
    engine = StreamingEngine(micro_model(), EngineConfig.from_options(device="cpu"))
    tr = Trainer(model=engine, train_dataset=token_dataset(4), args=args(tmp_path, max_steps=1))
    del tr
    gc.collect()
    assert not engine.closed   # its owner closes it
    engine.close()
