"""Training data: what datasets are accepted, text packing, padding collation, and a batch
stream whose position can be saved and restored exactly.

Accepted: a ``datasets.Dataset`` / ``datasets.IterableDataset`` / torch ``Dataset`` /
``IterableDataset`` (or a plain list) whose examples hold ``input_ids`` (optionally
``labels`` and ``attention_mask``), or a ``text`` column plus a tokenizer (text is tokenised,
joined with EOS and packed into ``seq_len``-token blocks).

Order: map-style datasets are shuffled per epoch exactly as ``transformers.Trainer`` does
(``torch.randperm(n)`` from a generator seeded with ``data_seed or seed`` plus the epoch), so
both trainers see the same batches; iterable datasets are read in their own order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch

from megatrain_nb.engine.inputs import OBJECTIVE_DATA
from megatrain_nb.values import check

from .sharding import ZERO_WEIGHT, deal

IGNORE_INDEX = -100


class DataError(ValueError):
    """The training or evaluation data cannot be used; the message says why."""


def _is_iterable_style(ds) -> bool:
    import datasets

    return isinstance(ds, (datasets.IterableDataset, torch.utils.data.IterableDataset)) or not hasattr(ds, "__len__")


def _columns(ds) -> Optional[list[str]]:
    names = getattr(ds, "column_names", None)
    if isinstance(names, dict):  # DatasetDict
        raise DataError("got a DatasetDict; pass one split, e.g. dataset['train']")
    return list(names) if names is not None else None


def _first_example(ds):
    if _is_iterable_style(ds):
        for ex in ds:
            return ex
        return None
    return ds[0] if len(ds) else None


def as_example(ex) -> dict:
    if isinstance(ex, dict) or hasattr(ex, "keys"):
        return ex
    if isinstance(ex, (list, tuple, torch.Tensor)):
        return {"input_ids": ex}
    raise DataError(f"a dataset example is a {type(ex).__name__}; expected a dict with 'input_ids' "
                    "(or 'text' with a tokenizer)")


def pack_token_stream(docs_ids: Iterator[list[int]], seq_len: int, eos_id: Optional[int]) -> Iterator[list[int]]:
    """Join documents (EOS after each) and cut the stream into ``seq_len`` blocks."""
    buf: list[int] = []
    for ids in docs_ids:
        buf.extend(ids)
        if eos_id is not None:
            buf.append(eos_id)
        while len(buf) >= seq_len:
            yield buf[:seq_len]
            buf = buf[seq_len:]


class _PackedIterable(torch.utils.data.IterableDataset):
    def __init__(self, source, tokenizer, seq_len, text_column):
        self.source, self.tokenizer, self.seq_len, self.text_column = source, tokenizer, seq_len, text_column

    def set_epoch(self, epoch):
        if hasattr(self.source, "set_epoch"):
            self.source.set_epoch(epoch)

    def __iter__(self):
        docs = (self.tokenizer(as_example(ex)[self.text_column], add_special_tokens=False)["input_ids"]
                for ex in self.source)
        for block in pack_token_stream(docs, self.seq_len, self.tokenizer.eos_token_id):
            yield {"input_ids": block}


def _tokenize_texts(ds, tokenizer, seq_len, text_column, packing, what):
    if tokenizer is None:
        raise DataError(f"{what} has a '{text_column}' column but no input_ids, and no tokenizer was "
                        "given; pass tokenizer=... (or a dataset of token ids)")
    if check("seq_len", seq_len) is None:
        raise DataError("seq_len=None: packing text needs a sequence length (at least 2)")
    if _is_iterable_style(ds):
        if not packing:
            raise DataError("packing=False is only supported for map-style datasets")
        return _PackedIterable(ds, tokenizer, seq_len, text_column)
    texts = [as_example(ds[i])[text_column] for i in range(len(ds))]
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    if packing:
        blocks = list(pack_token_stream(iter(encoded), seq_len, tokenizer.eos_token_id))
        if not blocks:
            total = sum(len(e) for e in encoded)
            raise DataError(f"{what}: the text holds {total} tokens, too short to fill one sequence of "
                            f"seq_len={seq_len}; add text or lower seq_len")
    else:
        blocks = [e[:seq_len] for e in encoded if len(e) >= 2]
    return [{"input_ids": b} for b in blocks]


def prepare_dataset(ds, *, tokenizer=None, seq_len: Optional[int] = None, text_column: str = "text",
                    packing: bool = True, what: str = "train_dataset"):
    """Check ``ds`` and turn a text dataset into token blocks. Returns a dataset of examples
    holding ``input_ids`` (and whatever else they had)."""
    if ds is None:
        raise DataError(f"{what} is None")
    import datasets

    if isinstance(ds, datasets.DatasetDict):
        raise DataError(f"{what} is a DatasetDict with splits {list(ds)}; pass one split, e.g. ds['train']")
    if not _is_iterable_style(ds) and len(ds) == 0:
        raise DataError(f"{what} is empty (0 examples)")
    cols = _columns(ds)
    first = _first_example(ds)
    if first is None:
        raise DataError(f"{what} is empty (it yielded no examples)")
    keys = list(as_example(first).keys()) if cols is None else cols
    if "input_ids" in keys:
        _check_lengths(ds, what)
        return ds
    if text_column in keys:
        return _tokenize_texts(ds, tokenizer, seq_len, text_column, packing, what)
    raise DataError(f"{what} has columns {keys}: it needs an 'input_ids' column (token ids) or a "
                    f"'{text_column}' column plus a tokenizer")


def _check_lengths(ds, what: str, limit: int = 1000) -> None:
    """Fail early on token sequences a causal LM cannot learn from (the collator checks the rest)."""
    if _is_iterable_style(ds):
        return
    for i in range(min(len(ds), limit)):
        n = example_len(ds[i])
        if n < 2:
            raise DataError(f"{what}[{i}] has {n} token(s); a causal LM needs at least 2 per sequence "
                            "(one input and one target). Filter out short sequences or pack text.")


def _to_long(x, what: str = "input_ids") -> torch.Tensor:
    """Token ids as int64; a float or bool column is refused, not truncated (1.7 -> 1)."""
    t = x if isinstance(x, torch.Tensor) else torch.as_tensor(x)
    if t.is_floating_point() or t.is_complex() or (t.dtype == torch.bool and what != "attention_mask"):
        sample = t.reshape(-1)[:3].tolist()
        raise DataError(f"{what} holds {t.dtype} values (e.g. {sample}); token ids must be integers. Tokenize "
                        "the text, or cast the column to int (datasets: ds.cast_column(...))")
    return t.long()


@dataclass
class PaddingCollator:
    """Pads ``input_ids`` (right) to the longest example; ``attention_mask`` 0 and ``labels`` -100
    on padding. Labels default to ``input_ids``. Rejects examples too short to train on."""

    pad_token_id: int = 0

    def __call__(self, examples: list) -> dict:
        examples = [as_example(e) for e in examples]
        ids = [_to_long(e["input_ids"]).reshape(-1) for e in examples]
        for i, t in enumerate(ids):
            if t.numel() < 2:
                raise DataError(f"an example has {t.numel()} token(s); a causal LM needs at least 2 "
                                "(one input and one target). Filter out short sequences.")
        longest = max(t.numel() for t in ids)
        batch_ids = torch.full((len(ids), longest), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(ids), longest), dtype=torch.long)
        labels = torch.full((len(ids), longest), IGNORE_INDEX, dtype=torch.long)
        for row, (e, t) in enumerate(zip(examples, ids)):
            n = t.numel()
            batch_ids[row, :n] = t
            mask[row, :n] = _to_long(e["attention_mask"], "attention_mask").reshape(-1)[:n] if "attention_mask" in e else 1
            lab = _to_long(e["labels"], "labels").reshape(-1)[:n] if "labels" in e and e["labels"] is not None else t
            labels[row, :n] = lab
        labels[mask == 0] = IGNORE_INDEX
        out = {"input_ids": batch_ids, "labels": labels}
        if not bool(mask.all()):  # an all-ones mask means no mask: leave it out (same result, faster)
            out["attention_mask"] = mask
        return out


SIDE_KEYS = ("completion_mask", "ref_chosen_logps", "ref_rejected_logps")
#: A collator's dict of a processor's extra model inputs (``pixel_values``, ``image_grid_thw``, ...:
#: trainer/sft_vision.py); kept by :func:`finish_batch`, handed to the engine by :func:`model_inputs`.
EXTRA_INPUTS = "extra_inputs"
#: What the engine takes of a finished batch besides the extras: its tokens, and a sequence objective's side
#: data (DPO's pairs, GRPO's rollouts), which travels with its micro-batch (engine/compute/objective.py).
BATCH_KEYS = ("input_ids", "attention_mask", "labels", "position_ids", OBJECTIVE_DATA)


def finish_batch(batch: dict) -> dict:
    """Make a collator's output usable: tensors, labels present (input_ids, -100 on padding);
    ``position_ids`` (packed rows) kept."""
    if "input_ids" not in batch:
        raise DataError(f"the data collator returned keys {list(batch)}; it must return 'input_ids'")
    out = {"input_ids": _to_long(batch["input_ids"])}
    if out["input_ids"].dim() != 2:
        raise DataError(f"input_ids batch has shape {tuple(out['input_ids'].shape)}; expected [batch, seq]")
    if batch.get("attention_mask") is not None:
        out["attention_mask"] = _to_long(batch["attention_mask"], "attention_mask")
    if batch.get("position_ids") is not None:   # packed rows (padding-free): per-document positions
        out["position_ids"] = _to_long(batch["position_ids"], "position_ids")
    labels = batch.get("labels")
    if labels is None:
        labels = out["input_ids"].clone()
        if "attention_mask" in out:
            labels[out["attention_mask"] == 0] = IGNORE_INDEX
    out["labels"] = _to_long(labels, "labels")
    for k in SIDE_KEYS:   # what a sequence-level objective reads per micro-batch (DPO's reference)
        if batch.get(k) is not None:
            out[k] = torch.as_tensor(batch[k])
    if batch.get(EXTRA_INPUTS):
        out[EXTRA_INPUTS] = {k: torch.as_tensor(v) for k, v in batch[EXTRA_INPUTS].items()}
    if out["input_ids"].shape[1] < 2:
        raise DataError("a batch has sequences of 1 token; a causal LM needs at least 2 (input and target)")
    return out


def model_inputs(batch: dict) -> dict:
    """What the engine takes of a finished batch, as one dict: the token keys and a processor's
    extra inputs (the engine hands those to the model's forward)."""
    out = {k: batch[k] for k in BATCH_KEYS if batch.get(k) is not None}
    out.update(batch.get(EXTRA_INPUTS) or {})
    return out


def count_targets(batch: dict) -> int:
    """Tokens that count in a causal LM loss (labels shifted by one), as transformers counts them."""
    return int((batch["labels"][..., 1:] != IGNORE_INDEX).sum())


def count_tokens(batch: dict) -> int:
    if batch.get(ZERO_WEIGHT):  # a data-parallel rank's filler micro-batch: no real tokens
        return 0
    m = batch.get("attention_mask")
    return int(m.sum()) if m is not None else batch["input_ids"].numel()


class BatchStream:
    """Micro-batches in training order, grouped into optimizer windows, with a restorable position.

    Position = (epoch, micro-batches of the global order already consumed in that epoch, by all
    ranks together: a position saved by N ranks means the same on M). For map-style data the
    order of epoch ``e`` is ``torch.randperm(n, generator=seeded(seed + e))`` (what
    transformers.Trainer's seedable sampler gives), or ``range(n)`` for ``sequential``.
    """

    def __init__(self, dataset, *, batch_size: int, collate: Callable, seed: int, shuffle: bool = True,
                 drop_last: bool = False, rank: int = 0, world: int = 1):
        self.dataset, self.batch_size, self.collate = dataset, batch_size, collate
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        # Data parallel: every rank walks the same global order; a step's window of
        # accumulation x world micro-batches is dealt out by sharding.deal.
        self.rank, self.world = int(rank), int(world)
        self.iterable = _is_iterable_style(dataset)
        self.epoch, self.consumed = 0, 0
        self._iter: Optional[Iterator] = None
        if not self.iterable:
            n = len(dataset)
            self.batches_per_epoch = n // batch_size if drop_last else -(-n // batch_size)
            if self.batches_per_epoch == 0:
                raise DataError(f"train_dataset has {n} examples: fewer than one batch of {batch_size} "
                                "with dataloader_drop_last=True")
        else:
            self.batches_per_epoch = None

    # -- position ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])
        self._iter = None

    # -- iteration ---------------------------------------------------------------------------
    def _order(self, epoch: int) -> list[int]:
        n = len(self.dataset)
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator()
        g.manual_seed(self.seed + epoch)
        return torch.randperm(n, generator=g).tolist()

    def _make_iter(self) -> Iterator:
        if self.iterable:
            if hasattr(self.dataset, "set_epoch"):
                self.dataset.set_epoch(self.epoch)
            it = self._iter_examples_iterable()
            for _ in range(self.consumed):  # fast-forward: re-read and drop what was consumed
                if next(it, None) is None:
                    break
            return it
        return self._iter_indices(self._order(self.epoch), self.consumed)

    # The iterators yield callables that load and collate one micro-batch, so that a rank of a
    # data-parallel run builds only its own share of a window.
    def _iter_indices(self, order, start):
        bs = self.batch_size
        for b in range(start, self.batches_per_epoch):
            yield self._loader(order[b * bs:(b + 1) * bs])

    def _loader(self, idx):
        def load():
            getitems = getattr(self.dataset, "__getitems__", None)
            examples = getitems(idx) if getitems is not None else [self.dataset[i] for i in idx]
            return self.collate(examples)
        return load

    def _iter_examples_iterable(self):
        buf = []
        for ex in self.dataset:
            buf.append(ex)
            if len(buf) == self.batch_size:
                yield (lambda b=buf: self.collate(b))
                buf = []
        if buf and not self.drop_last:
            yield (lambda b=buf: self.collate(b))

    def next_window(self, accumulation: int) -> tuple[list[dict], bool]:
        """This rank's micro-batches of the next optimizer step and whether the epoch ended.

        The step takes up to ``accumulation x world`` micro-batches of the global order; this
        rank gets its share (see :mod:`.sharding`). At an epoch's end the window is shorter
        (transformers.Trainer does the same)."""
        if self._iter is None:
            self._iter = self._make_iter()
        raw: list = []
        ended = False
        while len(raw) < accumulation * self.world:
            load = next(self._iter, None)
            if load is None:
                ended = True
                break
            raw.append(load)
            self.consumed += 1
        if not ended and self.batches_per_epoch is not None and self.consumed >= self.batches_per_epoch:
            ended = True
        return deal(raw, self.rank, self.world, finish_batch), ended

    def start_next_epoch(self) -> None:
        self.epoch += 1
        self.consumed = 0
        self._iter = None


def eval_batches(dataset, *, batch_size: int, collate: Callable, rank: int = 0, world: int = 1) -> Iterator[dict]:
    """Evaluation batches in dataset order; with ``world`` > 1, this rank's share: batch i goes to
    rank i mod world, and every rank gets the same number of batches (the last ones padded with
    zero-weight batches: each evaluation is a round of gathers every rank must join)."""
    stream = BatchStream(dataset, batch_size=batch_size, collate=collate, seed=0, shuffle=False,
                         rank=rank, world=world)
    while True:
        window, ended = stream.next_window(1)
        yield from window
        if ended:
            return


MODEL_INPUT_KEYS = ("input_ids", "attention_mask", "labels", "special_tokens_mask")


class ColumnFilter:
    """Hand a user's collator only the model-input keys of each example (what transformers'
    ``remove_unused_columns`` does), so a leftover ``text`` column does not break it."""

    def __init__(self, collator: Callable):
        self.collator = collator

    def __call__(self, examples: list):
        examples = [as_example(e) for e in examples]
        return self.collator([{k: e[k] for k in MODEL_INPUT_KEYS if k in e} for e in examples])


def default_collator(tokenizer) -> PaddingCollator:
    pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
    if pad is None and tokenizer is not None:
        pad = getattr(tokenizer, "eos_token_id", None)
    return PaddingCollator(pad_token_id=int(pad) if pad is not None else 0)


def example_len(ex: Any) -> int:
    ids = as_example(ex).get("input_ids")
    return len(ids) if ids is not None else 0
