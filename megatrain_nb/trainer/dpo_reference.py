"""The reference log-probs of a DPO run: data, not a model. One forward-only streamed pass of
the reference (the policy as it starts, or a given ``ref_model`` in an engine of its own) over
the prepared pairs, no gradients, no optimizer, nothing written back; stored in the run's output
folder under a key of what they depend on (the tokenised pairs, the tokenizer, the reference
weights, ``max_length``, truncation, LD-DPO's alpha), so resume, rewind, fork and later runs on
the same data read them instead of running the pass again.
"""
from __future__ import annotations

import hashlib
import json
import time
import warnings
from pathlib import Path
from typing import Callable, Optional

import torch

from ..atomic import atomic_file
from .data import eval_batches
from .dpo_data import token_fingerprint
from .dpo_loss import DPOObjective, DPOSettings

CACHE_DIR = "reference_logps"


def weights_fingerprint(source) -> str:
    """A cheap fingerprint of reference weights: per tensor its name, shape and 64 evenly spaced
    values (a module), or the weight files' names, sizes and times (a folder)."""
    h = hashlib.sha256()
    if isinstance(source, torch.nn.Module):
        for name, p in source.state_dict().items():
            h.update(f"{name}{tuple(p.shape)}{p.dtype}".encode())
            if p.is_meta or p.numel() == 0:
                continue
            flat = p.detach().reshape(-1)
            idx = torch.linspace(0, flat.numel() - 1, steps=min(64, flat.numel())).long()
            h.update(flat[idx].float().cpu().numpy().tobytes())
    elif hasattr(source, "named_parameters") and hasattr(source, "forward_backward"):   # a StreamingEngine
        for name, p in source.named_parameters():
            flat = p.detach().reshape(-1)
            idx = torch.linspace(0, flat.numel() - 1, steps=min(64, flat.numel())).long()
            h.update(f"{name}{tuple(p.shape)}".encode() + flat[idx].float().cpu().numpy().tobytes())
    else:
        folder = Path(source)
        for f in sorted(folder.iterdir()) if folder.is_dir() else []:
            if f.suffix in (".safetensors", ".bin", ".json"):
                st = f.stat()
                h.update(f"{f.name}{st.st_size}{st.st_mtime_ns}".encode())
    return h.hexdigest()[:20]


def tokenizer_fingerprint(tok) -> str:
    h = hashlib.sha256()
    h.update(str(getattr(tok, "name_or_path", "")).encode())
    h.update(str(len(tok)).encode())
    h.update(str(getattr(tok, "chat_template", "") or "").encode())
    h.update(json.dumps(sorted(tok.get_vocab().items())[:: max(len(tok) // 256, 1)]).encode())
    return h.hexdigest()[:20]


def cache_key(ds, tok, weights: str, args) -> str:
    parts = {"data": token_fingerprint(ds), "tokenizer": tokenizer_fingerprint(tok), "weights": weights,
             "max_length": args.max_length, "truncation_mode": args.truncation_mode, "ld_alpha": args.ld_alpha,
             "pad_to_multiple_of": args.pad_to_multiple_of}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


class ReferenceStopped(Exception):
    """The reference pass was stopped (``request_stop()``, or a Session's stop) before it ended."""


def reference_pass(engine, ds, collate: Callable, batch_size: int, settings: DPOSettings,
                   progress: Optional[Callable[[int, int], None]] = None, stop: Optional[Callable[[], bool]] = None):
    """The reference log-probs ``(chosen [N], rejected [N])`` of ``ds`` in order: forward only,
    through ``engine.evaluate`` with a log-prob-only objective. ``stop`` is asked before each
    batch (a Session applies its queued pause, resume and stop there); True ends the pass with
    :class:`ReferenceStopped`."""
    obj = DPOObjective(settings)
    obj.reference_only = True
    chosen, rejected, done = [], [], 0
    for b in eval_batches(ds, batch_size=batch_size, collate=collate):
        if stop is not None and stop():
            raise ReferenceStopped("the reference pass was stopped")
        engine.evaluate(b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"], loss_fn=obj)
        c, r = obj.ref_logps.pop().chunk(2, dim=0)
        chosen.append(c)
        rejected.append(r)
        done += c.shape[0]
        if progress is not None:
            progress(done, len(ds))
    return torch.cat(chosen), torch.cat(rejected)


class ReferenceCache:
    """Reference log-probs in ``<output_dir>/reference_logps/<what>-<key>.safetensors``.

    safetensors, not a pickle: nothing a cache file holds can run code when it is read (only
    ``trainer/checkpoint.py`` reads torch's pickles, a test keeps it so). A file that cannot be read
    is computed again, with a warning naming it."""

    def __init__(self, output_dir):
        self.folder = Path(output_dir) / CACHE_DIR

    def path(self, what: str, key: str) -> Path:
        return self.folder / f"{what}-{key}.safetensors"

    def load(self, what: str, key: str, n: int):
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        p = self.path(what, key)
        if not p.is_file():
            return None
        try:
            d = load_file(str(p))
            chosen, rejected = d["chosen"].clone(), d["rejected"].clone()   # (not views of a mapped file)
        except (SafetensorError, KeyError, OSError) as e:
            warnings.warn(f"the reference cache {p} cannot be read ({e}): computing the reference log-probs again")
            return None
        if chosen.shape[0] != n or rejected.shape[0] != n:
            return None
        return chosen, rejected

    def save(self, what: str, key: str, chosen, rejected, seconds: float) -> Path:
        from safetensors.torch import save

        p = self.path(what, key)
        data = save({"chosen": chosen.float().contiguous(), "rejected": rejected.float().contiguous()},
                    metadata={"seconds": repr(float(seconds)), "time": repr(time.time())})
        with atomic_file(p, "wb") as f:
            f.write(data)
        return p


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


__all__ = ["ReferenceCache", "cache_key", "reference_pass", "weights_fingerprint", "with_reference"]
