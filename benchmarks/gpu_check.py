"""One prepared script for a CUDA machine's first contact: does the engine's GPU path tell the truth?

    python benchmarks/gpu_check.py                    # < 8 minutes on one H100/H200-class GPU
    python benchmarks/gpu_check.py --quick            # < 4 minutes: smaller model, fewer steps, no sanitizer
    python benchmarks/gpu_check.py --list             # the sections
    python benchmarks/gpu_check.py --sections a,b     # only those
    python benchmarks/gpu_check.py --cpu-rehearsal    # every section on the CPU device (CI runs it)
    python benchmarks/gpu_check.py --sanitizer-only   # the sanitizer section alone (about 1-3 minutes)

It runs from a bare checkout: the checkout's root goes first on ``sys.path``, so ``megatrain_nb``
is this checkout's whether or not it is installed (torch, transformers and the few packages the
engine imports must be: a missing one is named at the start, with the pip command).

Each section is isolated: an exception prints its traceback and the next section runs; each
section's RESULT lines are printed (and flushed) as it ends, so a crash or a timeout later keeps
them. ``--fail-section NAME`` (or ``GPU_CHECK_FAIL=NAME``) makes that section raise at its start,
to check exactly that. A time budget (``--budget-s``; 450 s, 220 s with ``--quick``) skips the
sections that would start after it. The exit status is 1 when a section raised or a checked
target was missed; RESULT lines whose target is marked ``(info)`` are figures, not checks.

The sections (``--list``; gpu_sections.py holds their parts) -- every one also runs on the CPU
device under ``--cpu-rehearsal``, at tiny sizes, where it has a CPU meaning:

* parity: gradients against plain PyTorch (the HF model's own forward/backward), fp32 (TF32 off)
  and bf16 compute (fp32 master and gradients);
* delayed-streams: a 3-micro-batch window, checkpoint_interval=2, boundary activations on the
  device, host and disk tiers, with a sleep kernel ahead of every copy on the h2d and d2h
  streams, NaN written late into fresh device buffers and released host buffers: gradients equal
  the plain run's (<= 1e-6). On CPU: the adversarial transport;
* host-poisoning: the adversary catches a host buffer reused mid-transfer and a copy into a
  fresh buffer not ordered after the compute;
* cpu-side: the fused CPU AdamW's parameters/s, the link's host->device and device->host GB/s
  (registered pinned and pageable), pinned bytes per parameter of a 7B in bf16 by the engine's
  accounting (``pinned_bytes_per_param_7b_bf16``, target <= 2.2), and a bf16 engine's pinned
  bytes against that accounting;
* throughput: a ~1B Llama-style model streamed; model TFLOPS (6 x params that multiply x tokens
  + attention), the step predicted at the machine-rates section's rates against the measured;
* memory: allocated and reserved peaks against the planner's figure for the real batch; a run
  capped at that plan + 5%;
* idle-and-link: the compute stream's idle fraction (profiler) -- labelled CPU-bound, not a
  stall, when the forward waited longer for updates than for copies -- the engine's H2D rate
  against a raw pinned copy, the pageable copies' share of the copy time (the step's input ids
  and labels are pageable: their count is a figure, not a check);
* threads: CPU seconds of each engine thread per step; a copy thread near 1 s/s spins;
* accumulation: an 8-micro-batch window layer-major against micro-batch-major; loads per layer;
* dropout-rng: train mode with dropout, recompute at interval 2, against HF from the same seed;
* sanitizer: PyTorch's CUDA stream sanitizer (subprocess, bounded) over single-batch, clipped,
  windowed, evaluation and disk-tier steps (CPU: the same steps, no sanitizer);
* machine-rates: ``mt.measure_machine`` on the device, every rate positive, <= 60 s;
* registered-pinned: a ``pinned.pinned_empty`` buffer is pinned at its exact size, not inherited
  by forks, copies exactly both ways at a pinned block's rate, unregistered once dropped (CPU: a
  fake cudart, the bookkeeping);
* two-gpus (2+ GPUs): two ranks under torchrun, a sharded step each under a hang timeout.
"""
from __future__ import annotations

import argparse
import copy
import faulthandler
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _p in (str(HERE), str(ROOT)):   # the checkout first: its megatrain_nb, installed or not
    while _p in sys.path:
        sys.path.remove(_p)
    sys.path.insert(0, _p)

#: what the engine imports besides torch and transformers (import name: what pip installs)
ENGINE_NEEDS = {"xxhash": "xxhash", "psutil": "psutil", "safetensors": "safetensors", "yaml": "pyyaml",
                "numpy": "numpy"}


def missing_modules(needs=None) -> list:
    """The pip names of ``needs`` (default: the engine's, :data:`ENGINE_NEEDS`, and torch and
    transformers) that this interpreter cannot import."""
    import importlib.util

    needs = dict(ENGINE_NEEDS, torch="torch", transformers="transformers") if needs is None else needs
    def absent(mod: str) -> bool:
        try:
            return importlib.util.find_spec(mod) is None
        except (ImportError, ValueError):   # (a finder that refuses it: as good as absent)
            return True
    return [pip for mod, pip in needs.items() if absent(mod)]


_MISSING = missing_modules() if __name__ == "__main__" else []
if _MISSING:   # (said in one line, not a traceback deep in an import)
    sys.exit(f"gpu_check: this Python lacks {', '.join(_MISSING)}, which the engine imports: "
             f"pip install {' '.join(_MISSING)} (or pip install -e . in the checkout)")

import torch  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from common import machine, median  # noqa: E402
from megatrain_nb.engine import EngineConfig, StreamingEngine  # noqa: E402
from megatrain_nb.engine.telemetry import waits_by_cause  # noqa: E402

import gpu_sections as sec  # noqa: E402

FAIL_ENV = "GPU_CHECK_FAIL"


class Check:
    """The run: its device, arguments, figures sections share (``shared``), and the RESULT lines
    of the section that is running (printed as it ends)."""

    def __init__(self, a, device: str):
        self.a, self.device = a, device
        self.cuda = device.startswith("cuda")
        self.prefix = "gpu_" if self.cuda else "rehearsal_"
        self.shared: dict = {}
        self.lines: list = []
        self.missed: list = []

    def emit(self, name: str, value, unit: str, op: str, target, check: bool = True) -> None:
        """A RESULT line of this section; ``check`` False: a figure (printed "(info)")."""
        self.lines.append((self.prefix + name, float(value), unit, op, target, check))

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def flush(self) -> None:
        """Print this section's RESULT lines (flushed), noting the checked targets missed."""
        for name, value, unit, op, target, check in self.lines:
            tag = "" if check else ", info"
            print(f"RESULT {name} {value:.4g} {unit} (target {op} {target:g}{tag})", flush=True)
            if check and not _met(value, op, target):
                self.missed.append(name)
        self.lines = []


def _met(value: float, op: str, target: float) -> bool:
    if value != value:   # NaN: not measured
        return False
    return {"<=": value <= target, ">=": value >= target, "<": value < target, ">": value > target,
            "==": value == target}[op]


def llama(layers, hidden, vocab=32000, heads=16):
    # Llama's MLP width: 8/3 of the hidden, up to a multiple of 256 at a GPU's sizes (5461 for a
    # hidden of 2048 would leave the bf16 GEMMs on slower kernels: 5632)
    inter = hidden * 8 // 3
    if hidden >= 1024:
        inter = -(-inter // 256) * 256
    return AutoConfig.for_model("llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                                max_position_embeddings=4096, tie_word_embeddings=False)


def parity(c: Check, precision: str) -> float:
    torch.manual_seed(0)
    hidden, seq = (256, 128) if c.cuda else (64, 32)
    model = AutoModelForCausalLM.from_config(llama(4 if c.cuda else 2, hidden, vocab=2048, heads=4)).eval()
    ref = copy.deepcopy(model).to(c.device)
    ids = torch.randint(0, 2048, (2, seq), device=c.device)
    am = torch.ones_like(ids)
    am[1, :17] = 0
    out = ref(input_ids=ids, attention_mask=am, labels=ids.masked_fill(am == 0, -100))
    out.loss.backward()
    engine = StreamingEngine(model, EngineConfig(device=c.device, precision=precision))
    try:
        mine = engine.forward_backward(ids, attention_mask=am)
        grads = {n: p.grad.float().cpu() for n, p in ref.named_parameters()}
        worst = 0.0
        for name, g in engine.named_gradients():
            r = grads[name]
            worst = max(worst, float((g - r).norm() / (r.norm() + 1e-12)))
    finally:
        engine.close()
    print(f"parity {precision}: loss {mine.loss:.6f} vs {float(out.loss.detach()):.6f}; worst relative grad error {worst:.2e}")
    return worst


def _meta_engine(c: Check, vram=None):
    """A Llama of the run's shape built on the meta device and streamed on the device."""
    a = c.a
    cfg = llama(a.layers, a.hidden, vocab=32000 if c.cuda else 512, heads=16 if c.cuda else 4)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return cfg, StreamingEngine(model, EngineConfig(device=c.device, precision=a.precision,
                                                    max_vram_gb=a.vram if vram is None else vram))


def model_flops(cfg, engine, n: int, tokens: int, a) -> float:
    """The model's FLOPs for ``tokens`` (MFU-style): 6 x the parameters that multiply (the
    input embedding is a lookup: left out) x tokens, + attention (12 x layers x hidden x seq
    x tokens). The recompute of checkpointed layers (a second forward, 2N) is work the
    engine chooses, not the model's: left out, so the figure compares with a resident run's."""
    embed = cfg.vocab_size * cfg.hidden_size if not getattr(cfg, "tie_word_embeddings", False) else 0
    return 6 * (n - embed) * tokens + 12 * a.layers * a.hidden * a.seq * tokens


def real_plan(engine, cfg, a):
    """The planner's device figure for the workload this script runs: ``batch`` x ``seq``
    tokens, one micro-batch, gradients leaving unit by unit (not the engine's own plan, which
    is made for batch 1 x seq 1 before any batch is known)."""
    from megatrain_nb.engine.planning.planner import ModelShape, UnitSpec, Workload, make_plan

    specs = [UnitSpec(u.name, u.numel, u.kind, u.tied_output) for u in engine.units]
    return make_plan(specs, ModelShape.of(cfg), engine.config, cuda=engine.device.type == "cuda",
                     workload=Workload(batch=a.batch, seq=a.seq, gradients="held", clipped=False))


def predicted_step(engine, a, rates):
    """``engine.prediction`` for the timed workload (batch x seq, one micro-batch, no clipping:
    ``forward_backward(step_lr=...)``) at the rates measured in this run, or None without rates."""
    from megatrain_nb.engine.planning.planner import Workload
    from megatrain_nb.engine.planning.prediction_check import engine_prediction

    if rates is None:
        return None
    return engine_prediction(engine, Workload(batch=a.batch, seq=a.seq, accumulation=1, gradients="none",
                                              clipped=False), rates)


def _timed(c: Check, engine, ids) -> list:
    times = []
    for _ in range(c.a.steps):
        t0 = time.perf_counter()
        engine.forward_backward(ids, step_lr=1e-5)
        c.sync()
        times.append(time.perf_counter() - t0)
    return times


def throughput(c: Check) -> dict:
    """Timed steps of the run's model: TFLOPS, memory against the plan for the real batch, CPU
    seconds per engine thread per step, the step predicted at the machine-rates section's rates;
    on CUDA one profiled step (the compute stream's idle time, the copies' rate)."""
    a = c.a
    base = _outside_the_plan(c)
    cfg, engine = _meta_engine(c)
    try:
        n = engine.num_parameters()
        ids = torch.randint(0, cfg.vocab_size, (a.batch, a.seq))
        flops = model_flops(cfg, engine, n, ids.numel(), a)
        engine.forward_backward(ids, step_lr=1e-5)  # warm-up (creates optimizer states)
        c.sync()
        if c.cuda:
            torch.cuda.reset_peak_memory_stats()
            free0, total = torch.cuda.mem_get_info()
        engine.counters.reset()
        cpu0 = sec.thread_cpu_seconds()
        times = _timed(c, engine, ids)
        cpu1 = sec.thread_cpu_seconds()
        tel = engine.telemetry()
        step = median(times)
        out = {"tflops": flops / step / 1e12, "step": step, "total": sum(times), "tel": tel, "n": n,
               "threads": {k: (v - cpu0.get(k, 0.0)) / sum(times) for k, v in cpu1.items() if k.startswith("mtnb-")},
               "plan": real_plan(engine, cfg, a).device["total"], "engine_plan": engine.plan.device["total"],
               "device_peak": engine.memory_report()["device"]["peak_bytes"]}
        if c.cuda:
            out["mem"] = {"allocated": torch.cuda.max_memory_allocated() - base[0],
                          "reserved": torch.cuda.max_memory_reserved() - base[1],
                          "used": total - min(free0, torch.cuda.mem_get_info()[0])}
        print(f"throughput: {n / 1e9:.3f}B params, batch {a.batch}x{a.seq}, {a.precision}: step {step:.3f}s "
              f"{[round(t, 3) for t in times]}, {out['tflops']:.2f} TFLOPS")
        # (each part below on its own: a failure prints its traceback and leaves the timed figures
        # to the sections that read them)
        pred = _guarded("the prediction", lambda: predicted_step(engine, a, c.shared.get("rates")))
        out["predicted"] = pred.step_seconds if pred is not None else float("nan")
        out["bottleneck"] = pred.bottleneck if pred is not None else ""
        if pred is not None:
            print(f"prediction at the measured rates: {pred}")
        out["pinned"] = _guarded("the pinned bytes", lambda: sec.engine_pinned(engine)) or {}
        if c.cuda:
            out.update(_guarded("the profiled step", lambda: _profiled_step(engine, ids, a)) or {})
        return out
    finally:
        engine.close()


def _outside_the_plan(c: Check) -> tuple:
    """(allocated, reserved) device bytes before the engine, with cuBLAS's workspaces made: one per
    thread that multiplies (this one's, autograd's backward thread's), in fp32 and in the compute
    dtype. They stay allocated, outside any plan (memory.DEVICE_HEADROOM_BYTES), and are not the
    engine's peak against its plan. (0, 0) on a CPU device."""
    if not c.cuda:
        return 0, 0
    for dtype in {torch.float32, torch.bfloat16 if c.a.precision == "bf16" else torch.float32}:
        x = torch.randn(64, 64, device=c.device, dtype=dtype, requires_grad=True)
        (x @ x).sum().backward()   # (the backward's matmuls on autograd's thread)
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()


def _guarded(what: str, fn):
    """``fn()``, or None with its traceback printed."""
    try:
        return fn()
    except Exception:  # noqa: BLE001 - said, and the section goes on
        print(f"throughput: {what} failed:")
        traceback.print_exc(file=sys.stdout)
        return None


def _profiled_step(engine, ids, a) -> dict:
    """One step under the CUDA profiler: the compute stream's idle fraction, the engine's H2D rate
    over its copies' busy time, the pageable copies (the inputs') and their share of that time."""
    from torch.profiler import ProfilerActivity, profile

    h2d0 = engine.telemetry()["bytes"]["host_to_device"]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.forward_backward(ids, step_lr=1e-5)
        torch.cuda.synchronize()
    # (telemetry counts 4 bytes a parameter; a bf16 load moves 2)
    moved = (engine.telemetry()["bytes"]["host_to_device"] - h2d0) * (2 if a.precision == "bf16" else 4) // 4
    try:
        idle, h2d_us, pageable, pageable_us = sec.compute_idle_fraction(prof)
    except Exception as e:  # noqa: BLE001 - a profiler API that moved: said, the section goes on
        print(f"profiler: {type(e).__name__}: {e}")
        idle, h2d_us, pageable, pageable_us = float("nan"), 0.0, -1, 0.0
    out = {"idle": idle, "h2d_gbps": moved / (h2d_us / 1e6) / 1e9 if h2d_us else float("nan"),
           "pageable": pageable, "pageable_share": pageable_us / h2d_us if h2d_us else float("nan")}
    print(f"compute stream idle {idle:.3f}; engine H2D {out['h2d_gbps']:.1f} GB/s over {moved / 2**30:.2f} GiB; "
          f"pageable HtoD copies {pageable} ({out['pageable_share']:.3f} of the copy time: the inputs)")
    return out


def plan_plus_5(c: Check, plan_bytes: int) -> tuple:
    """Steps with max_vram_gb = the real batch's plan + 5%: (steps done, error, reserved peak)."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    cap = plan_bytes * 1.05 / 2**30
    done, err, engine = 0, "", None
    # the cap held by the caching allocator too (max_vram_gb only steers the plan): past it, an OOM;
    # over what it holds outside any plan already (cuBLAS's workspaces)
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    outside = _outside_the_plan(c)[1]
    torch.cuda.set_per_process_memory_fraction(min((cap * 2**30 + outside) / total, 1.0))
    try:
        cfg, engine = _meta_engine(c, vram=cap)
        ids = torch.randint(0, cfg.vocab_size, (c.a.batch, c.a.seq))
        for _ in range(2):
            engine.forward_backward(ids, step_lr=1e-5)
            torch.cuda.synchronize()
            done += 1
    except Exception as e:  # noqa: BLE001 - an OOM here is the finding
        err = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        if engine is not None:
            engine.close()
    peak = torch.cuda.max_memory_reserved()
    print(f"plan + 5% ({cap:.2f} GiB): {done} steps, reserved peak {peak / 2**30:.2f} GiB {err}")
    return done, err, peak


def accumulation(c: Check, A: int) -> dict:
    """Throughput of an A-micro-batch window: layer-major against micro-batch-major."""
    a = c.a
    cfg, engine = _meta_engine(c)
    n = engine.num_parameters()
    ids = torch.randint(0, cfg.vocab_size, (a.batch, a.seq))
    window = [ids] * A
    flops = model_flops(cfg, engine, n, A * ids.numel(), a)
    n_items = A * a.batch * (a.seq - 1)

    def step(layer_major: bool):
        if layer_major:
            engine.forward_backward(window, step_lr=1e-5)
        else:
            for i, b in enumerate(window):
                engine.forward_backward(b, num_items_in_batch=n_items, step_lr=1e-5 if i == A - 1 else None)
        c.sync()

    out = {}
    try:
        for layer_major in (False, True):
            step(layer_major)  # warm-up
            times = []
            for _ in range(max(1, a.steps - 1)):
                t0 = time.perf_counter()
                step(layer_major)
                times.append(time.perf_counter() - t0)
            last = engine.telemetry()["last_step"]
            tf = flops / median(times) / 1e12
            print(f"accumulation {A}, {'layer-major' if layer_major else 'micro-batch-major'}: step "
                  f"{median(times):.3f}s, {tf:.2f} TFLOPS, loads/layer {last['loads_per_layer']:g}")
            out[layer_major] = (tf, last["loads_per_layer"])
    finally:
        engine.close()
    return out


# ------------------------------------------------------------------------------------- sections
def s_parity(c: Check) -> None:
    if c.cuda:   # fp32 means fp32 here: TF32 off for this section, the user's settings put back
        saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        c.emit("grad_rel_err_fp32", parity(c, "fp32"), "", "<=", 1e-4)
        c.emit("grad_rel_err_bf16", parity(c, "bf16"), "", "<=", 5e-2)
    finally:
        if c.cuda:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def s_delayed_streams(c: Check) -> None:
    par = sec.tier_parity(c.device, hidden=256 if c.cuda else 64, seq=64 if c.cuda else 16)
    for t in ("device", "host", "disk"):
        c.emit(f"delayed_streams_rel_err_{t}", par[t], "", "<=", 1e-6)
    c.emit("delayed_streams_plain_vs_hf", par["hf"], "", "<=", 1e-4)
    if not c.cuda:   # the adversary did its work
        c.emit("adversary_late_writes", par["late"], "writes", ">", 0)
        c.emit("adversary_poisoned", par["poisoned"], "buffers", ">", 0)


def s_host_poisoning(c: Check) -> None:
    poi = sec.host_poisoning()   # (the CPU transport's adversary, whatever the device)
    c.emit("poisoning_caught", poi["caught"], "of 2", "==", 2)
    c.emit("poisoning_clean", poi["clean"], "of 1", "==", 1)


def s_cpu_side(c: Check) -> None:
    got = sec.cpu_side(c.device, c.a.quick or not c.cuda)
    c.emit("optimizer_adamw_params_per_s", got["adamw_params_per_s"] / 1e6, "M/s", ">", 0, check=False)
    for k in [k for k in got if k.startswith(("h2d_", "d2h_"))]:
        c.emit(f"link_{k}_gbps", got[k], "GB/s", ">", 0, check=False)
    # (a figure: 2.0 B/param of bf16 shadows + the ring of three pinned 32 MiB chunks the gradients
    # land through, 0.015 for Llama-2-7B: engine/transport/landing.py -- issue 45)
    c.emit("pinned_bytes_per_param_7b_bf16", got["pinned_per_param_7b_bf16"], "B", "<=", 2.2)
    if c.cuda:   # a bf16 engine's pinned bytes against the accounting (registered: exact pages)
        cfg = llama(4, 512, vocab=4096, heads=8)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
        engine = StreamingEngine(model, EngineConfig(device=c.device, precision="bf16"))
        try:
            engine.forward_backward(torch.randint(0, 4096, (2, 64)), step_lr=1e-5)
            got = sec.engine_pinned(engine)
        finally:
            engine.close()
        print(f"pinned by a bf16 engine: {got}")
        c.emit("pinned_bytes_vs_plan", got["total"] / max(got["plan"]["total"], 1), "x", "<=", 1.05)


def s_throughput(c: Check) -> None:
    thr = c.shared["thr"] = throughput(c)
    c.emit("tflops", thr["tflops"], "TFLOPS", ">", 0, check=False)
    c.emit("step_seconds", thr["step"], "s", ">", 0, check=False)
    print(f"predicted bottleneck: {thr['bottleneck'] or '(no rates: run machine-rates first)'}")
    c.emit("prediction_error", thr["step"] / thr["predicted"], "x", ">=", 0.8, check=False)
    p = thr["pinned"]
    print(f"pinned now: {p['total'] / 2**20:.1f} MiB (store {p['store'] / 2**20:.1f}, pool {p['pool'] / 2**20:.1f}, "
          f"staging {p['staging'] / 2**20:.1f}); accounting {p['plan']['total'] / 2**20:.1f} MiB")


def _raw_h2d(c: Check) -> float:
    """A raw pinned host->device copy's GB/s, measured once per run."""
    if "raw_h2d" not in c.shared:
        c.shared["raw_h2d"] = sec.raw_pinned_h2d_gbps()
    return c.shared["raw_h2d"]


def _thr(c: Check) -> dict:
    if "thr" not in c.shared:
        raise RuntimeError("the throughput section did not run (or failed): nothing to read")
    return c.shared["thr"]


def s_memory(c: Check) -> None:
    thr = _thr(c)
    if not c.cuda:   # the engine's own accounting against the plan for the real batch
        c.emit("device_peak_vs_plan", thr["device_peak"] / thr["plan"], "x", "<=", 1.0, check=False)
        return
    mem = thr["mem"]
    print("device (GiB): " + ", ".join(f"{k} {v / 2**30:.2f}" for k, v in mem.items())
          + f", plan {thr['plan'] / 2**30:.2f}, engine plan {thr['engine_plan'] / 2**30:.2f}")
    c.emit("allocated_peak_vs_plan", mem["allocated"] / thr["plan"], "x", "<=", 1.0)
    c.emit("reserved_peak_vs_plan", mem["reserved"] / thr["plan"], "x", "<=", 1.1)
    c.emit("plan_plus_5pct_steps", plan_plus_5(c, thr["plan"])[0], "steps", "==", 2)


def s_idle_and_link(c: Check) -> None:
    thr = _thr(c)
    # a forward's wait for its pending updates is in the "device" wait (it waits for their
    # weights): the CPU's (telemetry.waits_by_cause), not the copies'
    waits, step = waits_by_cause(thr["tel"]), thr["total"]
    on_copies = waits["device"] / step
    on_cpu = sum(waits[k] for k in ("optimizer", "optimizer_exposed", "optimizer_exposed_disk", "decode", "disk")) / step
    cpu_bound = on_cpu > on_copies
    print(f"the compute waited {on_copies:.3f} of the step for copies in, {on_cpu:.3f} for the CPU "
          f"(updates, decodes, disk){': the step is CPU-bound, not stalled on the link' if cpu_bound else ''}")
    c.emit("compute_wait_for_copies_fraction", on_copies, "", "<=", 0.1, check=c.cuda)
    c.emit("compute_wait_for_cpu_fraction", on_cpu, "", "<=", 0.1, check=False)
    if not c.cuda:
        return
    raw = _raw_h2d(c)
    name = "compute_idle_fraction_cpu_bound" if cpu_bound else "compute_idle_fraction"
    c.emit(name, thr["idle"], "", "<=", 0.1, check=not cpu_bound)
    c.emit("h2d_vs_raw_pinned", thr["h2d_gbps"] / raw, "x", ">=", 0.7)
    c.emit("pageable_h2d_copies_per_step", thr["pageable"], "copies", "<=", 4, check=False)
    c.emit("pageable_h2d_share_of_copy_time", thr["pageable_share"], "", "<=", 0.05)
    if not c.a.quick:
        resident = sec.resident_step_seconds(llama(c.a.layers, c.a.hidden), c.a.batch, c.a.seq)
        print(f"raw pinned H2D {raw:.1f} GB/s; fully resident step {resident:.2f}s vs streamed {thr['step']:.2f}s")
        c.emit("step_vs_resident", thr["step"] / resident, "x", "<=", 1.5, check=not cpu_bound)


def s_threads(c: Check) -> None:
    per = _thr(c)["threads"]
    print("engine threads, CPU s per s of step: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(per.items())))
    for name, v in sorted(per.items()):
        if name.startswith(("mtnb-h2d", "mtnb-d2h")):   # (on a CPU device the copy threads do the memcpy)
            c.emit(f"thread_cpu_{name}", v, "s/s", "<=", 0.5, check=c.cuda)


def s_accumulation(c: Check) -> None:
    acc = accumulation(c, 4 if c.a.quick or not c.cuda else 8)
    c.emit("accum_tflops_layer_major", acc[True][0], "TFLOPS", ">=", round(acc[False][0], 2), check=c.cuda)
    c.emit("accum_tflops_micro_batch_major", acc[False][0], "TFLOPS", ">", 0, check=False)
    c.emit("accum_loads_per_layer", acc[True][1], "loads", "==", 2)


def s_dropout_rng(c: Check) -> None:
    c.emit("dropout_rng_rel_err", sec.dropout_parity(c.device), "", "<=", 1e-4)


def s_sanitizer(c: Check) -> None:
    steps, races, _ = sanitizer("cuda" if c.cuda else "cpu")
    c.emit("sanitizer_steps", steps, "steps", "==", SANITIZER_STEPS)
    c.emit("sanitizer_races", races, "reports", "==", 0)


def s_machine_rates(c: Check) -> None:
    model = llama(c.a.layers, c.a.hidden) if c.cuda else sec.small_llama()
    rates, took, bad = sec.machine_rates(c.device, model=model, quick=c.a.quick or not c.cuda)
    c.shared["rates"] = rates
    c.emit("machine_rates_seconds", took, "s", "<=", 60, check=c.cuda)
    c.emit("machine_rates_not_positive", len(bad), "rates", "==", 0)
    if c.cuda:
        raw = _raw_h2d(c)
        # (--quick measures tiny copies, launch-bound: said, not checked)
        c.emit("machine_rates_h2d_pinned_vs_raw", rates.h2d_pinned / 1e9 / raw, "x", ">=", 0.8, check=not c.a.quick)


def s_registered_pinned(c: Check) -> None:
    if not c.cuda:
        reg = sec.registered_rehearsal()
        c.emit("registered_exact", int(reg["exact"]), "", "==", 1)
        c.emit("registered_not_inherited_by_forks", int(reg["dontfork"]), "", "==", 1,
               check=sys.platform.startswith("linux"))
        c.emit("registered_left_after_free", reg["left_registered"], "buffers", "==", 0)
        return
    reg = sec.registered_pinned()
    c.emit("registered_pinned_exact", int(reg["exact"] and reg["registered"] == 600 << 20), "", "==", 1)
    c.emit("registered_is_pinned", int(reg["is_pinned"]), "", "==", 1)
    c.emit("registered_host_allocator_growth", reg["host_alloc_grew"], "bytes", "==", 0,
           check=reg["host_alloc_grew"] >= 0)   # (-1: this torch keeps no host stats)
    c.emit("registered_roundtrip_exact", int(reg["roundtrip"]), "", "==", 1)
    c.emit("registered_h2d_vs_caching_block", reg["gbps"] / reg["raw_gbps"], "x", ">=", 0.9)
    c.emit("registered_left_after_free", reg["left_registered"], "buffers", "==", 0)


def s_two_gpus(c: Check) -> None:
    if not c.cuda or torch.cuda.device_count() < 2:
        print("two-gpus: needs two CUDA devices; skipped here")
        return
    ok, foreign, _ = two_gpus()
    c.emit("two_ranks_stepped", ok, "ranks", "==", 2)
    c.emit("two_ranks_foreign_contexts", foreign, "contexts", "==", 0)


#: (name, what it checks, the function) - in the order they run; printed by --list. The
#: machine-rates section runs before throughput (whose prediction uses its rates).
SECTIONS = [
    ("parity", "fp32 and bf16 gradients against the HF model on the device", s_parity),
    ("delayed-streams", "window tiers device/host/disk, interval 2, delayed streams vs the plain run", s_delayed_streams),
    ("host-poisoning", "a host buffer reused mid-transfer, a fresh buffer copied without the compute wait",
     s_host_poisoning),
    ("cpu-side", "AdamW params/s, H2D/D2H GB/s, pinned bytes per param of a 7B in bf16, vs the accounting",
     s_cpu_side),
    ("machine-rates", "mt.measure_machine on the device (<= 60 s, every rate > 0; pinned H2D vs raw)",
     s_machine_rates),
    ("throughput", "TFLOPS of a ~1B model streamed; the step against its prediction", s_throughput),
    ("memory", "allocated/reserved peaks against the plan for the real batch; plan + 5%", s_memory),
    ("idle-and-link", "compute idle (CPU-bound said as such), H2D vs a raw pinned copy, pageable share",
     s_idle_and_link),
    ("threads", "CPU seconds per engine thread per step (spinning)", s_threads),
    ("accumulation", "layer-major window vs micro-batch-major; loads per layer", s_accumulation),
    ("dropout-rng", "train-mode dropout with recompute against HF", s_dropout_rng),
    ("sanitizer", "the CUDA stream sanitizer over a few steps of every kind", s_sanitizer),
    ("registered-pinned", "cudaHostRegister'd buffer: exact, not inherited by forks, rate, unregistered",
     s_registered_pinned),
    ("two-gpus", "two ranks: one context each, a sharded step under a hang timeout (needs 2 GPUs)", s_two_gpus),
]


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


def sanitizer(device: str = "cuda", timeout: float = SANITIZER_TIMEOUT_S) -> tuple:
    """(steps done, data races reported, seconds) of :func:`sanitizer_child` in a subprocess
    (``device`` "cpu": the plumbing alone, without the sanitizer)."""
    env = dict(os.environ, TORCH_CUDA_SANITIZER="1")
    if device != "cuda":   # (any value switches it on)
        env.pop("TORCH_CUDA_SANITIZER")
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, __file__, "--sanitizer-child", "--child-device", device], env=env,
                           capture_output=True, text=True, timeout=timeout)
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


TWO_GPU_TIMEOUT_S = 150   # the whole two-rank run; the collectives' own timeout is well under it


def two_gpu_child() -> int:
    """One rank of :func:`two_gpus` (under torchrun): a sharded step, then which GPUs hold a
    context of this process (pynvml, when installed). Prints ``TWOGPU rank=R steps=N foreign=F``."""
    from megatrain_nb.engine.ranks.dist import Dist

    dist = Dist.from_env()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(llama(4, 256, vocab=2048, heads=4))
    engine = StreamingEngine(model, EngineConfig(device=str(dist.device), precision="bf16"), dist=dist)
    steps = 0
    for _ in range(2):
        engine.forward_backward(torch.randint(0, 2048, (2, 128)), step_lr=1e-4, max_grad_norm=1.0)
        steps += 1
    torch.cuda.synchronize()
    foreign = -1
    try:
        import pynvml

        pynvml.nvmlInit()
        foreign = 0
        for i in range(pynvml.nvmlDeviceGetCount()):
            if i == dist.device.index:
                continue
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            foreign += sum(p.pid == os.getpid() for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h))
    except Exception:  # noqa: BLE001 - no NVML here: the count is unknown (-1)
        pass
    print(f"TWOGPU rank={dist.rank} steps={steps} foreign={foreign}", flush=True)
    engine.close()
    return 0


def two_gpus() -> tuple:
    """(ranks that finished both steps, contexts on foreign GPUs (-1: unknown), seconds)."""
    env = dict(os.environ, MEGATRAIN_DIST_TIMEOUT_S="60", PYTHONPATH=str(ROOT))
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "megatrain_nb.torchrun", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           "--master-port=29517", __file__, "--two-gpu-child"]
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TWO_GPU_TIMEOUT_S)
        out, errout = p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        errout = "(hung: timed out)"
    lines = [ln.split() for ln in out.splitlines() if ln.startswith("TWOGPU ")]
    ok = sum(1 for ln in lines if ln[2] == "steps=2")
    foreign = [int(ln[3].split("=")[1]) for ln in lines]
    bad = -1 if not foreign or min(foreign) < 0 else sum(foreign)
    dt = time.perf_counter() - t0
    print(f"two GPUs: {ok}/2 ranks stepped, contexts on other GPUs {bad}, {dt:.0f}s")
    if ok < 2:
        print("two-GPU stderr (last 3000 characters):\n" + errout[-3000:])
    return ok, bad, dt



# --------------------------------------------------------------------------------------- runner
#: a section's seconds after which the stacks of a possible hang are printed
SECTION_HANG_S = 180.0


def run_sections(c: Check, names, fail=()) -> int:
    """Each section in turn, isolated; its RESULT lines printed as it ends. Returns the exit status."""
    t_start, failed, skipped = time.perf_counter(), [], []
    for name, what, fn in SECTIONS:
        if name not in names:
            continue
        if time.perf_counter() - t_start > c.a.budget_s:
            skipped.append(name)
            print(f"== {name}: skipped (the time budget of {c.a.budget_s:.0f} s is spent)", flush=True)
            continue
        print(f"== {name}: {what}", flush=True)
        t0 = time.perf_counter()
        # a section still running after SECTION_HANG_S prints every thread's stack (once; it runs on)
        try:
            faulthandler.dump_traceback_later(SECTION_HANG_S, exit=False, file=sys.stdout)
        except (ValueError, OSError, AttributeError):   # (a stdout without a file descriptor)
            pass
        try:
            if name in fail:
                raise RuntimeError(f"injected failure of section {name!r} ({FAIL_ENV} / --fail-section)")
            fn(c)
        except Exception:  # noqa: BLE001 - one section's failure is its own; the next runs
            failed.append(name)
            traceback.print_exc(file=sys.stdout)
            c.lines.append((f"{c.prefix}section_failed_{name.replace('-', '_')}", 1.0, "", "==", 0, True))
        finally:
            faulthandler.cancel_dump_traceback_later()
            if c.cuda:
                torch.cuda.empty_cache()
            c.flush()
            print(f"   ({name}: {time.perf_counter() - t0:.1f} s)", flush=True)
    total = time.perf_counter() - t_start
    c.emit("check_seconds", total, "s", "<=", 220 if c.a.quick else 480, check=c.cuda)
    c.flush()
    ok = not failed and not c.missed
    label = "cpu rehearsal" if not c.cuda else "gpu check"
    print(f"{label}: {'ok' if ok else 'FAILED'} in {total:.1f}s; sections failed {failed or 'none'}, targets missed "
          f"{c.missed or 'none'}" + (f", skipped {skipped}" if skipped else ""), flush=True)
    return 0 if ok else 1


def list_sections() -> int:
    for name, what, _ in SECTIONS:
        print(f"{name:18s} {what}")
    import megatrain_nb

    print(f"# megatrain_nb from {Path(megatrain_nb.__file__).resolve().parent}")
    return 0


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--vram", type=float, default=None)
    ap.add_argument("--quick", action="store_true", help="a smaller model and fewer steps (< 4 minutes on an H100)")
    ap.add_argument("--budget-s", type=float, default=None, help="skip the sections that would start after this")
    ap.add_argument("--sections", default=None, help="comma-separated section names (default: all)")
    ap.add_argument("--fail-section", default=None, help="make this section raise (checks the isolation)")
    ap.add_argument("--list", action="store_true", help="print the sections and exit")
    ap.add_argument("--cpu-rehearsal", action="store_true", help="every section on the CPU device, tiny sizes")
    ap.add_argument("--sanitizer-only", action="store_true", help="the sanitizer section alone")
    ap.add_argument("--sanitizer-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--two-gpu-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-device", default="cuda", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    cpu = a.cpu_rehearsal
    size = (2, 64, 2, 32, 2) if cpu else (8, 2048, 4, 1024, 2) if a.quick else (16, 2048, 8, 1024, 3)
    for k, v in zip(("layers", "hidden", "batch", "seq", "steps"), size):
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.budget_s is None:
        a.budget_s = 220.0 if a.quick else 450.0
    return a


def main(argv=None) -> int:
    a = _args(argv)
    if a.list:
        return list_sections()
    if a.sanitizer_child:
        return sanitizer_child(a.child_device)
    if a.two_gpu_child:
        return two_gpu_child()
    names = {n for n, _, _ in SECTIONS} if a.sections is None else set(a.sections.split(","))
    if a.sanitizer_only:
        names = {"sanitizer"}
    fail = {s for s in (a.fail_section, os.environ.get(FAIL_ENV)) if s}
    unknown = (names | fail) - {n for n, _, _ in SECTIONS}
    if unknown:
        print(f"unknown section(s) {sorted(unknown)}; --list names them")
        return 2
    if a.steps < 1:
        print(f"--steps {a.steps}: the timed sections need at least one step")
        return 2
    if a.quick and a.sections is None and not a.cpu_rehearsal and not a.sanitizer_only:
        names.discard("sanitizer")
        print("--quick: the sanitizer section is left out (--sanitizer-only runs it: 1-3 minutes)")
    print(machine(), "torch", torch.__version__, flush=True)
    if a.cpu_rehearsal:
        return run_sections(Check(a, "cpu"), names, fail)
    if not torch.cuda.is_available():
        print("no CUDA device here: nothing to check (run this on a GPU machine; --cpu-rehearsal runs it on the CPU)")
        return 0
    print(torch.cuda.get_device_name(), flush=True)
    return run_sections(Check(a, "cuda"), names, fail)


if __name__ == "__main__":
    sys.exit(main())
