"""A fork of a preference run may change its loss: ``beta`` and ``loss_type`` (``branches.DPO_ALLOWED``).

The reference log-probs do not depend on either (the cache key is the data, the tokenizer, the
reference weights and the truncation), so the fork reads the parent's cache and only the loss
the engine's head computes changes. Checked here, before anything is built: on a run that is not
a DPO run they are refused by name (a TrainingArguments run would ignore them silently), and the
new values must pass TRL's own checks with the run's other DPOConfig fields.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from megatrain_nb.values import check, row_name

DPO_FIELDS = ("beta", "loss_type")


def check_dpo_changes(changes: dict, trainer: Any, kind: Any = None) -> None:
    """Refuse ``beta``/``loss_type`` on a non-DPO run; normalise ``loss_type`` (a name -> a list of
    names, as DPOConfig holds it) in ``changes`` and check the values. ``kind``: what ranks in
    worker processes train (``remote.ProcessRun.training_kind``), where no trainer is at hand."""
    given = [k for k in DPO_FIELDS if k in changes]
    if not given:
        return
    if trainer is None and kind not in (None, "dpo"):
        raise ValueError(f"a fork can change {', '.join(given)} only in a preference (DPO) run; its ranks train "
                         f"a {kind} run")
    for k in given:   # the table's rules (megatrain_nb/values.py), as DPOTrainer and run.yaml apply them
        changes[k] = check(row_name(k, "dpo"), changes[k], f"fork({k})")
    if trainer is None:   # ranks in worker processes: their DPOTrainer checks the values as it is built
        return
    settings = getattr(trainer, "settings", None)
    if settings is None or not hasattr(settings, "loss_type"):
        raise ValueError(f"a fork can change {', '.join(given)} only in a preference (DPO) run; "
                         f"{type(trainer).__name__} has no DPO loss")
    new = dataclasses.replace(settings, **{k: (list(v) if k == "loss_type" else float(v))
                                           for k, v in changes.items() if k in DPO_FIELDS})
    new.check()   # TRL's refusals: an unknown loss, loss_weights of another length, ...
