"""``format="dcp"``: a ``torch.distributed.checkpoint`` of the model's state dict under its Hugging
Face names, which ``torch.distributed.checkpoint.load`` reads into a Hugging Face model's state
dict -- in one process, or sharded under FSDP2 (``fully_shard``) on any number of ranks
(docs/EXPORT.md). A tied model's checkpoint still holds ``lm_head.weight`` (the state dict's
alias of the embedding), since a loader asks for every key of ``model.state_dict()``.

Bounded memory: the weights are first streamed, unit by unit, into a safetensors file beside
the checkpoint (:mod:`.safetensors_out`), whose tensors are then memory-mapped (file pages, read
and dropped by the kernel as DCP writes them) and handed to ``dcp.save``; the file is removed.
"""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import torch

from megatrain_nb.atomic import atomic_dir

from .safetensors_out import write_config_files, write_safetensors
from .source import WeightSource

_NP = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I64": np.int64, "I32": np.int32,
       "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def mapped_safetensors(path: str) -> dict:
    """``{name: tensor}`` backed by a memory map of the safetensors file ``path`` (no copy)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        head = json.loads(f.read(n))
    head.pop("__metadata__", None)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for name, e in head.items():
        b, end = e["data_offsets"]
        raw = mm[8 + n + b: 8 + n + end]
        if e["dtype"] == "BF16":
            out[name] = torch.from_numpy(raw.view(np.int16)).view(torch.bfloat16).reshape(e["shape"])
        else:
            out[name] = torch.from_numpy(raw.view(_NP[e["dtype"]])).reshape(e["shape"])
    return out


def write_dcp(src: WeightSource, path) -> str:
    """Write ``src``'s state dict as a DCP folder at ``path`` (plus config and tokenizer)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    def write(tmp: str) -> None:
        staging = os.path.join(tmp, ".staging")
        write_safetensors(src, staging, shard_bytes=1 << 62)
        with warnings.catch_warnings():   # read-only memory maps: DCP only reads them
            warnings.simplefilter("ignore", UserWarning)
            state = mapped_safetensors(os.path.join(staging, "model.safetensors"))
        if src.tied and "lm_head.weight" not in state:
            emb = next(k for k in state if k.endswith("embed_tokens.weight"))
            state["lm_head.weight"] = state[emb]
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp, single_file_per_rank=True, thread_count=1))
        del state
        shutil.rmtree(staging)
        write_config_files(src, tmp)

    return os.fspath(atomic_dir(os.fspath(path), write))


def read_dcp(path, model) -> None:
    """Load a DCP export into ``model`` (a Hugging Face model of the same config), in place."""
    import torch.distributed.checkpoint as dcp

    state = model.state_dict()
    dcp.load(state, checkpoint_id=os.fspath(path))
    model.load_state_dict(state)
