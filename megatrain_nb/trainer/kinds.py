"""Training kinds: what differs between plain, SFT, DPO and the next ones (GRPO, vision) plugs
into one step loop (:class:`~megatrain_nb.trainer.run.Run`) through four public hooks, never by
overriding the loop's private methods.

A kind is asked, at each point of a run:

- ``before_run(trainer)``: before the first step (DPO: its reference log-probs); False ends the
  run there, nothing trained (a stop that reached a reference pass);
- ``before_window(trainer, window)``: before a step's micro-batches go through the engine (DPO:
  the reference log-probs of a streamed window); each micro-batch dict of ``window`` gets its
  sequence objective's side data as its ``"objective_data"`` (DPO's pairs with the step's scale;
  GRPO's rollouts come with theirs), which travels with it through the engine; returns fields for
  the step's record;
- ``step_loss(trainer, out, loss_sum, n_items)``: the step's loss as logged, from the engine's
  output ``out`` (:class:`~megatrain_nb.engine.outcome.EngineOutput`): the mean token loss
  (``loss_sum`` over ``n_items``, all ranks), or the objective's own (``out.objective_loss``);
- ``after_window(trainer, window, out, record)``: the step's record is built; add the kind's
  metrics (a sequence objective's: ``out.objective_metrics``, one dict per micro-batch).

The loss itself is the trainer's ``loss_fn`` (a token loss, or a sequence-level objective:
engine/compute/objective.py), as TRL's trainers extend ``compute_loss``. Objectives are stateless:
what they measure comes back in the engine's output and the kind collects it (:class:`MetricLists`
holds the means a trainer logs). Kinds register by name (:func:`register_kind`), so a run's kind is
data: ``Trainer.kind.name`` is in every run header.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, Iterable, Optional, Protocol, runtime_checkable


@runtime_checkable
class TrainingKind(Protocol):
    """The hooks a training kind gives the step loop (see the module)."""

    name: str

    def before_run(self, trainer: Any) -> bool: ...

    def before_window(self, trainer: Any, window: list) -> dict: ...

    def step_loss(self, trainer: Any, out: Any, loss_sum: float, n_items: int) -> float: ...

    def after_window(self, trainer: Any, window: list, out: Any, record: dict) -> None: ...


class PlainKind:
    """Causal-LM training on token losses: ``mt.Trainer`` and ``mt.SFTTrainer`` (whose difference is
    its data and its token metrics, not the step)."""

    def __init__(self, name: str = "plain"):
        self.name = name

    def before_run(self, trainer: Any) -> bool:
        return True

    def before_window(self, trainer: Any, window: list) -> dict:
        return {}

    def step_loss(self, trainer: Any, out: Any, loss_sum: float, n_items: int) -> float:
        """The mean token loss over the step's target tokens (all ranks)."""
        return loss_sum / n_items

    def after_window(self, trainer: Any, window: list, out: Any, record: dict) -> None:
        return None


class MetricLists:
    """A sequence objective's metrics as the engine returns them (a dict per micro-batch), kept by
    name until a log takes their means (TRL's: each name's mean over the micro-batches since the
    last log)."""

    def __init__(self, skip_nan: bool = False):
        self.skip_nan = skip_nan   # GRPO's: NaN values left out of a mean (None when all are NaN)
        self.lists: Dict[str, list] = {}

    def add(self, metrics: Optional[Iterable[dict]]) -> Dict[str, float]:
        """Add each micro-batch's metrics; returns these micro-batches' own means (a step's record)."""
        new: Dict[str, list] = {}
        for m in metrics or ():
            for k, v in m.items():
                new.setdefault(k, []).append(float(v))
        for k, v in new.items():
            self.lists.setdefault(k, []).extend(v)
        return self._means(new)

    def take(self) -> Dict[str, Optional[float]]:
        """The means since the last take (cleared)."""
        out, self.lists = self._means(self.lists), {}
        return out

    def _means(self, lists: Dict[str, list]) -> Dict[str, Optional[float]]:
        out = {}
        for k, v in lists.items():
            vals = [x for x in v if not math.isnan(x)] if self.skip_nan else v
            if vals or self.skip_nan:
                out[k] = sum(vals) / len(vals) if vals else None
        return out


_KINDS: dict[str, Callable[..., TrainingKind]] = {"plain": PlainKind, "sft": lambda: PlainKind("sft")}


def register_kind(name: str, make: Callable[..., TrainingKind]) -> None:
    """Make ``kind(name, ...)`` build a kind with ``make(...)`` (a trainer module registers its own
    at import: trainer/dpo.py registers "dpo")."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"a training kind's name is an identifier, got {name!r}")
    _KINDS[name] = make


def kind(name: str, *args: Any, **kwargs: Any) -> TrainingKind:
    """The training kind registered as ``name``, built with ``args``/``kwargs``."""
    try:
        make = _KINDS[name]
    except KeyError:
        raise ValueError(f"unknown training kind {name!r}; registered: {', '.join(sorted(_KINDS))}") from None
    made = make(*args, **kwargs)
    if not isinstance(made, TrainingKind):
        raise TypeError(f"training kind {name!r} lacks the TrainingKind hooks (before_run, before_window, "
                        "step_loss, after_window)")
    return made


def kind_names() -> tuple[str, ...]:
    return tuple(sorted(_KINDS))


__all__ = ["MetricLists", "PlainKind", "TrainingKind", "kind", "kind_names", "register_kind"]
