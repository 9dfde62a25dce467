"""The built-in default: a corpus, a tokenizer and token blocks that need no download.

The corpus is the running interpreter's own standard library source (``*.py`` under
``sysconfig.get_paths()["stdlib"]``, tests and site-packages excluded), read in sorted path
order up to ``max_bytes`` (the ``encodings`` charmap tables are left out); every
``eval_every``-th file goes to the eval split. A byte-level BPE tokenizer is trained on the
train split with ``tokenizers`` and cached, with the token ids, under ``~/.cache/megatrain_nb/``
(``MEGATRAIN_NB_CACHE`` overrides) in a folder named after a hash of the corpus content and the
tokenizer settings, so a different Python gives a different cache.

Example::

    from megatrain_nb.trainer.default import load_default
    tokenizer, train_ds, eval_ds = load_default(seq_len=128)
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sysconfig
from pathlib import Path

import numpy as np

from megatrain_nb.atomic import staging_dir
from megatrain_nb.values import check

EOS, PAD = "<|endoftext|>", "<|pad|>"
_FORMAT = 1
_SKIP_PARTS = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "__pycache__", "site-packages", "encodings",
               "dist-packages"}


def cache_dir() -> Path:
    root = os.environ.get("MEGATRAIN_NB_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "megatrain_nb")
    return Path(root)


def stdlib_files(max_bytes: int = 4_000_000, root: Path | None = None) -> list[Path]:
    """The stdlib source files of the corpus, in a deterministic order (``root``: the stdlib's folder).

    The skipped folders are pruned as the walk meets them: a global ``site-packages`` inside the
    stdlib's folder (pyenv's, a system Python's) would otherwise be walked whole, which took 1.5-2.4 s
    of every load of the default here for the same ~225 files."""
    root = Path(sysconfig.get_paths()["stdlib"]) if root is None else Path(root)
    found = []
    for folder, subfolders, names in os.walk(root):   # symlinked folders not followed, as rglob does not
        subfolders[:] = [n for n in subfolders if n not in _SKIP_PARTS]
        found += [Path(folder, n) for n in names if n.endswith(".py")]
    files = sorted(p for p in found if p.is_file())
    chosen, total = [], 0
    for p in files:
        size = p.stat().st_size
        if total + size > max_bytes and chosen:
            break
        chosen.append(p)
        total += size
    if not chosen:
        raise RuntimeError(f"no Python source files found under {root}; the built-in corpus needs the "
                           "interpreter's standard library sources")
    return chosen


def read_corpus(max_bytes: int = 4_000_000, eval_every: int = 20) -> tuple[list[str], list[str]]:
    """(train_documents, eval_documents) read from the stdlib sources."""
    train, evals = [], []
    for i, p in enumerate(stdlib_files(max_bytes)):
        text = p.read_text(encoding="utf-8", errors="replace")
        (evals if eval_every and i % eval_every == eval_every - 1 else train).append(text)
    return train, evals


def _corpus_key(train: list[str], evals: list[str], vocab_size: int) -> str:
    h = hashlib.sha256(json.dumps({"format": _FORMAT, "vocab": vocab_size}).encode())
    for part in (train, evals):
        for doc in part:
            h.update(hashlib.sha256(doc.encode("utf-8", "replace")).digest())
        h.update(b"|")
    return h.hexdigest()[:16]


def train_tokenizer(texts: list[str], vocab_size: int = 4096):
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, PAD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def wrap_tokenizer(tok):
    """Wrap a ``tokenizers.Tokenizer`` as a ``transformers.PreTrainedTokenizerFast``."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=PAD,
                                   unk_token=None, model_max_length=1_000_000)


def _encode_stream(tokenizer, docs: list[str]) -> np.ndarray:
    eos = tokenizer.convert_tokens_to_ids(EOS)
    ids: list[int] = []
    for enc in tokenizer(docs, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(eos)
    return np.asarray(ids, dtype=np.int32)


def load_default_tokens(vocab_size: int = 4096, max_bytes: int = 4_000_000, eval_every: int = 20):
    """(tokenizer, train_ids, eval_ids): the tokenizer and the whole token streams, cached."""
    train, evals = read_corpus(max_bytes, eval_every)
    key = _corpus_key(train, evals, vocab_size)
    folder = cache_dir() / f"stdlib-bpe{vocab_size}-{key}"
    if not (folder / "done").is_file():
        tok = wrap_tokenizer(train_tokenizer(train, vocab_size))
        folder.parent.mkdir(parents=True, exist_ok=True)
        with staging_dir(folder.parent, prefix=folder.name + ".tmp-") as tmp:
            tok.save_pretrained(tmp)
            np.save(tmp / "train_ids.npy", _encode_stream(tok, train))
            np.save(tmp / "eval_ids.npy", _encode_stream(tok, evals))
            (tmp / "done").write_text(json.dumps({"files": len(train) + len(evals)}))
            with contextlib.suppress(OSError):  # another process won the race: use theirs
                os.replace(tmp, folder)
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(folder))
    return tokenizer, np.load(folder / "train_ids.npy"), np.load(folder / "eval_ids.npy")


def blocks_dataset(ids: np.ndarray, seq_len: int):
    """A ``datasets.Dataset`` of ``input_ids`` blocks of ``seq_len`` tokens (the tail is dropped)."""
    import datasets

    n = len(ids) // seq_len
    if n == 0:
        raise ValueError(f"only {len(ids)} tokens: too few for one block of seq_len={seq_len}")
    blocks = ids[: n * seq_len].reshape(n, seq_len).astype(np.int64)
    return datasets.Dataset.from_dict({"input_ids": blocks.tolist()})


def load_default(seq_len: int = 128, vocab_size: int = 4096, max_bytes: int = 4_000_000,
                 eval_every: int = 20, max_eval_blocks: int | None = 64):
    """(tokenizer, train_dataset, eval_dataset) of the built-in default, no network needed.

    Each dataset is a ``datasets.Dataset`` with one ``input_ids`` column of ``seq_len``-token blocks
    (documents joined with ``<|endoftext|>`` and packed). ``max_eval_blocks`` keeps evaluation quick.
    """
    seq_len = check("seq_len", seq_len)   # the table's rule (at least 2 tokens)
    tokenizer, train_ids, eval_ids = load_default_tokens(vocab_size, max_bytes, eval_every)
    train_ds = blocks_dataset(train_ids, seq_len)
    eval_ds = blocks_dataset(eval_ids, seq_len)
    if max_eval_blocks is not None and len(eval_ds) > max_eval_blocks:
        eval_ds = eval_ds.select(range(max_eval_blocks))
    return tokenizer, train_ds, eval_ds
