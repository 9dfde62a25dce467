"""Hugging Face folders in and out: safetensors shards written unit by unit, atomically.

Also the package's one atomic-save helper: :func:`atomic_dir` / :func:`atomic_file` write to
a temporary sibling, fsync, then rename into place, so a reader (or a crash) sees the old
version or the new one, never half of one.
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
import secrets
import shutil
from typing import Callable, Dict, Iterator, Union

import torch
from torch import nn

# ---------------------------------------------------------------------------- atomic saves
def temp_name(final: str) -> str:
    """A sibling of ``final`` for its next version: ``<name>.tmp-<pid>-<random>`` (the pid lets a
    cleaner tell a dead writer's leftovers from a live one's)."""
    return f"{os.fspath(final).rstrip(os.sep)}.tmp-{os.getpid()}-{secrets.token_hex(4)}"


def fsync_path(path) -> None:
    """Flush a file's or a folder's entry to disk (best effort: some filesystems refuse)."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def fsync_tree(path) -> None:
    """fsync every file under ``path``, then the folders themselves."""
    for folder, _, files in os.walk(path):
        for f in files:
            fsync_path(os.path.join(folder, f))
        fsync_path(folder)


def atomic_dir(final, write: Callable[[str], None]) -> str:
    """Call ``write(tmp)`` on a fresh temporary folder beside ``final``, fsync it, then rename it
    to ``final`` (an older ``final`` is moved aside and removed). On any error the temporary
    folder is removed and ``final`` is left as it was. Returns ``final``."""
    final = os.path.abspath(os.fspath(final))
    parent = os.path.dirname(final)
    os.makedirs(parent, exist_ok=True)
    tmp = temp_name(final)
    os.mkdir(tmp)
    try:
        write(tmp)
        fsync_tree(tmp)
        if os.path.isdir(final):
            old = temp_name(final)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        fsync_path(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


@contextlib.contextmanager
def atomic_file(final, mode: str = "w", *, encoding: Union[str, None] = "utf-8") -> Iterator:
    """``with atomic_file(path) as f: f.write(...)``: written to a temporary sibling, fsynced and
    renamed over ``path`` when the block ends without an error (removed if it raises).
    ``mode`` "w" (text) or "wb" (bytes). The file gets the usual permissions (umask applied)."""
    final = os.path.abspath(os.fspath(final))
    os.makedirs(os.path.dirname(final), exist_ok=True)
    tmp = temp_name(final)
    try:
        with open(tmp, mode, encoding=None if "b" in mode else encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fsync_path(os.path.dirname(final))
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


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


def load_weights(engine, folder) -> None:
    """Read safetensors weights into the engine's master store, unit by unit (RAM or disk)."""
    from .materialize import SafetensorsSource

    source = SafetensorsSource(folder)
    for u in engine.units:
        values = source.unit_values(u)
        flat = torch.empty(u.numel, dtype=torch.float32)
        for p in u.params:
            flat[p.offset:p.offset + p.numel].copy_(values[p.name].reshape(-1))
        engine.weights.overwrite(u, flat)
