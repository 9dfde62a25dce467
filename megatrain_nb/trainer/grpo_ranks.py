"""GRPO on several ranks (torchrun): rollouts split across the ranks, gathered, and the run the
same for any number of ranks at the same global batch.

The rule (docs/GRPO.md, "Several processes"), as trl.GRPOTrainer splits its work over processes:

- **Every rank walks the whole generation batch** (TRL's ``RepeatSampler`` order, the global
  ``generation_batch_size`` rows = ``per_device_train_batch_size x steps_per_generation x
  ranks``) and **generates, scores and computes the log-probs of its own contiguous slice**
  (:func:`rank_rows`); the completions, rewards and log-probs are then gathered (JSON over the
  group, rank order: nothing unpickled), so every rank holds the generation batch's rollouts, and
  the group advantages are computed over whole groups, as TRL gathers its rewards.
- **Per-rollout random streams** (``rollout_seeds="per_rollout"``, the only rule with several
  ranks): each generation draws one int64 ``base`` from the global torch stream (rank 0's value
  is taken by all); rollout ``i`` of the generation batch (its position in TRL's order) samples
  every token from its own ``torch.Generator`` seeded ``base + 1 + i``, and the shuffle after the
  generation uses a generator seeded ``base``. So a rollout's draws do not depend on which rank
  makes it, nor on which other rollouts share its decoding batch: N ranks sample the completions
  one process samples with ``rollout_seeds="per_rollout"`` (the default in one process stays
  ``"global"``: TRL's own order of draws, for parity with trl.GRPOTrainer).
- **Training** as :class:`~.trainer.Trainer` deals micro-batches (:mod:`.sharding`): the
  generation batch is cut into ``steps_per_generation x ranks`` micro-batches of
  ``per_device_train_batch_size`` rows; an optimizer step takes ``gradient_accumulation_steps x
  ranks`` of them and rank r its contiguous share; the loss constants are the global ones (the
  step's micro-batches over all ranks, the generation batch's tokens), the gradients summed over
  the ranks. N ranks x accumulation A equal one process x accumulation N·A (and
  ``steps_per_generation`` N·S) up to summation order.
- Generation under several ranks is the layer-major streamed decoder on the sharded engine (each
  unit gathered per decoded token, ranks decoding in lockstep: a rank whose rows all ended runs
  filler passes until none decodes); ``generation="auto"`` picks it, ``"resident"`` is refused
  (a resident copy would need the whole model gathered on every rank).
"""
from __future__ import annotations

from typing import Callable, List, Optional

import torch

from .grpo_rollout import RewardError
from .sharding import rank_share

#: GRPOTrainer's ``rollout_seeds=`` (an engine option keyword)
ROLLOUT_SEEDS = ("global", "per_rollout")


def check_rollout_seeds(mode: Optional[str], world: int, generation: str) -> str:
    """The sampling rule (None: ``"per_rollout"`` with several ranks, else ``"global"``), checked
    against the ranks and the generation mode."""
    if mode is None:
        mode = "per_rollout" if world > 1 else "global"
    if mode not in ROLLOUT_SEEDS:
        raise ValueError(f"rollout_seeds={mode!r}: one of {', '.join(map(repr, ROLLOUT_SEEDS))} ('global': TRL's "
                         "order of draws on the global random stream, one process; 'per_rollout': each rollout "
                         "samples from its own generator, so the run is the same for any number of ranks)")
    if mode == "global" and world > 1:
        raise ValueError(f"rollout_seeds='global' (TRL's order of draws on one random stream) needs one process; "
                         f"on {world} ranks each rollout samples from its own generator: use "
                         "rollout_seeds='per_rollout' (the default with several ranks)")
    if mode == "per_rollout" and generation == "resident":
        why = f"{world} ranks generate" if world > 1 else "rollout_seeds='per_rollout' samples"
        raise ValueError(f"generation='resident' cannot be used here: {why} with the engine's streamed decoder "
                         "(each rollout drawing from its own generator; a resident copy would need the whole model "
                         "on every rank): use generation='streamed' or 'auto'")
    return mode


def rank_rows(n: int, rank: int, world: int) -> range:
    """This rank's contiguous slice of a generation batch's ``n`` rows (sizes differ by <= 1)."""
    if n < world:
        raise ValueError(f"a generation batch of {n} rollouts cannot be split over {world} ranks (each rank "
                         "decodes at least one): raise generation_batch_size / per_device_eval_batch_size")
    return rank_share(n, rank, world)


def sampling_base(dist) -> int:
    """One draw of the global stream for a generation (rank 0's value, taken by every rank)."""
    base = int(torch.randint(0, 2 ** 62, (), dtype=torch.int64))
    return int(dist.all_gather_json(base)[0]) if dist.world > 1 else base


def row_generators(base: int, rows: range) -> List[torch.Generator]:
    """Each rollout's own random stream: rollout ``i`` seeded ``base + 1 + i``."""
    return [torch.Generator().manual_seed(base + 1 + i) for i in rows]


def seeded_shuffle(rollouts: dict, base: int) -> dict:
    """TRL's ``shuffle_sequence_dict`` with its permutation drawn from a generator seeded ``base``
    (the same on every rank; the global stream untouched)."""
    from trl.trainer.utils import shuffle_sequence_dict

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(base)
        return shuffle_sequence_dict(rollouts)


def lockstep(dist) -> Optional[Callable[[bool], bool]]:
    """The decoder's ``more``: whether any rank still decodes (None in one process)."""
    if dist.world == 1:
        return None
    return lambda going: dist.sum(int(going)) > 0


def gather_lists(dist, mine: list) -> list:
    """Every rank's ``mine`` (JSON values) end to end, in rank order."""
    if dist.world == 1:
        return list(mine)
    return [x for part in dist.all_gather_json(list(mine)) for x in part]


def _as_json(rows: torch.Tensor) -> dict:
    """A float tensor ``[rows, ...]`` as JSON (exact: a float32 value survives JSON's float64)."""
    return {"shape": list(rows.shape[1:]), "v": rows.double().tolist()}


def _concat(parts: list, dtype) -> torch.Tensor:
    """The ranks' :func:`_as_json` parts concatenated in rank order."""
    return torch.cat([torch.tensor(p["v"], dtype=dtype).reshape(-1, *p["shape"]) for p in parts])


def gather_rows(dist, mine: torch.Tensor) -> torch.Tensor:
    """Every rank's rows of a float tensor ``[rows, ...]`` concatenated in rank order."""
    if dist.world == 1:
        return mine
    return _concat(dist.all_gather_json(_as_json(mine)), mine.dtype)


def gather_rewards(dist, score: Callable[[], torch.Tensor]) -> torch.Tensor:
    """This rank's ``score()`` ([rows, functions]) gathered; a reward function that failed on any
    rank is a :class:`RewardError` on every rank (naming the rank), so none waits on the others."""
    if dist.world == 1:
        return score()
    try:
        part = {"error": None, **_as_json(score())}
    except RewardError as e:
        part = {"error": str(e)}
    parts = dist.all_gather_json(part)
    failed = [(r, p["error"]) for r, p in enumerate(parts) if p["error"] is not None]
    if failed:
        raise RewardError("; ".join(f"rank {r}: {msg}" for r, msg in failed))
    return _concat(parts, torch.float32)


__all__ = ["ROLLOUT_SEEDS", "check_rollout_seeds", "gather_lists", "gather_rewards", "gather_rows", "lockstep",
           "rank_rows", "row_generators", "sampling_base", "seeded_shuffle"]
