"""mt.Session(..., args=SFTConfig(...), nproc_per_node=2) (issue 20): the worker ranks build an
mt.SFTTrainer from the SFTConfig (not a plain Trainer) and end where one process with twice the
accumulation ends. Every wait is bounded."""
import sys

import pytest

from .launch import REPO, alone_once
from .test_launcher import _env  # noqa: F401 - the same environment (autouse)
from .test_sft_torchrun import HERE, SFT_ONE_PROCESS
from .test_trainer_torchrun import _agree, _weights

pytest.importorskip("trl")

BOUND = 240


@pytest.mark.slow
@pytest.mark.xdist_group(SFT_ONE_PROCESS)
def test_session_with_an_sft_config_trains_an_sft_trainer_on_two_ranks(tmp_path):
    import megatrain_nb as mt
    from datasets import Dataset

    sys.path.insert(0, str(REPO / "tests"))
    from distributed.w_sft import CASES
    from trainer.sft_helpers import CONVS, sft_config, tiny_llama, tokenizer

    tok = tokenizer()
    args = sft_config(tmp_path / "two", **CASES["assistant"], gradient_accumulation_steps=2, max_steps=3,
                      weight_decay=0.1, max_grad_norm=0.5, per_device_eval_batch_size=2, eval_strategy="steps",
                      eval_steps=3)
    s = mt.Session(tiny_llama(len(tok)), train_dataset=Dataset.from_list(CONVS[:40]), args=args, tokenizer=tok,
                   eval_dataset=Dataset.from_list(CONVS[40:]), nproc_per_node=2, device="cpu")
    try:
        s.train()
        assert s.wait(timeout=BOUND) == "finished", (s.state, getattr(s, "worker_log", None))
    finally:
        s.close()
    one = alone_once(HERE / "w_sft.py", "4", "assistant")   # (test_sft_torchrun.py's too)
    # the workers saved the model into output_dir; a plain Trainer on chat rows would not have trained
    _agree(_weights(tmp_path / "two"), _weights(one / "final"))
