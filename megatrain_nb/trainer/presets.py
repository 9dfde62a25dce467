"""Llama-style model presets: tiny ones that train on a laptop CPU, and the big ones the
estimator talks about (configs only; nothing is downloaded or allocated).

Example::

    from megatrain_nb.trainer.presets import preset_config
    cfg = preset_config("tiny", vocab_size=4096)      # a transformers.LlamaConfig
    cfg = preset_config("llama-100b")                 # ~100B parameters, for mt.estimate
"""
from __future__ import annotations

def _llama(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int, positions: int,
           **extra) -> dict:
    return dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv_heads, intermediate_size=intermediate, vocab_size=vocab,
                max_position_embeddings=positions, **extra)


# Each: _llama(hidden, layers, heads, kv_heads, intermediate, vocab, positions, **other config fields)
PRESETS: dict[str, dict] = {
    # ~0.2M params: unit tests.
    "micro": _llama(64, 2, 4, 4, 192, 512, 256),
    # ~1.9M params with a 4k vocabulary: the demo's default, a couple of minutes on 2 CPU cores.
    "tiny": _llama(128, 4, 4, 4, 384, 4096, 1024),
    # ~7M params.
    "small": _llama(256, 6, 8, 8, 768, 4096, 2048),
    # Llama 3.2 1B shape (1.24B, tied embeddings).
    "llama-1b": _llama(2048, 16, 32, 8, 8192, 128256, 131072, tie_word_embeddings=True, rope_theta=500000.0),
    # Llama 2 7B shape (6.7B).
    "llama-7b": _llama(4096, 32, 32, 32, 11008, 32000, 4096),
    # Llama 2 70B shape (69B).
    "llama-70b": _llama(8192, 80, 64, 8, 28672, 32000, 4096),
    # A 100B-parameter Llama-style model (100.2B): the seed article's example size.
    "llama-100b": _llama(12288, 64, 96, 8, 33280, 32000, 4096),
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
