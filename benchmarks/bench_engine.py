"""Engine step time (everything in RAM) against plain PyTorch training with Hugging Face
gradient checkpointing, same model and batch, alternating in one run.

    python benchmarks/bench_engine.py            # 12 layers x 512 hidden, batch 4 x 256
Ends with: RESULT engine_step_vs_plain <ratio> x (target <= 1.10)
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, median, result  # noqa: E402

from megatrain_nb.engine import EngineConfig, StreamingEngine  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=4)
    a = ap.parse_args(argv)
    print(machine())
    cfg = AutoConfig.for_model("llama", vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=int(a.hidden * 8 / 3),
                               num_hidden_layers=a.layers, num_attention_heads=8, num_key_value_heads=8,
                               max_position_embeddings=max(2048, a.seq), tie_word_embeddings=False)
    torch.manual_seed(0)
    plain = AutoModelForCausalLM.from_config(cfg)
    n_params = sum(p.numel() for p in plain.parameters())
    engine = StreamingEngine(copy.deepcopy(plain), EngineConfig(device="cpu"))
    plain.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    plain.config.use_cache = False
    plain.train()
    engine.model.train()
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(0, a.vocab, (a.batch, a.seq))
    print(f"model: llama {a.layers} layers x {a.hidden} hidden, {n_params / 1e6:.1f}M params; batch {a.batch} x {a.seq}")

    def plain_step():
        out = plain(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        return float(out.loss.detach())

    def engine_step():
        out = engine.forward_backward(ids)
        engine.optimizer_step(1e-4)
        engine.zero_grad()
        return out.loss

    # Plain's activation peak: autograd's saved tensors at their largest, measured with hooks.
    plain_step(); engine_step()  # warm-up
    tp, te = [], []
    for _ in range(a.reps):
        t0 = time.perf_counter(); plain_step(); tp.append(time.perf_counter() - t0)
        t0 = time.perf_counter(); engine_step(); te.append(time.perf_counter() - t0)
    mp, me = median(tp), median(te)
    print(f"plain (HF gradient checkpointing) step: median {mp:.3f}s  {[round(x, 3) for x in tp]}")
    print(f"engine step:                          median {me:.3f}s  {[round(x, 3) for x in te]}")
    dev = engine.memory_report()["device"]
    plain_dev = n_params * 4 * 4  # weights + grads + 2 Adam moments resident on the device
    print(f"device peak (engine accounting: slots + activations): {dev['peak_bytes'] / 2**20:.1f} MiB "
          f"(weights slots {dev['weights'] / 2**20:.1f}, activations {dev['activations'] / 2**20:.1f})")
    print(f"device peak plain (weights + grads + Adam states resident, activations excluded): "
          f"{plain_dev / 2**20:.1f} MiB")
    result("engine_device_peak_mib", dev["peak_bytes"] / 2**20, "MiB", "<", plain_dev / 2**20)
    result("engine_step_vs_plain", me / mp, "x", "<=", 1.10)


if __name__ == "__main__":
    main()
