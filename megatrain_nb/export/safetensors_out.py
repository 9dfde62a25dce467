"""``format="safetensors"``: a Hugging Face folder (config, sharded safetensors and their index,
generation config, tokenizer with its chat template when known), exact (fp32 as trained).

The shards are laid out from the source's entries before any weight is read (each file's
header first), then the bytes are written in order as the source yields them, as one stream cut
into the shards' files: from the source's pieces where it has them (the disk tier's files read
chunk by chunk, two units at once, :func:`.stream.stream_pieces`), else tensor by tensor; never a
whole shard in memory.
"""
from __future__ import annotations

import copy
import json
import os
from typing import List, Tuple

import torch

from megatrain_nb.atomic import atomic_dir

from .source import WeightSource, numel
from .stream import DirectFile, read_ahead, stream_pieces

#: the largest shard (as transformers' save_pretrained shards, one file per <= this many bytes)
SHARD_BYTES = 2 * 1024 ** 3
INDEX_NAME = "model.safetensors.index.json"
_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}


def _size(shape, dtype) -> int:
    return numel(shape) * torch.empty((), dtype=dtype).element_size()


def plan_shards(entries, shard_bytes: int = SHARD_BYTES) -> List[List[Tuple[str, tuple, torch.dtype]]]:
    """The entries cut into consecutive shards of at most ``shard_bytes`` (a bigger tensor alone)."""
    shards, current, size = [], [], 0
    for e in entries:
        n = _size(e[1], e[2])
        if current and size + n > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(e)
        size += n
    if current or not shards:
        shards.append(current)
    return shards


def _header(entries) -> bytes:
    head, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, dtype in entries:
        n = _size(shape, dtype)
        head[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def write_config_files(src: WeightSource, target: str, dtype: str = "float32") -> None:
    """config.json (architectures, dtype), generation_config.json and the tokenizer, if known."""
    cfg = copy.deepcopy(src.config)
    cfg.architectures = [src.model_class]
    cfg.use_cache = True
    try:
        cfg.dtype = dtype
    except Exception:   # noqa: BLE001 - an older config class without the field
        pass
    cfg.save_pretrained(target)
    if src.generation_config is not None:
        try:
            src.generation_config.save_pretrained(target)
        except Exception:   # noqa: BLE001 - a generation config that does not validate is left out
            pass
    if src.tokenizer is not None:
        src.tokenizer.save_pretrained(target)


class _Shards:
    """The shards' files written as one stream: ``write(bytes-like)`` fills each shard's file
    (its header first) up to its size, then opens the next."""

    def __init__(self, target: str, names: List[str], shards):
        self.target, self.names, self.shards = target, names, shards
        self.index, self.left, self.out = -1, 0, None
        self.total = 0

    def _next(self) -> None:
        if self.out is not None:
            self.out.close()
            self.out = None
        self.index += 1
        shard = self.shards[self.index]
        head = _header(shard)
        self.left = sum(_size(s, d) for _, s, d in shard)
        self.out = DirectFile(os.path.join(self.target, self.names[self.index]), size=len(head) + self.left)
        self.out.write(head)

    def write(self, data) -> None:
        mv = memoryview(data).cast("B")
        while len(mv):
            while self.left == 0:
                if self.index + 1 == len(self.shards):
                    raise RuntimeError(f"export: the source yielded more bytes than its entries lay out "
                                       f"({len(mv)} past the end); nothing was kept")
                self._next()
            n = min(len(mv), self.left)
            self.out.write(mv[:n])
            self.left -= n
            self.total += n
            mv = mv[n:]

    def close(self, abort: bool = False) -> None:
        if not abort:
            while self.index + 1 < len(self.shards):   # (shards with no bytes)
                self._next()
            if self.left:
                raise RuntimeError(f"export: {self.left} bytes of {self.names[self.index]} were not written; "
                                   "nothing was kept")
        if self.out is not None:
            self.out.close(abort=abort)
            self.out = None


def _write_tensors(src: WeightSource, out: _Shards) -> None:
    it = read_ahead(src.tensors())   # the next unit is read while this one is written
    for want, shape, dtype in src.entries:
        name, t = next(it)
        if name != want or tuple(t.shape) != tuple(shape):
            raise RuntimeError(f"export: the source yielded {name} {tuple(t.shape)} where {want} {shape} "
                               "was laid out; nothing was kept")
        data = t.detach().to(dtype).contiguous().view(-1).view(torch.uint8).numpy()
        out.write(data)
        del t, data


def _write_weights(src: WeightSource, target: str, shard_bytes: int) -> int:
    shards = plan_shards(src.entries, shard_bytes)
    names = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    out = _Shards(target, names, shards)
    try:
        if src.pieces is not None:   # the stored bytes are the file's: streamed as they are read
            stream_pieces(src.pieces(), out.write)
        else:
            _write_tensors(src, out)
    except BaseException:
        out.close(abort=True)
        raise
    out.close()
    if len(shards) > 1:
        index = {"metadata": {"total_size": out.total},
                 "weight_map": {n: f for f, shard in zip(names, shards) for n, _, _ in shard}}
        with open(os.path.join(target, INDEX_NAME), "w") as f:
            json.dump(index, f, indent=2)
    return out.total


def write_safetensors(src: WeightSource, path, *, shard_bytes: int = SHARD_BYTES) -> str:
    """Write ``src`` as a Hugging Face folder at ``path`` (a temporary folder renamed into place;
    an existing folder there is replaced only once the new one is complete)."""
    def write(tmp: str) -> None:
        write_config_files(src, tmp)
        _write_weights(src, tmp, shard_bytes)

    return os.fspath(atomic_dir(os.fspath(path), write))
