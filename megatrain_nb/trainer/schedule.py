"""The learning-rate schedule: ``transformers.get_scheduler`` driven on a one-parameter dummy
optimiser (the engine's AdamW takes the rate as an argument), plus the live ``set_lr`` override.

``set_lr(lr)`` anchors the schedule at its next value ``s0``: from then on the rate is
``lr * s(t) / s0``. A constant schedule therefore stays exactly ``lr``, and a decaying one keeps
decaying from ``lr`` in the same proportion.
"""
from __future__ import annotations

from typing import Optional

import torch


class LRSchedule:
    def __init__(self, *, learning_rate: float, scheduler_type, num_training_steps: int,
                 num_warmup_steps: int = 0, scheduler_kwargs: Optional[dict] = None):
        from transformers import get_scheduler

        self.base_lr = float(learning_rate)
        self._param = torch.nn.Parameter(torch.zeros(1))
        self._opt = torch.optim.SGD([self._param], lr=self.base_lr)
        self.scheduler = get_scheduler(scheduler_type, optimizer=self._opt, num_warmup_steps=num_warmup_steps,
                                       num_training_steps=num_training_steps,
                                       scheduler_specific_kwargs=scheduler_kwargs or {})
        self.override: Optional[tuple[float, float]] = None  # (lr, schedule value it was anchored at)

    def scheduled(self) -> float:
        lr = self.scheduler.get_last_lr()[0]
        return float(lr.item() if torch.is_tensor(lr) else lr)

    def current(self) -> float:
        """The learning rate of the next optimizer step."""
        s = self.scheduled()
        if self.override is None:
            return s
        lr, anchor = self.override
        return lr if s == anchor else lr * (s / anchor)

    def set_lr(self, lr: float) -> None:
        """``lr`` from the next step (checked by the caller's door: the table of values)."""
        anchor = self.scheduled()
        if anchor == 0.0:  # at a zero of the schedule (warm-up start): anchor on the peak instead
            anchor = self.base_lr or 1.0
        self.override = (float(lr), anchor)

    def step(self) -> None:
        self._opt.step()  # a no-op (no gradients); keeps torch's "scheduler before optimizer" check quiet
        self.scheduler.step()

    def state_dict(self) -> dict:
        return {"scheduler": self.scheduler.state_dict(), "override": self.override}

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self.override = tuple(state["override"]) if state.get("override") is not None else None
