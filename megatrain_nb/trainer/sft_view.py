"""What the model is trained on: one prepared training example, each token shown, the tokens
that count toward the loss highlighted — the masking check people otherwise do by hand
(``session.trained_on()``, ``%megatrain trained-on``, the report). No Jupyter import here.
"""
from __future__ import annotations

import html
from dataclasses import dataclass


def chat_prompt(tokenizer, messages) -> str:
    """``messages`` rendered with the tokenizer's chat template, ready for the assistant's answer."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("a sample conversation needs a tokenizer with a chat template (tokenizer.chat_template)")
    if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise ValueError('messages must be a list of {"role": ..., "content": ...} dicts')
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)


@dataclass
class TrainedOnView:
    """Tokens of one example and which count in the loss (``labels[t] != -100``)."""

    index: int
    tokens: list          # token strings
    counted: list         # bool per token: its label counts (the model learns to predict it)
    starts: list          # token indices where a packed document starts

    @property
    def counted_tokens(self) -> int:
        return sum(self.counted)

    def text(self) -> str:
        """Plain text: counted tokens in [brackets]."""
        return " ".join(f"[{t}]" if c else t for t, c in zip(self.tokens, self.counted))

    def _repr_html_(self) -> str:
        parts = []
        for i, (t, c) in enumerate(zip(self.tokens, self.counted)):
            if i in self.starts and i:
                parts.append("<br><span style='color:#888'>── next packed document ──</span><br>")
            style = "background:#c8f7c5;border-bottom:2px solid #2a9d2a" if c else "color:#777"
            parts.append(f"<span style='{style};padding:0 1px' title='{'in the loss' if c else 'not in the loss'}'>"
                         f"{html.escape(t)}</span>")
        head = (f"<div><b>Training example {self.index}</b>: {self.counted_tokens} of {len(self.tokens)} tokens "
                "count toward the loss (<span style='background:#c8f7c5'>highlighted</span>)</div>")
        body = " ".join(parts)
        return head + f"<div style='font-family:monospace;line-height:1.8;white-space:normal'>{body}</div>"

    def __repr__(self) -> str:
        return f"<trained on: example {self.index}, {self.counted_tokens}/{len(self.tokens)} tokens in the loss>"


def trained_on_view(trainer, index: int = 0) -> TrainedOnView:
    """The view of ``trainer.train_dataset[index]`` (prepared rows: ``input_ids`` and ``labels``; a
    vision row as the trainer's collator makes it, its image tokens shown one by one)."""
    ds = getattr(trainer, "train_dataset", None)
    tok = getattr(trainer, "tokenizer", None)
    if ds is None or not hasattr(ds, "__getitem__") or not hasattr(ds, "__len__"):
        raise ValueError("the trainer has no map-style train_dataset to show")
    if not 0 <= index < len(ds):
        raise IndexError(f"index {index}: the prepared train_dataset has {len(ds)} rows")
    row = ds[index]
    if row.get("input_ids") is None and getattr(trainer, "vision", False):   # a vision row: made into tokens per batch
        batch = trainer.data_collator([row])
        keep = batch["attention_mask"][0].bool() if batch.get("attention_mask") is not None else slice(None)
        row = {"input_ids": batch["input_ids"][0][keep].tolist(), "labels": batch["labels"][0][keep].tolist()}
    ids = list(row["input_ids"])
    labels = list(row["labels"]) if row.get("labels") is not None else list(ids)
    # HF shift: a label at t is predicted from the tokens before it; t=0 never counts
    counted = [False] + [lab != -100 for lab in labels[1:]]
    starts, pos = [0], 0
    for n in list(row.get("seq_lengths") or [])[:-1]:
        pos += n
        starts.append(pos)
    for s in starts:   # TRL's padding-free collator masks each packed document's first token
        counted[s] = False
    tokens = tok.convert_ids_to_tokens(ids) if tok is not None else [str(i) for i in ids]
    return TrainedOnView(index=index, tokens=tokens, counted=counted, starts=starts)
