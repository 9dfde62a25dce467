"""Sharded checkpoints that move between world sizes.

Each rank writes one file with its shard of every unit (master weights, Adam states in their
stored form: fp32, or a codec's codes and per-block scales), in parallel, never holding more
than its own shards. A rank of a run with another world size reads back its new range of each
unit by slicing only the overlapping pieces of the old files (safetensors reads a slice without
loading the rest).

Why this is exact for compressed states: shard boundaries are multiples of
:data:`~.dist.SHARD_ALIGN`, which every codec block size divides, so an old shard's blocks are
whole blocks of the unit, and a new range is a run of whole blocks (only the unit's very last
block may be short, in every world size alike). Concatenating the overlapping blocks' codes and
scales gives bit for bit what encoding the new range would.

We looked at ``torch.distributed.checkpoint``: it re-shards DTensors / ShardedTensors with a
planner, but our states are not tensors of one shape sharded evenly (per-block scales, packed
4-bit codes, padded uneven shards), so we would still map them by hand; a plain file per rank
with explicit element ranges keeps that mapping in one place and the files readable by
safetensors alone.

File: ``<dir>/shards-<rank>-of-<world>.safetensors``; tensors ``<unit>/<key>``; metadata
``{"format", "world", "rank", "codec", "units": {unit: [numel, start, end]}}``.
"""
from __future__ import annotations

import json
import os
from typing import Dict, Iterable, Mapping, Optional, Tuple

import torch

from ..updates.codecs import get_codec
from .dist import SHARD_ALIGN, ShardLayout

FORMAT = "megatrain_nb-shards-v1"


def shard_file(folder, rank: int, world: int) -> str:
    return os.path.join(str(folder), f"shards-{rank:05d}-of-{world:05d}.safetensors")


def write_rank_shards(folder, *, rank: int, world: int, codec: str,
                      units: Mapping[str, Tuple[int, int, int]], tensors: Mapping[str, Mapping[str, torch.Tensor]],
                      extra: Optional[dict] = None) -> str:
    """Write this rank's file. ``units``: unit name -> (numel, start, end) of this rank's range;
    ``tensors``: unit name -> {key: tensor of that range in its stored form}. Written to a
    temporary name and renamed, so a reader never sees half a file."""
    from safetensors.torch import save_file

    flat = {}
    for name, keys in tensors.items():
        if name not in units:
            raise ValueError(f"tensors for unit {name!r} but no range for it in units")
        for k, t in keys.items():
            flat[f"{name}/{k}"] = t.contiguous()
    meta = {"format": FORMAT, "world": world, "rank": rank, "codec": codec, "align": SHARD_ALIGN,
            "units": {n: list(map(int, r)) for n, r in units.items()}, "extra": extra or {}}
    final = shard_file(folder, rank, world)
    tmp = final + f".tmp-{os.getpid()}"
    save_file(flat, tmp, metadata={"meta": json.dumps(meta)})
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
    return final


def read_meta(folder) -> list[dict]:
    """The metadata of every rank file in ``folder``, by rank; checks the set is complete."""
    from safetensors import safe_open

    names = sorted(f for f in os.listdir(folder) if f.startswith("shards-") and f.endswith(".safetensors"))
    if not names:
        raise FileNotFoundError(f"{folder} holds no shards-*-of-*.safetensors files: not a sharded checkpoint")
    metas = []
    for n in names:
        with safe_open(os.path.join(folder, n), "pt") as fh:
            m = json.loads((fh.metadata() or {}).get("meta", "{}"))
        if m.get("format") != FORMAT:
            raise ValueError(f"{n}: format {m.get('format')!r}, expected {FORMAT!r}")
        metas.append(m)
    world = metas[0]["world"]
    if sorted(m["rank"] for m in metas) != list(range(world)) or any(m["world"] != world for m in metas):
        found = [(m["rank"], m["world"]) for m in metas]
        raise ValueError(f"{folder}: incomplete or mixed sharded checkpoint (rank, world) = {found}; "
                         f"expected ranks 0..{world - 1} of {world}")
    return sorted(metas, key=lambda m: m["rank"])


def _key_kind(key: str, codec: str) -> Tuple[str, int, int]:
    """(kind, block, codes per element-unit) of a stored key: fp32 element-indexed, or a codec's
    block-indexed codes / scales."""
    if key.endswith(".codes") or key.endswith(".scales"):
        role = key.rsplit(".", 1)[0]
        c = get_codec(codec, role)
        return ("codes" if key.endswith(".codes") else "scales"), c.block, getattr(c, "codes_per_byte", 1)
    return "elements", 1, 1


def _piece_slice(kind: str, block: int, per_byte: int, a: int, b: int) -> slice:
    """Which part of a stored tensor holds elements [a, b) of its range (a, b relative to the
    range's start; a is block-aligned)."""
    if kind == "elements":
        return slice(a, b)
    assert a % block == 0, "shard boundaries are block-aligned"
    b0, b1 = a // block, -(-b // block)
    if kind == "scales":
        return slice(b0, b1)
    return slice(b0 * block // per_byte, b1 * block // per_byte)


def read_range(folder, metas: list[dict], unit: str, start: int, end: int,
               keys: Optional[Iterable[str]] = None) -> Dict[str, torch.Tensor]:
    """Elements [start, end) of ``unit`` (every key, or ``keys``), assembled from the old ranks'
    files, reading only the overlapping slices. ``start`` must be a shard boundary (a multiple of
    the alignment) and ``end`` one too, or the unit's end."""
    from safetensors import safe_open

    numel = metas[0]["units"][unit][0] if unit in metas[0]["units"] else None
    if numel is None:
        raise KeyError(f"unit {unit!r} is not in the checkpoint (it has {sorted(metas[0]['units'])})")
    if start == end == numel:  # a rank that owns none of a small unit
        return {}
    if start % SHARD_ALIGN or (end % SHARD_ALIGN and end != numel) or not 0 <= start <= end <= numel:
        raise ValueError(f"range [{start}, {end}) of unit {unit!r} ({numel} elements) is not on shard boundaries")
    codec = metas[0]["codec"]
    parts: Dict[str, list] = {}
    for m in metas:
        n, s, e = m["units"][unit]
        if n != numel:
            raise ValueError(f"rank {m['rank']}'s file says unit {unit!r} has {n} elements, rank 0's {numel}")
        a, b = max(s, start), min(e, end)
        if a >= b:
            continue
        with safe_open(shard_file(folder, m["rank"], m["world"]), "pt") as fh:
            want = [k for k in fh.keys() if k.startswith(unit + "/")]
            for full_key in want:
                key = full_key[len(unit) + 1:]
                if keys is not None and key not in keys:
                    continue
                kind, block, per_byte = _key_kind(key, codec)
                parts.setdefault(key, []).append(fh.get_slice(full_key)[_piece_slice(kind, block, per_byte,
                                                                                    a - s, b - s)])
    return {k: torch.cat(v) if len(v) > 1 else v[0] for k, v in parts.items()}


def read_rank_shards(folder, rank: int, world: int, numels: Mapping[str, int],
                     keys: Optional[Iterable[str]] = None) -> Dict[str, Dict[str, torch.Tensor]]:
    """This rank's shard of every unit for a run of ``world`` ranks, whatever world wrote the
    checkpoint. ``numels``: unit name -> elements (checked against the files)."""
    metas = read_meta(folder)
    out = {}
    for name, numel in numels.items():
        lay = ShardLayout.make(numel, world)
        s, e = lay.bounds(rank)
        if name in metas[0]["units"] and metas[0]["units"][name][0] != numel:
            raise ValueError(f"unit {name!r}: the checkpoint has {metas[0]['units'][name][0]} elements, this "
                             f"model {numel}; it was written for another model")
        out[name] = read_range(folder, metas, name, s, e, keys)
    return out


def save_engine_shards(path, *, units, state_unit, weights, states, adam_steps, dist, codec: str) -> None:
    """Write this rank's shard of every unit of an engine (master weights, stored Adam states,
    step counts) into ``path``, then wait for every rank (collective). ``state_unit(u)``: the
    part of ``u`` this rank holds (``u`` itself when not sharded)."""
    states.flush()
    os.makedirs(path, exist_ok=True)
    ranges, tensors, steps = {}, {}, {}
    for u in units:
        su = state_unit(u)
        start = su.start if su is not u else 0
        ranges[u.name] = (u.numel, start, start + su.numel)
        keys = {"master": weights.read_now(su)}
        keys.update(states.stored(su) or {})
        tensors[u.name] = keys
        if u.index in adam_steps:
            steps[u.name] = int(adam_steps[u.index])
    write_rank_shards(path, rank=dist.rank, world=dist.world, codec=codec, units=ranges, tensors=tensors,
                      extra={"steps": steps})
    dist.barrier()   # the checkpoint is complete once every rank's file is


def load_engine_shards(path, *, units, state_unit, weights, states, adam, dist, codec: str) -> None:
    """Read this rank's range of every unit from a checkpoint :func:`save_engine_shards` wrote
    with any world size into ``weights``, ``states`` and ``adam``'s step counts."""
    metas = read_meta(path)
    saved = metas[0]["codec"]
    if saved != codec:
        raise ValueError(f"the checkpoint's optimizer states use codec {saved!r} but this engine uses "
                         f"{codec!r}; set optimizer_compression={saved!r}")
    parts = read_rank_shards(path, dist.rank, dist.world, {u.name: u.numel for u in units})
    steps = metas[0]["extra"].get("steps", {})
    for u in units:
        su = state_unit(u)
        got = dict(parts[u.name])
        if su.numel == 0:
            continue
        weights.overwrite(su, got.pop("master"))
        if got:
            states.put_stored(su, got)
    states.flush()
    adam.load_state_dict({str(u.index): torch.tensor(float(steps[u.name])) for u in units if u.name in steps})


def refuse_sharded(what: str, world: int) -> None:
    """Hugging Face-layout checkpoints hold whole units: refuse them with state sharded over ranks."""
    if world > 1:
        raise NotImplementedError(f"{what}() from a Hugging Face-layout checkpoint with state sharded over "
                                  f"{world} ranks is not built yet; use a sharded checkpoint")
