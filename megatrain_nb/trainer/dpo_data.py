"""Preference data for :class:`~megatrain_nb.trainer.dpo.DPOTrainer`, prepared as
``trl.DPOTrainer._prepare_dataset`` prepares it (trl 1.x), on TRL's public utilities and in TRL's
order: the prompt extracted when there is none (``extract_prompt``), EOS added to plain-text
completions, prompt / prompt+chosen / prompt+rejected tokenised (the chat template for
conversational rows), the completion starting where prompt and prompt+completion diverge
(``common_prefix_length``), and with ``keep_start`` truncation the rows whose prompt alone fills
``max_length`` dropped (counted and reported). Rows are checked first, each bad one named.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Optional

from megatrain_nb.assets import preference_rows

from .data import DataError

PREF_KEYS = ("prompt_ids", "chosen_ids", "rejected_ids")


@dataclass
class PreferenceReport:
    """What preparation decided for one dataset (kept on the trainer, warned once)."""
    what: str = "train_dataset"
    examples: int = 0
    conversational: bool = False
    implicit_prompt: bool = False
    dropped_prompt_too_long: int = 0
    same_after_truncation: tuple = ()   # rows whose chosen and rejected sequences are equal once cut to max_length

    def message(self) -> str:
        lines = []
        if self.dropped_prompt_too_long:
            lines.append(f"{self.what}: {self.dropped_prompt_too_long} of {self.examples} pairs were dropped because "
                         "their prompt alone fills max_length (no completion token would be left to learn from, as "
                         "TRL drops them); raise DPOConfig.max_length to keep them")
        rows = self.same_after_truncation
        if rows:
            shown = ", ".join(str(i) for i in rows[:10]) + (f" and {len(rows) - 10} more" if len(rows) > 10 else "")
            lines.append(f"{self.what}: {len(rows)} of {self.examples} pairs (row {shown}) have the same chosen and "
                         "rejected tokens once cut to max_length: they carry no preference (their loss has no "
                         "gradient); raise DPOConfig.max_length or drop them")
        return "\n".join(lines)


def _is_conv(value) -> bool:
    return isinstance(value, list) and (not value or isinstance(value[0], dict))


def check_preference_rows(ds, what: str, cols=None) -> None:
    """Every row has ``chosen`` and ``rejected`` of one format (text or messages) and they differ."""
    cols = set(ds.column_names or []) if cols is None else cols
    missing = [c for c in ("chosen", "rejected") if c not in cols]
    if missing:
        raise DataError(f"{what} has no {missing} column: preference rows need 'chosen' and 'rejected' (and "
                        f"optionally 'prompt'); its columns are {sorted(cols)}")
    if "image" in cols or "images" in cols:
        raise DataError(f"{what} holds images ('image'/'images' column) but was read as text pairs (its first row "
                        "has none): give every row its images (an empty list for a text-only row) and the model's "
                        "processor as processing_class")
    first = None
    for i, ex in enumerate(ds):
        kind = _row_kind(ex, i, what)
        if first is None:
            first = kind
        elif kind != first:
            raise DataError(f"{what} row {i} is {kind} but row 0 is {first}: a dataset holds one format")
        _check_answers(ex, i, what, kind, implicit="prompt" not in cols)


def _row_kind(ex: dict, i: int, what: str) -> str:
    """"text" or "messages": the row's one format (refused naming the row: a missing or None
    chosen/rejected, another type, mixed formats)."""
    kinds = {}
    for c in ("prompt", "chosen", "rejected"):
        if c not in ex:
            if c == "prompt":
                continue
            raise DataError(f"{what} row {i} has no '{c}' (its keys are {sorted(ex)}); every pair needs a chosen and "
                            "a rejected completion")
        v = ex[c]
        if v is None:
            raise DataError(f"{what} row {i}: '{c}' is missing (None); every pair needs a chosen and a "
                            "rejected completion")
        if not isinstance(v, str) and not _is_conv(v):
            raise DataError(f"{what} row {i}: '{c}' is a {type(v).__name__}; give text or a list of "
                            "messages")
        kinds[c] = "messages" if _is_conv(v) else "text"
    if len(set(kinds.values())) > 1:
        raise DataError(f"{what} row {i} mixes formats: {kinds}; prompt, chosen and rejected are all text or "
                        "all lists of messages")
    return next(iter(kinds.values()))


def _empty(text) -> bool:
    return not isinstance(text, str) or not text.strip()


def _check_answers(ex: dict, i: int, what: str, kind: str, implicit: bool) -> None:
    """Refused naming the row: chosen equal to rejected, an empty or whitespace answer, an empty
    list of messages or an empty assistant message, and (implicit prompt) a chosen and a rejected
    from two different conversations."""
    if ex["chosen"] == ex["rejected"]:
        raise DataError(f"{what} row {i}: chosen and rejected are the same; the pair carries no preference. "
                        "Remove it or fix the data")
    for c in ("chosen", "rejected"):
        v = ex[c]
        if kind == "text" and not implicit and _empty(v):
            raise DataError(f"{what} row {i}: the {c} answer is empty (or only whitespace); every pair needs an "
                            "answer on each side. Remove the row or fix the data")
        if kind == "messages":
            if not v:
                raise DataError(f"{what} row {i}: '{c}' is an empty list of messages; every pair needs an answer "
                                "on each side")
            for j, m in enumerate(v):
                if not isinstance(m, dict) or "role" not in m:
                    raise DataError(f"{what} row {i}: '{c}' message {j} is not a {{'role', 'content'}} message")
                if m["role"] == "assistant" and _empty(m.get("content")):
                    raise DataError(f"{what} row {i}: '{c}' message {j} (assistant) is empty; an answer needs text. "
                                    "Remove the row or fix the data")
    if implicit:
        _check_implicit(ex, i, what, kind)


def _check_implicit(ex: dict, i: int, what: str, kind: str) -> None:
    """Chosen and rejected without a prompt: the prompt is their shared start (TRL's
    ``extract_prompt``); none, or a user turn after it, means two different conversations."""
    c, r = ex["chosen"], ex["rejected"]
    n = 0
    while n < min(len(c), len(r)) and c[n] == r[n]:
        n += 1
    if kind == "text":
        if n == 0 or _empty(c[n:]) or _empty(r[n:]):
            raise DataError(f"{what} row {i}: chosen and rejected (no 'prompt' column) "
                            + ("share no start, so the implicit prompt is empty: two different texts?"
                               if n == 0 else "differ only in whitespace after their shared start")
                            + " Give a 'prompt' column, or fix the row")
        return
    turns = [m.get("role") for m in c[n:] + r[n:]]
    if n == 0 or any(t != "assistant" for t in turns):
        raise DataError(f"{what} row {i}: chosen and rejected (no 'prompt' column) are two different conversations: "
                        + ("they share no first message" if n == 0 else "they differ at a "
                           f"{next(t for t in turns if t != 'assistant')!r} turn, not only in the assistant's answer")
                        + ". The implicit prompt is what they share; give a 'prompt' column, or fix the row")


def _tokenize(tok, value, **kw) -> list:
    if isinstance(value, list):
        return list(tok.apply_chat_template(value, tokenize=True, return_dict=True, **kw)["input_ids"])
    return list(tok(text=value)["input_ids"])


def _add_eos(example, eos_token):
    for c in ("chosen", "rejected"):
        if not example[c].endswith(eos_token):
            example[c] = example[c] + eos_token
    return example


def _tokenize_pair(example, tok):
    """TRL's ``tokenize_fn``: prompt / chosen / rejected ids, the completion from where they diverge."""
    from trl.data_utils import common_prefix_length, is_conversational

    tools = example.get("tools")
    tools = json.loads(tools) if isinstance(tools, str) else tools
    kw = {"tools": tools, **(example.get("chat_template_kwargs") or {})}
    if is_conversational(example):
        prompt = _tokenize(tok, example["prompt"], add_generation_prompt=True, **kw)
        chosen = _tokenize(tok, example["prompt"] + example["chosen"], **kw)
        rejected = _tokenize(tok, example["prompt"] + example["rejected"], **kw)
    else:
        prompt = _tokenize(tok, example["prompt"])
        chosen = _tokenize(tok, example["prompt"] + example["chosen"])
        rejected = _tokenize(tok, example["prompt"] + example["rejected"])
    n = min(common_prefix_length(prompt, chosen), common_prefix_length(prompt, rejected))
    return {"prompt_ids": prompt[:n], "chosen_ids": chosen[n:], "rejected_ids": rejected[n:]}


def prepare_preference_dataset(ds, tok, *, max_length: Optional[int], truncation_mode: str, what: str,
                               num_proc: Optional[int] = None):
    """``ds`` (a Dataset or a list of dicts) tokenised as TRL's DPOTrainer tokenises it; returns
    ``(dataset, PreferenceReport)``."""
    import datasets
    from trl.data_utils import extract_prompt, is_conversational

    if isinstance(ds, datasets.IterableDataset):
        return prepare_iterable(ds, tok, max_length=max_length, truncation_mode=truncation_mode, what=what)
    if isinstance(ds, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        raise DataError(f"{what} is a DatasetDict with splits {list(ds)}; pass one split, e.g. ds['train']")
    if isinstance(ds, (list, tuple)):
        rows = [dict(r) for r in ds]
        if rows and not all(k in rows[0] for k in PREF_KEYS):   # checked before Arrow refuses mixed types
            check_preference_rows(rows, what, cols={k for r in rows for k in r})
        ds = datasets.Dataset.from_list(rows)
    if not isinstance(ds, datasets.Dataset):
        raise DataError(f"{what} is a {type(ds).__name__}; DPOTrainer takes a datasets.Dataset or a list of dicts")
    if len(ds) == 0:
        raise DataError(f"{what} is empty (0 examples)")
    if all(k in ds.column_names for k in PREF_KEYS):   # already tokenised (TRL skips it too)
        report = PreferenceReport(what, len(ds))
        report.same_after_truncation = check_token_rows(ds, what, max_length, truncation_mode)
        return ds, report
    check_preference_rows(ds, what)
    report = PreferenceReport(what, len(ds))
    kw = {"num_proc": num_proc}
    if "prompt" not in ds.column_names:
        report.implicit_prompt = True
        ds = ds.map(extract_prompt, desc=f"Extracting prompt from {what}", **kw)
    report.conversational = is_conversational(ds[0])
    if not report.conversational:
        ds = ds.map(_add_eos, fn_kwargs={"eos_token": tok.eos_token}, desc=f"Adding EOS to {what}", **kw)
    ds = ds.map(_tokenize_pair, fn_kwargs={"tok": tok}, desc=f"Tokenizing {what}", **kw)
    report.same_after_truncation = check_token_rows(ds, what, max_length, truncation_mode)
    if max_length is not None and truncation_mode == "keep_start":
        n = len(ds)
        ds = ds.filter(lambda ex: len(ex["prompt_ids"]) < max_length, desc=f"Dropping fully truncated {what}", **kw)
        report.dropped_prompt_too_long = n - len(ds)
        if len(ds) == 0:
            raise DataError(f"{what}: every pair's prompt fills max_length={max_length}; nothing is left to train "
                            "on. Raise DPOConfig.max_length")
    return ds, report


def check_token_ids(ex: dict, i: int, what: str) -> None:
    """One tokenised pair: refused naming the row when a completion is empty or both are the same
    tokens (chosen = rejected + EOS among them: plain-text answers get an EOS when they lack one)."""
    for c in ("chosen_ids", "rejected_ids"):
        if not ex[c]:
            raise DataError(f"{what} row {i}: the {c[:-4]} completion is empty once tokenised; every pair needs at "
                            "least one completion token on each side")
    if list(ex["chosen_ids"]) == list(ex["rejected_ids"]):
        raise DataError(f"{what} row {i}: chosen and rejected are the same tokens once tokenised (e.g. one is the "
                        "other with the EOS token added); the pair carries no preference. Remove it or fix the data")


def _same_after_cut(ex: dict, max_length: int, mode: str) -> bool:
    cut = slice(None, max_length) if mode == "keep_start" else slice(-max_length, None)
    prompt = list(ex["prompt_ids"])
    if mode == "keep_start" and len(prompt) >= max_length:
        return False   # dropped (its prompt alone fills max_length), counted apart
    return (prompt + list(ex["chosen_ids"]))[cut] == (prompt + list(ex["rejected_ids"]))[cut]


def check_token_rows(ds, what: str, max_length: Optional[int], truncation_mode: str) -> tuple:
    """Every tokenised pair checked (:func:`check_token_ids`); the rows whose chosen and
    rejected sequences are the same once cut to ``max_length`` as the collator cuts them (kept,
    and warned: :class:`PreferenceReport`)."""
    same = []
    for i, ex in enumerate(ds.select_columns(list(PREF_KEYS))):
        check_token_ids(ex, i, what)
        if max_length is not None and _same_after_cut(ex, max_length, truncation_mode):
            same.append(i)
    return tuple(same)


def check_row(ex: dict, i: int, what: str, first_kind: str) -> None:
    """One row's checks (:func:`check_preference_rows`), for rows read lazily."""
    kind = _row_kind(ex, i, what)
    if kind != first_kind:
        raise DataError(f"{what} row {i} is {kind} but row 0 is {first_kind}: a dataset holds one format")
    _check_answers(ex, i, what, kind, implicit=ex.get("prompt") is None)


def prepare_iterable(ds, tok, *, max_length: Optional[int], truncation_mode: str, what: str):
    """An IterableDataset prepared lazily, as TRL maps it (each row checked as it is read; the
    count of dropped pairs is not known ahead)."""
    from trl.data_utils import extract_prompt, is_conversational

    first = next(iter(ds), None)
    if first is None:
        raise DataError(f"{what} is empty (0 examples)")
    if "chosen" not in first or "rejected" not in first:
        raise DataError(f"{what} rows need 'chosen' and 'rejected' (and optionally 'prompt'); the first row has "
                        f"{sorted(first)}")
    if all(k in first for k in PREF_KEYS):
        return ds, PreferenceReport(what)
    kind = "messages" if _is_conv(first["chosen"]) else "text"
    ds = ds.map(lambda ex, i: check_row(ex, i, what, kind) or ex, with_indices=True)
    report = PreferenceReport(what, conversational=kind == "messages", implicit_prompt="prompt" not in first)
    if report.implicit_prompt:
        ds = ds.map(extract_prompt)
    if not is_conversational(first):
        ds = ds.map(_add_eos, fn_kwargs={"eos_token": tok.eos_token})
    ds = ds.map(_tokenize_pair, fn_kwargs={"tok": tok})
    ds = ds.map(lambda ex, i: check_token_ids(ex, i, what) or ex, with_indices=True)
    if max_length is not None and truncation_mode == "keep_start":
        ds = ds.filter(lambda ex: len(ex["prompt_ids"]) < max_length)
    return ds, report


def token_fingerprint(ds) -> str:
    """A hash of the tokenised pairs (what the reference log-probs depend on in the data)."""
    h = hashlib.sha256()
    for ex in ds.select_columns(list(PREF_KEYS)):
        h.update(json.dumps([ex[k] for k in PREF_KEYS]).encode())
    return h.hexdigest()[:20]


class PreferenceCollator:
    """TRL's ``DataCollatorForPreference`` on the columns TRL hands it, then the labels the engine
    takes (input ids where the completion mask is 1, else -100: what TRL passes its model)."""

    def __init__(self, collator):
        self.collator = collator

    def __call__(self, examples: list) -> dict:
        keys = PREF_KEYS + ("ref_chosen_logps", "ref_rejected_logps")
        batch = self.collator([{k: e[k] for k in keys if k in e} for e in examples])
        batch["labels"] = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
        return batch


def builtin_preference_pairs(n: Optional[int] = None) -> list:
    """The shipped preference set (``megatrain_nb/assets/preferences.py``: generated from the
    shipped chat set, the rejected reply a near miss of the chosen one), as a list of rows."""
    return preference_rows(n)
