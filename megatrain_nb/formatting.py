"""Numbers as people read them: bytes in binary units, durations, plain numbers. One place
for the notebook displays, the reports, the estimator and the command line (standard library
only, so any layer may use it).

Example::

    fmt_bytes(3 * 2**30)        # '3.0 GiB'
    fmt_seconds(3725)           # '1h02m'
    fmt_num(0.000123, ".3g")    # '0.000123'
"""
from __future__ import annotations

import math
from typing import Any, Optional

_BINARY_UNITS = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def byte_scale(max_bytes: float) -> tuple[float, str]:
    """(divisor, unit) to show byte counts up to ``max_bytes``: ``(2**30, "GiB")``..."""
    for unit, div in _BINARY_UNITS:
        if max_bytes >= div:
            return float(div), unit
    return 1.0, "B"


def fmt_bytes(b: Optional[float], *, none: str = "–", digits: int = 1, compact: bool = False) -> str:
    """``'512 B'``, ``'1.5 KiB'`` ... ``'2.0 TiB'`` (``digits`` decimals); ``none`` for None or a
    non-finite value. ``compact`` (a progress bar's narrow field): ``'512B'``, ``'1.5K'``, ``'3.0M'``..."""
    if b is None or not math.isfinite(b):
        return none
    div, unit = byte_scale(abs(b))
    if compact:
        return f"{b:.0f}B" if unit == "B" else f"{b / div:.{digits}f}{unit[0]}"
    return f"{b:.0f} B" if unit == "B" else f"{b / div:.{digits}f} {unit}"


def fmt_seconds(s: Optional[float]) -> str:
    """``'42s'``, ``'3m07s'``, ``'1h02m'``; ``'–'`` when unknown."""
    if s is None or not math.isfinite(s):
        return "–"
    s = int(round(s))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{sec:02d}s" if m else f"{sec}s")


def fmt_num(v: Any, spec: str = ".4g") -> str:
    """``v`` formatted with ``spec``; ``'–'`` for None, non-numbers and non-finite values."""
    return format(v, spec) if isinstance(v, (int, float)) and math.isfinite(v) else "–"
