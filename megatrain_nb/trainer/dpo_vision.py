"""TRL's vision preference data for :class:`~megatrain_nb.trainer.dpo.DPOTrainer`: a processor
(``transformers.ProcessorMixin``) as ``processing_class``, rows with an ``images`` list (or an
``image``) beside ``prompt`` / ``chosen`` / ``rejected`` (messages whose content may be a list of
``{"type": "image"}`` / ``{"type": "text", ...}`` parts, or text).

As ``trl.DPOTrainer`` does it, the rows are not prepared ahead: TRL's own
``DataCollatorForVisionPreference`` makes each batch (the chat template, the processor's image
tokens and pixels for the prompts, the chosen rows then the rejected rows, flushed left), and the
processor's outputs besides the tokens (``pixel_values``, ``image_grid_thw``,
``mm_token_type_ids``, ...) ride the batch as ``extra_inputs`` to the model's forward. What
differs, said where TRL is silent:

- **The reference log-probs are computed ahead**, with the images, in one forward-only pass of the
  engine over the pairs (TRL runs its reference model beside every step for vision data; the
  reference's weights do not change, so the values are the same to round-off) and cached under a
  key of the pairs' text and pictures (:func:`vision_fingerprint`) and the processor.
- **Image tokens are never truncated**: a pair whose image tokens reach past ``max_length`` is
  refused, the row named (TRL's model raises a mismatch naming no row). Text past it is cut as
  TRL cuts it.
- Bad rows name themselves: no ``prompt``, no images list, a count of image placeholders that
  differs from the images.
"""
from __future__ import annotations

import json
from typing import Optional

import torch
import xxhash

from .data import EXTRA_INPUTS, DataError
from .sft_data import head_rows
from .sft_vision import (ROW, check_vision_rows, collate_named, image_token_ids, row_images, rows_over,
                          vision_row_problem, with_row_index)

#: The columns TRL's vision preference collator reads (its ``_signature_columns`` for vision data).
VISION_PREF_COLUMNS = ("prompt", "chosen", "rejected", "image", "images", "tools", "chat_template_kwargs")
REF_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")
#: The rows checked when the trainer is built (each row is checked again as a batch takes it).
VISION_HEAD = 64


def check_vision_dpo_args(args) -> None:
    """The DPOConfig settings TRL refuses (or cannot apply) for vision data, refused in its words."""
    if args.max_length is not None and args.truncation_mode == "keep_end":
        raise ValueError("truncation_mode='keep_end' is not supported for vision-language models. Image tokens reside "
                         "inside the prompt portion of the sequence; keep_end may drop them. Use "
                         "truncation_mode='keep_start' (the default) or set max_length=None.")
    if args.pad_to_multiple_of not in (None, "auto"):
        raise ValueError("DPOConfig.pad_to_multiple_of is not implemented for vision-language data (TRL's "
                         "DataCollatorForVisionPreference refuses it); leave it None")


def pair_problem(ex: dict) -> Optional[str]:
    """What is wrong with one vision preference row (None: nothing), before TRL's collator meets it."""
    missing = [c for c in ("prompt", "chosen", "rejected") if ex.get(c) is None]
    if missing:
        return (f"it has no {missing} (keys {sorted(ex)}); a vision preference row needs an explicit 'prompt' beside "
                "'chosen' and 'rejected' (TRL does not extract the prompt of vision rows)")
    conv = [isinstance(ex[c], (list, tuple)) for c in ("prompt", "chosen", "rejected")]
    if len(set(conv)) > 1:
        return "it mixes formats: prompt, chosen and rejected are all text or all lists of messages"
    if ex["chosen"] == ex["rejected"]:
        return "chosen and rejected are the same; the pair carries no preference"
    if not conv[0]:
        return vision_row_problem({"images": row_images(ex), "prompt": ex["prompt"]})
    for side in ("chosen", "rejected"):
        bad = vision_row_problem({"images": row_images(ex), "messages": list(ex["prompt"]) + list(ex[side])})
        if bad:
            return f"(prompt + {side}) {bad}"
    return None


def prepare_vision_pairs(ds, what: str):
    """``ds`` (a Dataset or a list of rows) as a Dataset with each row's name (``mt_row``); its
    first rows checked. Not tokenised: TRL's collator does it per batch."""
    import datasets

    if isinstance(ds, (list, tuple)):
        ds = datasets.Dataset.from_list([dict(r) for r in ds])
    if isinstance(ds, datasets.IterableDataset):
        raise DataError(f"{what} is an IterableDataset of images: megatrain_nb's DPOTrainer computes the reference "
                        "log-probs of vision pairs ahead, over a map-style dataset; pass a datasets.Dataset")
    if not isinstance(ds, datasets.Dataset):
        raise DataError(f"{what} is a {type(ds).__name__}; DPOTrainer takes a datasets.Dataset or a list of dicts")
    if len(ds) == 0:
        raise DataError(f"{what} is empty (0 examples)")
    check_vision_rows(head_rows(ds, VISION_HEAD), what, problem=pair_problem)
    return with_row_index(ds, what)


def _image_digest(h, img) -> None:
    if hasattr(img, "tobytes"):   # a PIL image
        h.update(f"{img.mode}{img.size}".encode())
        h.update(img.tobytes())
    else:
        h.update(json.dumps(img, sort_keys=True, default=str).encode())


def vision_fingerprint(ds, processor) -> str:
    """A digest (xxh3-128) of what vision pairs' reference log-probs depend on in the data: every
    row's prompt, chosen and rejected and its pictures' pixels, and the processor's image settings."""
    h = xxhash.xxh3_128()
    h.update(processor.image_processor.to_json_string().encode())
    for ex in ds:
        h.update(json.dumps([ex.get(c) for c in ("prompt", "chosen", "rejected", "tools", "chat_template_kwargs")],
                            sort_keys=True, default=str).encode())
        for img in row_images(ex) or []:
            _image_digest(h, img)
    return "vision:" + h.hexdigest()[:24]


class VisionPreferenceCollator:
    """TRL's ``DataCollatorForVisionPreference`` on TRL's vision columns, the rows checked and named,
    image tokens never truncated; the batch as the engine takes it: the tokens, the completion mask,
    the labels (input ids where the completion mask is 1, else -100, as TRL passes its model), the
    reference columns when the rows have them, and the processor's other outputs under
    ``extra_inputs``."""

    def __init__(self, processor, *, max_length: Optional[int], what: str = "train_dataset"):
        from trl.trainer.dpo_trainer import DataCollatorForVisionPreference

        self.whole = DataCollatorForVisionPreference(processor=processor, max_length=None)
        self.cut = DataCollatorForVisionPreference(processor=processor, max_length=max_length) if max_length else None
        self.max_length, self.what = max_length, what
        self.image_ids = sorted(image_token_ids(processor))

    def _too_long(self, out, names: list) -> bool:
        """Whether a row is longer than max_length (refused when its image tokens reach past it)."""
        def refuse(i, length, n_image, last):
            side = "chosen" if i < len(names) else "rejected"
            raise DataError(
                f"{names[i % len(names)]} ({side}) has {length} tokens, {n_image} of them its "
                f"images' (the last at position {last}), more than max_length={self.max_length}: image "
                "tokens are never truncated. Raise DPOConfig.max_length, set it to None (TRL's advice for "
                "vision data), or make the images smaller (the processor's max_pixels)")
        return bool(rows_over(out, self.max_length, self.image_ids, refuse)[1])

    def __call__(self, examples: list) -> dict:
        names = [ex.get(ROW) or f"{self.what}: row {j} of a batch" for j, ex in enumerate(examples)]
        for ex, name in zip(examples, names):
            bad = pair_problem(ex) if ("image" in ex or "images" in ex) else "it has no 'image' or 'images' column"
            if bad:
                raise DataError(f"{name}: {bad}")
        rows = [{k: v for k, v in ex.items() if k in VISION_PREF_COLUMNS} for ex in examples]
        out = collate_named(self.whole, rows, names)
        if self.max_length is not None and self._too_long(out, names):
            out = collate_named(self.cut, rows, names)
        ids, cm = out["input_ids"], out["completion_mask"]
        batch = {"input_ids": ids, "attention_mask": out["attention_mask"], "completion_mask": cm,
                 "labels": ids.masked_fill(cm == 0, -100)}
        extras = {k: v for k, v in out.items() if k not in batch and torch.is_tensor(v)}
        if extras:
            batch[EXTRA_INPUTS] = extras
        for c in REF_COLUMNS:
            if all(ex.get(c) is not None for ex in examples):
                batch[c] = torch.tensor([float(ex[c]) for ex in examples])
        return batch


__all__ = ["VisionPreferenceCollator", "check_vision_dpo_args", "pair_problem",
           "prepare_vision_pairs", "vision_fingerprint"]
