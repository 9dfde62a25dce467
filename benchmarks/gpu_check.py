"""One prepared script for a CUDA machine: correctness and throughput of the engine on the GPU.

    python benchmarks/gpu_check.py            # < 5 minutes on one H100/H200-class GPU

1. Gradient parity on CUDA against plain PyTorch (the HF model's own forward/backward), fp32
   (TF32 off) and bf16 compute (fp32 master and gradients).
2. Throughput: a ~1B Llama-style model streamed through the GPU; TFLOPS counted as
   6 * params * real tokens + attention (12 * layers * hidden * seq * tokens), from timed steps.
3. Stall fraction (compute waiting for weights) and peak device memory against the plan.
4. Accumulation 8, layer-major (one forward_backward of the 8-micro-batch window per step):
   TFLOPS, loads per layer per step (2) and tokens per weight fetch, against the same window
   run micro-batch by micro-batch.
Ends with RESULT lines.
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


def llama(layers, hidden, vocab=32000, heads=16):
    return AutoConfig.for_model("llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                                max_position_embeddings=4096, tie_word_embeddings=False)


def parity(precision: str) -> float:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(llama(4, 256, vocab=2048, heads=4)).eval()
    ref = copy.deepcopy(model).cuda()
    ids = torch.randint(0, 2048, (2, 128), device="cuda")
    am = torch.ones_like(ids)
    am[1, :17] = 0
    out = ref(input_ids=ids, attention_mask=am, labels=ids.masked_fill(am == 0, -100))
    out.loss.backward()
    engine = StreamingEngine(model, EngineConfig(device="cuda", precision=precision))
    mine = engine.forward_backward(ids, attention_mask=am)
    grads = {n: p.grad.float().cpu() for n, p in ref.named_parameters()}
    worst = 0.0
    for name, g in engine.named_gradients():
        r = grads[name]
        worst = max(worst, float((g - r).norm() / (r.norm() + 1e-12)))
    print(f"parity {precision}: loss {mine.loss:.6f} vs {float(out.loss):.6f}; worst relative grad error {worst:.2e}")
    engine.close()
    return worst


def _meta_engine(a):
    """A Llama of the requested shape built on the meta device and streamed on CUDA."""
    cfg = llama(a.layers, a.hidden)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return cfg, StreamingEngine(model, EngineConfig(device="cuda", precision=a.precision, max_vram_gb=a.vram))


def throughput(a):
    cfg, engine = _meta_engine(a)
    n = engine.num_parameters()
    ids = torch.randint(0, cfg.vocab_size, (a.batch, a.seq))
    tokens = ids.numel()
    flops = 6 * n * tokens + 12 * a.layers * a.hidden * a.seq * tokens
    engine.forward_backward(ids, step_lr=1e-5)  # warm-up (creates optimizer states)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    engine.counters.reset()
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        engine.forward_backward(ids, step_lr=1e-5)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    tel = engine.telemetry()
    rep = engine.memory_report()["device"]
    step = median(times)
    tflops = flops / step / 1e12
    stall = tel["stall_seconds"]["device"] / sum(times)
    print(f"throughput: {n / 1e9:.2f}B params, batch {a.batch}x{a.seq}, {a.precision}: step {step:.2f}s "
          f"{[round(t, 2) for t in times]}, {tflops:.1f} TFLOPS, stall fraction {stall:.3f}")
    print(f"device: allocator peak {rep['allocator_peak_bytes'] / 2**30:.2f} GiB; plan "
          f"{engine.plan.device['total'] / 2**30:.2f} GiB (weights {engine.plan.device['weights'] / 2**30:.2f}); "
          f"engine accounting peak {rep['peak_bytes'] / 2**30:.2f} GiB")
    print("prefetch:", tel["prefetch"]["device"], "bytes:", {k: f"{v / 2**30:.1f} GiB" for k, v in tel["bytes"].items()})
    engine.close()
    return tflops, stall, rep["allocator_peak_bytes"], engine.plan.device["total"]


def accumulation(a, A: int = 8):
    """Throughput of an A-micro-batch window: layer-major against micro-batch-major."""
    cfg, engine = _meta_engine(a)
    n = engine.num_parameters()
    ids = torch.randint(0, cfg.vocab_size, (a.batch, a.seq))
    window = [ids] * A
    tokens = A * ids.numel()
    flops = 6 * n * tokens + 12 * a.layers * a.hidden * a.seq * tokens
    n_items = A * a.batch * (a.seq - 1)

    def step(layer_major: bool):
        if layer_major:
            engine.forward_backward(window, step_lr=1e-5)
        else:
            for i, b in enumerate(window):
                engine.forward_backward(b, num_items_in_batch=n_items, step_lr=1e-5 if i == A - 1 else None)
        torch.cuda.synchronize()

    out = {}
    for layer_major in (False, True):
        step(layer_major)  # warm-up
        times = []
        for _ in range(max(1, a.steps - 1)):
            t0 = time.perf_counter()
            step(layer_major)
            times.append(time.perf_counter() - t0)
        last = engine.telemetry()["last_step"]
        tf = flops / median(times) / 1e12
        name = "layer-major" if layer_major else "micro-batch-major"
        print(f"accumulation {A}, {name}: step {median(times):.2f}s, {tf:.1f} TFLOPS, loads/layer "
              f"{last['loads_per_layer']:g}, tokens/fetch {last['tokens_per_weight_fetch']:.0f}, boundary "
              f"{last.get('boundary_bytes')}, plan {engine.last_window_plan.reason if layer_major else '-'}")
        out[layer_major] = (tf, last["loads_per_layer"])
    engine.close()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--vram", type=float, default=None)
    a = ap.parse_args(argv)
    print(machine())
    if not torch.cuda.is_available():
        print("no CUDA device here: nothing to check (run this on a GPU machine)")
        return 0
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    e32 = parity("fp32")
    e16 = parity("bf16")
    tflops, stall, peak, plan = throughput(a)
    acc = accumulation(a)
    result("gpu_grad_rel_err_fp32", e32, "", "<=", 1e-4)
    result("gpu_grad_rel_err_bf16", e16, "", "<=", 5e-2)
    result("gpu_tflops", tflops, "TFLOPS", ">", 0)
    result("gpu_stall_fraction", stall, "", "<=", 0.1)
    result("gpu_peak_vs_plan", peak / plan, "x", "<=", 1.3)
    result("gpu_accum8_tflops_layer_major", acc[True][0], "TFLOPS", ">=", round(acc[False][0], 1))
    result("gpu_accum8_tflops_micro_batch_major", acc[False][0], "TFLOPS", ">", 0)
    result("gpu_accum8_loads_per_layer", acc[True][1], "loads", "==", 2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
