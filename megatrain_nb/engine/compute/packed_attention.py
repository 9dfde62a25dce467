"""Packed rows at long lengths: attention per document, with no [seq, seq] mask.

Packed rows (several documents per row, ``position_ids`` restarting at 0 for each, no attention
mask; ``inputs.PackedRows``) keep their documents apart through the model's own mask code, which
for SDPA builds a [batch, 1, seq, seq] boolean mask: 16 GiB for one row of 131,072 tokens, and
SDPA then cannot use its flash kernel. Above :data:`PACKED_TOKENS` tokens per row the engine
switches such a model to the attention implementation registered here, ``"megatrain_docs"``:

* its mask function builds nothing for rows without padding (the documents are found from the
  position ids in the attention call instead); a padded row's mask is SDPA's own (``sdpa_mask``);
* its attention function runs SDPA's causal kernel on each document's tokens on its own (where
  the position ids do not step by one, a new document starts, as ``masking_utils`` finds them),
  else it is Hugging Face's SDPA forward unchanged.

Same results as the masked SDPA up to round-off; memory linear in the row. Only models whose
layers all attend causally over the whole row (no sliding-window, chunked or bidirectional
layers: those keep their masks) are switched, only from "sdpa".
"""
from __future__ import annotations

import logging
import threading
import weakref
from typing import Dict, List, Optional

import torch

from ..inputs import PackedRows

log = logging.getLogger(__name__)

NAME = "megatrain_docs"
#: Tokens per packed row above which the model's SDPA is switched to per-document attention.
PACKED_TOKENS = 4096
_registered = False
#: id(position ids tensor) -> (a weak reference to it, its documents): found once per batch on
#: the host (:func:`remember_documents`, from the prepared batch), read by every layer's call.
_known: Dict[int, tuple] = {}
_known_lock = threading.Lock()


def _documents(position_ids: torch.Tensor) -> List[List[tuple]]:
    """Per row, the (start, end) of each document: a new one where the positions do not step by
    one. (Reads the positions on the host: a sync where they live on the device.)"""
    step = position_ids[:, 1:] - position_ids[:, :-1]
    out = []
    for row in (step != 1).tolist():
        starts = [0] + [i + 1 for i, new in enumerate(row) if new]
        ends = starts[1:] + [position_ids.shape[1]]
        out.append(list(zip(starts, ends)))
    return out


def remember_documents(position_ids: torch.Tensor) -> List[List[tuple]]:
    """The documents of ``position_ids`` (this very tensor: the model hands it to every layer),
    found now and kept while the tensor lives, so the layers' calls do not read the positions
    back (a host sync per layer call on a GPU)."""
    key = id(position_ids)
    with _known_lock:
        hit = _known.get(key)
        if hit is not None and hit[0]() is position_ids:
            return hit[1]
    docs = _documents(position_ids)
    with _known_lock:
        for k in [k for k, (ref, _) in _known.items() if ref() is None]:
            del _known[k]
        _known[key] = (weakref.ref(position_ids), docs)
    return docs


def _documents_of(pos: torch.Tensor, rows: int) -> List[List[tuple]]:
    """The documents of ``pos`` for ``rows`` rows (a [1, seq] row shared by the batch repeated)."""
    docs = remember_documents(pos if pos.dim() == 2 else pos.view(1, -1))
    if len(docs) == rows:
        return docs
    if len(docs) == 1:
        return docs * rows
    return _documents(pos.expand(rows, -1))


def docs_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                           scaling: Optional[float] = None, **kwargs):
    """Hugging Face's SDPA forward per document of each packed row ([batch, heads, seq, dim] in,
    [batch, seq, heads, dim] out); with a mask, or one document per row, SDPA's forward as it is."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    pos = kwargs.pop("position_ids", None)
    if pos is None and attention_mask is None and query.shape[2] > 1:
        raise RuntimeError(f"{type(module).__name__} does not hand position_ids to its attention function, so "
                           f"{NAME!r} cannot find the documents of a packed row; raise "
                           "megatrain_nb.engine.compute.packed_attention.PACKED_TOKENS (now "
                           f"{PACKED_TOKENS:,}) above the row length to keep the model's own [seq, seq] mask")
    docs = None if pos is None or attention_mask is not None or query.shape[2] != pos.shape[-1] \
        else _documents_of(pos, query.shape[0])
    if docs is None or all(len(d) == 1 for d in docs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      position_ids=pos, **kwargs)
    rows = []
    for b, spans in enumerate(docs):
        parts = [sdpa_attention_forward(module, query[b:b + 1, :, s:e], key[b:b + 1, :, s:e], value[b:b + 1, :, s:e],
                                        None, dropout=dropout, scaling=scaling, is_causal=True, **kwargs)[0]
                 for s, e in spans]
        rows.append(torch.cat(parts, dim=1))
    return torch.cat(rows, dim=0), None


def docs_mask(*args, attention_mask: Optional[torch.Tensor] = None, **kwargs):
    """No mask for rows without padding (the attention finds the documents); SDPA's own otherwise."""
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None or bool(attention_mask.all()):
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def register() -> None:
    """Register ``"megatrain_docs"`` with transformers' attention and mask interfaces (once)."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        AttentionInterface.register(NAME, docs_attention_forward)
        AttentionMaskInterface.register(NAME, docs_mask)
        _registered = True


def _causal_everywhere(config) -> bool:
    """Every layer attends causally over the whole row (no windows, chunks or bidirectional parts)."""
    cfg = getattr(config, "get_text_config", lambda: config)()
    if getattr(cfg, "sliding_window", None) or getattr(cfg, "attention_chunk_size", None):
        return False
    types = getattr(cfg, "layer_types", None)
    return not types or all(t == "full_attention" for t in types)


def packed_attention(model, batches) -> Optional[str]:
    """Switch ``model`` from SDPA to per-document attention when a micro-batch of ``batches``
    (prepared ``(ids, am, labels)``) is made of packed rows longer than :data:`PACKED_TOKENS`;
    returns the note logged (None: nothing done)."""

    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or not _causal_everywhere(config):
        return None
    if not any(isinstance(am, PackedRows) and ids.shape[1] > PACKED_TOKENS for ids, am, _ in batches):
        return None
    for ids, am, _ in batches:   # once per batch, before any layer runs
        if isinstance(am, PackedRows):
            remember_documents(am.position_ids)
    register()
    try:
        model.set_attn_implementation(NAME)
    except (ValueError, ImportError, AttributeError) as e:
        log.warning("packed rows: per-document attention unavailable (%s); the model's mask code builds a "
                    "[seq, seq] mask per row", e)
        return None
    note = (f"packed rows over {PACKED_TOKENS:,} tokens: attention runs per document (SDPA's causal kernel on "
            f"each document; no [seq, seq] mask), attn_implementation={NAME!r}")
    log.info(note)
    return note
