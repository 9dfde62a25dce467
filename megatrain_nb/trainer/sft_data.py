"""Instruction and chat data for :class:`~megatrain_nb.trainer.sft.SFTTrainer`: the formats,
their detection and conversion, and the preparation ``trl.SFTTrainer`` does (chat template,
completion / assistant masks, labels, truncation, packing), built on TRL's public utilities.

Formats (one per dataset; a row of another format is refused with its index)::

    text               {"text": "..."}                         (SFTConfig.dataset_text_field)
    prompt_completion  {"prompt": "...", "completion": "..."}  (or lists of messages: conversational)
    messages           {"messages": [{"role": ..., "content": ...}, ...]}
    alpaca             {"instruction", "input", "output"[, "system"]}  -> conversational prompt-completion
    sharegpt           {"conversations": [{"from": "human"|"gpt"|"system", "value": ...}]} -> messages

The steps and their order are those of TRL's ``SFTTrainer._prepare_dataset`` (a private method,
so it is reproduced here from TRL's public pieces; ``tests/trainer/test_sft_parity.py`` checks
that the output is the same, row for row). Where TRL is silent this module counts and reports:
examples truncated to ``max_length`` and examples left with no target token are counted in a
:class:`PrepReport` and reported once; bad rows (no chat template, an empty assistant turn, a
role the template does not render, rows of mixed formats) are refused with the row's index.
The steps themselves are in ``sft_prepare.py``; an iterable dataset is checked there lazily.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .data import DataError

FORMATS = ("text", "prompt_completion", "messages", "alpaca", "sharegpt")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "tool": "tool", "observation": "tool"}
INSTALL_HINT = 'pip install "megatrain-nb[sft]"'


def require_trl():
    """Import trl, or say how to install it."""
    try:
        import trl
    except ImportError as e:
        raise ImportError(f"mt.SFTTrainer uses TRL's data utilities; install them with: {INSTALL_HINT}") from e
    return trl


@dataclass
class PrepReport:
    """What preparation decided, per dataset: reported once as a warning, kept on the trainer."""

    what: str = "train_dataset"
    format: str = ""
    examples: int = 0
    truncated: int = 0            # longer than max_length: cut to it
    no_target_dropped: int = 0    # left with no token counted in the loss (after truncation): dropped
    tokens_dropped: int = 0       # tokens cut by truncation
    no_assistant_dropped: int = 0  # conversations with no assistant turn under assistant_only_loss: dropped
    notes: list = field(default_factory=list)

    def message(self) -> str:
        parts = []
        if self.truncated:
            parts.append(f"{self.truncated} of {self.examples} examples were longer than max_length and were "
                         f"truncated ({self.tokens_dropped} tokens dropped); raise SFTConfig.max_length to keep them")
        if self.no_target_dropped:
            parts.append(f"{self.no_target_dropped} examples had no token left to learn from (an empty completion "
                         "or assistant turn after truncation) and were dropped")
        if self.no_assistant_dropped:
            parts.append(f"{self.no_assistant_dropped} conversations had no assistant turn (nothing to learn with "
                         "assistant_only_loss=True) and were dropped")
        return f"{self.what}: " + "; ".join(parts) if parts else ""


# ---------------------------------------------------------------------------------------- formats
def row_format(ex: dict, text_field: str = "text") -> Optional[str]:
    """The format of one row (None: not recognised). Columns holding None do not count."""
    has = {k for k, v in ex.items() if v is not None}
    if "input_ids" in has:
        return "tokens"
    if "conversations" in has:
        return "sharegpt"
    if "messages" in has:
        return "messages"
    if "instruction" in has and "output" in has:
        return "alpaca"
    if "prompt" in has and "completion" in has:
        return "prompt_completion"
    if text_field in has:
        return "text"
    return None


def _a(v) -> str:
    name = type(v).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _messages_problem(msgs, key: str, role_key: str = "role", content_key: str = "content") -> Optional[str]:
    if not isinstance(msgs, (list, tuple)):
        return f"'{key}' is {_a(msgs)}, not a list of {{{role_key!r}: ..., {content_key!r}: ...}} dicts"
    for j, m in enumerate(msgs):
        if not isinstance(m, dict):
            return f"'{key}'[{j}] is {_a(m)}, not a {{{role_key!r}: ..., {content_key!r}: ...}} dict"
        if not isinstance(m.get(role_key), str):
            return f"'{key}'[{j}] has {role_key}={m.get(role_key)!r}; a role is text (e.g. 'user')"
        content = m.get(content_key)
        if not isinstance(content, str) and not (content is None and m.get("tool_calls")):
            return f"'{key}'[{j}] has {content_key}={content!r:.40} ({_a(content)}); a message's content is text"
    return None


def row_problem(ex: dict, fmt: str, text_field: str = "text") -> Optional[str]:
    """What is wrong with the types of one row of format ``fmt`` (None: nothing), said before
    Arrow (an ``ArrowInvalid`` naming no row) or the tokenizer meets it."""
    if fmt == "text":
        v = ex[text_field]
        if not isinstance(v, str):
            return f"'{text_field}' is {_a(v)} ({v!r:.40}), not text"
        return None if v.strip() else f"'{text_field}' is empty: nothing to learn from; remove the row"
    if fmt == "messages":
        return _messages_problem(ex["messages"], "messages")
    if fmt == "sharegpt":
        return _messages_problem(ex["conversations"], "conversations", "from", "value")
    if fmt == "alpaca":
        for k in ("instruction", "output", "input", "system"):
            if ex.get(k) is not None and not isinstance(ex[k], str):
                return f"'{k}' is {_a(ex[k])} ({ex[k]!r:.40}), not text"
        return None
    if fmt == "prompt_completion":
        p, c = ex["prompt"], ex["completion"]
        if isinstance(p, str) and isinstance(c, str):
            return None
        if isinstance(p, str) or isinstance(c, str):
            return ("'prompt' and 'completion' must both be text, or both lists of messages; got "
                    f"{type(p).__name__} and {type(c).__name__}")
        return _messages_problem(p, "prompt") or _messages_problem(c, "completion")
    return None


def has_assistant_turn(ex: dict) -> bool:
    """A conversation row holds an assistant turn (a prompt-completion's completion counts)."""
    msgs = ex.get("messages") if ex.get("messages") is not None else ex.get("completion")
    return any(isinstance(m, dict) and m.get("role") == "assistant" for m in (msgs or []))


def detect_format(rows: list, text_field: str = "text", what: str = "train_dataset") -> str:
    """The one format of ``rows``; mixed or unrecognised rows are refused with their index."""
    seen: dict[str, int] = {}
    for i, ex in enumerate(rows):
        f = row_format(ex, text_field)
        if f is None:
            raise DataError(f"{what}[{i}] has keys {sorted(k for k, v in ex.items() if v is not None)}: not a "
                            f"format SFTTrainer reads ({', '.join(FORMATS)}; text is read from "
                            f"'{text_field}' = SFTConfig.dataset_text_field)")
        bad = row_problem(ex, f, text_field)
        if bad:
            raise DataError(f"{what}[{i}] ({f}): {bad}")
        seen.setdefault(f, i)
    if len(seen) > 1:
        where = ", ".join(f"{f} (first at row {i})" for f, i in seen.items())
        raise DataError(f"{what} mixes formats: {where}. Convert the rows to one format first")
    return next(iter(seen))


def alpaca_to_prompt_completion(ex: dict) -> dict:
    """alpaca -> conversational prompt-completion (the response alone counts in the loss by default)."""
    user = ex["instruction"] if not ex.get("input") else f"{ex['instruction']}\n\n{ex['input']}"
    prompt = ([{"role": "system", "content": ex["system"]}] if ex.get("system") else []) + \
        [{"role": "user", "content": user}]
    return {"prompt": prompt, "completion": [{"role": "assistant", "content": ex["output"]}]}


def sharegpt_to_messages(ex: dict, index: int = 0, what: str = "train_dataset") -> dict:
    """sharegpt (``from``/``value``, roles human/gpt/system) -> ``messages`` (role/content)."""
    msgs = [{"role": "system", "content": ex["system"]}] if ex.get("system") else []
    for turn in ex["conversations"]:
        role = SHAREGPT_ROLES.get(turn.get("from"))
        if role is None:
            raise DataError(f"{what}[{index}]: sharegpt role {turn.get('from')!r} is not one of "
                            f"{sorted(SHAREGPT_ROLES)}; map it to one of them first")
        msgs.append({"role": role, "content": turn.get("value")})
    return {"messages": msgs}


def to_trl_rows(rows: list, fmt: str, what: str) -> list:
    """Rows of TRL's own formats (alpaca and sharegpt converted; others unchanged)."""
    if fmt == "alpaca":
        return [alpaca_to_prompt_completion(ex) for ex in rows]
    if fmt == "sharegpt":
        return [sharegpt_to_messages(ex, i, what) for i, ex in enumerate(rows)]
    return rows


def check_conversation(messages: list, tokenizer, chat_template: Optional[str], index: int, what: str,
                       tools=None) -> None:
    """An empty assistant turn, or a message the chat template does not render, is refused."""
    for m in messages:
        if m.get("role") == "assistant" and not (m.get("content") or "").strip() and not m.get("tool_calls"):
            raise DataError(f"{what}[{index}] has an empty assistant turn: it would teach the model to answer "
                            "nothing. Remove the turn or the example")
    try:
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, chat_template=chat_template, tools=tools)
    except Exception as e:   # jinja's TemplateError, or the template's raise_exception
        roles = sorted({str(m.get("role")) for m in messages})
        raise DataError(f"{what}[{index}]: the chat template cannot render these messages (roles {roles}): {e}. "
                        "Use roles the template knows or a template that knows them "
                        "(SFTConfig.chat_template_path)") from e
    for m in messages:
        content = m.get("content")
        if isinstance(content, str) and content.strip() and content.strip() not in rendered:
            raise DataError(f"{what}[{index}]: the chat template left out a {m.get('role')!r} message "
                            f"({content[:40]!r}): it does not render that role. Use roles the template knows")


# ---------------------------------------------------------------------------------------- preparation
@dataclass
class SFTDataOptions:
    """The SFTConfig fields preparation reads, plus what the trainer decided."""

    max_length: Optional[int]
    truncation_mode: str
    dataset_text_field: str
    packing: bool
    packing_strategy: str
    shuffle_dataset: bool
    seed: int
    completion_only_loss: bool
    assistant_only_loss: bool
    chat_template: Optional[str]      # a training template TRL swaps in (None: the tokenizer's own)
    dataset_num_proc: Optional[int] = None


def as_dataset(ds, what: str, text_field: Optional[str] = "text"):
    import datasets

    if isinstance(ds, (datasets.DatasetDict, datasets.IterableDatasetDict)):
        raise DataError(f"{what} is a DatasetDict with splits {list(ds)}; pass one split, e.g. ds['train']")
    if isinstance(ds, (datasets.Dataset, datasets.IterableDataset)):
        return ds
    if isinstance(ds, (list, tuple)):
        if not ds:
            raise DataError(f"{what} is empty (0 examples)")
        rows = [dict(r) for r in ds]
        if text_field is not None:   # before a Dataset keeps the first row's columns only
            detect_format(rows, text_field, what)
        return datasets.Dataset.from_list(rows)
    raise DataError(f"{what} is a {type(ds).__name__}; SFTTrainer takes a datasets.Dataset, IterableDataset "
                    "or a list of dicts")


def head_rows(ds, n: int = 1000) -> list:
    import datasets

    if isinstance(ds, datasets.Dataset):
        return [ds[i] for i in range(min(len(ds), n))] if n < len(ds) else list(ds)
    out = []
    for ex in ds:
        out.append(ex)
        if len(out) >= n:
            break
    return out


def first_row(ds, what: str = "train_dataset") -> dict:
    """The first row of ``ds`` (a list, a Dataset, an IterableDataset) as it is, unconverted."""
    if isinstance(ds, (list, tuple)):
        if not ds:
            raise DataError(f"{what} is empty (0 examples)")
        return dict(ds[0])
    rows = head_rows(as_dataset(ds, what, None), 1)
    if not rows:
        raise DataError(f"{what} is empty")
    return dict(rows[0])


def is_conversational_dataset(ds, text_field: str = "text") -> bool:
    """Whether ``ds`` (a dataset or list) holds instruction or chat rows (vs text or token ids)."""
    rows = head_rows(ds, 1) if not isinstance(ds, (list, tuple)) else list(ds[:1])
    return bool(rows) and row_format(dict(rows[0]), text_field) in ("prompt_completion", "messages", "alpaca",
                                                                     "sharegpt")


def column_names(ds) -> list:
    """A dataset's columns (an iterable dataset without features: the first row's keys)."""
    return list(ds.column_names) if ds.column_names is not None else list(next(iter(ds)).keys())


