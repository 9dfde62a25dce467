"""The notebook surface: Session (background training + controls), the live dashboard,
the %megatrain magics and run reports.

Example::

    from megatrain_nb.notebook import Session
    session = Session("tiny"); session.train()

The names load on first use (PEP 562): ``%load_ext megatrain_nb`` imports ``magics`` alone,
not the Session (and with it torch).
"""
from __future__ import annotations

import importlib

_LAZY = {"Session": ".session", "TrainerLike": ".run_state",
         "load_ipython_extension": ".magics", "unload_ipython_extension": ".magics"}

__all__ = ["Session", "TrainerLike", "load_ipython_extension", "unload_ipython_extension"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
