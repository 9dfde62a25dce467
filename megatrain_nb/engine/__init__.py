"""The streaming engine: no Jupyter imports here.

    from megatrain_nb.engine import StreamingEngine, EngineConfig
"""
from .config import EngineConfig, EngineOverrides
from .engine import EngineOutput, StreamingEngine

__all__ = ["EngineConfig", "EngineOutput", "EngineOverrides", "StreamingEngine"]
