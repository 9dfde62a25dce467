"""The seed-compatible trainer: ``mt.init``, ``mt.Trainer``, data, checkpoints, the built-in default.

    import megatrain_nb as mt
    mt.init(offload_dir="/nvme/cache", max_vram_gb=80, optimizer_compression=True)
    trainer = mt.Trainer(model=model, train_dataset=ds, args=TrainingArguments(...))
    trainer.train()

The names load on first use (PEP 562), so importing one of the trainer's light modules
(``megatrain_nb.trainer.snapshot``, ``.args``, ``.checkpoint``...) from the notebook or the
command line does not import the Trainer and with it torch and transformers.
"""
from __future__ import annotations

import importlib

_LAZY = {
    "PRESETS": "megatrain_nb.model_configs",          # mt.trainer.PRESETS, as before
    "preset_config": "megatrain_nb.model_configs",
    "UnsupportedArgumentError": ".args", "validate_training_args": ".args",
    "CheckpointError": ".checkpoint", "latest_checkpoint": ".checkpoint", "list_checkpoints": ".checkpoint",
    "DataError": ".data", "PaddingCollator": ".data",
    "load_default": ".default",
    "get_defaults": ".defaults", "init": ".defaults",
    "Trainer": ".trainer",
}
#: the submodules this package's namespace always had (``megatrain_nb.trainer.checkpoint``)
_SUBMODULES = ("args", "checkpoint", "data", "default", "defaults", "trainer")

__all__ = sorted(n for n in _LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
