"""Where and how a run is displayed (kept free of heavy imports: train() calls it first)."""
from __future__ import annotations

import os
import sys
from typing import Any, Optional

_MODES = ("auto", "widgets", "html")


def in_kernel() -> bool:
    """True inside a Jupyter kernel (an IPython shell with a kernel attached)."""
    if "IPython" not in sys.modules:
        return False
    from IPython import get_ipython

    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def resolve_mode(requested: Any) -> Optional[str]:
    """None (display nothing) outside a Jupyter kernel or when asked; else a mode name.
    ``MEGATRAIN_NB_DASHBOARD`` (auto | widgets | html | none) sets the default."""
    if requested is None:
        requested = os.environ.get("MEGATRAIN_NB_DASHBOARD", "auto").strip().lower() or "auto"
    if requested is True:
        requested = "auto"
    if requested in (False, "none", "off", "false", "0"):
        return None
    if requested not in _MODES:
        raise ValueError(f"dashboard={requested!r}: use None/'auto', 'widgets', 'html' or False")
    return requested if in_kernel() else None
