"""TRL's vision data contract for :class:`~megatrain_nb.trainer.sft.SFTTrainer`: a processor
(``transformers.ProcessorMixin``) as ``processing_class``, rows with an ``images`` (a list) or
``image`` column beside ``messages`` (content: a list of ``{"type": "image"}`` /
``{"type": "text", "text": ...}`` parts, or plain text: the images go before the first user
turn), ``prompt``/``completion`` or a text column.

As ``trl.SFTTrainer`` does it, the rows are not prepared ahead (turning images into pixels is
done per batch) and TRL's own ``DataCollatorForVisionLanguageModeling`` makes each batch: the
chat template, the processor's image tokens and pixel values, the labels (assistant-only or
completion-only as configured). What differs, said where TRL is silent:

- **Image tokens are never truncated.** A row whose image tokens reach past ``max_length`` is
  refused, the row named, before the model sees it (TRL's processor or model raises a mismatch
  naming no row; TRL advises ``max_length=None`` for vision data). A row longer than
  ``max_length`` only by its text is truncated as TRL truncates it, counted in a
  :class:`~megatrain_nb.trainer.sft_data.PrepReport` and warned about at the first.
- **Bad rows name themselves**: a row without its images list, a part of another type than
  image/text, or a count of image placeholders that differs from its images.
- The processor's outputs besides the tokens (``pixel_values``, ``image_grid_thw``,
  ``mm_token_type_ids``, ...) travel as the batch's ``extra_inputs`` (trainer/data.py) and reach
  the model's forward through the engine.

Example::

    trainer = mt.SFTTrainer(model=vlm, processing_class=processor, train_dataset=ds,   # ds: images + messages
                            args=SFTConfig(output_dir="out", max_length=None, assistant_only_loss=True))
"""
from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Optional

import torch

from . import saving
from .data import EXTRA_INPUTS, DataError
from .sft_data import PrepReport, column_names, head_rows

#: The column a vision dataset carries so that a batch's rows can be named ("train_dataset[12]"); taken off
#: before TRL's collator.
ROW = "mt_row"
#: The columns TRL's vision collator reads (its ``_signature_columns`` for vision data), besides the text field.
VISION_COLUMNS = ("messages", "prompt", "completion", "image", "images")
TOKEN_KEYS = ("input_ids", "attention_mask", "labels")
#: The rows checked when the trainer is built (every row is checked again as a batch takes it).
VISION_HEAD = 64
ROLES = ("system", "user", "assistant", "tool")


def is_processor(obj) -> bool:
    """Whether ``obj`` is a multimodal processor (tokenizer plus image processor)."""
    from transformers import ProcessorMixin

    return isinstance(obj, ProcessorMixin)


def is_vision_row(ex) -> bool:
    """TRL's test of a vision dataset: its rows have an ``image`` or ``images`` key."""
    return isinstance(ex, dict) and ("image" in ex or "images" in ex)


def check_vision_args(args) -> None:
    """The SFTConfig settings TRL refuses for vision data, refused in its words."""
    if args.packing:
        raise ValueError("Packing is not supported for vision datasets. Please set `packing=False` in the SFTConfig.")
    if args.padding_free:
        raise ValueError("Padding-free training is yet not supported for vision datasets. Please set "
                         "`padding_free=False` in the `SFTConfig`.")
    if args.max_length is not None and args.truncation_mode == "keep_end":
        raise ValueError("truncation_mode='keep_end' is not supported for vision datasets: image tokens sit in the "
                         "prompt, so keeping the end may drop them. Use truncation_mode='keep_start' (the default) "
                         "or set max_length=None.")


def _placeholders(messages) -> int:
    return sum(1 for m in messages if isinstance(m, dict) and m.get("content") and m.get("role") != "tool"
               and not isinstance(m["content"], str)
               for p in m["content"] if isinstance(p, dict) and p.get("type") == "image" and p.get("image") is None)


def row_images(ex: dict) -> list:
    """A row's images as TRL reads them (``image``: one; ``images``: a list)."""
    if "image" in ex:
        return [ex["image"]]
    imgs = ex.get("images")
    return list(imgs) if isinstance(imgs, (list, tuple)) else imgs


def vision_row_problem(ex: dict, text_field: str = "text") -> Optional[str]:
    """What is wrong with one vision row (None: nothing), before TRL's collator meets it."""
    imgs = row_images(ex)
    if not isinstance(imgs, list):
        return f"'images' is {type(imgs).__name__}, not a list of images (use 'image' for one image per row)"
    if any(i is None for i in imgs):
        return "an image is missing (None) in its images"
    turns = ex.get("messages") if ex.get("messages") is not None else (
        list(ex["prompt"]) + list(ex["completion"]) if isinstance(ex.get("prompt"), (list, tuple)) else None)
    if turns is None:
        if ex.get("prompt") is None and not isinstance(ex.get(text_field), str):
            return (f"it has no 'messages', 'prompt'/'completion' or '{text_field}' beside its images "
                    f"(keys {sorted(ex)})")
        return None
    for j, m in enumerate(turns):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            return f"message {j} is not a {{'role': ..., 'content': ...}} dict with a role in {ROLES}"
        content = m.get("content")
        if isinstance(content, (list, tuple)):
            for p in content:
                if not isinstance(p, dict) or p.get("type") not in ("image", "text"):
                    return (f"message {j} has a content part {p!r:.60}; a part is {{'type': 'image'}} or "
                            "{'type': 'text', 'text': ...}")
    structured = any(isinstance(m.get("content"), (list, tuple)) for m in turns)
    n = _placeholders(turns)
    if structured and n != len(imgs):
        return (f"its messages hold {n} image placeholder(s) ({{'type': 'image'}}) for {len(imgs)} image(s); "
                "give one placeholder per image")
    return None


def check_vision_rows(rows: list, what: str, text_field: str = "text", problem=None) -> None:
    """Refuse, naming the row, the first rows that are not TRL vision rows (``problem(ex)``: what is
    wrong with one row, default :func:`vision_row_problem`; DPO's pairs give theirs)."""
    for i, ex in enumerate(rows):
        if not is_vision_row(ex):
            raise DataError(f"{what}[{i}] has no 'image' or 'images' column while the rows before it have images; "
                            "give every row its images (an empty list for a text-only row)")
        bad = problem(ex) if problem is not None else vision_row_problem(ex, text_field)
        if bad:
            raise DataError(f"{what}[{i}]: {bad}")


def collate_named(collator, rows: list, names: list) -> dict:
    """TRL's vision ``collator`` on ``rows``; the processor's refusal names the batch's rows."""
    try:
        return collator([dict(r) for r in rows])   # (TRL's collator rewrites its examples' keys)
    except ValueError as e:
        raise DataError(f"{', '.join(names)}: the processor refused the batch: {e}") from e


def rows_over(out: dict, max_length: int, image_ids: list, refuse) -> tuple:
    """(each row's length, the rows longer than ``max_length``) of a collated batch; a long row whose
    image tokens reach past ``max_length`` is refused by ``refuse(i, length, image tokens, last
    position)`` (it raises: image tokens are never truncated)."""
    ids, lengths = out["input_ids"], out["attention_mask"].sum(dim=1).tolist()
    long = [i for i, n in enumerate(lengths) if n > max_length]
    marks = torch.tensor(image_ids, dtype=ids.dtype)
    for i in long:
        at = torch.isin(ids[i], marks).nonzero().flatten() if image_ids else torch.empty(0)
        if at.numel() and int(at[-1]) >= max_length:
            refuse(i, lengths[i], int(at.numel()), int(at[-1]))
    return lengths, long


def with_row_index(ds, what: str = "train_dataset"):
    """``ds`` with the :data:`ROW` column (each row's name, ``what[i]``), so a batch names its rows."""
    import datasets

    if ROW in column_names(ds):
        return ds
    if isinstance(ds, datasets.Dataset):
        return ds.add_column(ROW, [f"{what}[{i}]" for i in range(len(ds))])
    return ds.map(lambda ex, i: {ROW: f"{what}[{i}]"}, with_indices=True)


def image_token_ids(processor) -> set:
    """The ids of the processor's image tokens (what the model replaces with image features)."""
    tok = processor.tokenizer
    ids = set()
    for attr in ("image_token_id", "image_token_index"):
        v = getattr(processor, attr, None)
        if isinstance(v, int):
            ids.add(v)
    token = getattr(processor, "image_token", None)
    if isinstance(token, str) and token in tok.get_vocab():
        ids.add(tok.convert_tokens_to_ids(token))
    return ids


#: rows a vision dataset's plan is made from (the processor runs on them before the engine is built)
PLAN_ROWS = 8


def planned_rows(collate, rows: list, image_ids, max_length: Optional[int]) -> Optional[tuple]:
    """(the longest row's tokens -- at most ``max_length`` --, the most image tokens a row has) of
    ``rows`` as ``collate`` (TRL's vision collator, ``max_length=None``) makes them: what the
    engine's plan prices a step at (``Workload.seq``, ``Workload.image_tokens``), counted before
    the engine is built. None where it cannot say (no rows, no image token id, the processor
    refused a row: the rows are checked, and named, when they are prepared)."""
    if not rows or not image_ids:
        return None
    try:
        out = collate([dict(r) for r in rows])
    except Exception:   # (a probe: a row the collator refuses is named when the data is prepared)
        return None
    ids, lengths = out["input_ids"], out["attention_mask"].sum(dim=1)
    images = torch.isin(ids, torch.tensor(sorted(image_ids), dtype=ids.dtype)).sum(dim=1)
    seq = int(lengths.max())
    return (min(seq, max_length) if max_length else seq), int(images.max())


def vision_rows_plan(processor, dataset, max_length: Optional[int], text_field: str = "text",
                     preference: bool = False) -> Optional[tuple]:
    """:func:`planned_rows` of ``dataset``'s first :data:`PLAN_ROWS` rows, collated by TRL's vision
    collator for ``processor`` (``preference``: its preference pairs' collator, chosen and
    rejected rows both counted)."""
    if preference:
        from trl.trainer.dpo_trainer import DataCollatorForVisionPreference
        collate = DataCollatorForVisionPreference(processor=processor, max_length=None)
        keep = {"prompt", "chosen", "rejected", "image", "images", "tools", "chat_template_kwargs"}
    else:
        from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling
        collate = DataCollatorForVisionLanguageModeling(processor=processor, max_length=None,
                                                        dataset_text_field=text_field)
        keep = set(VISION_COLUMNS) | {text_field}
    try:
        rows = head_rows(dataset, PLAN_ROWS)
    except Exception:   # (a probe: a dataset it cannot read is named when it is prepared)
        return None
    rows = [{k: v for k, v in dict(r).items() if k in keep} for r in rows]
    return planned_rows(collate, rows, image_token_ids(processor), max_length)


def with_image_tokens(work, rows: Optional[tuple]):
    """``work`` (a run's :class:`~megatrain_nb.engine.planning.planner.Workload`) with the vision
    rows' length and image tokens (:func:`vision_rows_plan`; as it is where None)."""
    if rows is None:
        return work
    seq, images = rows
    return dataclasses.replace(work, seq=max(seq, images), image_tokens=images)


class VisionCollator:
    """TRL's ``DataCollatorForVisionLanguageModeling`` on TRL's vision columns, with the rows
    checked and named, image tokens never truncated, and the processor's extra outputs put
    under ``extra_inputs``. ``report`` counts the rows truncated (by their text only)."""

    def __init__(self, processor, *, max_length: Optional[int], completion_only_loss: bool, dataset_text_field: str,
                 assistant_only_loss: bool, chat_template: Optional[str], pad_to_multiple_of: Optional[int],
                 what: str = "train_dataset"):
        from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

        kw = dict(processor=processor, completion_only_loss=completion_only_loss, pad_to_multiple_of=pad_to_multiple_of,
                  dataset_text_field=dataset_text_field, assistant_only_loss=assistant_only_loss,
                  chat_template=chat_template)
        self.whole = DataCollatorForVisionLanguageModeling(max_length=None, **kw)
        self.cut = DataCollatorForVisionLanguageModeling(max_length=max_length, **kw) if max_length else None
        self.max_length, self.text_field, self.what = max_length, dataset_text_field, what
        self.image_ids = sorted(image_token_ids(processor))
        self.report = PrepReport(what=what, format="vision")

    def _rows(self, examples: list) -> tuple:
        keep = set(VISION_COLUMNS) | {self.text_field}
        rows, names = [], []
        for j, ex in enumerate(examples):
            name = ex.get(ROW) or f"{self.what}: row {j} of a batch"
            bad = vision_row_problem(ex, self.text_field) if is_vision_row(ex) else \
                "it has no 'image' or 'images' column (a vision dataset gives every row its images)"
            if bad:
                raise DataError(f"{name}: {bad}")
            rows.append({k: v for k, v in ex.items() if k in keep})
            names.append(name)
        return rows, names

    def _check_lengths(self, out: dict, names: list) -> list:
        """The rows longer than max_length (by their text only: refused when images reach past it)."""
        def refuse(i, length, n_image, last):
            raise DataError(
                f"{names[i]} has {length} tokens, {n_image} of them its images' "
                f"(the last at position {last}), more than max_length={self.max_length}: image tokens "
                "are never truncated (the model would get images without their tokens). Raise "
                "SFTConfig.max_length, set it to None (TRL's advice for vision data), or make the images smaller "
                "(the processor's max_pixels)")
        lengths, long = rows_over(out, self.max_length, self.image_ids, refuse)
        self.report.examples += len(lengths)
        if long:
            first = self.report.truncated == 0
            self.report.truncated += len(long)
            self.report.tokens_dropped += sum(lengths[i] - self.max_length for i in long)
            if first:
                warnings.warn(f"{names[long[0]]} has {lengths[long[0]]} tokens, more than max_length="
                              f"{self.max_length}, its images within it: its text is truncated (as TRL truncates), "
                              "as is any later such row, counted in trainer.prep_reports", stacklevel=3)
        return long

    def __call__(self, examples: list) -> dict:
        rows, names = self._rows(examples)
        out = collate_named(self.whole, rows, names)
        if self.max_length is not None and self._check_lengths(out, names):
            out = collate_named(self.cut, rows, names)
        return split_extras(out)


def save_with_processor(trainer, output_dir: Optional[str]) -> str:
    """``save_model`` of a trainer with a processor (SFT's, DPO's): the model's folder and the
    processor's files (``AutoProcessor`` loads it), the weights held still while it writes."""
    trainer.hooks.hold_weights("save_model()")
    return saving.save_model_folder(trainer.engine, trainer.processor, trainer.dist,
                                    Path(output_dir or trainer.args.output_dir))


def split_extras(out) -> dict:
    """A vision collator's output as a batch: the token keys, and the processor's other outputs
    (``pixel_values``, ``image_grid_thw``, ...) under ``extra_inputs`` for the model's forward."""
    batch = {k: out[k] for k in (*TOKEN_KEYS, "position_ids") if out.get(k) is not None}
    extras = {k: v for k, v in out.items() if k not in batch and torch.is_tensor(v)}
    if extras:
        batch[EXTRA_INPUTS] = extras
    return batch


class UserVisionCollator:
    """A user's collator for vision rows (it gets the rows as they are, as TRL gives them), its
    output split as :func:`split_extras` splits it."""

    def __init__(self, collator):
        self.collator = collator

    def __call__(self, examples: list) -> dict:
        return split_extras(self.collator([{k: v for k, v in ex.items() if k != ROW} for ex in examples]))
