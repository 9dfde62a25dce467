"""The DPO family's losses as a sequence-level objective of the engine (:mod:`..engine.objective`).

Every formula is ``trl.DPOTrainer._compute_loss``'s (trl 1.x), written on per-sequence statistics
the chunked head gathers: the (LD-weighted) sum of the label log-probs over the completion, and
for the metrics the token count, entropy, mean logit, top-1 hits and WPO's aligned log-probs.
A micro-batch is TRL's batch: the chosen rows first, then the rejected rows. The reference
log-probs are data: each micro-batch carries its own (:class:`PairBatch`, its ``objective_data``).
No trl import here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

from megatrain_nb.engine.compute.objective import TOKEN_NLL
from megatrain_nb.values import DPO_LOSS_TYPES

LOSS_TYPES = DPO_LOSS_TYPES   # (the table of values holds them: megatrain_nb/values.py)
F_DIVERGENCE_LOSSES = {"sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft"}


@dataclass
class DPOSettings:
    """The DPOConfig fields that shape the loss (TRL's defaults)."""
    beta: float = 0.1
    loss_type: List[str] = field(default_factory=lambda: ["sigmoid"])
    loss_weights: Optional[List[float]] = None
    label_smoothing: float = 0.0
    ld_alpha: Optional[float] = None
    f_divergence_type: str = "reverse_kl"
    f_alpha_divergence_coef: float = 0.5
    use_weighting: bool = False
    discopop_tau: float = 0.05

    @classmethod
    def from_args(cls, args) -> "DPOSettings":
        names = [f for f in cls.__dataclass_fields__]
        return cls(**{n: getattr(args, n) for n in names})

    def check(self) -> None:
        """TRL's own refusals, with its messages' substance."""
        bad = [t for t in self.loss_type if t not in LOSS_TYPES]
        if bad:
            raise ValueError(f"Unknown loss type: {bad}. Should be one of {list(LOSS_TYPES)}")
        weights = self.loss_weights or [1.0] * len(self.loss_type)
        if len(weights) != len(self.loss_type):
            raise ValueError("`loss_weights` must have the same length as `loss_type`")
        if self.f_divergence_type not in ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"):
            raise ValueError(f"Unknown f_divergence_type: {self.f_divergence_type}")
        if self.f_divergence_type != "reverse_kl" and not set(self.loss_type) <= F_DIVERGENCE_LOSSES:
            raise ValueError(f"`f_divergence_type='{self.f_divergence_type}'` is only supported for the loss types "
                             f"{sorted(F_DIVERGENCE_LOSSES)}; you gave {self.loss_type}")
        if self.use_weighting and {"aot", "aot_unpaired"} & set(self.loss_type):
            raise NotImplementedError("WPO-style weighting is not implemented for 'aot' or 'aot_unpaired'")
        if "exo_pair" in self.loss_type and self.label_smoothing == 0.0:
            raise ValueError("Label smoothing must be greater than 0.0 when using 'exo_pair' loss (the EXO paper "
                             "recommends 1e-3)")
        if self.ld_alpha is not None and not 0.0 <= self.ld_alpha <= 1.0:
            raise ValueError(f"ld_alpha must be in [0.0, 1.0], got {self.ld_alpha}")


def ld_weights(labels: torch.Tensor, alpha: Optional[float]) -> torch.Tensor:
    """Per-token weights [batch, seq] of the loss tokens: 1, or with LD-DPO's ``alpha`` 1 on the
    first min(chosen, rejected) completion tokens of a pair and ``alpha`` beyond."""
    mask = (labels != -100).to(torch.float32)
    if alpha is None:
        return mask
    pos = mask.cumsum(dim=1)
    lens = mask.sum(dim=1)
    chosen, rejected = lens.chunk(2, dim=0)
    shared = torch.minimum(chosen, rejected).repeat(2)[:, None]
    shared_mask = (pos > 0) & (pos <= shared) & (mask > 0)
    tail_mask = (pos > shared) & (mask > 0)
    return shared_mask.float() + alpha * tail_mask.float()


def f_scores(logratios: torch.Tensor, s: DPOSettings) -> torch.Tensor:
    """The f-divergence scores of the log-ratios (TRL's, clamps included)."""
    if s.f_divergence_type == "reverse_kl":
        return logratios
    if s.f_divergence_type == "forward_kl":
        return 1 - torch.exp(-logratios)
    if s.f_divergence_type == "js_divergence":
        return math.log(2) + F.logsigmoid(logratios)
    a = s.f_alpha_divergence_coef
    if abs(a - 1.0) < 1e-6:
        return logratios
    t = torch.clamp(((a - 1.0) * logratios).float(), max=80.0)
    return (torch.exp(t) - 1.0).to(logratios.dtype) * (1.0 / (a - 1.0))


def pair_losses(loss_type: str, s: DPOSettings, c_lr, r_lr, c_lp, r_lp, ref_c, ref_r, counts,
                sft_mean) -> torch.Tensor:
    """One loss type's per-pair losses (TRL's formulas). ``c_lr``/``r_lr``: chosen/rejected
    log-ratios; ``c_lp``/``r_lp`` log-probs; ``counts``: (chosen, rejected) completion lengths."""
    b = s.beta
    cs, rs = f_scores(c_lr, s), f_scores(r_lr, s)
    delta = cs - rs
    if loss_type == "sigmoid":
        return -F.logsigmoid(b * delta)
    if loss_type == "hinge":
        return torch.relu(1 - b * delta)
    if loss_type in ("ipo", "sigmoid_norm"):
        d = cs / counts[0].clamp(min=1.0) - rs / counts[1].clamp(min=1.0)
        return (d - 1 / (2 * b)) ** 2 if loss_type == "ipo" else -F.logsigmoid(b * d)
    if loss_type == "exo_pair":
        eps = torch.tensor(s.label_smoothing, device=delta.device)
        return (torch.sigmoid(b * delta) * (F.logsigmoid(b * delta) - torch.log1p(-eps))
                + torch.sigmoid(-b * delta) * (F.logsigmoid(-b * delta) - torch.log(eps)))
    if loss_type == "nca_pair":
        return -F.logsigmoid(b * c_lr) - 0.5 * F.logsigmoid(-b * c_lr) - 0.5 * F.logsigmoid(-b * r_lr)
    if loss_type == "robust":
        ls = s.label_smoothing
        return (-(1 - ls) * F.logsigmoid(b * delta) + ls * F.logsigmoid(-b * delta)) / (1 - 2 * ls)
    if loss_type == "bco_pair":
        return -F.logsigmoid(b * c_lr) - F.logsigmoid(-b * r_lr)
    if loss_type == "sppo_hard":
        return (c_lr - 0.5 / b) ** 2 + (r_lr + 0.5 / b) ** 2
    if loss_type in ("aot", "aot_unpaired"):
        if loss_type == "aot":
            d = torch.sort(c_lp - r_lp, dim=0)[0] - torch.sort(ref_c - ref_r, dim=0)[0]
        else:
            d = torch.sort(c_lr, dim=0)[0] - torch.sort(r_lr, dim=0)[0]
        return -F.logsigmoid(b * d) * (1 - s.label_smoothing) - F.logsigmoid(-b * d) * s.label_smoothing
    if loss_type == "apo_zero":
        return (1 - torch.sigmoid(b * c_lr)) + torch.sigmoid(b * r_lr)
    if loss_type == "apo_down":
        return torch.sigmoid(b * c_lr) + (1 - torch.sigmoid(b * (c_lr - r_lr)))
    if loss_type == "discopop":
        logits = delta * b
        mod = torch.sigmoid(logits / s.discopop_tau)
        return -F.logsigmoid(logits) * (1 - mod) + torch.exp(-logits) * mod
    if loss_type == "sft":
        return sft_mean.expand(c_lr.shape[0])
    raise ValueError(f"Unknown loss type: {loss_type}")


@dataclass
class PairBatch:
    """What a micro-batch brings besides its tokens (its ``objective_data``): the reference
    log-probs of its chosen and rejected rows, its completion lengths (unshifted, as TRL counts
    them) and attention tokens, and what its loss is multiplied by."""
    ref_chosen: torch.Tensor
    ref_rejected: torch.Tensor
    completion_counts: torch.Tensor
    attention_tokens: int
    weight: float = 1.0   # 0.0: a data-parallel rank's filler micro-batch (no loss, no metrics)
    # 1 / the step's real micro-batches over every rank (transformers divides by the accumulation
    # steps, DDP averages over ranks); 1.0 in evaluation
    scale: float = 1.0


@dataclass
class _Pairs:
    """One micro-batch's context: its data and its tokens' LD weights [batch, seq]."""
    data: Optional[PairBatch]
    weights: torch.Tensor


def _pairs_context(labels: torch.Tensor, data, alpha: Optional[float], need_data: bool, who: str) -> _Pairs:
    if labels.shape[0] % 2:
        raise ValueError(f"a preference micro-batch has chosen and rejected rows side by side; got "
                         f"{labels.shape[0]} rows")
    if need_data and not isinstance(data, PairBatch):
        raise ValueError(f"{who}: a micro-batch came without its reference log-probs: pass its PairBatch as the "
                         f"micro-batch's objective_data (got {type(data).__name__})")
    return _Pairs(data, ld_weights(labels, alpha))


def _label_logps(ctx: _Pairs, logits, labels, start, plain: bool, grad: bool):
    """The (LD-weighted) label log-probs' sums of a chunk, the log-probs and the loss mask; without
    ``grad`` also the labels' summed NLL (the head's cross-entropy: engine/compute/objective.py)."""
    keep = labels != -100
    w = ctx.weights[:, start:start + labels.shape[1]].to(logits.device)
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, labels.clamp(min=0)[..., None])[..., 0] * keep
    out = {"logps": (logp * w).sum(dim=1)}
    if plain:
        out["plain_logps"] = logp.sum(dim=1)
    if not grad:
        out[TOKEN_NLL] = -logp.detach().sum(dim=1)
    return out, logp_all, logp, keep


class DPOObjective:
    """The DPO family's loss on the engine's chunked head (:class:`..engine.objective.SequenceObjective`):
    each micro-batch's :class:`PairBatch` is its ``objective_data``; the objective keeps nothing
    between calls. A micro-batch's metrics (TRL's names) come back from :meth:`metrics` through
    ``EngineOutput.objective_metrics``; the trainer averages them at each log."""

    def __init__(self, settings: DPOSettings):
        settings.check()
        self.s = settings
        self.weights = settings.loss_weights or [1.0] * len(settings.loss_type)
        self.plain = settings.ld_alpha is not None and "sft" in settings.loss_type
        self.differentiable = ("logps", "plain_logps") if self.plain else ("logps",)

    def context(self, labels: torch.Tensor, data) -> _Pairs:
        return _pairs_context(labels, data, self.s.ld_alpha, True, "DPOObjective")

    # ------------------------------------------------------------------ per chunk
    def token_stats(self, ctx: _Pairs, logits, labels, start, grad):
        out, logp_all, logp, keep = _label_logps(ctx, logits, labels, start, self.plain, grad)
        if grad:
            return out
        with torch.no_grad():   # the metrics' statistics: never differentiated
            k = keep.float()
            lp, lg = logp_all.detach(), logits.detach()
            out["tokens"] = k.sum(dim=1)
            out["entropy"] = (-(lp.exp() * lp).sum(-1) * k).sum(dim=1)
            out["mean_logits"] = (lg.mean(-1) * k).sum(dim=1)
            out["top1"] = ((lg.argmax(-1) == labels) & keep).float().sum(dim=1)
            if self.s.use_weighting:
                out["wpo"] = ((logp.detach() - torch.logsumexp(2 * lp, dim=-1)) * k).sum(dim=1)
        return out

    # ------------------------------------------------------------------ per micro-batch
    def loss(self, ctx: _Pairs, stats):
        cur, s = ctx.data, self.s
        c_lp, r_lp = stats["logps"].chunk(2, dim=0)
        ref_c, ref_r = (t.to(c_lp) for t in (cur.ref_chosen, cur.ref_rejected))
        c_lr, r_lr = c_lp - ref_c, r_lp - ref_r
        counts = cur.completion_counts.to(c_lp).chunk(2, dim=0)
        sft_mean = None
        if "sft" in s.loss_type:
            plain = stats["plain_logps" if self.plain else "logps"].chunk(2, dim=0)[0]
            sft_mean = -plain.sum() / stats["tokens"].chunk(2, dim=0)[0].sum()
        total = 0.0
        for lt, lw in zip(s.loss_type, self.weights):
            per_pair = pair_losses(lt, s, c_lr, r_lr, c_lp, r_lp, ref_c, ref_r, counts, sft_mean)
            if s.use_weighting:
                mean = stats["wpo"] / stats["tokens"].clamp(min=1)
                cw, rw = torch.exp(mean).chunk(2, dim=0)
                per_pair = per_pair * (cw * rw)
            total = total + per_pair.mean() * lw
        return total * (cur.scale * cur.weight)

    def metrics(self, ctx: _Pairs, stats, loss: float) -> Dict[str, float]:
        """TRL's DPO metrics of the micro-batch (none for a filler micro-batch)."""
        if not ctx.data.weight:
            return {}
        m, b = {}, self.s.beta
        tokens = stats["tokens"]
        n = float(tokens.sum())
        m["entropy"] = float(stats["entropy"].sum()) / n if n > 0 else 0.0
        ct, rt = (float(t.sum()) for t in tokens.chunk(2, dim=0))
        cl, rl = (float(t.sum()) for t in stats["mean_logits"].chunk(2, dim=0))
        m["logits/chosen"] = cl / ct if ct > 0 else 0.0
        m["logits/rejected"] = rl / rt if rt > 0 else 0.0
        m["mean_token_accuracy"] = float(stats["top1"].chunk(2, dim=0)[0].sum()) / ct if ct > 0 else 0.0
        c_lp, r_lp = stats["logps"].chunk(2, dim=0)
        cr = b * (c_lp - ctx.data.ref_chosen.to(c_lp))
        rr = b * (r_lp - ctx.data.ref_rejected.to(r_lp))
        m["rewards/chosen"] = float(cr.mean())
        m["rewards/rejected"] = float(rr.mean())
        m["rewards/accuracies"] = float((cr > rr).float().mean())
        m["rewards/margins"] = float((cr - rr).mean())
        m["logps/chosen"] = float(c_lp.mean())
        m["logps/rejected"] = float(r_lp.mean())
        return m


class ReferenceLogps:
    """The reference pass's objective (forward only): each row's (LD-weighted) label log-prob sum,
    returned as the micro-batch's metric ``logps`` [batch] (on the CPU); needs no side data."""

    differentiable = ()

    def __init__(self, settings: DPOSettings):
        self.s = settings

    def context(self, labels: torch.Tensor, data) -> _Pairs:
        return _pairs_context(labels, data, self.s.ld_alpha, False, "ReferenceLogps")

    def token_stats(self, ctx: _Pairs, logits, labels, start, grad):
        return _label_logps(ctx, logits, labels, start, False, grad)[0]

    def loss(self, ctx: _Pairs, stats):
        return stats["logps"].sum() * 0.0

    def metrics(self, ctx: _Pairs, stats, loss: float) -> Dict[str, torch.Tensor]:
        return {"logps": stats["logps"].detach().cpu()}
