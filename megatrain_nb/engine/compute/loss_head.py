"""The model's head and the loss, run on the final hidden states in chunks of
``loss_chunk_tokens`` (so the logits of a whole sequence are never on the device at once): the
CausalLM's own head code runs with its base model swapped for a stub that returns the given
hidden states (:class:`.HiddenStatesStub`)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F

from .objective import TOKEN_NLL, is_sequence_objective
from ..proxies import HiddenStatesStub, swapped_submodule
from ..recompute import ActivationMeter

__all__ = ["HeadOut", "LossHead"]


@dataclass
class HeadOut:
    """One micro-batch through the head: ``loss_sum`` the sum of its token losses (the
    cross-entropy of its shifted labels, or a token ``loss_fn``'s: what ``EngineOutput.loss``
    averages, also under a sequence objective); ``grad`` (with backward) the gradient at its hidden
    states; under a sequence objective its loss (``objective_loss``, as back-propagated) and
    ``metrics`` (the objective's)."""

    loss_sum: float
    grad: Optional[torch.Tensor] = None
    objective_loss: Optional[float] = None
    metrics: Optional[Dict[str, Any]] = None


def _token_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The summed cross-entropy of a chunk's labels (-100 ignored): the Hugging Face loss's terms."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                           reduction="sum")


class LossHead:
    """``model``'s head (its base model at ``base_name``, ``path`` inside it: see
    :func:`.discovery.locate`) over chunks of ``loss_chunk_tokens`` tokens; ``meter`` counts the
    logits' bytes."""

    def __init__(self, model, base_name: str, base, path, loss_chunk_tokens: int, meter: ActivationMeter):
        self.model = model
        self.base_name = base_name
        self.loss_chunk_tokens = loss_chunk_tokens
        self.meter = meter
        self._stub = HiddenStatesStub(base, path)

    def logits(self, hidden_chunk: torch.Tensor) -> torch.Tensor:
        """The CausalLM's own head code (lm_head + the family's logit transform) on one chunk."""
        stub = self._stub
        stub.hidden = hidden_chunk
        dummy = torch.zeros(hidden_chunk.shape[:2], dtype=torch.long, device=hidden_chunk.device)
        try:
            with swapped_submodule(self.model, self.base_name, stub):
                out = self.model(input_ids=dummy, use_cache=False)
        except IndexError as e:   # the head indexes outputs of the base model the stub does not have
            raise NotImplementedError(
                f"{type(self.model).__name__}'s head reads more of its base model's output than the final hidden "
                f"states ({e}); this family is not supported by the streaming engine yet.") from e
        finally:
            stub.hidden = None
        return out.logits

    def all_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [batch, seq, vocab] (fp32, CPU) of ``hidden``, chunk by chunk."""
        chunk = max(1, self.loss_chunk_tokens // max(hidden.shape[0], 1))
        out = [self.logits(hidden[:, s:s + chunk]).float().cpu() for s in range(0, hidden.shape[1], chunk)]
        return torch.cat(out, dim=1)

    def _chunk(self, B: int, S: int) -> int:
        return max(1, min(S, self.loss_chunk_tokens // max(B, 1) or 1))

    def loss(self, hidden, shift, loss_fn, denom, backward: bool = False, data=None) -> HeadOut:
        """The head and the loss over ``hidden`` in chunks of ``loss_chunk_tokens``; with
        ``backward`` each chunk's ``loss / denom`` is back-propagated to its hidden states.
        ``loss_fn`` may be a sequence-level objective (:mod:`.objective`): then ``denom`` is the
        objective's and ``data`` is this micro-batch's ``objective_data``."""
        if is_sequence_objective(loss_fn):
            return self.sequence_loss(hidden, shift, loss_fn, backward, data)
        if data is not None:
            raise ValueError(f"a micro-batch came with objective_data ({type(data).__name__}), but loss_fn is a token "
                             "loss, which takes none; pass the sequence-level objective that reads it as loss_fn, or "
                             "leave objective_data out.")
        B, S = shift.shape
        chunk = self._chunk(B, S)
        # the chunks' sums added on the device in float64 (a Python float's additions, in the same
        # order: the same bits), read once at the end -- no host sync per chunk
        total = torch.zeros((), dtype=torch.float64, device=hidden.device)
        grads = []
        for s in range(0, S, chunk):
            lab = shift[:, s:s + chunk]
            hc = hidden[:, s:s + chunk]
            if backward:
                hc = hc.detach().requires_grad_(True)
            with torch.enable_grad() if backward else contextlib.nullcontext():
                logits = self.logits(hc).float()
                part = loss_fn(logits, lab) if loss_fn is not None else _token_ce(logits, lab)
                self.meter.at(self.meter.saved + 3 * logits.numel() * 4)
            total += part.detach().double()
            if backward:
                if part.requires_grad:
                    (part / denom).backward()
                grads.append(hc.grad if hc.grad is not None else torch.zeros_like(hc))
            del logits, part
        return HeadOut(float(total), torch.cat(grads, dim=1) if backward else None)

    def sequence_loss(self, hidden, shift, objective, backward: bool = False, data=None) -> HeadOut:
        """A sequence-level objective over ``hidden`` (see :mod:`.objective`) with this
        micro-batch's ``data``: its statistics summed chunk by chunk without gradients (and the
        mean token loss's cross-entropy beside them), its loss, and with ``backward`` the chunks
        again, each token weighted by d(loss)/d(its sequence's statistic). A micro-batch that is
        one chunk keeps that chunk's graph from the statistics to the backward instead (one pass)."""
        B, S = shift.shape
        chunk = self._chunk(B, S)
        ctx = objective.context(shift, data)
        one = backward and chunk >= S
        hc = hidden.detach().requires_grad_(True) if one else None
        sums: dict = {}
        ce = torch.zeros((), dtype=torch.float64, device=hidden.device)
        with torch.enable_grad() if one else torch.no_grad():
            for s in range(0, S, chunk):
                logits = self.logits(hc if one else hidden[:, s:s + chunk]).float()
                self.meter.at(self.meter.saved + (3 if one else 2) * logits.numel() * 4)
                lab = shift[:, s:s + chunk]
                part = objective.token_stats(ctx, logits, lab, s, grad=False)
                for k, v in part.items():
                    sums[k] = sums[k] + v if k in sums else v
                with torch.no_grad():   # EngineOutput.loss's cross-entropy: the objective's, else the head's
                    ce += (part[TOKEN_NLL].detach().sum() if TOKEN_NLL in part
                           else _token_ce(logits.detach(), lab)).double()
                del logits, part
        stats = {k: v.detach() for k, v in sums.items()}
        if not backward:
            loss = float(objective.loss(ctx, stats))
            return HeadOut(float(ce), None, loss, objective.metrics(ctx, stats, loss))
        weights, loss = self._weights(objective, ctx, stats)
        metrics = objective.metrics(ctx, stats, loss)
        if one:
            surrogate = sum((w * sums[k]).sum() for k, w in weights.items())
            if weights and surrogate.requires_grad:
                surrogate.backward()
            return HeadOut(float(ce), hc.grad if hc.grad is not None else torch.zeros_like(hc), loss, metrics)
        del sums
        grads = []
        for s in range(0, S, chunk):
            hc = hidden[:, s:s + chunk].detach().requires_grad_(True)
            if weights:
                with torch.enable_grad():
                    logits = self.logits(hc).float()
                    self.meter.at(self.meter.saved + 3 * logits.numel() * 4)
                    part = objective.token_stats(ctx, logits, shift[:, s:s + chunk], s, grad=True)
                    surrogate = sum((w * part[k]).sum() for k, w in weights.items())
                    if surrogate.requires_grad:
                        surrogate.backward()
                    del logits, part, surrogate
            grads.append(hc.grad if hc.grad is not None else torch.zeros_like(hc))
        return HeadOut(float(ce), torch.cat(grads, dim=1), loss, metrics)

    @staticmethod
    def _weights(objective, ctx, stats):
        """d(loss)/d(each differentiable statistic), per sequence, and the loss."""
        names = [k for k in objective.differentiable if k in stats]
        leaves = {k: stats[k].clone().requires_grad_(True) for k in names}
        with torch.enable_grad():
            loss_t = objective.loss(ctx, {**stats, **leaves})
            ws = (torch.autograd.grad(loss_t, [leaves[k] for k in names], allow_unused=True)
                  if loss_t.requires_grad and names else [None] * len(names))
        return {k: w.detach() for k, w in zip(names, ws) if w is not None}, float(loss_t.detach())
