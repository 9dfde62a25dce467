"""The streaming engine: no Jupyter imports here.

    from megatrain_nb.engine import StreamingEngine, EngineConfig

The two names load on first use (PEP 562), so importing one of the engine's torch-free modules
(``megatrain_nb.engine.family``, the planning package's neighbours) does not import torch.
"""
from __future__ import annotations

import importlib

_LAZY = {"EngineConfig": ".config", "EngineOverrides": ".config", "EngineOutput": ".engine",
         "StreamingEngine": ".engine"}

__all__ = ["EngineConfig", "EngineOutput", "EngineOverrides", "StreamingEngine"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
