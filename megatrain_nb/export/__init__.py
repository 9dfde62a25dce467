"""Exports of a trained model (docs/EXPORT.md): ``mt.export(obj, path, format=...)``,
``trainer.export(...)``, ``session.export(...)`` and ``megatrain-nb export SRC DEST``.

``format``:

- ``"safetensors"``: a Hugging Face folder (config, sharded safetensors, tokenizer and chat
  template when known, generation config), exact;
- ``"gguf"``: one llama.cpp file, ``dtype`` f32 | f16 | bf16 | q8_0 (:mod:`.gguf_out`);
- ``"dcp"``: a ``torch.distributed.checkpoint`` that FSDP2 or ``dcp.load`` reads (:mod:`.dcp_out`).

``obj``: a Trainer (between steps or after ``train()``), a Session (while it runs: a snapshot is
taken at the next step boundary -- the only time the run waits -- and the export reads from it
while training goes on), a StreamingEngine, or a path (a saved model folder, a checkpoint, a
run's ``output_dir``, a ``.gguf`` file). The weights are read unit by unit wherever they live.
"""
from __future__ import annotations

import os
import sys
import types
from typing import Any, Optional

from megatrain_nb.gguf_in import convert as convert_gguf
from megatrain_nb.gguf_in import is_gguf
from megatrain_nb.model_source import is_engine

from .dcp_out import read_dcp, write_dcp
from .gguf_out import ARCHS, DTYPES, write_gguf
from .safetensors_out import write_safetensors
from .source import WeightSource, engine_source, folder_source, snapshot_source

FORMATS = ("safetensors", "gguf", "dcp")

__all__ = ["export", "source_of", "FORMATS", "DTYPES", "ARCHS", "read_dcp", "WeightSource"]


def _is_session(obj) -> bool:
    return hasattr(obj, "snapshot") and hasattr(obj, "trainer") and hasattr(obj, "rewind")


def _session_source(session) -> WeightSource:
    trainer = session.trainer
    if trainer is None or getattr(trainer, "engine", None) is None:
        raise RuntimeError(f"session {getattr(session, 'name', '')!r} holds no model (it released it when it ended, "
                           "or runs in worker processes); export its last checkpoint: mt.export('<output_dir>', ...)")
    if session.state in ("running", "paused"):   # a snapshot at the next step boundary; training goes on
        info = session.snapshot()
        return snapshot_source(trainer.engine, info.path, tokenizer=trainer.tokenizer)
    return _trainer_source(trainer)


def _trainer_source(trainer) -> WeightSource:
    hooks = getattr(trainer, "hooks", None)   # (trainer/run.py's RunHooks)
    if hooks is not None:   # a branch sharing its engine: its own weights first
        hooks.hold_weights("export()")
    return engine_source(trainer.engine, tokenizer=trainer.tokenizer, describe="the trainer's model")


def source_of(obj: Any) -> WeightSource:
    """The :class:`WeightSource` of a Trainer, Session, engine or path (see the module)."""
    if isinstance(obj, (str, os.PathLike)):
        path = os.fspath(obj)
        return folder_source(convert_gguf(path) if is_gguf(path) else path)
    if _is_session(obj):
        return _session_source(obj)
    if is_engine(obj):
        return engine_source(obj)
    if hasattr(obj, "engine") and hasattr(obj, "save_model"):
        return _trainer_source(obj)
    raise TypeError(f"export() takes a Trainer, a Session, a StreamingEngine or a model folder / checkpoint / run "
                    f"folder / .gguf path, not {type(obj).__name__}")


def export(obj: Any, path, format: str = "safetensors", *, dtype: Optional[str] = None,
           tokenizer: bool = True) -> str:
    """Write ``obj``'s model to ``path`` in ``format``; returns the path written.

    ``dtype``: for ``gguf`` one of f32 | f16 | bf16 | q8_0 (default f16); safetensors and dcp are
    fp32, exact. ``tokenizer=False``: a GGUF without tokenizer metadata."""
    if format not in FORMATS:
        raise ValueError(f"format={format!r}: one of {', '.join(FORMATS)}")
    if dtype is not None and format != "gguf" and dtype not in ("f32", "fp32", "float32"):
        raise ValueError(f"dtype={dtype!r} applies to format='gguf'; {format} exports are fp32, exact")
    src = source_of(obj)
    engine = None if _is_session(obj) else (obj if is_engine(obj) else getattr(obj, "engine", None))
    lock = getattr(engine, "lock", None)
    if lock is None:
        return _write(src, path, format, dtype, tokenizer)
    with lock:   # a Trainer or engine: nothing trains while its weights are read
        return _write(src, path, format, dtype, tokenizer)


def _write(src: WeightSource, path, format: str, dtype, tokenizer: bool) -> str:
    if format == "safetensors":
        return write_safetensors(src, path)
    if format == "dcp":
        return write_dcp(src, path)
    return write_gguf(src, path, dtype=dtype or "f16", tokenizer=tokenizer)


class _CallableModule(types.ModuleType):
    """``mt.export(...)``: once this package is imported, ``megatrain_nb.export`` is the package
    itself (Python sets the submodule on its parent), so the package calls :func:`export`."""

    def __call__(self, *args, **kwargs):
        return export(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
