"""A tokenizer as GGUF metadata (llama.cpp's keys, as transformers' GGUF loader reads them back):
``tokenizer.ggml.model`` ("gpt2": byte-level BPE), ``tokens`` in id order (padded to the model's
vocabulary with ``[PAD<i>]``, as llama.cpp's converter does), ``token_type`` (1 normal, 3 control
for special tokens, 4 user-defined for other added tokens, 5 unused for padding), ``merges`` as
``"a b"`` strings, ``pre`` (the split regex's name where transformers knows it), the special ids,
``add_bos_token`` and ``chat_template``.

Byte-level BPE tokenizers (GPT-2, Llama 3, Qwen, SmolLM) are written; another kind (WordLevel,
sentencepiece) is named in :class:`VocabUnsupported` and the export goes on without a tokenizer
only when the caller asked for that.
"""
from __future__ import annotations

import json
from typing import Optional

NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5


class VocabUnsupported(ValueError):
    """The tokenizer cannot be written as GGUF metadata (the message says why and what to do)."""


def _backend_json(tok) -> dict:
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        raise VocabUnsupported(f"{type(tok).__name__} is not a fast tokenizer (no tokenizer.json); GGUF tokenizer "
                               "metadata is written from a fast byte-level BPE tokenizer")
    return json.loads(backend.to_str())


def _byte_level(d: dict) -> bool:
    def has(node) -> bool:
        if not isinstance(node, dict):
            return False
        if node.get("type") == "ByteLevel":
            return True
        return any(has(x) for x in node.get("pretokenizers", []) or node.get("decoders", []) or [])
    return has(d.get("pre_tokenizer")) or has(d.get("decoder"))


def _split_regex(d: dict) -> Optional[str]:
    pre = d.get("pre_tokenizer") or {}
    for node in pre.get("pretokenizers", [pre]) if isinstance(pre, dict) else []:
        if isinstance(node, dict) and node.get("type") == "Split":
            pattern = node.get("pattern") or {}
            return pattern.get("Regex") or pattern.get("String")
    return None


def _pre_name(d: dict) -> str:
    regex = _split_regex(d)
    if regex is None:
        return "gpt2"
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
    except ImportError:   # an older transformers: its reader knows no names
        return "gpt2"
    for name, pattern in GGUF_PRE_TOKENIZER_SPLITS.items():
        if pattern == regex:
            return name
    return "gpt2"


def vocab_fields(tok, vocab_size: int) -> dict:
    """``{key: value}`` of the tokenizer metadata (``tokenizer.`` keys), or VocabUnsupported."""
    d = _backend_json(tok)
    model = d.get("model") or {}
    if model.get("type") != "BPE" or not _byte_level(d):
        raise VocabUnsupported(f"the tokenizer is a {model.get('type')} model"
                               f"{'' if _byte_level(d) else ' without byte-level pre-tokenization'}; the GGUF writer "
                               "writes byte-level BPE tokenizers (GPT-2, Llama 3, Qwen, SmolLM)")
    by_id = {i: t for t, i in tok.get_vocab().items()}
    if max(by_id) >= vocab_size:
        raise VocabUnsupported(f"the tokenizer has ids up to {max(by_id)} but the model's vocabulary is {vocab_size}")
    added = {a["id"]: bool(a.get("special")) for a in d.get("added_tokens", [])}
    tokens, types = [], []
    for i in range(vocab_size):
        if i in by_id:
            tokens.append(by_id[i])
            types.append((CONTROL if added[i] else USER_DEFINED) if i in added else NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    out = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": _pre_name(d), "tokenizer.ggml.tokens": tokens,
           "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges}
    for key, attr in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("unknown_token_id", "unk_token_id"), ("padding_token_id", "pad_token_id")):
        value = getattr(tok, attr, None)
        if isinstance(value, int):
            out[f"tokenizer.ggml.{key}"] = value
    out["tokenizer.ggml.add_bos_token"] = bool(getattr(tok, "add_bos_token", False))
    template = getattr(tok, "chat_template", None)
    if isinstance(template, str) and template:
        out["tokenizer.chat_template"] = template
    return out


def add_vocab(writer, fields: dict) -> None:
    """Put ``fields`` (from :func:`vocab_fields`) on a ``gguf.GGUFWriter``."""
    from gguf import GGUFValueType

    for key, value in fields.items():
        if key == "tokenizer.ggml.token_type":
            writer.add_array(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, list):
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, GGUFValueType.STRING)
