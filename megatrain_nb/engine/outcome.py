"""EngineOutput: what one call of ``forward_backward`` returns -- for a call that ends an
optimizer step, the whole step (loss, tokens, norm, skipped, memory, telemetry, layer
statistics); StepOutcome: what the last optimizer step came to -- its global norm, whether it
was skipped, and a failure not yet reported.

Written only by the update modules (:mod:`.intake` records the norm and the skip decision,
:mod:`.update_runner` a failed update); the engine reads it (``engine.updates.outcome``) and
reports a failure through :meth:`check` / :meth:`check_intact`.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import List, Optional

from .updates import finite


class TornLoad(RuntimeError):
    """A load that failed part way: some units hold the folder's state, the others the state
    they held before. Recorded as a failure, so nothing trains, saves or reads on the mixture."""

    def __init__(self, path: str, cause: BaseException):
        self.path, self.cause = path, cause
        super().__init__(f"loading {path!r} failed part way ({type(cause).__name__}: {cause}), so the engine "
                         "holds a mixture of that state and the one before. Load a checkpoint or snapshot that "
                         "checks (load_checkpoint(), Session.rewind()) before training, saving or reading weights")


@dataclass
class EngineOutput:
    """One ``forward_backward`` (or ``evaluate``) call.

    ``loss`` has one meaning whatever the ``loss_fn``: the mean token loss of the call's
    micro-batches over their ``num_tokens`` target tokens, the Hugging Face definition (labels
    shifted by one, ``-100`` ignored; the cross-entropy, or a token ``loss_fn``'s own per-token
    loss). Under a sequence-level objective (engine/compute/objective.py: DPO, GRPO) it is still
    that cross-entropy of the labels, and the objective's own value is ``objective_loss``: the sum
    of its micro-batch losses as back-propagated (the call's gradient is that of
    ``objective_loss``), with ``objective_metrics`` each micro-batch's metrics in the call's order
    (the objective's ``metrics()``; both None under a token loss).

    With ``step_lr`` (the call ends the optimizer step) it carries all a step's record needs, so
    nobody goes back into the engine for it: ``memory`` (``memory_report()``), ``telemetry``
    (``telemetry()``) and, when ``EngineConfig.layer_stats`` is on, ``layer_stats`` (each unit's
    latest update; with clipping a unit whose update still runs in the worker has the step
    before's). None on a call that does not end a step."""

    loss: float
    num_tokens: int
    grad_norm: Optional[float] = None   # with step_lr and max_grad_norm: the norm before clipping
    skipped: bool = False               # the step was not applied (non-finite, on_nonfinite='skip')
    memory: Optional[dict] = None
    telemetry: Optional[dict] = None
    layer_stats: Optional[list] = None
    objective_loss: Optional[float] = None         # a sequence objective's loss, summed over the micro-batches
    objective_metrics: Optional[List[dict]] = None  # ... and its metrics, one dict per micro-batch


def objective_fields(heads: list) -> dict:
    """``EngineOutput``'s objective fields of the micro-batches' head outputs (``HeadOut``: the
    step's order); empty under a token loss."""
    if not heads or heads[0].objective_loss is None:
        return {}
    return {"objective_loss": sum(h.objective_loss for h in heads), "objective_metrics": [h.metrics for h in heads]}


class StepOutcome:
    """The last step's norm (before clipping; None without clipping), whether it was skipped,
    a failed update (delivered once, then recorded until a checkpoint is loaded) and a stopped
    non-finite step met in a worker thread that no caller has heard of yet."""

    def __init__(self):
        self._lock = threading.Lock()
        self._norm: Optional[float] = None
        self._skipped = False
        self._failed: Optional[BaseException] = None
        self._nonfinite: Optional[BaseException] = None

    # ------------------------------------------------------------------ read by the engine
    @property
    def norm(self) -> Optional[float]:
        return self._norm

    @property
    def skipped(self) -> bool:
        return self._skipped

    @property
    def failed(self) -> Optional[BaseException]:
        return self._failed

    @property
    def nonfinite(self) -> Optional[BaseException]:
        return self._nonfinite

    def check(self) -> None:
        """Raise if an update failed earlier (weights and states may be out of step), or a
        stopped non-finite step is not reported yet."""
        self._raise_failed("an optimizer update failed earlier", "; weights and optimizer states may be out of "
                           "step. Fix the cause, then load_checkpoint() a saved checkpoint or build a new engine.",
                           what="the step")

    def refuse_if_failed(self, what: str) -> None:
        """After a failed update some units hold the new step and others the old one: reading
        or saving the weights would hand out a mixture, so ``what`` is refused until a load."""
        self._raise_failed(f"{what} refused: an optimizer update failed", ", so the weights hold a half-applied "
                           "step. load_checkpoint() a saved checkpoint (or build a new engine) first.",
                           what=what)

    def _raise_failed(self, head: str, tail: str, what: str) -> None:
        """A stopped non-finite step not reported yet; else, if an update failed,
        ``RuntimeError("<head> (<the failure>)<tail>")`` from that failure."""
        self.raise_nonfinite()
        failed = self._failed
        if isinstance(failed, TornLoad):
            raise RuntimeError(f"{what} refused: {failed}") from failed
        if failed is not None:
            raise RuntimeError(f"{head} ({type(failed).__name__}: {failed}){tail}") from failed

    def raise_nonfinite(self) -> None:
        """A stopped non-finite step met in a worker or another thread: reported once."""
        with self._lock:
            e, self._nonfinite = self._nonfinite, None
        if e is not None:
            raise e

    # ------------------------------------------------------------------ written by the update modules
    def record_step(self, norm: Optional[float], skipped: bool) -> None:
        self._norm, self._skipped = norm, skipped

    def record_failure(self, error: BaseException) -> None:
        """An update failed (``error``), or a stopped non-finite step none of whose updates was
        applied: the latter is reported once by the next call; the former refuses training."""
        with self._lock:
            if isinstance(error, finite.NonFiniteError) and not error.partial:
                self._nonfinite = error
            else:
                self._failed = error

    def reported(self, error: Optional[BaseException] = None) -> None:
        """``error`` (None: any) reached a caller: a pending non-finite step is not reported again."""
        with self._lock:
            if error is None or error is self._nonfinite:
                self._nonfinite = None

    def clear(self) -> None:
        """Weights and states were replaced consistently: training may go on."""
        with self._lock:
            self._failed = self._nonfinite = None
