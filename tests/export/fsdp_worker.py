"""One rank of an FSDP2 (``fully_shard``) job on CPU/gloo that continues from a DCP export:
``python fsdp_worker.py DCP_DIR BATCH_FILE OUT_JSON`` with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set (tests/export/test_fsdp_continue.py). Every layer and the root are sharded; the
DCP is loaded into the sharded state dict; the loss of the next batch is written by rank 0."""
from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoConfig, AutoModelForCausalLM


def main(path: str, batch_file: str, out: str) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    try:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        torch.manual_seed(1234)   # any initial weights: the checkpoint replaces them all
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        state = get_model_state_dict(model)
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state)
        shards = sum(p.to_local().numel() for p in model.parameters())   # DTensors: this rank's part
        total = sum(p.numel() for p in model.parameters())
        ids = torch.load(batch_file)
        with torch.no_grad():
            loss = float(model(ids, labels=ids).loss)
        dist.barrier()
        if dist.get_rank() == 0:
            with open(out, "w") as f:
                json.dump({"loss": loss, "local": shards, "total": total}, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
