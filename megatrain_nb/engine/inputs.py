"""Validate and normalise one batch (input ids, attention mask, labels) for the engine, and tell
a window of micro-batches (layer-major accumulation) from one batch.

Packed rows (several documents in one row, no padding: TRL's padding-free packing) come with
``position_ids`` that restart at 0 for each document and no attention mask. They travel in the
attention-mask slot as :class:`PackedRows`; the model's own forward receives them as
``position_ids`` and its mask code keeps the documents apart (``masking_utils`` finds the
document boundaries where the position ids restart).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class PackedRows:
    """Per-document position ids [batch, seq] of packed rows (taking the attention mask's place)."""

    position_ids: torch.Tensor


@dataclass(frozen=True)
class WithExtras:
    """The attention-mask slot of a batch with a processor's extra inputs (``pixel_values``,
    ``image_grid_thw``, ...: engine/vision.py): the mask (or None) and the extras by keyword."""

    mask: Optional[torch.Tensor]
    extras: dict


def model_inputs(am) -> dict:
    """The keyword arguments the model's forward takes for the attention-mask slot ``am``."""
    if isinstance(am, PackedRows):
        return {"position_ids": am.position_ids}
    if isinstance(am, WithExtras):
        return {"attention_mask": am.mask, **am.extras}
    return {"attention_mask": am}


def with_extras(attention_mask, extras: Optional[dict]):
    """The attention-mask slot of a batch given with a processor's extra inputs by keyword
    (``forward_backward(ids, attention_mask=..., pixel_values=...)``): a :class:`WithExtras`
    (inputs given as None left out), or the mask itself when there are none."""
    extras = {k: v for k, v in (extras or {}).items() if v is not None}
    if not extras:
        return attention_mask
    if isinstance(attention_mask, (WithExtras, PackedRows)):
        raise ValueError(f"extra inputs {sorted(extras)} given twice (by keyword and in the batch).")
    return WithExtras(attention_mask, extras)


def _prepare_extras(extras: WithExtras, position_ids, device: torch.device) -> dict:
    if position_ids is not None:
        raise ValueError(f"packed rows (position_ids) with extra inputs {sorted(extras.extras)} are not supported; "
                         "pass padded rows with an attention_mask.")
    out = {}
    for k, v in extras.extras.items():
        if not torch.is_tensor(v):
            raise ValueError(f"extra input {k!r} must be a tensor (as the processor returns it with "
                             f"return_tensors='pt'); got {type(v).__name__}.")
        out[k] = v.to(device)
    return out


def _prepare_positions(position_ids, input_ids: torch.Tensor, attention_mask, max_pos: Optional[int]) -> PackedRows:
    if attention_mask is not None:
        raise ValueError("position_ids were given with an attention_mask: packed rows (per-document position ids) "
                         "carry no attention mask; pass one or the other.")
    pos = torch.as_tensor(position_ids)
    if pos.dim() == 1:
        pos = pos.unsqueeze(0)
    if pos.shape != input_ids.shape or pos.is_floating_point() or pos.dtype == torch.bool:
        raise ValueError(f"position_ids must be integers shaped like input_ids {tuple(input_ids.shape)}; got "
                         f"{tuple(pos.shape)} {pos.dtype}.")
    if int(pos.min()) < 0 or (max_pos is not None and int(pos.max()) >= max_pos):
        raise ValueError(f"position_ids range {int(pos.min())}..{int(pos.max())} is outside the model's positions "
                         f"(0..{max_pos - 1 if max_pos else 'any'}).")
    return PackedRows(pos.long())


def prepare_batch(input_ids, attention_mask, labels, *, vocab: int, max_pos: Optional[int], device: torch.device,
                  position_ids=None):
    """``(input_ids, attention_mask, labels)`` as [batch, seq] tensors on ``device``; labels
    default to the input ids (masked positions -100). With ``position_ids`` (packed rows) the
    second item is a :class:`PackedRows`. Bad input raises ValueError naming it."""
    if isinstance(input_ids, Mapping):   # one batch as a dict (evaluate(batch), forward_logits(batch))
        if attention_mask is not None or labels is not None or position_ids is not None:
            raise ValueError("a batch given as a dict carries its attention_mask/labels/position_ids and extra inputs "
                             "(pixel_values, ...) inside it.")
        (input_ids, attention_mask, labels, position_ids), = window_batches([input_ids])
    if isinstance(attention_mask, WithExtras):   # a processor's extra inputs (a window's dict)
        extras = _prepare_extras(attention_mask, position_ids, device)
        ids, am, labels = prepare_batch(input_ids, attention_mask.mask, labels, vocab=vocab, max_pos=max_pos,
                                        device=device)
        return ids, WithExtras(am, extras), labels
    if not torch.is_tensor(input_ids):
        input_ids = torch.as_tensor(input_ids)
    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
    if input_ids.dim() != 2 or input_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"input_ids must be an integer tensor [batch, seq]; got {tuple(input_ids.shape)} "
                         f"{input_ids.dtype}.")
    if input_ids.numel() == 0:
        raise ValueError(f"input_ids is empty (shape {tuple(input_ids.shape)}): a batch needs at least one "
                         "sequence of at least one token; drop empty batches or examples.")
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= vocab:
        bad = lo if lo < 0 else hi
        raise ValueError(f"token id {bad} is outside the model's vocabulary (0..{vocab - 1}); the tokenizer "
                         "does not match the model, or resize the model's embeddings.")
    if max_pos is not None and input_ids.shape[1] > max_pos and position_ids is None:
        raise ValueError(f"input has {input_ids.shape[1]} tokens but the model supports at most {max_pos} "
                         "positions; truncate or pack sequences to that length.")
    input_ids = input_ids.long()
    if attention_mask is not None:
        attention_mask = torch.as_tensor(attention_mask)
        if attention_mask.dim() == 1:
            attention_mask = attention_mask.unsqueeze(0)
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} does not match input_ids "
                             f"{tuple(input_ids.shape)}.")
    if labels is None:
        labels = input_ids.clone()
        if attention_mask is not None:
            labels = labels.masked_fill(attention_mask == 0, -100)
    else:
        labels = torch.as_tensor(labels)
        if labels.is_floating_point() or labels.dtype == torch.bool:
            raise ValueError(f"labels must be integer token ids (or -100); got {labels.dtype}.")
        labels = labels.long()
        if labels.dim() == 1:
            labels = labels.unsqueeze(0)
        if labels.shape != input_ids.shape:
            raise ValueError(f"labels shape {tuple(labels.shape)} does not match input_ids "
                             f"{tuple(input_ids.shape)}.")
        bad = labels[(labels != -100) & ((labels < 0) | (labels >= vocab))]
        if bad.numel():
            raise ValueError(f"label {int(bad[0])} is outside the model's vocabulary (0..{vocab - 1}) and is not "
                             "the ignore index -100; the labels do not match the model's tokenizer.")
    if position_ids is not None:
        packed = _prepare_positions(position_ids, input_ids, attention_mask, max_pos)
        return input_ids.to(device), PackedRows(packed.position_ids.to(device)), labels.to(device)
    am = attention_mask.to(device) if attention_mask is not None else None
    return input_ids.to(device), am, labels.to(device)


def window_batches(x) -> Optional[list]:
    """``x`` as a window of ``(input_ids, attention_mask, labels, position_ids)`` micro-batches, or
    None when it is one batch. A window is a list or tuple whose items are all tensors (input ids)
    or dicts with ``input_ids`` (and optionally ``attention_mask``, ``labels``, ``position_ids``),
    or one such dict. A dict's other keys are a processor's extra inputs (``pixel_values``, ...):
    they ride with the mask as :class:`WithExtras`; the model's forward must take them (vision.py)."""
    if isinstance(x, Mapping):
        x = [x]
    if not isinstance(x, (list, tuple)) or not x or not all(torch.is_tensor(b) or isinstance(b, Mapping) for b in x):
        return None
    out = []
    for i, b in enumerate(x):
        if torch.is_tensor(b):
            out.append((b, None, None, None))
            continue
        if "input_ids" not in b:
            raise ValueError(f"micro-batch {i} of the window must be a tensor of input ids or a dict with "
                             f"'input_ids' (and optionally 'attention_mask', 'labels', 'position_ids' and the "
                             f"processor's extra inputs); got keys {sorted(b)}.")
        am = b.get("attention_mask")
        extras = {k: v for k, v in b.items() if k not in _BATCH_KEYS and v is not None}
        out.append((b["input_ids"], WithExtras(am, extras) if extras else am, b.get("labels"), b.get("position_ids")))
    return out


#: the key of a micro-batch's dict that holds its sequence objective's side data (compute/objective.py)
OBJECTIVE_DATA = "objective_data"
_BATCH_KEYS = frozenset({"input_ids", "attention_mask", "labels", "position_ids", OBJECTIVE_DATA})


def window_data(x) -> Optional[list]:
    """Each micro-batch's ``objective_data`` of a window (or of one dict batch) ``x``, in its
    order (None where a micro-batch has none); None when none has any."""
    items = [x] if isinstance(x, Mapping) else x
    if not isinstance(items, (list, tuple)):
        return None
    data = [b.get(OBJECTIVE_DATA) if isinstance(b, Mapping) else None for b in items]
    return data if any(d is not None for d in data) else None
