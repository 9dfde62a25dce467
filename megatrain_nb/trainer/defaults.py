"""Process-wide defaults set by ``mt.init(...)`` and used by later Trainers and Sessions.

Example::

    import megatrain_nb as mt
    mt.init(offload_dir="/nvme/cache", max_vram_gb=80, optimizer_compression=True)
    mt.get_defaults()   # {'offload_dir': '/nvme/cache', 'max_vram_gb': 80, 'optimizer_compression': True}

Each ``init`` call replaces the previous defaults (call ``init()`` with no arguments to clear
them). Explicit engine options given to a Trainer or Session override these.
"""
from __future__ import annotations

import threading

from megatrain_nb.engine import EngineConfig

_LOCK = threading.Lock()
_DEFAULTS: dict = {}


def init(**engine_options) -> dict:
    """Set the process-wide engine defaults: any :class:`~megatrain_nb.engine.EngineConfig` field
    (``offload_dir``, ``max_vram_gb``, ``optimizer_compression``, ``device``, ...).

    The options are validated now (an unknown name or a bad value raises at once). Returns the
    defaults in force.
    """
    EngineConfig.from_options(**engine_options)  # validates names and values
    with _LOCK:
        _DEFAULTS.clear()
        _DEFAULTS.update(engine_options)
        return dict(_DEFAULTS)


def get_defaults() -> dict:
    """A copy of the defaults set by :func:`init`."""
    with _LOCK:
        return dict(_DEFAULTS)


def merge_engine_options(derived: dict, explicit: dict) -> dict:
    """defaults < ``derived`` (from TrainingArguments) < ``explicit`` engine options.

    A field set both by TrainingArguments and explicitly to different values is an error.
    """
    clash = {k: (derived[k], explicit[k]) for k in derived.keys() & explicit.keys() if derived[k] != explicit[k]}
    if clash:
        detail = "; ".join(f"{k}: TrainingArguments gives {a!r}, engine option gives {b!r}"
                           for k, (a, b) in sorted(clash.items()))
        raise ValueError(f"conflicting settings ({detail}); set each in one place")
    return {**get_defaults(), **derived, **explicit}
