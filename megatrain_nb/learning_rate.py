"""The learning rate's rule, kept under its old names: the rule itself is the table's
(:mod:`megatrain_nb.values`), which every door applies. The sidebar's TypeScript mirrors the
limit (``extension/src/commands.ts``, ``MAX_LR``); a test keeps the two alike.
"""
from __future__ import annotations

from typing import Any

from megatrain_nb.values import VALUES, check

#: Above this a learning rate is a typo (1e10 for 1e-10), not a setting: AdamW's steps are
#: about lr in size, and weights of order 1 do not survive a step of 10.
MAX_LEARNING_RATE = VALUES["learning_rate"].high


def check_learning_rate(value: Any, what: str = "learning_rate") -> float:
    """``value`` as a float when it keeps the table's learning-rate rule (numbers written as
    text count); else :class:`~megatrain_nb.values.ValueRefused` naming ``what``.

    >>> check_learning_rate("3e-4")
    0.0003
    """
    return check("learning_rate", value, what)
