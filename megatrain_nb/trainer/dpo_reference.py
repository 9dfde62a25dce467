"""The reference log-probs of a DPO run: data, not a model. One forward-only streamed pass of
the reference (the policy as it starts, or a given ``ref_model`` in an engine of its own) over
the prepared pairs, no gradients, no optimizer, nothing written back; stored in the run's output
folder under a key of what they depend on (the tokenised pairs' content, the tokenizer, a digest
of the reference's weights, ``max_length``, truncation, LD-DPO's alpha, the precision), with an
xxh3 digest of the payload, so resume, rewind, fork and later runs on the same data read them
instead of running the pass again; a damaged, edited, foreign or non-finite file is computed again
with a line saying why.
"""
from __future__ import annotations

import hashlib
import json
import time
import warnings
from pathlib import Path
from typing import Callable, Optional

import torch
import xxhash
from safetensors import SafetensorError, safe_open

from ..atomic import atomic_file
from .data import EXTRA_INPUTS, DataError, eval_batches
from .dpo_data import token_fingerprint
from .dpo_loss import DPOSettings, ReferenceLogps

CACHE_DIR = "reference_logps"


def _tensor_bytes(t: torch.Tensor):
    """The bytes of a tensor (any dtype) as a buffer xxh3 reads."""
    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()


def weights_fingerprint(source) -> str:
    """The reference's identity: a digest (xxh3-128) of every weight's name, shape, dtype and bytes
    (a module, or an engine's master weights), or of the weight files' names, sizes, times and
    inodes (a folder: its source, not read)."""
    h = xxhash.xxh3_128()
    if isinstance(source, torch.nn.Module):
        named = source.state_dict().items()
    elif hasattr(source, "named_parameters") and hasattr(source, "forward_backward"):   # a StreamingEngine
        named = source.named_parameters()
    else:
        folder = Path(source)
        for f in sorted(folder.iterdir()) if folder.is_dir() else []:
            if f.suffix in (".safetensors", ".bin", ".json"):
                st = f.stat()
                h.update(f"{f.name}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}\n".encode())
        return "folder:" + h.hexdigest()[:24]
    for name, p in named:
        h.update(f"{name}{tuple(p.shape)}{p.dtype}".encode())
        if not p.is_meta and p.numel():
            h.update(_tensor_bytes(p))
    return h.hexdigest()[:24]


def tokenizer_fingerprint(tok) -> str:
    """The tokenizer's vocabulary (every entry), special tokens and chat template."""
    h = xxhash.xxh3_128()
    h.update(str(getattr(tok, "name_or_path", "")).encode())
    h.update(str(len(tok)).encode())
    h.update(str(getattr(tok, "chat_template", "") or "").encode())
    h.update(json.dumps(sorted(tok.get_vocab().items())).encode())
    h.update(json.dumps(getattr(tok, "special_tokens_map", {}), sort_keys=True, default=str).encode())
    return h.hexdigest()[:20]


def cache_parts(ds, tok, weights: str, args, precision: str = "fp32", data: Optional[str] = None) -> dict:
    """What the reference log-probs depend on: the tokenised pairs' content (``data``: another
    digest of it, the vision pairs' text and pictures), the tokenizer, the reference's identity, how
    rows are cut and padded, LD-DPO's alpha (it weights the log-prob sums) and the compute precision."""
    return {"data": data or token_fingerprint(ds), "tokenizer": tokenizer_fingerprint(tok), "weights": weights,
            "max_length": args.max_length, "truncation_mode": args.truncation_mode, "ld_alpha": args.ld_alpha,
            "pad_to_multiple_of": args.pad_to_multiple_of, "precision": precision, "pairs": len(ds)}


def cache_key(ds, tok, weights: str, args, precision: str = "fp32") -> str:
    return key_of(cache_parts(ds, tok, weights, args, precision))


def key_of(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def payload_digest(chosen: torch.Tensor, rejected: torch.Tensor) -> str:
    """xxh3-64 of the two columns, by name and in order (swapping them changes it)."""
    h = xxhash.xxh3_64()
    for name, t in (("chosen", chosen), ("rejected", rejected)):
        h.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
        h.update(_tensor_bytes(t))
    return h.hexdigest()


def first_nonfinite(chosen: torch.Tensor, rejected: torch.Tensor) -> Optional[tuple]:
    """``(column, row)`` of the first non-finite reference log-prob, None when all are finite."""
    for name, t in (("chosen", chosen), ("rejected", rejected)):
        bad = (~torch.isfinite(t)).nonzero()
        if bad.numel():
            return name, int(bad[0, 0])
    return None


class ReferenceStopped(Exception):
    """The reference pass was stopped (``request_stop()``, or a Session's stop) before it ended."""


def reference_pass(engine, ds, collate: Callable, batch_size: int, settings: DPOSettings,
                   progress: Optional[Callable[[int, int], None]] = None, stop: Optional[Callable[[], bool]] = None):
    """The reference log-probs ``(chosen [N], rejected [N])`` of ``ds`` in order: forward only,
    through ``engine.evaluate`` with a log-prob-only objective. ``stop`` is asked before each
    batch (a Session applies its queued pause, resume and stop there); True ends the pass with
    :class:`ReferenceStopped`."""
    obj = ReferenceLogps(settings)
    chosen, rejected, done = [], [], 0
    for b in eval_batches(ds, batch_size=batch_size, collate=collate):
        if stop is not None and stop():
            raise ReferenceStopped("the reference pass was stopped")
        out = engine.evaluate(b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"], loss_fn=obj,
                              **(b.get(EXTRA_INPUTS) or {}))   # (a processor's inputs: the pictures)
        c, r = out.objective_metrics[0]["logps"].chunk(2, dim=0)
        chosen.append(c)
        rejected.append(r)
        done += c.shape[0]
        if progress is not None:
            progress(done, len(ds))
    return torch.cat(chosen), torch.cat(rejected)


class ReferenceCache:
    """Reference log-probs in ``<output_dir>/reference_logps/<what>-<key>.safetensors``.

    safetensors, not a pickle: nothing a cache file holds can run code when it is read (only
    ``trainer/checkpoint.py`` reads torch's pickles, a test keeps it so). The header holds the key
    the file was written for, a digest of its inputs' data part and an xxh3 digest of the payload;
    on read the key, the digest, the length and every value's finiteness are checked. A file that
    fails one is not used: the reference log-probs are computed again, with a line saying why
    (``reason``, also in the run's metrics log)."""

    def __init__(self, output_dir):
        self.folder = Path(output_dir) / CACHE_DIR
        self.reason = ""   # why the last load() found nothing usable ("" = no file, or it was used)

    def path(self, what: str, key: str) -> Path:
        return self.folder / f"{what}-{key}.safetensors"

    def load(self, what: str, key: str, n: int, parts: Optional[dict] = None):
        """``(chosen, rejected)`` from the file of ``key``, or None (computed again: ``reason``
        says why and a warning says it once)."""
        self.reason = ""
        p = self.path(what, key)
        if not p.is_file():
            return None
        got, why = self._read(p, key, n, parts)
        if why:
            self.reason = f"the reference cache {p} {why}: computing the reference log-probs again"
            warnings.warn(self.reason, stacklevel=3)
            return None
        return got

    def _read(self, p: Path, key: str, n: int, parts: Optional[dict]):
        try:
            with safe_open(str(p), framework="pt") as f:
                meta = f.metadata() or {}
                chosen, rejected = f.get_tensor("chosen").clone(), f.get_tensor("rejected").clone()
        except (SafetensorError, KeyError, OSError, ValueError, RuntimeError) as e:
            return None, f"cannot be read ({' '.join(str(e).split())[:200]})"
        if "xxh3" not in meta or "key" not in meta:
            return None, "has no checksum (written by an older megatrain_nb, or by something else)"
        if meta["key"] != key:
            data = (parts or {}).get("data")
            other = ("other data (its pairs' tokens differ)" if data and meta.get("data") not in (None, data[:12])
                     else "other inputs (tokenizer, reference weights, max_length, truncation or precision)")
            return None, f"was written for {other} (key {meta['key']}, this run's {key})"
        if payload_digest(chosen, rejected) != meta["xxh3"]:
            return None, "does not match its checksum (damaged, or its values edited or swapped)"
        if chosen.shape != (n,) or rejected.shape != (n,):
            return None, f"holds {tuple(chosen.shape)} / {tuple(rejected.shape)} values for {n} pairs"
        bad = first_nonfinite(chosen, rejected)
        if bad is not None:
            return None, f"holds a non-finite {bad[0]} log-prob (pair {bad[1]})"
        return (chosen, rejected), ""

    def save(self, what: str, key: str, chosen, rejected, seconds: float, parts: Optional[dict] = None) -> Path:
        from safetensors.torch import save

        chosen, rejected = chosen.float().contiguous(), rejected.float().contiguous()
        p = self.path(what, key)
        meta = {"key": key, "xxh3": payload_digest(chosen, rejected), "seconds": f"{float(seconds):.4g}"}
        if parts and parts.get("data"):
            meta["data"] = str(parts["data"])[:12]
        data = save({"chosen": chosen, "rejected": rejected}, metadata=meta)
        with atomic_file(p, "wb") as f:
            f.write(data)
        return p


def check_reference_values(chosen, rejected, what: str, where: str) -> None:
    """Refuse non-finite reference log-probs, naming the pair (``where``: where they came from)."""
    bad = first_nonfinite(torch.as_tensor(chosen, dtype=torch.float64), torch.as_tensor(rejected, dtype=torch.float64))
    if bad is not None:
        raise DataError(f"{what} row {bad[1]}: its ref_{bad[0]}_logps is not finite ({where}); reference "
                        "log-probs are sums of token log-probs, finite numbers. Fix or drop that row (or remove the "
                        "ref_*_logps columns: the trainer then computes them)")


def with_reference(ds, chosen, rejected):
    """``ds`` with the reference columns TRL's collator reads."""
    for c in ("ref_chosen_logps", "ref_rejected_logps"):
        if c in ds.column_names:
            ds = ds.remove_columns(c)
    ds = ds.add_column("ref_chosen_logps", chosen.tolist())
    return ds.add_column("ref_rejected_logps", rejected.tolist())


def cache_bytes(folder) -> int:
    f = Path(folder) / CACHE_DIR
    return sum(p.stat().st_size for p in f.glob("*.safetensors")) if f.is_dir() else 0


__all__ = ["ReferenceCache", "cache_key", "cache_parts", "check_reference_values", "key_of", "payload_digest",
           "reference_pass", "weights_fingerprint", "with_reference"]
