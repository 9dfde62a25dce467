"""Attention at long lengths: the backend's memory-efficient kernels, not eager's score matrix.

A model configured with ``attn_implementation="eager"`` materialises [batch, heads, seq, seq]
scores and probabilities in every layer: quadratic in the sequence, where SDPA's flash and
memory-efficient kernels (on CUDA) and its flash CPU kernel keep a layer's attention linear.
Above :data:`EAGER_TOKENS` tokens per row the engine switches such a model to "sdpa" with a note,
unless that would change its results (attention logit soft-capping, which SDPA does not do) or
the model has no SDPA path: then it warns with the bytes eager will take. Sliding-window and
chunked-attention layers keep their masks either way (the model's own mask code builds them).
"""
from __future__ import annotations

import logging
import warnings
import weakref
from typing import Optional

log = logging.getLogger(__name__)

#: Tokens per row above which eager attention is not left as it is.
EAGER_TOKENS = 4096
_warned = weakref.WeakSet()   # models left eager that were warned about (once each)


def _score_bytes(config, batch: int, seq: int) -> int:
    cfg = getattr(config, "get_text_config", lambda: config)()
    heads = int(getattr(cfg, "num_attention_heads", 0) or getattr(cfg, "n_head", 0) or 1)
    return 2 * batch * heads * seq * seq * 4   # scores and probabilities, fp32 (softmax's dtype)


def long_attention(model, batch: int, seq: int) -> Optional[str]:
    """Switch ``model`` from eager attention to SDPA for a ``seq``-token row when that keeps its
    results, or warn; returns the note given (None: nothing to say)."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "eager" or seq <= EAGER_TOKENS or model in _warned:
        return None
    gib = _score_bytes(config, batch, seq) / 2**30
    cap = getattr(getattr(config, "get_text_config", lambda: config)(), "attn_logit_softcapping", None)
    why = None
    if cap:
        why = f"its attention logits are soft-capped ({cap}), which SDPA does not do"
    elif not getattr(model, "_supports_sdpa", False):
        why = f"{type(model).__name__} has no SDPA attention"
    else:
        try:
            model.set_attn_implementation("sdpa")
        except (ValueError, ImportError, AttributeError) as e:
            why = f"switching to SDPA failed ({e})"
    if why is None:
        note = (f"eager attention at {seq:,} tokens would hold {gib:.1f} GiB of attention scores per layer "
                f"([{batch}, heads, {seq}, {seq}]); switched the model to attn_implementation='sdpa' "
                "(memory-efficient kernels, the same results up to round-off). Load it with "
                "attn_implementation='sdpa' to silence this.")
    else:
        note = (f"eager attention at {seq:,} tokens holds {gib:.1f} GiB of attention scores per layer "
                f"([{batch}, heads, {seq}, {seq}]); left eager because {why}. Use shorter rows "
                "or expect the device to need that much more.")
        _warned.add(model)
    warnings.warn(note, stacklevel=3)
    log.warning(note)
    return note
