"""One prepared script for a CUDA machine: correctness and throughput of the engine on the GPU.

    python benchmarks/gpu_check.py            # < 8 minutes on one H100/H200-class GPU
    python benchmarks/gpu_check.py --sanitizer-only   # section 5 alone (about 1-3 minutes)

1. Gradient parity on CUDA against plain PyTorch (the HF model's own forward/backward), fp32
   (TF32 off) and bf16 compute (fp32 master and gradients).
2. Throughput: a ~1B Llama-style model streamed through the GPU; TFLOPS counted as
   6 * params * real tokens + attention (12 * layers * hidden * seq * tokens), from timed steps.
3. Stall fraction (compute waiting for weights) and peak device memory against the plan.
4. Accumulation 8, layer-major (one forward_backward of the 8-micro-batch window per step):
   TFLOPS, loads per layer per step (2) and tokens per weight fetch, against the same window
   run micro-batch by micro-batch.
5. The streams' synchronisation under PyTorch's CUDA stream sanitizer (``TORCH_CUDA_SANITIZER=1``,
   in a subprocess, bounded): a small model, single-batch steps with and without clipping, a
   layer-major window (boundary activations on the device, then in host RAM), an evaluation;
   every kernel launch is checked against the events the engine records and waits on. The
   sanitizer's dispatch mode is per thread, so the child enters it in the engine's worker
   threads too (the copies, the gathers and the gradient return run there).
Ends with RESULT lines.
"""
from __future__ import annotations

import argparse
import copy
import os
import subprocess
import tempfile
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


SANITIZER_TIMEOUT_S = 150   # (the whole script stays under 8 minutes)
SANITIZER_STEPS = 10   # what sanitizer_child runs: 3 single batches, 3 windows, 1 evaluation, 3 disk-tier steps


def _sanitize_worker_threads() -> None:
    """CSAN's dispatch mode is thread-local: enter it in every worker thread the engine starts
    (each ThreadPoolExecutor gets an initializer that does), so their copies are checked too."""
    import concurrent.futures
    from torch.cuda._sanitizer import cuda_sanitizer

    base = concurrent.futures.ThreadPoolExecutor.__init__

    def init(self, max_workers=None, thread_name_prefix="", initializer=None, initargs=()):
        def start(*a):
            cuda_sanitizer.dispatch.__enter__()
            if initializer is not None:
                initializer(*a)
        base(self, max_workers, thread_name_prefix, start, initargs)
    concurrent.futures.ThreadPoolExecutor.__init__ = init


def sanitizer_child(device: str = "cuda") -> int:
    """Run under TORCH_CUDA_SANITIZER=1: a few steps of the streaming engine; prints one
    ``SANITIZER steps=N error=...`` line (data races themselves go to stderr, one report each)."""
    from torch.cuda._sanitizer import cuda_sanitizer

    if device == "cuda":   # (device "cpu": a dry run of this script's plumbing, without CUDA)
        assert cuda_sanitizer.enabled, "TORCH_CUDA_SANITIZER=1 was not set"
        _sanitize_worker_threads()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(llama(4, 128, vocab=512, heads=4))
    done, err = 0, ""
    try:
        engine = StreamingEngine(copy.deepcopy(model), EngineConfig(device=device, precision="bf16"))
        ids = torch.randint(0, 512, (2, 64))
        for lr, clip in ((1e-4, None), (None, None), (1e-4, 1.0)):
            out = engine.forward_backward(ids, step_lr=lr, max_grad_norm=clip)
            assert out.loss == out.loss, "NaN loss"
            done += 1
        out = engine.forward_backward([ids, ids.flip(1)], step_lr=1e-4)
        done += 1
        # the boundary activations in host RAM (copies out and back in), block recompute
        host = StreamingEngine(copy.deepcopy(model), EngineConfig(device=device, precision="bf16",
                                                                  window_tier="host", checkpoint_interval=2))
        host.forward_backward([ids, ids.flip(1)], step_lr=1e-4, max_grad_norm=1.0)
        host.forward_backward([ids, ids.flip(1)], step_lr=1e-4)
        done += 2
        engine.evaluate(ids)
        if device == "cuda":
            torch.cuda.synchronize()
        done += 1
        # master weights on the disk tier, no host cache: the pinned staging buffers, a clipped
        # step's held backward reads (the compute stream grown) and fresh copies, then unclipped
        with tempfile.TemporaryDirectory() as d:
            disk = StreamingEngine(copy.deepcopy(model), EngineConfig(device=device, precision="bf16", offload_dir=d,
                                                                      offload_params=True, host_cache_gb=0))
            for clip in (1.0, 1.0, None):
                disk.forward_backward(ids, step_lr=1e-4, max_grad_norm=clip)
                done += 1
            if device == "cuda":
                torch.cuda.synchronize()
            disk.close()
        for e in (engine, host):
            e.close()
    except Exception as e:  # noqa: BLE001 - reported to the parent
        err = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    print(f"SANITIZER steps={done} error={err!r}", flush=True)
    return 0


def sanitizer() -> tuple:
    """(steps done, data races reported, seconds) of :func:`sanitizer_child` in a subprocess."""
    env = dict(os.environ, TORCH_CUDA_SANITIZER="1")
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, __file__, "--sanitizer-child"], env=env, capture_output=True,
                           text=True, timeout=SANITIZER_TIMEOUT_S)
        out, errout = p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        errout = (e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")) + "\n(timed out)"
    dt = time.perf_counter() - t0
    races = errout.count("CSAN detected a possible data race")
    line = next((ln for ln in out.splitlines() if ln.startswith("SANITIZER ")), "SANITIZER steps=0 error='no report'")
    steps = int(line.split()[1].split("=")[1])
    print(f"sanitizer: {line[len('SANITIZER '):]}, {races} data race report(s), {dt:.0f}s")
    if races or steps < SANITIZER_STEPS:
        print("sanitizer stderr (last 4000 characters):\n" + errout[-4000:])
    return steps, races, dt


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--vram", type=float, default=None)
    ap.add_argument("--sanitizer-only", action="store_true", help="section 5 alone")
    ap.add_argument("--sanitizer-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-device", default="cuda", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.sanitizer_child:
        return sanitizer_child(a.child_device)
    print(machine())
    if not torch.cuda.is_available():
        print("no CUDA device here: nothing to check (run this on a GPU machine)")
        return 0
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    if a.sanitizer_only:
        steps, races, _ = sanitizer()
        result("gpu_sanitizer_steps", steps, "steps", "==", SANITIZER_STEPS)
        result("gpu_sanitizer_races", races, "reports", "==", 0)
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    e32 = parity("fp32")
    e16 = parity("bf16")
    tflops, stall, peak, plan = throughput(a)
    acc = accumulation(a)
    steps, races, _ = sanitizer()
    result("gpu_grad_rel_err_fp32", e32, "", "<=", 1e-4)
    result("gpu_grad_rel_err_bf16", e16, "", "<=", 5e-2)
    result("gpu_tflops", tflops, "TFLOPS", ">", 0)
    result("gpu_stall_fraction", stall, "", "<=", 0.1)
    result("gpu_peak_vs_plan", peak / plan, "x", "<=", 1.3)
    result("gpu_accum8_tflops_layer_major", acc[True][0], "TFLOPS", ">=", round(acc[False][0], 1))
    result("gpu_accum8_tflops_micro_batch_major", acc[False][0], "TFLOPS", ">", 0)
    result("gpu_accum8_loads_per_layer", acc[True][1], "loads", "==", 2)
    result("gpu_sanitizer_steps", steps, "steps", "==", SANITIZER_STEPS)
    result("gpu_sanitizer_races", races, "reports", "==", 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
