"""A run saved here continues under FSDP2: the DCP export taken after step 2 is loaded into a
two-rank gloo FSDP2 (``fully_shard``) model on CPU, whose loss on step 3's batch is this
project's step-3 loss within 1e-6 (docs/EXPORT.md)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from datasets import Dataset

import megatrain_nb as mt

from . import helpers as h

pytestmark = pytest.mark.slow
WORKER = Path(__file__).with_name("fsdp_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fsdp2_continues_from_the_dcp_export_with_the_next_steps_loss(tmp_path):
    rows = h.rows(n=2, seq=20)   # one batch of both rows each step: step 3's batch is known
    trainer = mt.Trainer(model=h.model("llama"), train_dataset=Dataset.from_list(rows), tokenizer=h.tokenizer(),
                         args=h.args(tmp_path / "run", max_steps=3))
    losses = {}
    try:
        for record in trainer.iter_steps():
            losses[record["step"]] = record["loss"]
            if record["step"] == 2:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    path = mt.export(trainer, tmp_path / "dcp", format="dcp")
    finally:
        trainer.close()
    batch = tmp_path / "batch.pt"
    torch.save(torch.tensor([r["input_ids"] for r in rows]), batch)
    out = tmp_path / "out.json"
    port = str(_free_port())
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(WORKER), path, str(batch), str(out)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    assert all(p.returncode == 0 for p in procs), "\n".join(x[-3000:] for x in logs)
    got = json.loads(out.read_text())
    assert got["local"] < got["total"]   # sharded: rank 0 holds a part of every layer
    assert abs(got["loss"] - losses[3]) < 1e-6, (got["loss"], losses[3])
