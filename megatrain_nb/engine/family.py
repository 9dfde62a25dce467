"""Model-family quirks of the Hugging Face configs, in one place.

Families name the same fact differently (GPT-2: ``n_embd`` / ``n_positions``; T5-style:
``d_model``; multimodal wrappers keep the language model's config in ``text_config``). Every
reader of these facts in the package goes through here, so a new family's spelling is one line.
"""
from __future__ import annotations

from typing import Optional

_HIDDEN = ("hidden_size", "n_embd", "d_model")
_MAX_POSITIONS = ("max_position_embeddings", "n_positions", "max_sequence_length")


def text_config(cfg):
    """The language model's config (``cfg`` itself unless it wraps one)."""
    get = getattr(cfg, "get_text_config", None)
    return get() if callable(get) else cfg


def hidden_size(cfg) -> int:
    """The model width; 0 if the config names it in no known way."""
    cfg = text_config(cfg)
    for name in _HIDDEN:
        if getattr(cfg, name, None):
            return int(getattr(cfg, name))
    return 0


def max_positions(cfg) -> Optional[int]:
    """The most positions (tokens per sequence) the model supports; None if unbounded/unknown."""
    cfg = text_config(cfg)
    for name in _MAX_POSITIONS:
        v = getattr(cfg, name, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def intermediate_size(cfg) -> Optional[int]:
    """The MLP width (the widest, where it is given per layer), or None (the planner then
    assumes 4 x hidden)."""
    v = getattr(text_config(cfg), "intermediate_size", None)
    if isinstance(v, (list, tuple)):
        v = max((x for x in v if isinstance(x, int)), default=None)
    return v


def vocab_size(cfg) -> int:
    return text_config(cfg).vocab_size
