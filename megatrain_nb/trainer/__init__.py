"""The seed-compatible trainer: ``mt.init``, ``mt.Trainer``, data, checkpoints, the built-in default.

    import megatrain_nb as mt
    mt.init(offload_dir="/nvme/cache", max_vram_gb=80, optimizer_compression=True)
    trainer = mt.Trainer(model=model, train_dataset=ds, args=TrainingArguments(...))
    trainer.train()
"""
from megatrain_nb.model_configs import PRESETS, preset_config  # mt.trainer.PRESETS, as before

from .args import UnsupportedArgumentError, validate_training_args
from .checkpoint import CheckpointError, latest_checkpoint, list_checkpoints
from .data import DataError, PaddingCollator
from .default import load_default
from .defaults import get_defaults, init
from .trainer import Trainer

__all__ = [
    "CheckpointError", "DataError", "PRESETS", "PaddingCollator", "Trainer", "UnsupportedArgumentError",
    "get_defaults", "init", "latest_checkpoint", "list_checkpoints", "load_default", "preset_config",
    "validate_training_args",
]
