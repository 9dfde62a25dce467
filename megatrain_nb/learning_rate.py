"""The learning rate's rule, kept under its old names: the rule itself is the table's
(:mod:`megatrain_nb.values`), which every door applies. The sidebar's TypeScript mirrors the
limit (``extension/src/commands.ts``, ``MAX_LR``); a test keeps the two alike.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Optional

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


@dataclass(frozen=True)
class LearningRate:
    """A run's learning rate as one value, the one every view reads (the dashboard's header and
    field, the heartbeat the sidebar lists, the summary HTML, the report): what the latest step
    used, and a value asked for that no step has used yet.

    ``last``: the rate the latest optimizer step used (the configured rate before the first step).
    ``requested``: a value given to ``set_lr`` (code, magic, widget, inbox, HTTP) that no step has
    used yet; None once a step has (nothing stays pending after it applied).
    ``applies_at``: the optimizer step the request applies to, once the run took it (None: the
    run has not reached a step boundary since).

    >>> LearningRate(1e-3, 5e-4, 7).describe()
    '0.001 → 0.0005 from step 7'
    """

    last: Optional[float]
    requested: Optional[float] = None
    applies_at: Optional[int] = None

    @property
    def pending(self) -> bool:
        return self.requested is not None

    @property
    def shown(self) -> Optional[float]:
        """What a single field shows: the request while it is pending, else the latest step's."""
        return self.requested if self.requested is not None else self.last

    def describe(self) -> str:
        now = "—" if self.last is None else f"{self.last:.3g}"
        if self.requested is None:
            return now
        when = f"from step {self.applies_at}" if self.applies_at is not None else "from the next step"
        return f"{now} → {self.requested:.3g} {when}"

    def as_dict(self) -> dict:
        return {"lr": self.last, "requested_lr": self.requested, "lr_applies_at": self.applies_at}


class LearningRateRequest:
    """The one holder of a pending ``set_lr`` on the notebook's side (thread-safe): asked
    (:meth:`ask`), taken by the run at a step boundary (:meth:`taken`, with the step it applies
    to), and gone once a step at or past that one is recorded (:meth:`view`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value: Optional[float] = None
        self._applies_at: Optional[int] = None

    def ask(self, value: float) -> None:
        with self._lock:
            self._value, self._applies_at = float(value), None

    def taken(self, value: Any, steps_done: int) -> None:
        """The run applied ``value`` at the boundary after ``steps_done`` steps: the next step uses it."""
        with self._lock:
            if self._value is not None and value is not None and float(value) == self._value:
                self._applies_at = int(steps_done) + 1

    def view(self, last: Optional[float], steps_done: int) -> LearningRate:
        with self._lock:
            if self._applies_at is not None and steps_done >= self._applies_at:
                self._value = self._applies_at = None   # a step used it: nothing is pending
            return LearningRate(None if last is None else float(last), self._value, self._applies_at)
