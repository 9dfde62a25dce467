"""Linked checkpoints of a sharded run: every rank its own linked folder (``engine/tiers/linked.py``).

With several ranks each rank holds its shard of every unit, in its own host RAM and its own
disk tier. A snapshot therefore has one linked folder per rank, written by that rank alone and
in parallel: its disk-tier files hard-linked, its RAM-held shards and step counts written.

    <folder>/rank-<r>-of-<world>/linked.json, ram_state.safetensors, disk/<file>.mtd

Rank 0 writes the shared files beside them (trainer state, scheduler, RNG, manifest: see
``trainer/saving.py``). A rank-linked snapshot loads back into a run of the same world size
(the run that wrote it): a snapshot is for going back, not for moving between world sizes,
which a checkpoint does (``engine/ranks/reshard.py``).
"""
from __future__ import annotations

import os
import re
from typing import Dict, List

from ..tiers.linked import DISK_FOLDER, is_linked, load_linked, save_linked
from ..tiers.linked_check import rank_folder

_RANK = re.compile(r"^rank-(\d{5})-of-(\d{5})$")


def rank_folders(folder) -> List[str]:
    """The rank folders in ``folder`` (names), sorted; empty when it is no rank-linked checkpoint."""
    try:
        names = os.listdir(os.fspath(folder))
    except OSError:
        return []
    return sorted(n for n in names if _RANK.match(n) and is_linked(os.path.join(os.fspath(folder), n)))


def disk_folders(world: int) -> tuple:
    """The sub-folders of a rank-linked checkpoint that hold hard links (left out of its manifest:
    the disk tier's files carry checksums of their own)."""
    return tuple(f"{os.path.basename(rank_folder('', r, world))}/{DISK_FOLDER}" for r in range(world))


def save_linked_rank(engine, folder) -> Dict[str, int]:
    """This rank's linked folder inside ``folder`` (which exists on every rank: a shared
    filesystem). Collective: returns the bytes linked, copied and written, summed over ranks,
    once every rank's folder is complete."""
    d = engine.dist
    sub = rank_folder(folder, d.rank, d.world)
    os.makedirs(sub, exist_ok=True)
    mine = save_linked(engine, sub)
    every = d.all_gather_json(mine)    # also the barrier: every rank's folder is written
    return {k: sum(int(e[k]) for e in every) for k in mine}


def is_rank_linked(folder) -> bool:
    return bool(rank_folders(folder))


def load_linked_rank(engine, folder) -> None:
    """Load this rank's folder of a rank-linked checkpoint (collective: ends with a barrier)."""
    d = engine.dist
    found = rank_folders(folder)
    want = os.path.basename(rank_folder(folder, d.rank, d.world))
    if want not in found:
        worlds = sorted({int(_RANK.match(n).group(2)) for n in found})
        raise ValueError(f"snapshot {os.fspath(folder)!r} was written by {', '.join(map(str, worlds))} rank(s) and "
                         f"this run has {d.world}: a snapshot loads back into the run that wrote it (same number of "
                         "ranks); to move between world sizes, resume from a checkpoint (checkpoint-<step>)")
    load_linked(engine, os.path.join(os.fspath(folder), want))
    d.barrier()


__all__ = ["disk_folders", "is_rank_linked", "load_linked_rank", "rank_folder", "rank_folders",
           "save_linked_rank"]
