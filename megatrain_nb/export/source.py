"""Where an export reads the weights from, one unit (or one tensor) at a time.

A :class:`WeightSource` knows every tensor's name, shape and dtype before any is read (the
writers lay out their headers first) and then yields the tensors in that order, unit by unit,
so an export holds one unit's weights at a time whatever tier they live on:

- :func:`engine_source`: a StreamingEngine at rest (``engine.named_parameters()`` reads each
  unit from the host store, or from the disk tier into a buffer of that unit's size);
- :func:`snapshot_source`: a snapshot of a running Session (its ``ram_state.safetensors`` and the
  disk tier's hard-linked files, read unit by unit with the engine's own checked reader);
- :func:`folder_source`: a saved Hugging Face folder or a checkpoint (safetensors, tensor by
  tensor), or a run's ``output_dir`` (its newest checkpoint, else the model saved there).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, List, Optional, Tuple

import torch

from megatrain_nb.engine.tiers.disk_params import weights_key
from megatrain_nb.engine.tiers.io import shard_files
from megatrain_nb.engine.tiers.linked import DISK_FOLDER, LINKED_FILE, RAM_FILE
from megatrain_nb.trainer import checkpoint as ckpt

from .stream import Piece

Shape = Tuple[int, ...]


@dataclass
class WeightSource:
    """``config`` (transformers), ``entries`` [(name, shape, dtype)] in the order ``tensors()``
    yields them, ``model_class`` (``LlamaForCausalLM``...), ``tokenizer`` / ``generation_config``
    when known, ``describe`` (how a message names it)."""

    config: Any
    entries: List[Tuple[str, Shape, torch.dtype]]
    tensors: Callable[[], Iterator[Tuple[str, torch.Tensor]]]
    model_class: str
    describe: str
    tokenizer: Any = None
    generation_config: Any = None
    extra: dict = field(default_factory=dict)
    #: the same bytes as ``tensors()`` as :class:`~.stream.Piece` s, unit by unit (the disk tier's
    #: files read range by range, several at once), where the stored bytes are the entries'
    #: bytes; None: only ``tensors()``
    pieces: Optional[Callable[[], Iterator[Piece]]] = None

    @property
    def tied(self) -> bool:
        """The output head shares the input embedding (no ``lm_head.weight`` of its own)."""
        names = {n for n, _, _ in self.entries}
        return bool(getattr(self.config, "tie_word_embeddings", False)) or (
            "lm_head.weight" not in names and any(n.endswith("embed_tokens.weight") for n in names))

    def nbytes(self) -> int:
        return sum(numel(s) * torch.empty((), dtype=d).element_size() for _, s, d in self.entries)


def numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _class_name(model) -> str:
    return type(model).__name__


def _ordered(unit):
    """A unit's parameters in the order they lie in its flat buffer."""
    return sorted(unit.params, key=lambda p: p.offset)


def _spans(unit, esize: int = 4):
    return [(p.offset * esize, (p.offset + p.numel) * esize) for p in _ordered(unit)]


def _buffer_pieces(buffers: dict) -> Iterator[Piece]:
    for b in buffers.values():
        t = b.detach().cpu().contiguous()
        yield Piece([(0, t.numel() * t.element_size())], load=lambda t=t: t)


def _engine_pieces(engine, buffers: dict) -> Iterator[Piece]:
    """The engine's units as pieces: from the disk tier's files range by range (a unit its host
    cache holds, from RAM), or as the weight store hands them out (RAM)."""
    engine.pager.wait_grads()
    engine.updates.check_intact("export()")
    weights = engine.weights
    disk = getattr(weights, "disk", None) if engine.params_on_disk else None
    store = getattr(disk, "store", disk)
    for u in engine.units:
        if disk is None:
            yield Piece(_spans(u), load=lambda u=u: weights.read_now(u))
            continue
        weights.dirty.wait_clean(u)   # its update's write has been issued
        key = weights_key(u)
        if getattr(disk, "resident_bytes", None) is not None and disk.resident_bytes([key]):
            yield Piece(_spans(u), load=lambda key=key: disk.read(key, outside_plan=True, share=True).result()["w"])
        else:   # ordered after the key's last write
            yield Piece(_spans(u), open=lambda key=key: store.read_ranged(key))
    yield from _buffer_pieces(buffers)


def engine_source(engine, tokenizer=None, describe: str = "the engine") -> WeightSource:
    """The engine's fp32 master weights, unit by unit (call when nothing trains: between steps,
    or after ``train()``)."""
    if getattr(engine, "sharded", None) is not None:
        raise ValueError("export from a data-parallel engine: save a checkpoint (trainer.save_model()) and export "
                         "that folder with `megatrain-nb export`")
    buffers = dict(getattr(engine, "persistent_buffers", {}) or {})
    entries = [(p.name, tuple(p.shape), torch.float32) for u in engine.units for p in _ordered(u)]
    entries += [(n, tuple(b.shape), b.dtype) for n, b in buffers.items()]

    def tensors():
        it = engine.named_parameters()   # unit by unit, in each unit's own order
        for u in engine.units:
            views = dict(next(it) for _ in u.params)
            for p in _ordered(u):
                yield p.name, views.pop(p.name)
            del views
        for n, b in buffers.items():
            yield n, b.detach().cpu()

    model = engine.model
    return WeightSource(engine.model_config, entries, tensors, _class_name(model), describe, tokenizer=tokenizer,
                        generation_config=getattr(model, "generation_config", None),
                        pieces=lambda: _engine_pieces(engine, buffers))


def snapshot_source(engine, folder, tokenizer=None) -> WeightSource:
    """The weights of a snapshot ``folder`` this ``engine``'s run took (linked: RAM-held units
    from ``ram_state.safetensors``, disk-tier units from their hard-linked files), unit by unit."""
    from safetensors import safe_open

    folder = os.fspath(folder)
    meta_path = os.path.join(folder, LINKED_FILE)
    if not os.path.isfile(meta_path):
        raise ValueError(f"{folder!r} is not a snapshot of one process (no {LINKED_FILE}); export a checkpoint "
                         "folder instead")
    with open(meta_path) as f:
        meta = json.load(f)
    units = list(engine.units)
    if meta.get("units") != [u.name for u in units]:
        raise ValueError(f"snapshot {folder!r} holds units {meta.get('units')}, not this engine's")
    entries = [(p.name, tuple(p.shape), torch.float32) for u in units for p in _ordered(u)]

    def flat_of(u) -> torch.Tensor:
        if u.name in meta["weights"]:
            return engine.disk.read_file(os.path.join(folder, DISK_FOLDER, meta["weights"][u.name]), weights_key(u))["w"]
        with safe_open(os.path.join(folder, RAM_FILE), "pt") as fh:
            return fh.get_tensor(f"w/{u.name}")

    def tensors():
        for u in units:
            flat = flat_of(u)
            for p in _ordered(u):
                yield p.name, flat[p.offset:p.offset + p.numel].view(p.shape)
            del flat

    def pieces():
        for u in units:
            yield Piece(_spans(u), load=lambda u=u: flat_of(u))

    model = engine.model
    return WeightSource(engine.model_config, entries, tensors, _class_name(model), f"snapshot {folder}",
                        tokenizer=tokenizer, generation_config=getattr(model, "generation_config", None),
                        pieces=pieces)


def run_folder(path) -> str:
    """The model folder of ``path``: itself when it holds a model (a saved folder or a
    checkpoint), else a run's ``output_dir``'s newest checkpoint."""
    path = os.fspath(path)
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    if os.path.isdir(path):
        latest = ckpt.latest_checkpoint(path)
        if latest is not None and os.path.isfile(os.path.join(os.fspath(latest), "config.json")):
            return os.fspath(latest)
    if os.path.isfile(os.path.join(path, LINKED_FILE)):
        raise ValueError(f"{path!r} is a snapshot: export it from its Session (session.export) or save a checkpoint "
                         "and export that")
    raise FileNotFoundError(f"{path!r} is neither a model folder (config.json + safetensors), a checkpoint nor a "
                            "run's output_dir with a checkpoint; give one of those (or a .gguf file)")


def folder_source(path) -> WeightSource:
    """A Hugging Face folder, a checkpoint or a run's newest checkpoint, tensor by tensor."""
    from safetensors import safe_open
    from transformers import AutoConfig, GenerationConfig

    folder = run_folder(path)
    config = AutoConfig.from_pretrained(folder)
    files = shard_files(folder)
    entries = []
    for file in dict.fromkeys(files.values()):
        with safe_open(file, "pt") as fh:
            for name in fh.keys():
                if files.get(name) == file:
                    sl = fh.get_slice(name)
                    entries.append((name, tuple(sl.get_shape()), _dtype(sl.get_dtype())))

    def tensors():
        for file in dict.fromkeys(files.values()):
            with safe_open(file, "pt") as fh:
                for name in fh.keys():
                    if files.get(name) == file:
                        yield name, fh.get_tensor(name)

    try:
        gen = GenerationConfig.from_pretrained(folder)
    except Exception:   # noqa: BLE001 - a folder without generation_config.json
        gen = None
    arch = (getattr(config, "architectures", None) or [None])[0] or _causal_class(config)
    return WeightSource(config, entries, tensors, arch, f"folder {folder}", tokenizer=_tokenizer(folder),
                        generation_config=gen, extra={"folder": folder})


def _causal_class(config) -> str:
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].__name__


def _tokenizer(folder: str) -> Optional[Any]:
    if not any(os.path.isfile(os.path.join(folder, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except Exception:   # noqa: BLE001 - a folder whose tokenizer files do not load: exported without one
        return None


_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def _dtype(name: str) -> torch.dtype:
    return _DTYPES[name]
