"""mt.SFTTrainer and mt.DPOTrainer plan their engines for the rows a micro-batch holds (issue 45
item 8): text rows of at most ``max_length`` tokens (not the Trainer's default 1024-token row) and,
for DPO, each pair's chosen and rejected rows (two rows a pair)."""
import pytest

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

import megatrain_nb as mt  # noqa: E402

from .dpo_helpers import dpo_config, pairs  # noqa: E402
from .sft_helpers import CONVS, sft_config, tiny_llama, tokenizer  # noqa: E402


def _first_batch(t):
    return t.data_collator([t.train_dataset[i] for i in range(t.args.per_device_train_batch_size)])


def test_sft_is_planned_for_rows_of_max_length(tmp_path):
    tok = tokenizer()
    t = mt.SFTTrainer(model=tiny_llama(len(tok)), args=sft_config(tmp_path),
                      train_dataset=datasets.Dataset.from_list(CONVS[:8]), processing_class=tok, device="cpu")
    try:
        work, ids = t.engine.workload, _first_batch(t)["input_ids"]
        assert (work.batch, work.seq) == (2, 64)   # sft_config: max_length=64
        assert ids.shape[0] == work.batch and ids.shape[1] <= work.seq
    finally:
        t.close()


def test_dpo_is_planned_for_a_pair_s_two_rows_of_max_length(tmp_path):
    tok = tokenizer()
    t = mt.DPOTrainer(model=tiny_llama(len(tok)), args=dpo_config(tmp_path),
                      train_dataset=datasets.Dataset.from_list(pairs(8)), processing_class=tok, device="cpu")
    try:
        work, ids = t.engine.workload, _first_batch(t)["input_ids"]
        assert (work.batch, work.seq) == (4, 48)   # dpo_config: max_length=48; 2 pairs: their chosen and rejected rows
        assert ids.shape[0] == work.batch and ids.shape[1] <= work.seq
    finally:
        t.close()
