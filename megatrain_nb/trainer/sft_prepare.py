"""The steps of :func:`prepare_sft_dataset` (defined at the end), in the order of TRL's
``SFTTrainer._prepare_dataset``: rows checked and converted to TRL's formats, tokenised as TRL's
``tokenize_fn`` does, labels from the completion / assistant masks, truncation, examples with no
target token dropped or refused, packing.

A map-style dataset is checked and counted at once; an iterable one (``datasets.IterableDataset``)
lazily, by ``map`` / ``filter`` functions that run as the trainer reads its rows: the same checks,
errors that name the row, truncations counted as they happen and reported at the first.

Example::

    ds, report = prepare_sft_dataset(ds, tokenizer, opts)   # runs these steps in order
"""
from __future__ import annotations

import json
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Optional

from .data import DataError
from .sft_data import (FORMATS, PrepReport, SFTDataOptions, alpaca_to_prompt_completion, as_dataset,
                       check_conversation, column_names, detect_format, has_assistant_turn, head_rows, row_format,
                       row_problem, sharegpt_to_messages, to_trl_rows)


class Preparation:
    """The steps of :func:`prepare_sft_dataset` on one dataset, in TRL's order. A map-style
    dataset is checked and counted at once; an iterable one lazily, in ``map``/``filter``
    functions that run as the trainer reads the rows (counts in :attr:`report` grow as it does)."""

    def __init__(self, tokenizer, opts: SFTDataOptions, what: str, is_map: bool):
        self.tokenizer, self.opts, self.what, self.is_map = tokenizer, opts, what, is_map
        self.report = PrepReport(what=what)
        self.map_kwargs = {"num_proc": opts.dataset_num_proc} if is_map else {}
        self.conversational = False

    def map(self, ds, fn, **kw):
        return ds.map(fn, **kw, **self.map_kwargs)

    # ---- rows: one format, TRL's; conversations the template renders
    def checked_rows(self, ds, fmt: str, text_field: str, n_head: int):
        """Rows of TRL's formats (alpaca and sharegpt converted), each of format ``fmt`` and, if
        conversational, with no empty assistant turn and only roles the chat template renders."""
        import datasets

        if not self.is_map:
            return self._checked_lazily(ds, fmt, text_field)
        if fmt in ("alpaca", "sharegpt"):   # every row is checked (the head only was so far), then converted
            rows = [ds[i] for i in range(len(ds))]
            detect_format(rows, text_field, self.what)
            ds = datasets.Dataset.from_list(to_trl_rows(rows, fmt, self.what))
        elif len(ds) > n_head:
            detect_format([ds[i] for i in range(len(ds))], text_field, self.what)
        if self._is_conversational(ds):
            for i in range(len(ds)):
                self.check_conversation(ds[i], i)
            if self.opts.assistant_only_loss:
                keep = [i for i in range(len(ds)) if has_assistant_turn(ds[i])]
                if len(keep) < len(ds):
                    self.report.no_assistant_dropped = len(ds) - len(keep)
                    if not keep:
                        raise DataError(f"{self.what}: no conversation has an assistant turn, so nothing is left to "
                                        "learn with assistant_only_loss=True")
                    ds = ds.select(keep)
        return ds

    def _keep_assistant_counted(self, ex) -> bool:   # an iterable dataset's: counted as they are read
        keep = has_assistant_turn(ex)
        if not keep:
            self.report.no_assistant_dropped += 1
        return keep

    def _checked_lazily(self, ds, fmt: str, text_field: str):
        convert = {"alpaca": lambda ex, i: alpaca_to_prompt_completion(ex),
                   "sharegpt": lambda ex, i: sharegpt_to_messages(ex, i, self.what)}.get(fmt)

        def one_format(ex, i):
            f = row_format(ex, text_field)
            if f != fmt:
                raise DataError(mixed_row_message(ex, i, f, fmt, text_field, self.what))
            bad = row_problem(ex, f, text_field)
            if bad:
                raise DataError(f"{self.what}[{i}] ({f}): {bad}")
            return convert(ex, i) if convert is not None else {}

        ds = ds.map(one_format, with_indices=True, remove_columns=column_names(ds) if convert else None)
        if self._is_conversational(ds):
            ds = ds.map(lambda ex, i: self.check_conversation(ex, i) or {}, with_indices=True)
            if self.opts.assistant_only_loss:
                ds = ds.filter(self._keep_assistant_counted)
        return ds

    def _is_conversational(self, ds) -> bool:
        from trl.data_utils import is_conversational

        self.conversational = is_conversational(next(iter(ds)))
        if self.conversational and self.opts.chat_template is None and \
                not getattr(self.tokenizer, "chat_template", None):
            raise DataError(f"{self.what} is conversational but the tokenizer has no chat template. Give one: "
                            "SFTConfig(chat_template_path='template.jinja'), or set tokenizer.chat_template "
                            "(a Jinja string) before building the trainer")
        return self.conversational

    def check_conversation(self, ex: dict, i: int) -> None:
        msgs = ex["messages"] if ex.get("messages") is not None else list(ex["prompt"]) + list(ex["completion"])
        check_conversation(msgs, self.tokenizer, self.opts.chat_template, i, self.what, tools=_tools(ex))

    # ---- tokens and labels
    def tokenized(self, ds):
        from trl.data_utils import common_prefix_length

        tokenizer, opts, what = self.tokenizer, self.opts, self.what
        if not self.conversational:
            eos, field_ = tokenizer.eos_token, opts.dataset_text_field

            def add_eos(example):
                if field_ in example and not example[field_].endswith(eos):
                    example[field_] = example[field_] + eos
                elif "completion" in example and not example["completion"].endswith(eos):
                    example["completion"] = example["completion"] + eos
                return example

            ds = self.map(ds, add_eos, remove_columns="messages" if "messages" in column_names(ds) else None)

        def tokenize(example, idx):
            return _tokenize_example(example, idx, tokenizer, opts, what, common_prefix_length)

        return self.map(ds, tokenize, with_indices=True)

    def with_labels(self, ds):
        if "labels" in column_names(ds):
            return ds
        columns = column_names(ds)
        masks = [c for c in ("completion_mask", "assistant_masks") if c in columns
                 and (c != "completion_mask" or self.opts.completion_only_loss)]

        def build_labels(example):
            bits = [example[c] for c in masks]
            return {"labels": [t if all(b) else -100 for t, *b in zip(example["input_ids"], *bits)]}

        return self.map(ds, build_labels, remove_columns=masks)

    # ---- truncation, examples with no target, packing
    def count_long(self, lengths) -> None:
        """Count examples longer than max_length (at once: all ``lengths``; lazily: one row at a time)."""
        m = self.opts.max_length
        r = self.report
        r.examples += len(lengths)
        r.truncated += sum(n > m for n in lengths)
        r.tokens_dropped += sum(max(n - m, 0) for n in lengths)

    def counted(self, fn):
        """``fn(example, idx)`` that also counts (and, the first time, reports) the long examples it sees."""
        def counting(example, idx):
            was = self.report.truncated
            self.count_long([len(example["input_ids"])])
            if was == 0 and self.report.truncated == 1:
                warnings.warn(f"{self.what}[{idx}] has {len(example['input_ids'])} tokens, more than max_length="
                              f"{self.opts.max_length}: it and any later such example are truncated, counted in "
                              "trainer.prep_reports (raise SFTConfig.max_length to keep them)", stacklevel=2)
            return fn(example, idx)
        return counting

    def truncated(self, ds):
        opts = self.opts
        if opts.max_length is None or opts.packing:
            return ds
        if opts.truncation_mode not in ("keep_start", "keep_end"):
            raise DataError(f"truncation_mode={opts.truncation_mode!r}: use 'keep_start' or 'keep_end'")
        sl = slice(None, opts.max_length) if opts.truncation_mode == "keep_start" else slice(-opts.max_length, None)

        def cut(ex, idx=0):
            return {"input_ids": ex["input_ids"][sl], "labels": ex["labels"][sl]}

        if self.is_map:
            self.count_long([len(x) for x in ds["input_ids"]])
            return self.map(ds, cut)
        return ds.map(self.counted(cut), with_indices=True)

    def with_target(self, ds):
        """Drop (after truncation, counted, as TRL drops them) or refuse the examples with no
        token counted in the loss: they add nothing but a zero-loss step."""
        opts, what = self.opts, self.what
        before = len(ds) if self.is_map else None
        cut = opts.max_length is not None and (not opts.packing or opts.packing_strategy == "bfd")
        if cut and opts.packing:   # bfd packing truncates a long document: what it keeps must hold a target
            limit = opts.max_length
            ds = ds.filter((lambda ex: has_target(ex, limit)) if self.is_map else
                           (lambda ex: self._keep_counted(ex, limit)), **self.map_kwargs)
        elif cut:
            ds = ds.filter(has_target if self.is_map else self._keep_counted, **self.map_kwargs)
        elif self.is_map:
            empty = [i for i, lab in enumerate(ds["labels"]) if all(t == -100 for t in lab)]
            if empty:
                raise DataError(no_target_message(what, empty[0], len(empty) - 1))
        else:
            ds = ds.map(self._refuse_no_target, with_indices=True)
        if self.is_map:
            self.report.examples = self.report.examples or before
            self.report.no_target_dropped = before - len(ds)
            if len(ds) == 0:
                raise DataError(f"{what}: no example is left with a token to learn from after truncation to "
                                f"max_length={opts.max_length}; raise max_length")
        return ds

    def _keep_counted(self, ex, limit=None) -> bool:   # an iterable dataset's: counted as they are read
        keep = has_target(ex, limit)
        if not keep:
            self.report.no_target_dropped += 1
        return keep

    def _refuse_no_target(self, ex, idx):
        if not has_target(ex):
            raise DataError(no_target_message(self.what, idx, None))
        return {}

    def packed(self, ds):
        from trl.data_utils import pack_dataset

        opts = self.opts
        if opts.max_length is None:
            raise DataError("packing=True needs max_length (the packed row length); set SFTConfig.max_length")
        bfd = opts.packing_strategy == "bfd"   # bfd truncates documents longer than a row
        if self.is_map:
            lengths = [len(x) for x in ds["input_ids"]]
            self.report.examples = len(lengths) if not bfd else 0
            if bfd:
                self.count_long(lengths)
        elif bfd:
            ds = ds.map(self.counted(lambda ex, idx: {}), with_indices=True)
        ds = ds.select_columns(["input_ids", "labels"])
        if opts.shuffle_dataset:
            ds = ds.shuffle(seed=opts.seed)
        return pack_dataset(ds, opts.max_length, opts.packing_strategy, self.map_kwargs)


def has_target(ex: dict, limit: Optional[int] = None) -> bool:
    """A token counted in the loss (among the first ``limit``: what a truncation keeps)."""
    return any(t != -100 for t in ex["labels"][:limit])


def mixed_row_message(ex: dict, i: int, f: Optional[str], fmt: str, text_field: str, what: str) -> str:
    if f is None:
        return (f"{what}[{i}] has keys {sorted(k for k, v in ex.items() if v is not None)}: not a format "
                f"SFTTrainer reads ({', '.join(FORMATS)}; text is read from '{text_field}' = "
                "SFTConfig.dataset_text_field)")
    return (f"{what} mixes formats: row {i} is {f}, the rows before it {fmt}. Convert the rows to one "
            "format first")


def no_target_message(what: str, i: int, more: Optional[int]) -> str:
    also = f" (and {more} more)" if more else ""
    return (f"{what}[{i}]{also} has no token counted in the loss (its completion or assistant turns are empty "
            "or masked); remove such examples")


def _tools(example):
    tools = example.get("tools")
    return json.loads(tools) if isinstance(tools, str) else tools


def _chat(tokenizer, messages, **kw) -> dict:
    return tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kw)


def _tokenize_example(example: dict, idx: int, tokenizer, opts: SFTDataOptions, what: str, prefix_len) -> dict:
    """One row as TRL tokenises it (``SFTTrainer._prepare_dataset``'s ``tokenize_fn``)."""
    from trl.data_utils import is_conversational

    kw = {"chat_template": opts.chat_template, "tools": _tools(example), **(example.get("chat_template_kwargs") or {})}
    out: dict[str, Any] = {}
    if "prompt" in example and example.get("prompt") is not None:
        if is_conversational(example):
            prompt_ids = _chat(tokenizer, example["prompt"], add_generation_prompt=True, **kw)["input_ids"]
            full = _chat(tokenizer, list(example["prompt"]) + list(example["completion"]),
                         return_assistant_tokens_mask=opts.assistant_only_loss, **kw)
            ids = full["input_ids"]
            if "assistant_masks" in full:
                out["assistant_masks"] = full["assistant_masks"]
        else:
            prompt_ids = tokenizer(text=example["prompt"])["input_ids"]
            ids = tokenizer(text=example["prompt"] + example["completion"])["input_ids"]
        n = prefix_len(prompt_ids, ids)
        if n < len(prompt_ids):
            warnings.warn(f"{what}[{idx}]: the tokenized prompt is not a prefix of prompt+completion; the "
                          "completion starts where they diverge (as in TRL)", stacklevel=2)
        out["input_ids"] = ids
        out["completion_mask"] = [0] * n + [1] * (len(ids) - n)
    elif is_conversational(example):
        done = _chat(tokenizer, example["messages"], return_assistant_tokens_mask=opts.assistant_only_loss, **kw)
        out = {k: done[k] for k in ("input_ids", "assistant_masks") if k in done}
    else:
        out = {"input_ids": tokenizer(text=example[opts.dataset_text_field])["input_ids"]}
    if "assistant_masks" in out and 1 not in out["assistant_masks"]:
        raise DataError(f"{what}[{idx}] has no assistant token in its assistant mask with assistant_only_loss=True: "
                        "the chat template marks no span with {% generation %} for it (or it has no assistant "
                        "turn). Check the template's generation marks and the example")
    return out


def prepare_sft_dataset(ds, tokenizer, opts: SFTDataOptions, *, formatting_func: Optional[Callable] = None,
                        what: str = "train_dataset") -> tuple:
    """``(dataset, report)``: ``ds`` tokenised with ``input_ids`` and ``labels`` (-100: not in the
    loss), truncated or packed (``seq_lengths`` per packed row), as ``trl.SFTTrainer`` prepares it.

    A map-style dataset is checked row by row here; an iterable one as its rows are read (the
    error names the row), its truncations counted as they happen and reported at the first.
    The ``datasets`` "Map" progress bars stay off meanwhile (a few maps per dataset, each over
    in a blink: six bars in a notebook said nothing the report does not)."""
    with _no_progress_bars():
        return _prepare(ds, tokenizer, opts, formatting_func, what)


@contextmanager
def _no_progress_bars():
    import datasets

    was = not datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was:
            datasets.enable_progress_bars()


def _prepare(ds, tokenizer, opts: SFTDataOptions, formatting_func, what: str) -> tuple:
    import datasets

    ds = as_dataset(ds, what, None if formatting_func is not None else opts.dataset_text_field)
    prep = Preparation(tokenizer, opts, what, isinstance(ds, datasets.Dataset))
    if prep.is_map and len(ds) == 0:
        raise DataError(f"{what} is empty (0 examples)")
    text_field = "text" if formatting_func is not None else opts.dataset_text_field
    if formatting_func is not None and "input_ids" not in column_names(ds):
        # the formatter's text is the example (language modelling): the source columns go
        ds = prep.map(ds, lambda ex: {"text": formatting_func(ex)}, batched=False,
                      remove_columns=[c for c in column_names(ds) if c != "text"])
    head = head_rows(ds)
    if not head:
        raise DataError(f"{what} is empty (it yielded no examples)")
    prep.report.format = fmt = detect_format(head, text_field, what)
    if fmt != "tokens":
        ds = prep.tokenized(prep.checked_rows(ds, fmt, text_field, len(head)))
    ds = prep.with_target(prep.truncated(prep.with_labels(ds)))
    if opts.packing:
        ds = prep.packed(ds)
    if opts.shuffle_dataset:
        ds = ds.shuffle(seed=opts.seed)
    return ds, prep.report
