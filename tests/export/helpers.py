"""Tiny models of several architectures and a tiny byte-level BPE tokenizer, built offline."""
from __future__ import annotations

import functools

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast, TrainingArguments

VOCAB = 320
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
TEXT = ("the quick brown fox jumps over the lazy dog. a model trained in full precision streams its layers "
        "from host memory and disk to the device, one unit at a time. what is the capital of france? paris. ") * 4


@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator([TEXT], trainer=trainer)
    return core.to_str()


def tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (< VOCAB ids) with special tokens and a chat template."""
    from tokenizers import Tokenizer

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_tokenizer_json()),
                                  bos_token="<|endoftext|>", eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def config(kind: str, layers: int = 2):
    """llama | qwen2 | gemma2 (tied) | qwen3_moe: tiny configs the GGUF loader reads back."""
    common = dict(vocab_size=VOCAB, num_hidden_layers=layers, hidden_size=64, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, bos_token_id=0,
                  eos_token_id=0, pad_token_id=0)
    if kind == "llama":
        return AutoConfig.for_model("llama", tie_word_embeddings=False, **common)
    if kind == "qwen2":
        return AutoConfig.for_model("qwen2", tie_word_embeddings=False, **common)
    if kind == "gemma2":   # tied; softcapping and scaling at the class defaults (the loader does not read them)
        return AutoConfig.for_model("gemma2", tie_word_embeddings=True, head_dim=16, sliding_window=64,
                                    **common)
    if kind == "qwen3_moe":   # moe_intermediate_size at its default (the loader does not read it)
        return AutoConfig.for_model("qwen3_moe", tie_word_embeddings=False, head_dim=16, num_experts=4,
                                    num_experts_per_tok=2, norm_topk_prob=True, **common)
    raise KeyError(kind)


def model(kind: str, seed: int = 0, layers: int = 2):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config(kind, layers), dtype=torch.float32)


def rows(n: int = 8, seq: int = 24, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(1, 300, (seq,), generator=g).tolist()} for _ in range(n)]


def args(output_dir, **kw):
    base = dict(per_device_train_batch_size=2, learning_rate=3e-3, report_to="none", disable_tqdm=True,
                logging_steps=1, save_strategy="no", max_steps=1)
    base.update(kw)
    return TrainingArguments(output_dir=str(output_dir), **base)


def trained(kind: str, tmp_path, steps: int = 1, **engine):
    """A Trainer over a tiny ``kind`` model with the tiny tokenizer, trained ``steps`` steps."""
    from datasets import Dataset

    import megatrain_nb as mt

    t = mt.Trainer(model=model(kind), train_dataset=Dataset.from_list(rows()), tokenizer=tokenizer(),
                   args=args(tmp_path / "run", max_steps=steps), **engine)
    t.train()
    return t


def batch(seq: int = 16, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 300, (2, seq), generator=g)


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (the logits' max-abs scale)."""
    return float((a - b).abs().max() / b.abs().max())
