"""Dealing each optimizer step's micro-batches out over data-parallel ranks.

One global order of micro-batches, whatever the world size: an optimizer step of N ranks with
accumulation A consumes the N·A micro-batches that one rank with accumulation N·A would, and
rank r takes a contiguous share of them. Loss normalisation is global (the trainer sums the
target-token count over ranks), so the summed gradient is the one-process gradient up to the
order of summation, and changing the number of ranks does not change the run.

Every rank must run the same number of micro-batches per step (each one gathers every unit and
reduce-scatters its gradient in lockstep). When a window is short (the end of an epoch) and does
not split evenly, the ranks with fewer real micro-batches run a zero-weight one: the same inputs
with every label ignored, which adds exactly nothing to the loss or the gradient.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

IGNORE_INDEX = -100

#: Key set on a zero-weight micro-batch: it counts no tokens and no targets.
ZERO_WEIGHT = "zero_weight"


def rank_share(n: int, rank: int, world: int) -> range:
    """Positions of rank's micro-batches among a step's ``n``: contiguous, sizes differ by <= 1,
    the larger shares first."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} / world size {world}: need 0 <= rank < world")
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


def per_rank_count(n: int, world: int) -> int:
    """Micro-batches every rank runs for a step of ``n`` (the largest share)."""
    return -(-n // world)


def zero_weight(batch: dict) -> dict:
    """The same inputs with every label ignored: runs like ``batch``, contributes nothing."""
    out = dict(batch)
    out["labels"] = torch.full_like(batch["labels"], IGNORE_INDEX)
    out[ZERO_WEIGHT] = True
    return out


def deal(raw: Sequence[Callable[[], dict]], rank: int, world: int, finish: Callable[[dict], dict]) -> list[dict]:
    """This rank's micro-batches of one step's global window ``raw`` (callables that build a
    micro-batch, so a rank only loads and collates its own share), padded with zero-weight
    micro-batches to the count every rank runs."""
    if world == 1:
        return [finish(r()) for r in raw]
    mine = [finish(raw[i]()) for i in rank_share(len(raw), rank, world)]
    want = per_rank_count(len(raw), world)
    if len(mine) < want:
        template = mine[0] if mine else finish(raw[0]())
        mine.extend(zero_weight(template) for _ in range(want - len(mine)))
    return mine
