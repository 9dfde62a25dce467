"""Hugging Face folders in and out: safetensors shards written unit by unit, atomically
(through the package's one atomic-save helper, :mod:`megatrain_nb.atomic`)."""
from __future__ import annotations

import copy
import json
import os
from typing import Dict

import torch
from torch import nn

from megatrain_nb.atomic import atomic_dir


# ---------------------------------------------------------------------------- Hugging Face folders

SHARD_BYTES = 2 * 1024 ** 3
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def persistent_buffers(model: nn.Module) -> Dict[str, torch.Tensor]:
    """Buffers that belong in a saved state dict (persistent ones), by name."""
    param_ids = {id(p) for p in model.parameters()}
    out = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in param_ids and not isinstance(t, nn.Parameter):
            out[name] = t
    return out


def _iter_tensors(engine):
    for name, t in engine.named_parameters():
        yield name, t
    for name, b in engine.persistent_buffers.items():
        yield name, b.detach().cpu()


def save_pretrained(engine, path, *, atomic: bool = True) -> None:
    """Write config + safetensors (sharded when large) so from_pretrained loads the folder;
    ``atomic``: into a temporary folder renamed over ``path`` (see :func:`atomic_dir`)."""
    if atomic:
        atomic_dir(path, lambda tmp: _write_pretrained(engine, tmp))
    else:
        os.makedirs(os.fspath(path), exist_ok=True)
        _write_pretrained(engine, os.fspath(path))


def _write_pretrained(engine, target: str) -> None:
    from safetensors.torch import save_file

    cfg = copy.deepcopy(engine.model_config)
    cfg.architectures = [type(engine.model).__name__]
    cfg.use_cache = True
    try:
        cfg.dtype = "float32"
    except Exception:
        pass
    cfg.save_pretrained(target)
    gen = getattr(engine.model, "generation_config", None)
    if gen is not None:
        try:
            gen.save_pretrained(target)
        except Exception:
            pass
    shards, current, size = [], {}, 0
    for name, t in _iter_tensors(engine):
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
        current[name] = t
        size += nbytes
    if current or not shards:
        shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = WEIGHTS_NAME if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: v.contiguous() for k, v in shard.items()}, os.path.join(target, fname),
                  metadata={"format": "pt"})
        # safetensors writes its file 0600: the folder's other files' mode (umask applied), as save_pretrained's
        os.chmod(os.path.join(target, fname), os.stat(os.path.join(target, "config.json")).st_mode & 0o777)
        weight_map.update({k: fname for k in shard})
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for s in shards for t in s.values())
        with open(os.path.join(target, INDEX_NAME), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def shard_files(folder) -> Dict[str, str]:
    """name -> file for a Hugging Face safetensors folder (single file or sharded)."""
    folder = os.fspath(folder)
    index = os.path.join(folder, INDEX_NAME)
    if os.path.exists(index):
        with open(index) as f:
            wm = json.load(f)["weight_map"]
        return {k: os.path.join(folder, v) for k, v in wm.items()}
    single = os.path.join(folder, WEIGHTS_NAME)
    if not os.path.exists(single):
        raise FileNotFoundError(f"{folder} has no {WEIGHTS_NAME} or {INDEX_NAME}; save it with "
                                "save_pretrained(..., safe_serialization=True).")
    from safetensors import safe_open

    with safe_open(single, "pt") as fh:
        return {k: single for k in fh.keys()}


