"""mt.Session(..., args=DPOConfig(...), nproc_per_node=2) (issue 30): the worker ranks build an
mt.DPOTrainer from the DPOConfig and end where one process with twice the accumulation ends.
Every wait is bounded."""
import sys

import pytest

from .launch import REPO, alone_once
from .test_dpo_torchrun import DPO_ONE_PROCESS, HERE
from .test_launcher import _env  # noqa: F401 - the same environment (autouse)
from .test_trainer_torchrun import _agree, _weights

pytest.importorskip("trl")

BOUND = 240


@pytest.mark.slow
@pytest.mark.xdist_group(DPO_ONE_PROCESS)
def test_session_with_a_dpo_config_trains_a_dpo_trainer_on_two_ranks(tmp_path):
    import megatrain_nb as mt
    from datasets import Dataset

    sys.path.insert(0, str(REPO / "tests"))
    from trainer.dpo_helpers import dpo_config, pairs, tiny_llama, tokenizer

    tok = tokenizer()
    args = dpo_config(tmp_path / "two", gradient_accumulation_steps=2, max_steps=3, per_device_train_batch_size=1,
                      max_grad_norm=0.5, per_device_eval_batch_size=2, eval_strategy="steps", eval_steps=3)
    s = mt.Session(tiny_llama(len(tok)), train_dataset=Dataset.from_list(pairs(20)), args=args, tokenizer=tok,
                   eval_dataset=Dataset.from_list(pairs(5, "text")), nproc_per_node=2, device="cpu")
    try:
        s.train()
        assert s.wait(timeout=BOUND) == "finished", (s.state, getattr(s, "worker_log", None))
    finally:
        s.close()
    one = alone_once(HERE / "w_dpo.py", "4")   # (test_dpo_torchrun.py's too)
    # the workers saved the model into output_dir; a plain Trainer could not have read the pairs
    _agree(_weights(tmp_path / "two"), _weights(one / "final"))
    assert list((tmp_path / "two" / "reference_logps").glob("train-*.safetensors"))
