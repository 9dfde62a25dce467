"""GRPO and its variants as a sequence-level objective of the engine (:mod:`..engine.objective`).

Every formula is ``trl.GRPOTrainer._compute_loss``'s (trl 1.x). The loss is a sum over the
completion tokens of a nonlinear function of each token's log-prob, its old (sampling-time)
log-prob, its reference log-prob and its sequence's advantage, divided by constants fixed by the
masks (per loss type). So each chunk of the head applies the per-token function to its tokens and
returns per-sequence sums (:meth:`GRPOObjective.token_stats`); the loss normalises them
(:meth:`GRPOObjective.loss`). The per-token side data (old and reference log-probs) travel with
their micro-batch (its ``objective_data``, a :class:`RolloutBatch`) in the head's shifted-label
coordinates ``[batch, seq]`` (position ``p`` scores token ``p + 1``) and are sliced by each chunk's
``start``. The objective keeps nothing between calls. No trl import here.

Statistics (per sequence, summed over its loss tokens):

- ``pg`` (token-level importance sampling): the policy term ``per_token_loss`` before the KL;
- ``lr`` / ``logp`` (sequence-level importance sampling, cispo, vespo): the log-ratio and the
  log-prob sums, the policy term formed per sequence in :meth:`loss`;
- ``kl``: ``exp(ref - logp) - (ref - logp) - 1`` (times the token's ratio with
  ``use_bias_correction_kl`` at token level);
- metrics: ``n`` tokens, ``entropy``, clipped-token counts, vespo's clamped log-ratio and the
  off-policy mask's KL.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional

import torch

from megatrain_nb.engine.compute.objective import TOKEN_NLL

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo")
CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")   # PPO's two-sided clipping (and the clip_ratio metrics)
PER_SEQUENCE_MEAN = ("grpo", "sapo")                      # each sequence's mean, then the mean over sequences
BY_ITEMS = ("cispo", "dapo", "vespo")                     # the generation batch's tokens (num_items_in_batch)


@dataclass
class GRPOSettings:
    """The GRPOConfig fields that shape the loss (TRL's defaults)."""
    loss_type: str = "dapo"
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: Optional[float] = None
    delta: Optional[float] = None
    importance_sampling_level: str = "token"
    temperature: float = 1.0
    max_completion_length: int = 512
    use_bias_correction_kl: bool = True
    off_policy_mask_threshold: Optional[float] = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    steps_per_generation: int = 1

    @classmethod
    def from_args(cls, args) -> "GRPOSettings":
        return cls(**{n: getattr(args, n) for n in cls.__dataclass_fields__ if hasattr(args, n)})

    @property
    def eps_low(self) -> float:
        return self.epsilon

    @property
    def eps_high(self) -> float:
        return self.epsilon_high if self.epsilon_high is not None else self.epsilon

    def check(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"Unknown loss type: {self.loss_type!r}; GRPOConfig.loss_type is one of {list(LOSS_TYPES)}")
        if self.importance_sampling_level not in ("token", "sequence"):
            raise ValueError(f"Unknown importance sampling level: {self.importance_sampling_level!r}. Possible values "
                             "are 'token' and 'sequence'.")
        if self.temperature <= 0:
            raise ValueError(f"GRPOConfig.temperature must be > 0, got {self.temperature}")


@dataclass
class RolloutBatch:
    """What a micro-batch of rollouts brings besides its tokens, in the head's shifted-label
    coordinates: ``advantages`` [B] (or [B, seq]), ``old_logps`` / ``ref_logps`` [B, seq] (None:
    the current log-probs detached / no reference), ``num_items`` the generation batch's
    completion tokens (dapo, cispo, vespo), ``accumulation`` the step's micro-batches (TRL's
    ``current_gradient_accumulation_steps``), ``world`` the processes."""
    advantages: torch.Tensor
    old_logps: Optional[torch.Tensor] = None
    ref_logps: Optional[torch.Tensor] = None
    num_items: float = 1.0
    accumulation: int = 1
    world: int = 1
    weight: float = 1.0   # 0.0: a data-parallel rank's filler micro-batch
    per_generation: int = 0   # the steps a generation serves (0: steps_per_generation; evaluation: 1)


def _part(t: Optional[torch.Tensor], start: int, width: int, like: torch.Tensor) -> Optional[torch.Tensor]:
    return None if t is None else t[:, start:start + width].to(device=like.device, dtype=like.dtype)


def _adv(adv: torch.Tensor, start: int, width: int, like: torch.Tensor) -> torch.Tensor:
    a = adv.to(device=like.device, dtype=like.dtype)
    return a[:, None] if a.dim() == 1 else a[:, start:start + width]


class GRPOObjective:
    """GRPO's loss on the engine's chunked head (:class:`..engine.objective.SequenceObjective`):
    each micro-batch's :class:`RolloutBatch` is its ``objective_data``. Its loss as back-propagated
    (already divided by the accumulation, as TRL's) and its metrics (TRL's names, :meth:`metrics`)
    come back through ``EngineOutput``; nothing is kept here between calls."""

    def __init__(self, settings: GRPOSettings):
        settings.check()
        self.s = settings
        s = settings
        self.sequence_level = s.importance_sampling_level == "sequence"
        if s.loss_type == "vespo":
            names = ("logp",)
        elif self.sequence_level:
            names = ("lr", "logp") if s.loss_type == "cispo" else ("lr",)
        else:
            names = ("pg",)
        self.differentiable = names + (("kl",) if s.beta != 0.0 else ())

    def context(self, labels: torch.Tensor, data) -> RolloutBatch:
        """The micro-batch's own :class:`RolloutBatch` (its ``objective_data``), checked."""
        if not isinstance(data, RolloutBatch):
            raise ValueError("GRPOObjective: a micro-batch came without its advantages: pass its RolloutBatch as the "
                             f"micro-batch's objective_data (got {type(data).__name__})")
        if data.advantages.shape[0] != labels.shape[0]:
            raise ValueError(f"GRPOObjective: {data.advantages.shape[0]} advantages for a micro-batch of "
                             f"{labels.shape[0]} rows")
        return data

    # ------------------------------------------------------------------ per chunk
    def token_stats(self, cur: RolloutBatch, logits, labels, start, grad):
        s = self.s
        keep = labels != -100
        m = keep.to(logits.dtype)
        width = labels.shape[1]
        logp_all = torch.log_softmax(logits / s.temperature, dim=-1)
        logp = logp_all.gather(-1, labels.clamp(min=0)[..., None])[..., 0]
        old = _part(cur.old_logps, start, width, logp)
        old = logp.detach() if old is None else torch.where(keep, old, logp.detach())
        adv = _adv(cur.advantages, start, width, logp)
        log_ratio = logp - old
        out = {}
        if s.loss_type == "vespo":
            out["logp"] = (logp * m).sum(1)
        elif self.sequence_level:
            out["lr"] = (log_ratio * m).sum(1)
            if s.loss_type == "cispo":
                out["logp"] = (logp * m).sum(1)
        else:
            coef = torch.exp(log_ratio)
            out["pg"] = (self._token_policy(coef, adv, logp) * m).sum(1)
        if s.beta != 0.0:
            ref = _part(cur.ref_logps, start, width, logp)
            ref = torch.where(keep, ref, logp.detach())
            kl = torch.exp(ref - logp) - (ref - logp) - 1
            if s.use_bias_correction_kl and not self.sequence_level:
                kl = kl * torch.exp(log_ratio)
            out["kl"] = (kl * m).sum(1)
        if grad:
            return out
        with torch.no_grad():
            self._metric_stats(out, logp_all.detach(), log_ratio.detach(), adv, m)
            if s.temperature == 1.0:   # the labels' NLL EngineOutput.loss averages (else the head's own)
                out[TOKEN_NLL] = -(logp.detach() * m).sum(1)
        return out

    def _token_policy(self, coef, adv, logp):
        """TRL's per-token policy loss at token level (before the KL and the masks)."""
        s = self.s
        if s.loss_type == "cispo":
            return -torch.clamp(coef, max=s.eps_high).detach() * adv * logp
        if s.loss_type == "sapo":
            t = torch.where(adv > 0, s.sapo_temperature_pos, s.sapo_temperature_neg)
            return -(torch.sigmoid(t * (coef - 1)) * 4 / t) * adv
        coef2 = torch.clamp(coef, 1 - s.eps_low, 1 + s.eps_high)
        if s.delta is not None:
            coef = torch.clamp(coef, max=s.delta)
        return -torch.min(coef * adv, coef2 * adv)

    def _metric_stats(self, out, logp_all, log_ratio, adv, m) -> None:
        s = self.s
        out["n"] = m.sum(1)
        out["entropy"] = (-(logp_all.exp() * logp_all).sum(-1) * m).sum(1)
        if s.loss_type == "vespo":
            out["lr_clamped"] = (torch.clamp(log_ratio, -20.0, 20.0) * m).sum(1)
        if s.off_policy_mask_threshold is not None:
            out["opm_kl"] = (torch.nan_to_num(-log_ratio, nan=0.0) * m).sum(1)
        if not self.sequence_level and s.loss_type in CLIPPED + ("cispo",):
            coef = torch.exp(log_ratio)
            if s.loss_type == "cispo":
                out["clip_cispo"] = (((coef > s.eps_high) & (adv > 0)).to(m.dtype) * m).sum(1)
                return
            if s.delta is not None:
                coef = torch.clamp(coef, max=s.delta)
            out["clip_low"] = (((coef < 1 - s.eps_low) & (adv < 0)).to(m.dtype) * m).sum(1)
            out["clip_high"] = (((coef > 1 + s.eps_high) & (adv > 0)).to(m.dtype) * m).sum(1)

    # ------------------------------------------------------------------ per micro-batch
    def _sequence_terms(self, stats, adv):
        """The per-sequence sum of the policy term over its tokens, and the sequence-level ratio."""
        s, n = self.s, stats["n"].to(adv)
        if s.loss_type == "vespo":
            phi = self._gamma(stats["lr_clamped"].to(adv), adv)
            return -phi * adv * stats["logp"], None
        if not self.sequence_level:
            return stats["pg"], None
        coef = torch.exp(stats["lr"] / n.clamp(min=1.0))
        if s.loss_type == "cispo":
            return -torch.clamp(coef, max=s.eps_high).detach() * adv * stats["logp"], coef
        return self._token_policy(coef, adv, None) * n, coef

    def _gamma(self, seq_log_ratio, adv):
        s = self.s
        lower = math.log(1e-8)
        log_w = torch.clamp(seq_log_ratio, lower, 20.0)
        nonneg = adv >= 0
        k = torch.where(nonneg, s.vespo_k_pos, s.vespo_k_neg)
        lam = torch.where(nonneg, s.vespo_lambda_pos, s.vespo_lambda_neg).clamp(min=1e-4)
        return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)

    def _off_policy(self, stats, adv):
        thr = self.s.off_policy_mask_threshold
        if thr is None:
            return None
        avg = stats["opm_kl"] / stats["n"].clamp(min=1.0)
        return ((adv >= 0) | (avg <= thr)).to(adv.dtype)

    def loss(self, cur: RolloutBatch, stats):
        s = self.s
        like = next(iter(stats.values()))
        adv = cur.advantages.to(like)
        if adv.dim() > 1:
            raise ValueError("per-token advantages [batch, seq] need importance_sampling_level='token'")
        pg, coef = self._sequence_terms(stats, adv)
        keep = self._off_policy(stats, adv)
        if keep is not None:
            pg = pg * keep
        per_seq = pg
        if s.beta != 0.0:
            kl = stats["kl"] * coef if (coef is not None and s.use_bias_correction_kl) else stats["kl"]
            per_seq = per_seq + s.beta * kl
        n = stats["n"].to(like)
        B = n.shape[0]
        if s.loss_type in PER_SEQUENCE_MEAN:
            loss = (per_seq / n.clamp(min=1.0)).mean() / cur.accumulation
        elif s.loss_type == "bnpo":
            loss = per_seq.sum() / n.sum().clamp(min=1.0) / cur.accumulation
        elif s.loss_type == "dr_grpo":
            loss = per_seq.sum() / (B * s.max_completion_length) / cur.accumulation
        elif s.loss_type == "luspo":
            loss = per_seq.mean() / cur.accumulation
        else:   # BY_ITEMS
            spg = cur.per_generation or s.steps_per_generation
            normalizer = max(float(cur.num_items), 1.0) / cur.world * cur.accumulation / spg
            loss = per_seq.sum() / normalizer
        return loss * cur.weight

    def metrics(self, cur: RolloutBatch, stats, loss: float) -> Dict[str, float]:
        """TRL's GRPO metrics of the micro-batch (none for a filler micro-batch)."""
        if not cur.weight:
            return {}
        s, out = self.s, {}
        add = lambda k, v: out.__setitem__(k, float(v))  # noqa: E731
        n = stats["n"]
        tokens = float(n.sum())
        mean = lambda x: float(x.sum()) / max(tokens, 1.0)  # noqa: E731   (TRL's global_masked_mean)
        adv = cur.advantages.to(n)
        coef = None
        if self.sequence_level and s.loss_type != "vespo":
            coef = torch.exp(stats["lr"] / n.clamp(min=1.0))
        if s.beta != 0.0:
            kl = stats["kl"] * coef if (coef is not None and s.use_bias_correction_kl) else stats["kl"]
            add("kl", mean(kl))
        add("entropy", mean(stats["entropy"]))
        if s.loss_type in CLIPPED:
            if coef is not None:
                c = torch.clamp(coef, max=s.delta) if s.delta is not None else coef
                low = ((c < 1 - s.eps_low) & (adv < 0)).to(n.dtype)
                high = ((c > 1 + s.eps_high) & (adv > 0)).to(n.dtype)
                seq_low, seq_high, b = low, high, float(n.shape[0])
                add("clip_ratio/low_mean", float(low.sum()) / b)
                add("clip_ratio/high_mean", float(high.sum()) / b)
                add("clip_ratio/region_mean", float((low + high).sum()) / b)
            else:
                seq_low, seq_high = stats["clip_low"] / n, stats["clip_high"] / n
                add("clip_ratio/low_mean", mean(stats["clip_low"]))
                add("clip_ratio/high_mean", mean(stats["clip_high"]))
                add("clip_ratio/region_mean", mean(stats["clip_low"] + stats["clip_high"]))
            add("clip_ratio/low_min", _nan_reduce(seq_low, min))
            add("clip_ratio/high_max", _nan_reduce(seq_high, max))
        elif s.loss_type == "cispo" and "clip_cispo" in stats:
            add("cispo_clip_ratio", mean(stats["clip_cispo"]))
        elif s.loss_type == "vespo":
            phi = self._gamma(stats["lr_clamped"].to(adv), adv)
            add("vespo/phi_seq_mean", float(phi.sum()) / float(n.shape[0]))
        return out


def _nan_reduce(x: torch.Tensor, fn) -> float:
    vals = [float(v) for v in x.flatten() if not math.isnan(float(v))]
    return fn(vals) if vals else float("nan")


__all__ = ["GRPOObjective", "GRPOSettings", "RolloutBatch", "LOSS_TYPES"]


def to_shift(x: Optional[torch.Tensor], prompt_len: int) -> Optional[torch.Tensor]:
    """Per-completion-token values [B, C] placed in the head's shifted-label coordinates
    [B, prompt_len + C]: completion token ``j`` sits at input position ``prompt_len + j`` and is
    scored at shifted position ``prompt_len + j - 1`` (0 elsewhere)."""
    if x is None or x.dim() == 1:
        return x
    out = x.new_zeros(x.shape[0], prompt_len + x.shape[1])
    out[:, prompt_len - 1:prompt_len - 1 + x.shape[1]] = x
    return out


__all__ += ["to_shift"]
