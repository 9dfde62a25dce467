"""Optimizer-state codecs on real text: final loss of int8 / int4 against fp32 AdamW, and the
stored bytes per parameter of each, measured on the disk tier.

    python benchmarks/bench_codecs.py [--steps 300]
Prints: RESULT codec_int8_loss_vs_fp32 ... (target <= 1.01), RESULT codec_int4_loss_vs_fp32 ...
(target <= 1.03), and bytes per parameter of each codec.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, result  # noqa: E402

from megatrain_nb.engine import EngineConfig, StreamingEngine  # noqa: E402
from megatrain_nb.trainer.default import load_default_tokens  # noqa: E402


def run(codec: str, ids: np.ndarray, a, offload_dir: str):
    torch.manual_seed(0)
    cfg = AutoConfig.for_model("llama", vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.hidden * 8 // 3,
                               num_hidden_layers=a.layers, num_attention_heads=4, max_position_embeddings=a.seq)
    engine = StreamingEngine(AutoModelForCausalLM.from_config(cfg),
                             EngineConfig(device="cpu", optimizer_compression=codec, offload_dir=offload_dir,
                                          adam_betas=(0.9, 0.95), weight_decay=0.1))
    n_blocks = len(ids) // a.seq
    blocks = torch.from_numpy(ids[: n_blocks * a.seq].astype(np.int64)).view(n_blocks, a.seq)
    g = torch.Generator().manual_seed(1)
    order = torch.randperm(n_blocks, generator=g)
    losses = []
    t0 = time.perf_counter()
    for step in range(a.steps):
        idx = order[(step * a.batch) % (n_blocks - a.batch):][: a.batch]
        warm = min(1.0, (step + 1) / 30)
        lr = a.lr * warm * (0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * step / a.steps)))
        losses.append(engine.forward_backward(blocks[idx], step_lr=float(lr)).loss)
    dt = time.perf_counter() - t0
    disk_bytes = engine.memory_report()["disk"]["optimizer_states"]
    n = engine.num_parameters()
    engine.close()
    final = float(np.mean(losses[-20:]))
    print(f"{codec:>5}: final loss (mean of last 20) {final:.4f}  first {losses[0]:.3f}  "
          f"states on disk {disk_bytes / n:.3f} bytes/param  ({dt:.1f}s)")
    return final, disk_bytes / n


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    a = ap.parse_args(argv)
    print(machine())
    _, ids, _ = load_default_tokens(vocab_size=a.vocab)
    print(f"data: built-in default (stdlib sources), {len(ids)} tokens; llama {a.layers}x{a.hidden}, "
          f"batch {a.batch}x{a.seq}, {a.steps} steps, warmup+cosine lr {a.lr}")
    out = {}
    with tempfile.TemporaryDirectory(dir=".") as d:
        for codec in ("none", "int8", "int4"):
            out[codec] = run(codec, ids, a, d)
    base = out["none"][0]
    result("codec_none_bytes_per_param", out["none"][1], "B", "<=", 8.1)  # fp32 m and v plus file headers
    result("codec_int8_bytes_per_param", out["int8"][1], "B", "<", out["none"][1])
    result("codec_int4_bytes_per_param", out["int4"][1], "B", "<", out["int8"][1])
    result("codec_int8_loss_vs_fp32", out["int8"][0] / base, "x", "<=", 1.01)
    result("codec_int4_loss_vs_fp32", out["int4"][0] / base, "x", "<=", 1.03)


if __name__ == "__main__":
    main()
