"""The one rule for a learning rate, wherever it is set: ``TrainingArguments.learning_rate``
(the Trainer, the Session, run.yaml), ``set_lr`` (Trainer, Session), ``%megatrain lr``, the
sidebar's command (checked again by the server and the beacon). Standard library only, so the
Jupyter server side imports it cheaply. The sidebar's TypeScript mirrors it
(``extension/src/commands.ts``, ``MAX_LR``); a test keeps the two alike.
"""
from __future__ import annotations

import math
from typing import Any

#: Above this a learning rate is a typo (1e10 for 1e-10), not a setting: AdamW's steps are
#: about lr in size, and weights of order 1 do not survive a step of 10.
MAX_LEARNING_RATE = 10.0


def check_learning_rate(value: Any, what: str = "learning rate") -> float:
    """``value`` as a float when it is a sane learning rate: a finite number, > 0 and at most
    :data:`MAX_LEARNING_RATE`; numbers written as text ("3e-4") count. Otherwise ValueError
    naming ``what`` and the rule.

    >>> check_learning_rate("3e-4")
    0.0003
    """
    if isinstance(value, bool) or value is None:
        raise ValueError(f"{what} must be a positive number, e.g. 1e-4; got {value!r}")
    try:
        lr = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a positive number, e.g. 1e-4; got {value!r}") from None
    if not math.isfinite(lr) or lr <= 0:
        raise ValueError(f"{what} must be a finite number > 0, got {value!r}")
    if lr > MAX_LEARNING_RATE:
        raise ValueError(f"{what} {lr:g} is implausibly large (the limit is {MAX_LEARNING_RATE:g}; "
                         "a typo for a negative exponent?)")
    return lr
