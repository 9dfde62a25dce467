"""Sequence-level objectives: losses that are functions of per-sequence statistics, not sums
over tokens (DPO and its variants; KTO, ORPO, SimPO and policy-gradient losses fit the same way).

The chunked loss head (:meth:`.LossHead.loss`) takes such an objective in place of a token loss
function and runs it in two passes over the chunks of ``loss_chunk_tokens``:

1. without gradients, each chunk's logits give per-sequence statistics
   (:meth:`SequenceObjective.token_stats`: e.g. the sum of the label log-probs over the loss tokens,
   a token count, what the metrics need); they are summed over the chunks;
2. the objective turns the sums into the micro-batch's loss (:meth:`SequenceObjective.loss`), and
   autograd gives d(loss)/d(each sequence's statistic), a number per sequence and statistic;
3. with gradients, each chunk's logits again, back-propagated with every token weighted by its
   sequence's number (``sum_k w_k[b] * stat_k(chunk)[b]``), which is the chain rule exactly.
   (A micro-batch that fits one chunk is one pass: step 1 runs with gradients and keeps its graph.)

**Side data travels with its batch.** What a micro-batch brings besides its tokens (DPO's
reference log-probs, GRPO's advantages and old log-probs) is that micro-batch's
``objective_data``: a key of its dict in a window (``forward_backward([{"input_ids": ...,
"objective_data": ...}, ...])``), the ``objective_data=`` keyword for one batch. The step hands
each micro-batch's own to the head beside its labels; nothing is queued, so the order the engine
runs micro-batches in cannot mix them up.

**Objectives are stateless.** The head calls :meth:`SequenceObjective.context` once per
micro-batch with its labels and data; what it returns is handed back to every other call of that
micro-batch (its statistics, its loss, its metrics) and then dropped. An objective keeps nothing
between calls: the engine returns each micro-batch's loss and metrics
(``EngineOutput.objective_loss``, ``EngineOutput.objective_metrics``), and whoever drives it
collects them (the trainers: through the kind hooks, ``trainer/kinds.py``).

The logits of a whole sequence never exist, the step around the head is unchanged, and a
micro-batch is never split, so statistics that pair rows (chosen and rejected side by side) see
both. The engine knows nothing of any particular loss: a new objective is a new class with these
methods (KTO: a per-sequence log-prob sum and a KL estimate from mismatched pairs; ORPO: the
sum and the token count of the chosen rows plus the NLL; SimPO: the same with the count for length
normalisation; a policy gradient: the log-prob sum weighted by the advantages of its batch's data).
"""
from __future__ import annotations

from typing import Any, Dict, Protocol, Tuple, runtime_checkable

import torch

__all__ = ["TOKEN_NLL", "SequenceObjective", "is_sequence_objective"]

#: An optional statistic of :meth:`SequenceObjective.token_stats` without ``grad``: each sequence's
#: summed negative log-prob of its labels at temperature 1 (the cross-entropy ``EngineOutput.loss``
#: averages). An objective that has the label log-probs anyway returns it and spares the head its
#: own cross-entropy over the chunk's logits (a log-softmax over the vocabulary).
TOKEN_NLL = "token_nll"


@runtime_checkable
class SequenceObjective(Protocol):
    """What the chunked loss head asks of a sequence-level objective (see the module)."""

    #: names of the statistics the loss is differentiated through (the others are metrics)
    differentiable: Tuple[str, ...]

    def context(self, labels: torch.Tensor, data: Any) -> Any:
        """A micro-batch starts: ``labels`` [batch, seq] are its shifted labels (-100: not a loss
        token), ``data`` its ``objective_data`` (None when it came without). Returns what the
        other calls of this micro-batch read (its data checked, with what depends on the whole
        labels); refuse a micro-batch that lacks what the objective needs here."""

    def token_stats(self, ctx: Any, logits: torch.Tensor, labels: torch.Tensor, start: int,
                    grad: bool) -> Dict[str, torch.Tensor]:
        """Per-sequence statistics [batch] of one chunk: ``logits`` [batch, chunk, vocab] (fp32,
        the model's own head), ``labels`` its shifted labels, ``start`` its first position. With
        ``grad`` only the differentiable statistics are needed. With grad mode on (``grad``, or a
        micro-batch of one chunk, whose graph the head keeps for its backward) the differentiable
        statistics must carry the graph; compute the others under ``torch.no_grad()``. Without
        ``grad`` it may add :data:`TOKEN_NLL`."""

    def loss(self, ctx: Any, stats: Dict[str, torch.Tensor]) -> torch.Tensor:
        """The micro-batch's loss (a scalar, as the step back-propagates it: any averaging over
        micro-batches is the objective's, from its data) from the statistics summed over all chunks."""

    def metrics(self, ctx: Any, stats: Dict[str, torch.Tensor], loss: float) -> Dict[str, Any]:
        """The micro-batch's metrics from its statistics (detached) and loss: returned to the caller
        as they are (numbers, or tensors such as per-sequence log-probs), in
        ``EngineOutput.objective_metrics``."""


def is_sequence_objective(fn) -> bool:
    """Whether ``fn`` (a head's ``loss_fn``) is a sequence-level objective, not a token loss."""
    return fn is not None and all(hasattr(fn, m) for m in ("token_stats", "context", "metrics", "differentiable"))
