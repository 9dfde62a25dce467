"""megatrain_nb: full-precision training of models larger than accelerator memory, from Jupyter.

    import megatrain_nb as mt
    mt.init(offload_dir="/nvme/cache", max_vram_gb=80, optimizer_compression=True)
    trainer = mt.Trainer(model=model, train_dataset=ds, args=TrainingArguments(...))
    trainer.train()
"""
from __future__ import annotations

import importlib
import warnings

__version__ = "0.1.0"

# TRL's SFTConfig sets transformers' deprecated `gradient_checkpointing` itself (transformers >= 5.2x
# warns): a FutureWarning, in red in a notebook, that no user code of ours can act on.
warnings.filterwarnings("ignore", message="`gradient_checkpointing` is deprecated", category=FutureWarning)

# Heavy modules load on first use, so `import megatrain_nb` stays fast.
_LAZY = {
    "StreamingEngine": "megatrain_nb.engine",
    "EngineConfig": "megatrain_nb.engine",
    "init": "megatrain_nb.trainer",
    "Trainer": "megatrain_nb.trainer",
    "SFTTrainer": "megatrain_nb.trainer.sft",
    "DPOTrainer": "megatrain_nb.trainer.dpo",
    "GRPOTrainer": "megatrain_nb.trainer.grpo",
    "get_defaults": "megatrain_nb.trainer",
    "load_default": "megatrain_nb.trainer",
    "preset_config": "megatrain_nb.model_configs",
    "estimate": "megatrain_nb.engine.planning.estimator",
    "Estimate": "megatrain_nb.engine.planning.estimator",
    "estimate_scale_out": "megatrain_nb.engine.planning.estimator_dist",
    "measure_machine": "megatrain_nb.engine.measure",
    "MachineRates": "megatrain_nb.engine.planning.rates",
    "Session": "megatrain_nb.notebook",
    "compare": "megatrain_nb.notebook.compare",
    "export": "megatrain_nb.export",
    # IPython's %load_ext looks these up on the module: the magics (no torch) load then
    "load_ipython_extension": "megatrain_nb.notebook.magics",
    "unload_ipython_extension": "megatrain_nb.notebook.magics",
}

__all__ = list(_LAZY) + ["__version__"]


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'megatrain_nb' has no attribute {name!r}")

