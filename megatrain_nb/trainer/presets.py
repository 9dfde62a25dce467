"""Llama-style model presets: tiny ones that train on a laptop CPU, and the big ones the
estimator talks about (configs only; nothing is downloaded or allocated).

Example::

    from megatrain_nb.trainer.presets import preset_config
    cfg = preset_config("tiny", vocab_size=4096)      # a transformers.LlamaConfig
    cfg = preset_config("llama-100b")                 # ~100B parameters, for mt.estimate
"""
from __future__ import annotations

PRESETS: dict[str, dict] = {
    # ~0.2M params: unit tests.
    "micro": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                  intermediate_size=192, vocab_size=512, max_position_embeddings=256),
    # ~1.9M params with a 4k vocabulary: the demo's default, a couple of minutes on 2 CPU cores.
    "tiny": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                 intermediate_size=384, vocab_size=4096, max_position_embeddings=1024),
    # ~7M params.
    "small": dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=8,
                  intermediate_size=768, vocab_size=4096, max_position_embeddings=2048),
    # Llama 3.2 1B shape (1.24B, tied embeddings).
    "llama-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                     intermediate_size=8192, vocab_size=128256, max_position_embeddings=131072,
                     tie_word_embeddings=True, rope_theta=500000.0),
    # Llama 2 7B shape (6.7B).
    "llama-7b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                     intermediate_size=11008, vocab_size=32000, max_position_embeddings=4096),
    # Llama 2 70B shape (69B).
    "llama-70b": dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                      intermediate_size=28672, vocab_size=32000, max_position_embeddings=4096),
    # A 100B-parameter Llama-style model (100.2B): the seed article's example size.
    "llama-100b": dict(hidden_size=12288, num_hidden_layers=64, num_attention_heads=96, num_key_value_heads=8,
                       intermediate_size=33280, vocab_size=32000, max_position_embeddings=4096),
}


def preset_names() -> list[str]:
    return list(PRESETS)


def preset_config(name: str, vocab_size: int | None = None, **overrides):
    """A ``transformers.LlamaConfig`` for preset ``name`` (see :data:`PRESETS`).

    ``vocab_size`` (e.g. the built-in tokenizer's) and any other config field may be overridden.
    """
    from transformers import LlamaConfig

    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    fields = dict(PRESETS[name])
    if vocab_size is not None:
        fields["vocab_size"] = int(vocab_size)
    fields.update(overrides)
    fields.setdefault("tie_word_embeddings", False)
    return LlamaConfig(**fields)
