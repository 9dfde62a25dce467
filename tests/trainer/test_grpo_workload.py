"""mt.GRPOTrainer plans its engine for the rows it trains on (issue 45 item 8): one micro-batch of
``per_device_train_batch_size`` rollouts, each the longest prompt (as the tokenizer makes it) plus
``max_completion_length`` tokens, not the Trainer's default 1024-token row."""
import pytest

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

import megatrain_nb as mt  # noqa: E402
from megatrain_nb.trainer.grpo_data import micro_batch  # noqa: E402

from .test_grpo_parity import WORDS, config, reward_yes, tiny_model, tokenizer  # noqa: E402


def _prompts(conversational: bool):
    rows = [" ".join(WORDS[: 2 + i % 5]) for i in range(8)]   # 2..6 words: the longest is not the first
    if conversational:
        return datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": r}]} for r in rows])
    return datasets.Dataset.from_list([{"prompt": r} for r in rows])


def _longest(tok, ds, conversational: bool) -> int:
    if conversational:
        return max(len(tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=True)
                       ["input_ids"]) for p in ds["prompt"])
    return max(len(tok(p)["input_ids"]) for p in ds["prompt"])


@pytest.mark.parametrize("conversational", [False, True])
def test_the_engine_is_planned_for_prompt_plus_completion_rows(tmp_path, conversational):
    tok = tokenizer()
    ds = _prompts(conversational)
    args = config(tmp_path, per_device_train_batch_size=4, num_generations=4, max_completion_length=37,
                  gradient_accumulation_steps=2)
    t = mt.GRPOTrainer(model=tiny_model(tok), reward_funcs=reward_yes, args=args, train_dataset=ds,
                       processing_class=tok, device="cpu")
    try:
        want = _longest(tok, ds, conversational) + 37
        assert want != 1024 and want > 37 + 4
        work = t.engine.workload
        assert (work.batch, work.seq, work.accumulation) == (4, want, 2)
        # a generation batch's rows are no longer than the plan was told (the prompt probe is honest)
        r = t.make_rollouts([ds[i] for i in range(args.generation_batch_size)])
        assert micro_batch(r, 2)["input_ids"].shape[1] <= want
    finally:
        t.close()


def test_a_model_folder_without_a_tokenizer_argument_plans_with_its_own(tmp_path):
    tok = tokenizer()
    folder = tmp_path / "policy"
    tiny_model(tok).save_pretrained(folder)
    tok.save_pretrained(folder)
    ds = _prompts(False)
    t = mt.GRPOTrainer(model=str(folder), reward_funcs=reward_yes, args=config(tmp_path / "o", max_completion_length=9),
                       train_dataset=ds, device="cpu")
    try:
        assert t.engine.workload.seq == _longest(tok, ds, False) + 9
        assert t.engine.workload.batch == 4
    finally:
        t.close()
