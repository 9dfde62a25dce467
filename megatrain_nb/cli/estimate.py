"""``megatrain-nb estimate``: the memory table for a model on given hardware (also
``%megatrain estimate``)."""
from __future__ import annotations

import json

from megatrain_nb.estimate_words import budget_arg, estimate_from_words, run_estimate  # noqa: F401 - the CLI's names


def cmd_estimate(ns) -> int:
    est = run_estimate(ns)
    print(json.dumps(est.to_dict(), indent=2, default=str) if ns.json else est)
    return 0
