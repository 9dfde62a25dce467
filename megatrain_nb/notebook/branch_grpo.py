"""A fork of a GRPO run may change its sampling and its KL: ``temperature`` and ``beta``
(``branches.GRPO_ALLOWED``), besides what every fork may change (``learning_rate``...).

The fork is built by the run's own trainer (``GRPOTrainer.fork_trainer``: the same reward
functions and tokenizer, the reference from the run's starting weights) and its rollouts go on
from the snapshot's data position, made anew with the fork's settings from the fork's step.
Checked here, before anything is built: on a run that is not GRPO they are refused by name,
the values by the table (``grpo_temperature`` > 0, ``grpo_beta`` >= 0), and ``beta`` > 0 needs
the run's starting weights.
"""
from __future__ import annotations

from typing import Any

from megatrain_nb.values import check, row_name

GRPO_FIELDS = ("temperature", "beta")


def is_grpo_trainer(trainer: Any) -> bool:
    """An mt.GRPOTrainer (told without importing trl)."""
    return callable(getattr(trainer, "fork_trainer", None)) and hasattr(trainer, "reward_func_names")


def check_grpo_changes(changes: dict, trainer: Any, kind: Any = None) -> None:
    """Refuse ``temperature`` on a run that is not GRPO; check ``temperature``/``beta`` by the
    table in ``changes`` (a GRPO run's ``beta`` by GRPO's row: 0 allowed). ``kind``: what ranks in
    worker processes train (``remote.ProcessRun.training_kind``), where no trainer is at hand."""
    given = [k for k in GRPO_FIELDS if k in changes]
    if trainer is None and kind is None:   # (the kind unknown: beta by DPO's rule, as it always was)
        given = [k for k in given if k != "beta"]
    if not given:
        return
    other = None   # the run's kind when it is not GRPO
    if trainer is not None and not is_grpo_trainer(trainer):
        other = type(trainer).__name__
    if trainer is None and kind not in (None, "grpo"):
        other = f"a {kind} run"
    if other is not None:
        if "temperature" in given:
            raise ValueError(f"a fork can change temperature only in a GRPO run; {other} samples no completions")
        return   # beta: DPO's (branch_dpo.py)
    for k in given:
        changes[k] = check(row_name(k, "grpo"), changes[k], f"fork({k})")
