"""The one registry of model configs built from tables (nothing is downloaded or allocated):
the Llama-style presets (tiny ones that train on a laptop CPU, and the big ones the estimator
talks about), the tiny configs of the families the engine is tested against, and — through
:mod:`megatrain_nb.tiny_configs` — a tiny config of any causal-LM architecture transformers
registers. Used by the Session, the CLI, the estimator, the architecture sweep and the tests.

Example::

    from megatrain_nb.model_configs import preset_config, family_config, tiny
    cfg = preset_config("tiny", vocab_size=4096)      # a transformers.LlamaConfig
    cfg = preset_config("llama-100b")                 # ~100B parameters, for mt.estimate
    cfg = family_config("mixtral", layers=2)          # the tests' tiny Mixtral
    cfg = tiny("qwen3")                               # a preset, a family or any model type
"""
from __future__ import annotations

from megatrain_nb.tiny_configs import tiny_config


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


def is_preset(name) -> bool:
    return isinstance(name, str) and name in PRESETS


def check_preset(name) -> str:
    """``name`` if it is a preset, else ValueError naming it and the presets."""
    if not is_preset(name):
        raise ValueError(f"preset: {name!r} is not a preset; use one of {', '.join(PRESETS)}")
    return name


def preset_config(name: str, vocab_size: int | None = None, **overrides):
    """A ``transformers.LlamaConfig`` for preset ``name`` (see :data:`PRESETS`).

    ``vocab_size`` (e.g. the built-in tokenizer's) and any other config field may be overridden.
    """
    from transformers import LlamaConfig   # transformers: heavy, read only when a config is built

    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    fields = dict(PRESETS[name])
    if vocab_size is not None:
        fields["vocab_size"] = int(vocab_size)
    fields.update(overrides)
    fields.setdefault("tie_word_embeddings", False)
    return LlamaConfig(**fields)


#: published models' config.json numbers, for the figures on paper (benchmarks, estimate tests):
#: (model type, fields) -- or, for image-text-to-text models, (model type, text fields, vision
#: fields, top-level fields). Built here from their published values: nothing downloads.
PUBLISHED = {
    # huggingface.co/Qwen/Qwen2.5-7B
    "qwen2.5-7b": ("qwen2", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                 num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                                 max_position_embeddings=131072, rope_theta=1000000.0, rms_norm_eps=1e-6,
                                 tie_word_embeddings=False, torch_dtype="bfloat16")),
    # huggingface.co/Qwen/Qwen2.5-32B
    "qwen2.5-32b": ("qwen2", dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                                  num_attention_heads=40, num_key_value_heads=8, vocab_size=152064,
                                  max_position_embeddings=131072, rope_theta=1000000.0, rms_norm_eps=1e-6,
                                  tie_word_embeddings=False, torch_dtype="bfloat16")),
    # huggingface.co/Qwen/Qwen2-VL-7B-Instruct
    "qwen2-vl-7b": ("qwen2_vl",
                    dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                         num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768,
                         tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "mrope_section": [16, 24, 24], "rope_theta": 1e6}),
                    dict(depth=32, embed_dim=1280, hidden_size=3584, mlp_ratio=4, num_heads=16, in_channels=3,
                         patch_size=14, spatial_merge_size=2, temporal_patch_size=2),
                    dict(tie_word_embeddings=False)),
    # huggingface.co/Qwen/Qwen2.5-VL-7B-Instruct
    "qwen2.5-vl-7b": ("qwen2_5_vl",
                      dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                           num_key_value_heads=4, vocab_size=152064, max_position_embeddings=128000,
                           tie_word_embeddings=False,
                           rope_parameters={"rope_type": "default", "mrope_section": [16, 24, 24], "rope_theta": 1e6}),
                      dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=3584, window_size=112,
                           fullatt_block_indexes=[7, 15, 23, 31]),
                      dict(tie_word_embeddings=False)),
    # huggingface.co/google/gemma-3-27b-it
    "gemma-3-27b": ("gemma3",
                    dict(model_type="gemma3_text", hidden_size=5376, intermediate_size=21504, num_hidden_layers=62,
                         num_attention_heads=32, num_key_value_heads=16, head_dim=128, vocab_size=262208,
                         sliding_window=1024, max_position_embeddings=131072),
                    dict(model_type="siglip_vision_model", hidden_size=1152, intermediate_size=4304,
                         num_hidden_layers=27, num_attention_heads=16, image_size=896, patch_size=14),
                    dict(mm_tokens_per_image=256)),
}


def published_config(name: str):
    """A transformers config of the published model ``name`` (see :data:`PUBLISHED`)."""
    from transformers import AutoConfig   # transformers: heavy, read only when a config is built

    if name not in PUBLISHED:
        raise ValueError(f"unknown published config {name!r}; choose one of {', '.join(PUBLISHED)}")
    entry = PUBLISHED[name]
    if len(entry) == 2:
        return AutoConfig.for_model(entry[0], **entry[1])
    model_type, text, vision, top = entry
    return AutoConfig.for_model(model_type, text_config=dict(text), vision_config=dict(vision), **top)


#: the vocabulary of the families' tiny configs (tests draw token ids below it)
FAMILY_VOCAB = 96
#: the families every engine test is run against (parity with HF autograd, tiers, threads...)
FAMILIES = ["llama", "qwen2", "mistral", "gpt2", "gemma2", "phi3", "mixtral"]

# Per family: the config fields beside the common Llama-like ones (None: GPT-2's own names).
_FAMILY_FIELDS: dict[str, dict] = {
    "llama": {},
    "qwen2": {},
    "mistral": dict(sliding_window=5),
    "phi3": dict(resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    "gemma2": dict(head_dim=8, sliding_window=5, final_logit_softcapping=3.0, attn_logit_softcapping=5.0,
                   query_pre_attn_scalar=8),
    # a mixture of experts with a shared expert (tiling and routing tests; not in FAMILIES)
    "qwen2_moe": dict(moe_intermediate_size=16, shared_expert_intermediate_size=32, num_experts=4,
                      num_experts_per_tok=2),
}


def family_config(family: str, *, layers: int = 3, tie: bool = False, hidden: int = 32,
                  vocab: int = FAMILY_VOCAB, **overrides):
    """The tiny config of ``family`` (one of :data:`FAMILIES`, or ``qwen2_moe``): ``layers``
    decoder layers of width ``hidden``; ``overrides`` replace any field."""
    from transformers import AutoConfig   # transformers: heavy, read only when a config is built

    if family == "gpt2":
        fields = dict(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=4, n_positions=64,
                      tie_word_embeddings=tie, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    elif family in _FAMILY_FIELDS:
        fields = dict(vocab_size=vocab, num_hidden_layers=layers, tie_word_embeddings=tie, pad_token_id=0,
                      hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, **_FAMILY_FIELDS[family])
    else:
        raise KeyError(f"family {family!r} has no tiny config; families: {', '.join(FAMILIES + ['qwen2_moe'])}")
    fields.update(overrides)
    return AutoConfig.for_model(family, **fields)


def tiny(name: str):
    """A config by name: a preset (:data:`PRESETS`), a tested family (:func:`family_config`), or
    any causal-LM model type transformers registers (shrunk by :mod:`megatrain_nb.tiny_configs`)."""
    if name in PRESETS:
        return preset_config(name)
    if name in _FAMILY_FIELDS or name == "gpt2":
        return family_config(name)

    return tiny_config(name)
