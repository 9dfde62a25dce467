"""Shared pieces of the SFT tests: a tiny word-level tokenizer with a chat template that has
generation marks (built offline with ``tokenizers``), a tiny llama, and TRL/megatrain runs whose
model inputs are recorded."""
import copy

import torch
from transformers import AutoModelForCausalLM

from megatrain_nb.assets import build_word_tokenizer, generate_conversations
from megatrain_nb.model_configs import family_config

CONVS = generate_conversations(48, seed=7)


def words():
    from tokenizers.pre_tokenizers import Whitespace

    pre = Whitespace()
    return sorted({w for c in CONVS for m in c["messages"] for w, _ in pre.pre_tokenize_str(m["content"])})


def tokenizer(**kw):
    return build_word_tokenizer(words() + ["tool", "weather"], **kw)


def tiny_llama(vocab: int, seed: int = 0):
    cfg = family_config("llama", layers=2, vocab=vocab, max_position_embeddings=256, bos_token_id=None, eos_token_id=2)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).eval()


def sft_config(out, **kw):
    from trl import SFTConfig

    base = dict(output_dir=str(out), bf16=False, use_cpu=True, per_device_train_batch_size=2, learning_rate=1e-3,
                report_to="none", save_strategy="no", logging_steps=1, seed=0, disable_tqdm=True, max_length=64)
    base.update(kw)
    return SFTConfig(**base)


KEYS = ("input_ids", "labels", "attention_mask", "position_ids")


def _row(batch):
    return {k: batch[k].detach().clone() for k in KEYS if batch.get(k) is not None}


def run_trl(model, ds, args, tok):
    """Train with trl.SFTTrainer; returns (micro-batches fed to the model, final weights)."""
    import trl

    seen = []
    trainer = trl.SFTTrainer(model=copy.deepcopy(model), args=args, train_dataset=ds,
                             processing_class=copy.deepcopy(tok))

    def hook(mod, a, kw):
        if mod.training:
            seen.append(_row(kw))

    h = trainer.model.register_forward_pre_hook(hook, with_kwargs=True)
    trainer.train()
    h.remove()
    return seen, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}, trainer


def run_mt(model, ds, args, tok, **engine):
    """Train with mt.SFTTrainer; returns (micro-batches handed to the engine, final weights)."""
    import megatrain_nb as mt

    trainer = mt.SFTTrainer(model=copy.deepcopy(model), args=args, train_dataset=ds,
                            processing_class=copy.deepcopy(tok), device="cpu", **engine)
    seen = []
    eng = trainer.engine
    original = eng.forward_backward

    def record(input_ids, attention_mask=None, labels=None, position_ids=None, **kw):
        if isinstance(input_ids, list):
            seen.extend(_row(b) for b in input_ids)
        else:
            seen.append(_row({"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels,
                              "position_ids": position_ids}))
        return original(input_ids, attention_mask=attention_mask, labels=labels, position_ids=position_ids, **kw)

    eng.forward_backward = record
    trainer.train()
    weights = dict(trainer.engine.named_parameters())
    return seen, {n: w.clone() for n, w in weights.items()}, trainer


def assert_same_batches(a, b):
    assert len(a) == len(b), (len(a), len(b))
    for i, (x, y) in enumerate(zip(a, b)):
        assert set(x) == set(y), (i, set(x), set(y))
        for k in x:
            assert torch.equal(x[k].cpu(), y[k].cpu()), (i, k, x[k], y[k])


def max_rel_diff(a: dict, b: dict, start: dict) -> float:
    num = sum(float((a[k] - b[k]).double().norm() ** 2) for k in b) ** 0.5
    den = sum(float((b[k] - start[k]).double().norm() ** 2) for k in b) ** 0.5
    return num / den
