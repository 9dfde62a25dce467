"""Layer-major accumulation against the micro-batch-major path: loads per layer per step, host
peak RSS, step time, and the estimator's host RAM for llama-100b (batch 1 x accumulation 128).

    python benchmarks/bench_accumulation.py          # ~3 minutes on 2 quiet cores

Each (path, accumulation) runs in its own process, so its peak RSS is its own. Step times come
from one more process per A that runs both paths alternated, ``--reps`` steps each after a
warm-up (a step's updates included). The same micro-batch is used for every A; accumulation
A = 1, 4, 16. Ends with RESULT lines.

Host RAM: ``accum_rss_saved`` is the raw difference of the steps' peak RSS. On this CPU
"device" the device tier is RAM too: a layer-major window's per-unit gradient sums and
boundary activations live there, where a GPU would hold them in device memory. So
``accum_host_saved`` adds back the difference of the engine-accounted device-tier peaks
(``memory_report()["device"]["peak_bytes"]``: weights slots, activations, boundary
activations, gradient sums): the RAM saved that would remain a host saving on a GPU.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import hwm_bytes, machine, median, reset_peak_rss, result  # noqa: E402


def _engine_and_step(a, path: str):
    """A fresh engine on the bench's model (seed 0) and a function running one optimizer step
    of ``a.accumulation`` micro-batches on ``path``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatrain_nb.engine import EngineConfig, StreamingEngine

    cfg = AutoConfig.for_model("llama", vocab_size=a.vocab, hidden_size=a.hidden,
                               intermediate_size=int(a.hidden * 8 / 3), num_hidden_layers=a.layers,
                               num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=2048)
    torch.manual_seed(0)
    engine = StreamingEngine(AutoModelForCausalLM.from_config(cfg), EngineConfig(device="cpu"))
    ids = torch.randint(0, a.vocab, (a.batch, a.seq))
    window = [ids] * a.accumulation
    n_items = a.accumulation * a.batch * (a.seq - 1)

    def step():
        if path == "layer_major":
            engine.forward_backward(window, step_lr=1e-4)
            return
        for i, b in enumerate(window):
            engine.forward_backward(b, num_items_in_batch=n_items,
                                    step_lr=1e-4 if i == len(window) - 1 else None)
    return engine, step


def timing(a) -> dict:
    """(child) Step times of both paths in one process, alternated rep by rep after a warm-up
    each; a step's time includes its updates (waited for), so neither path's updates run into
    the other's step."""
    runs = {p: _engine_and_step(a, p) for p in PATHS}
    for engine, step in runs.values():
        step()
        engine.updates.wait_all()
    times = {p: [] for p in PATHS}
    for rep in range(a.reps):
        for p in (PATHS if rep % 2 == 0 else PATHS[::-1]):
            engine, step = runs[p]
            t0 = time.perf_counter()
            step()
            engine.updates.wait_all()
            times[p].append(time.perf_counter() - t0)
    for engine, _ in runs.values():
        engine.close()
    return times


def child(a) -> dict:
    from common import peak_rss_bytes

    engine, step = _engine_and_step(a, a.path)

    import gc

    gc.collect()
    steps_peak = reset_peak_rss()   # from here: the steps' own peak (warm-up included)
    step()  # warm-up: optimizer states, buffers
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    engine.updates.wait_all()
    last = engine.telemetry()["last_step"]
    mem = engine.memory_report()
    dev = mem["device"]
    out = {"step_s": median(times), "times": times, "loads_per_layer": last["loads_per_layer"],
           "tokens_per_weight_fetch": last["tokens_per_weight_fetch"],
           "h2d_bytes": last["host_to_device_bytes"], "peak_rss": peak_rss_bytes(),
           "steps_peak_rss": hwm_bytes() if steps_peak else None,
           "host_grads": mem["host"]["grads"], "host_buffers": mem["host"]["buffers"],
           "device_peak": dev["peak_bytes"], "grad_sums": dev["grad_sums"], "params": engine.num_parameters()}
    engine.close()
    return out


PATHS = ("micro_batch_major", "layer_major")


def run_child(path, A, a, mode: str = "--child") -> dict:
    cmd = [sys.executable, __file__, mode, "--path", path, "--accumulation", str(A)]
    for k in ("layers", "hidden", "vocab", "batch", "seq", "steps", "reps"):
        cmd += [f"--{k}", str(getattr(a, k))]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise RuntimeError(p.stderr[-3000:])
    return json.loads(p.stdout.strip().splitlines()[-1])


def estimator_figures() -> None:
    """llama-100b, batch 1 x 2048 x accumulation 128, 80 GiB device, 4 TiB disk, fp32 and bf16,
    with and without clipping: the host RAM micro-batch-major ("before") and layer-major
    ("after"). Two figures each: what a 1 TiB host's plan uses (RAM it has is used for what
    fits: master weights, held gradients, boundary activations; printed), and the least host
    RAM a plan needs (``Estimate.host_min``: everything that may leave RAM on the disk tier;
    RESULT lines, target: lower than before by the accumulator)."""
    import megatrain_nb as mt

    GiB = 2 ** 30
    kw = dict(vram_gb=80, ram_gb=1024, disk_gb=4096, batch=1, seq=2048, accumulation=128)
    for prec in ("fp32", "bf16"):
        before = mt.estimate("llama-100b", layer_major=False, precision=prec, **kw)   # clipping, as the seed
        acc = before.plan.host["grads"]
        b_min = before.host_min / GiB
        print(f"llama-100b acc 128 {prec} micro-batch-major: host {before.plan.host['total'] / GiB:.1f} GiB with "
              f"1 TiB, at least {b_min:.1f} GiB (the accumulator, {acc / GiB:.1f} GiB, stays in RAM)")
        result(f"estimate_llama100b_acc128_{prec}_host_min_before", b_min, "GiB", ">", 0)
        for clip in (False, True):
            after = mt.estimate("llama-100b", clipping=clip, precision=prec, **kw)
            h = {k: round(v / GiB, 1) for k, v in after.plan.host.items()}
            print(f"llama-100b acc 128 {prec} layer-major{' + clipping' if clip else ''}: with 1 TiB host {h}, "
                  f"placement {after.plan.placement}; {after.notes[0]}"
                  + (f"; {after.notes[1]}" if clip else ""))
            tag = f"estimate_llama100b_acc128_{prec}{'_clip' if clip else ''}"
            result(f"{tag}_host_min_after", after.host_min / GiB, "GiB", "<=",
                   math.ceil((b_min - acc / GiB) * 100) / 100)   # (as printed: 2 decimals)
            result(f"{tag}_loads_per_layer", after.plan.window["loads_per_layer"], "loads", "<=", 2)
            result(f"{tag}_tokens_per_fetch", after.plan.window["tokens_per_weight_fetch"], "tokens", ">=", 12000)
        for path, lm in (("layer-major", True), ("micro-batch-major", False)):   # clipping, clip_hold "auto"
            short = mt.estimate("llama-100b", precision=prec, layer_major=lm, **dict(kw, ram_gb=512))
            print(f"llama-100b acc 128 {prec} {path} + clipping, 512 GiB host: host "
                  f"{short.plan.host['total'] / GiB:.1f} GiB, placement {short.plan.placement}, feasible {short.feasible}")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--path", default="layer_major")
    ap.add_argument("--accumulation", type=int, default=1)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--steps", type=int, default=2, help="timed steps of each memory run")
    ap.add_argument("--reps", type=int, default=6, help="alternated timed steps per path of the timing run")
    ap.add_argument("--timing", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--estimate-only", action="store_true", help="only the estimator figures")
    a = ap.parse_args(argv)
    if a.estimate_only:
        estimator_figures()
        return 0
    if a.child:
        print(json.dumps(child(a)))
        return 0
    if a.timing:
        print(json.dumps(timing(a)))
        return 0
    print(machine())
    print(f"model: llama {a.layers} layers x {a.hidden} hidden, vocab {a.vocab}; micro-batch {a.batch} x {a.seq}; "
          f"{a.steps} timed steps per case, each case in its own process")
    res = {}
    for A in (1, 4, 16):
        for path in ("micro_batch_major", "layer_major"):
            r = res[(path, A)] = run_child(path, A, a)
            print(f"A={A:>2} {path:<18} step {r['step_s']:.3f}s {[round(t, 3) for t in r['times']]}  loads/layer "
                  f"{r['loads_per_layer']:g}  tokens/fetch {r['tokens_per_weight_fetch']:g}  h2d "
                  f"{r['h2d_bytes'] / 2**20:.0f} MiB  peak RSS {r['peak_rss'] / 2**20:.0f} MiB  steps' peak RSS "
                  f"{(r['steps_peak_rss'] or 0) / 2**20:.0f} MiB  host grads "
                  f"{r['host_grads'] / 2**20:.0f} MiB", flush=True)
    acc_bytes = 4 * res[("layer_major", 1)]["params"]
    print(f"fp32 gradient accumulator of this model: {acc_bytes / 2**20:.0f} MiB")
    ratio = {}
    for A in (1, 4, 16):   # step time: both paths in one process, alternated (MEASURING.md)
        t = run_child("", A, a, mode="--timing")
        ratio[A] = median(t["layer_major"]) / median(t["micro_batch_major"])
        print(f"A={A:>2} step time, updates included, {a.reps} alternated reps: layer-major median "
              f"{median(t['layer_major']):.3f}s {[round(x, 3) for x in t['layer_major']]}, micro-batch-major "
              f"{median(t['micro_batch_major']):.3f}s {[round(x, 3) for x in t['micro_batch_major']]}", flush=True)
    MiB = 2 ** 20
    for A in (1, 4, 16):
        lm, mb = res[("layer_major", A)], res[("micro_batch_major", A)]
        target = round(acc_bytes / MiB) if A > 1 else 0
        result(f"accum_loads_per_layer_A{A}", lm["loads_per_layer"], "loads", "==", 2)
        result(f"accum_rss_saved_A{A}", (mb["peak_rss"] - lm["peak_rss"]) / MiB, "MiB", ">=", target)
        # the steps' own peak (construction left out), where the OS lets the mark be reset
        rss = ("steps_peak_rss" if lm["steps_peak_rss"] and mb["steps_peak_rss"] else "peak_rss")
        saved = mb[rss] - lm[rss]
        if rss == "steps_peak_rss":
            result(f"accum_steps_rss_saved_A{A}", saved / MiB, "MiB", ">=", target)
        dev = lm["device_peak"] - mb["device_peak"]
        print(f"A={A:>2}: RSS saved {saved / MiB:.1f} MiB; device tier (RAM here, device memory on a GPU): layer-major "
              f"peak {lm['device_peak'] / MiB:.1f} MiB (gradient sums {lm['grad_sums'] / MiB:.1f}), "
              f"micro-batch-major {mb['device_peak'] / MiB:.1f} MiB; layer-major host buffers "
              f"{lm['host_buffers'] / MiB:.1f} MiB", flush=True)
        result(f"accum_host_saved_A{A}", (saved + dev) / MiB, "MiB", ">=", target)
        result(f"accum_step_vs_micro_batch_major_A{A}", ratio[A], "x", "<=", 1.05)
    estimator_figures()
    return 0


if __name__ == "__main__":
    sys.exit(main())
