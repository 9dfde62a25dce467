"""The first-contact sections of ``gpu_check.py`` (issues 37, 45): each returns its figures and
prints what it saw; gpu_check.py turns them into RESULT lines, section by section.

Every section also runs on the CPU device (``gpu_check.py --cpu-rehearsal``), where what it
measures has a CPU meaning (the device's memcpy for the link, the engine's own accounting for
memory); what has none (the profiler's stream idle time, CUDA's allocator) is said, not faked.

Two of them also run on CPU (``gpu_check.py --cpu-rehearsal``): delayed-stream parity and
host-buffer poisoning, on the adversarial CPU transport (engine/transport/transport.py), which lands every
copy late, runs the compute side late into freshly allocated buffers and keeps a host buffer in
flight until its release is waited for. On CUDA the same sections put sleep kernels on each
stream and NaN into every fresh buffer (late, on the compute stream) and every recycled host buffer.
"""
from __future__ import annotations

import contextlib
import copy
import os
import tempfile
import threading
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from megatrain_nb.engine import EngineConfig, StreamingEngine
from megatrain_nb.engine.transport import transport as transport_mod

SLEEP_CYCLES = 2_000_000   # ~1 ms at ~2 GHz: longer than any copy of the parity model


def small_llama(layers=4, hidden=64, vocab=512, heads=4, **kw):
    return AutoConfig.for_model("llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                                max_position_embeddings=512, tie_word_embeddings=False, **kw)


def _rel(engine, ref: dict) -> float:
    worst = 0.0
    for name, g in engine.named_gradients():
        r = ref[name].float().cpu()
        err = float((g.float().cpu() - r).norm() / (r.norm() + 1e-12))
        worst = max(worst, err if err == err else float("inf"))
    return worst


@contextlib.contextmanager
def delayed_cuda_streams(cycles: int = SLEEP_CYCLES):
    """Every CudaTransport copy starts behind a sleep kernel on its stream; every fresh device
    buffer (``device_empty``) is filled with NaN on the compute stream behind a sleep (its last
    owner's kernels, late); every released host buffer is filled with NaN once the compute has
    passed its release point. A missing stream wait then shows as NaN or a wrong gradient."""
    T = transport_mod.CudaTransport
    saved = {k: getattr(T, k) for k in ("copy_in", "copy_out", "device_empty", "release")}

    def copy_in(self, unit, src, dst, **kw):
        with torch.cuda.stream(self.h2d):
            torch.cuda._sleep(cycles)
        return saved["copy_in"](self, unit, src, dst, **kw)

    def copy_out(self, unit, src, dst, **kw):
        with torch.cuda.stream(self.d2h):
            torch.cuda._sleep(cycles)
        return saved["copy_out"](self, unit, src, dst, **kw)

    def device_empty(self, shape, dtype):
        t = saved["device_empty"](self, shape, dtype)
        torch.cuda._sleep(cycles)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    def release(self, dst):
        h = saved["release"](self, dst)
        if not dst.is_cuda and dst.is_floating_point():
            h.result()
            dst.fill_(float("nan"))
        return h

    for k, f in (("copy_in", copy_in), ("copy_out", copy_out), ("device_empty", device_empty), ("release", release)):
        setattr(T, k, f)
    try:
        yield
    finally:
        for k, f in saved.items():
            setattr(T, k, f)


@contextlib.contextmanager
def _env(name, value):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def tier_parity(device: str = "cpu", *, hidden=64, seq=16, tiers=("device", "host", "disk")) -> dict:
    """Gradients of a 3-micro-batch window (checkpoint_interval=2) with the boundary
    activations on each tier, under delayed streams (CPU: the adversarial transport; CUDA:
    sleep kernels and NaN), against the plain run (device tier, no delays) and HF autograd.
    Two windows per engine (the second reuses the first's recycled buffers). Returns
    {tier: worst relative error vs the plain run, "hf": the plain run vs HF autograd,
    "poisoned": buffers the adversary poisoned, "late": late compute writes}."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(small_llama(hidden=hidden)).eval()
    w = [torch.randint(1, 512, (2, seq)) for _ in range(3)]
    ref = copy.deepcopy(model).to(device)
    ids = torch.cat(w).to(device)
    ref(input_ids=ids, labels=ids).loss.backward()
    hf = {n: p.grad for n, p in ref.named_parameters()}
    cfg = dict(device=device, precision="fp32", checkpoint_interval=2)
    out = {"poisoned": 0, "late": 0}
    with _env(transport_mod.ADVERSARIAL_ENV, "0"):
        plain = StreamingEngine(copy.deepcopy(model), EngineConfig(**cfg))
        plain.forward_backward(w)
        base = {n: g.clone() for n, g in plain.named_gradients()}
        out["hf"] = _rel(plain, hf)
        plain.close()
    delays = delayed_cuda_streams() if device != "cpu" else _env(transport_mod.ADVERSARIAL_ENV, "1")
    with delays, tempfile.TemporaryDirectory() as d:
        for tier in tiers:
            e = StreamingEngine(copy.deepcopy(model), EngineConfig(window_tier=tier, offload_dir=os.path.join(d, tier),
                                                                   **cfg))
            try:
                worst = 0.0
                for _ in range(2):
                    e.zero_grad()
                    e.forward_backward(w)
                    got = e.last_window_plan.tier
                    assert got == tier, f"the window ran on the {got} tier, not {tier}"
                    worst = max(worst, _rel(e, base))
                out[tier] = worst
                t = e.pager.transport
                t = getattr(t, "inner", t)
                out["poisoned"] += getattr(t, "poisoned", 0)
                out["late"] += getattr(t, "late_writes", 0)
            except Exception as err:  # noqa: BLE001 - a race the delays exposed is a failed section
                print(f"tier {tier}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
                out[tier] = float("inf")
            finally:
                e.close()
    print("delayed-stream parity (" + device + "): " + ", ".join(f"{k} {v:.2e}" if isinstance(v, float) else f"{k} {v}"
                                                              for k, v in out.items()))
    return out


def host_poisoning() -> dict:
    """The adversary at work on CPU: a host buffer written before the transfer that read it is
    waited for is caught; a fresh buffer copied into without ordering after the compute is
    overwritten. Returns {"caught": 2 when both were, "clean": 1 when the ordered uses pass}."""
    from megatrain_nb.engine.transport.transport import CpuTransport, TransportError, all_of

    t = CpuTransport(adversarial=True)
    caught = clean = 0
    h = torch.arange(64, dtype=torch.float32)
    t.copy_in(None, h, t.device_empty((64,), torch.float32), after=t.record()).wait()
    last = t.release(h)
    h.copy_(torch.ones(64))   # reused before the release handle was waited for
    try:
        t.copy_in(None, h, t.device_empty((64,), torch.float32))
    except TransportError:
        caught += 1
    out = t.device_empty((64,), torch.float32)
    t.copy_in(None, torch.ones(64), out).wait()   # not ordered after the compute
    caught += int(torch.isnan(out).all())
    last.result()
    ok = t.device_empty((64,), torch.float32)
    t.copy_in(None, h, ok, after=all_of(last, t.record())).wait()
    clean = int(torch.equal(ok, torch.ones(64)))
    t.close()
    print(f"host-buffer poisoning (cpu): caught {caught}/2, ordered uses clean {clean}/1")
    return {"caught": caught, "clean": clean}


# ---------------------------------------------------------------------------------- CUDA only
def thread_cpu_seconds() -> dict:
    """CPU seconds of each live thread of this process, by its name (Linux /proc)."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for t in threading.enumerate():
        tid = getattr(t, "native_id", None)
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[t.name] = out.get(t.name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            continue
    return out


def compute_idle_fraction(prof) -> tuple:
    """(idle fraction of the busiest stream = the compute stream, between its first and last
    kernel; the HtoD copies' busy microseconds, pageable HtoD copies, their microseconds) from a
    ``torch.profiler`` run with CUDA activity. (Pageable copies are expected: the step's input
    ids and labels come from pageable memory; what matters is their share of the copy time.)"""
    by_stream, h2d_us, pageable, pageable_us = {}, 0.0, 0, 0.0
    for ev in prof.profiler.kineto_results.events():
        if ev.device_type() != torch.autograd.DeviceType.CUDA:
            continue
        start, dur, name = ev.start_ns() / 1e3, ev.duration_ns() / 1e3, ev.name()
        if "Memcpy HtoD" in name:
            h2d_us += dur
            if "Pageable" in name:
                pageable += 1
                pageable_us += dur
            continue
        if "Memcpy" in name or "Memset" in name:
            continue
        by_stream.setdefault(ev.device_resource_id(), []).append((start, start + dur))
    if not by_stream:
        return float("nan"), h2d_us, pageable, pageable_us
    spans = max(by_stream.values(), key=lambda s: sum(b - a for a, b in s))
    spans.sort()
    busy, end = 0.0, spans[0][0]
    for a, b in spans:
        if b > end:
            busy += b - max(a, end)
            end = b
    total = spans[-1][1] - spans[0][0]
    return 1.0 - busy / total if total > 0 else float("nan"), h2d_us, pageable, pageable_us


def raw_pinned_h2d_gbps(nbytes: int = 1 << 30) -> float:
    """A plain pinned host->device copy's rate (the link, as this process sees it)."""
    return _h2d_gbps(torch.empty(nbytes // 4, dtype=torch.float32, pin_memory=True))


def resident_step_seconds(cfg, batch: int, seq: int, steps: int = 3) -> float:
    """The same model fully resident on the GPU (fp32 master, bf16 autocast, fused AdamW)."""
    model = AutoModelForCausalLM.from_config(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device="cuda")
    times = []
    for i in range(steps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    del model, opt
    torch.cuda.empty_cache()
    return sorted(times)[len(times) // 2]


def dropout_parity(device: str = "cuda") -> float:
    """Train mode, attention and hidden dropout, checkpoint_interval=2 (recompute replays the
    RNG) on ``device``: the engine's gradients against HF's from the same seed."""
    cfg = AutoConfig.for_model("gpt2", vocab_size=512, n_embd=128, n_layer=4, n_head=4, n_positions=256,
                               resid_pdrop=0.2, embd_pdrop=0.2, attn_pdrop=0.2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).train()
    ids = torch.randint(0, 512, (2, 64))
    ref = copy.deepcopy(model).to(device)
    torch.manual_seed(123)
    torch.cuda.manual_seed_all(123)
    ref(input_ids=ids.to(device), labels=ids.to(device)).loss.backward()
    hf = {n: p.grad for n, p in ref.named_parameters()}
    engine = StreamingEngine(model, EngineConfig(device=device, precision="fp32", checkpoint_interval=2))
    torch.manual_seed(123)
    torch.cuda.manual_seed_all(123)
    engine.forward_backward(ids)
    err = _rel(engine, hf)
    engine.close()
    print(f"dropout/RNG parity (train mode, interval 2): worst relative grad error {err:.2e}")
    return err


def machine_rates(device: str, model=None, quick: bool = False) -> tuple:
    """mt.measure_machine on ``device``, measured now (refresh), into a private cache folder:
    (rates, wall seconds, the names of rates that are not positive finite numbers)."""
    import megatrain_nb as mt
    from megatrain_nb.engine.measure import check_finite

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-check-rates-") as cache, _env("MEGATRAIN_NB_CACHE", cache):
        rates = mt.measure_machine(device=device, refresh=True, model=model, quick=quick)
    took = time.perf_counter() - t0
    print(rates)
    return rates, took, check_finite(rates)


def _h2d_gbps(src) -> float:
    """GB/s of three non-blocking copies of host ``src`` to the device (after one to warm up)."""
    dst = torch.empty_like(src, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    b.record()
    b.synchronize()
    return 3 * src.numel() * src.element_size() / (a.elapsed_time(b) / 1e3) / 1e9


def registered_pinned(nbytes: int = 600 << 20) -> dict:
    """A buffer of ``pinned.pinned_empty`` (``cudaHostRegister``, exact size; 600 MiB would be a
    1 GiB block of the caching host allocator): pinned (``is_pinned``), registered in whole pages,
    the caching host allocator's reserved bytes unchanged, a non-blocking round trip exact, its
    host->device rate against a caching-allocator block's, unregistered once dropped."""
    import gc

    from megatrain_nb.engine.transport import pinned

    def reserved():
        try:
            stats = torch.cuda.host_memory_stats()   # (the caching host allocator's blocks, cached ones too)
            return stats.get("allocated_bytes.current", stats.get("reserved_bytes.current", -1))
        except Exception:  # noqa: BLE001 - a build without host stats: unknown
            return -1
    exact = pinned.exact_pinned()
    gc.collect()   # (earlier sections' buffers unregistered now, not inside the count below)
    before, live = reserved(), dict(pinned.registered)
    t = pinned.pinned_empty(nbytes // 4)
    grew = reserved() - before if before >= 0 else -1
    regs = pinned.registered["bytes"] - live["bytes"]
    t.copy_(torch.arange(t.numel(), dtype=torch.float32))
    dev = t.to("cuda", non_blocking=True)
    back = torch.empty_like(t)
    back.copy_(dev, non_blocking=True)
    torch.cuda.synchronize()
    out = dict(exact=exact, is_pinned=t.is_pinned(), registered=regs, host_alloc_grew=grew,
               roundtrip=bool(torch.equal(back, t)), gbps=_h2d_gbps(t), raw_gbps=raw_pinned_h2d_gbps(nbytes))
    del t, dev, back
    gc.collect()
    out["left_registered"] = pinned.registered["buffers"] - live["buffers"]
    print("registered pinned buffer:", out)
    return out


# ---------------------------------------------------------------------------------- the CPU side
def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def adamw_params_per_s(numel: int = 1 << 24, steps: int = 3) -> float:
    """Parameters/s of PyTorch's fused CPU AdamW (the engine's update kernel) on one ``numel``
    tensor, on this process's torch threads, after one step to warm up."""
    p = torch.nn.Parameter(torch.randn(numel))
    p.grad = torch.randn(numel)
    opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
    opt.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.step()
    return steps * numel / (time.perf_counter() - t0)


def link_gbps(device: str, nbytes: int) -> dict:
    """Host->device and device->host GB/s at ``nbytes``: from a registered pinned buffer
    (``pinned.pinned_empty``) and a pageable one on CUDA; on a CPU device the memcpy (its link)."""
    from megatrain_nb.engine.transport import pinned

    n = nbytes // 4
    out = {}
    kinds = (("pinned", pinned.pinned_empty(n)), ("pageable", torch.empty(n))) if device.startswith("cuda") \
        else (("memcpy", torch.empty(n)),)
    dev = torch.empty(n, device=device)
    for kind, host in kinds:
        host.fill_(1.0)
        for name, fn in (("h2d", lambda: dev.copy_(host, non_blocking=True)),
                         ("d2h", lambda: host.copy_(dev, non_blocking=True))):
            fn()
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(3):
                fn()
            _sync(device)
            out[f"{name}_{kind}"] = 3 * nbytes / (time.perf_counter() - t0) / 1e9
    return out


def llama_units(cfg) -> list:
    """The engine's units of a model of ``cfg``, built on the meta device (nothing allocated)."""
    from megatrain_nb.engine.units import build_units, find_layer_list

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return build_units(model, find_layer_list(model)[2])


def pinned_per_param_7b_bf16() -> tuple:
    """(pinned bytes per parameter, the layout) of Llama-2-7B's units in bf16 compute on the RAM
    tier, by the engine's accounting (host_store.pinned_layout: shadows + gradient landing)."""
    from megatrain_nb.engine.config import EngineConfig as Cfg
    from megatrain_nb.engine.tiers.host_store import pinned_layout

    cfg = AutoConfig.for_model("llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                               num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                               tie_word_embeddings=False)
    units = llama_units(cfg)
    n = sum(u.numel for u in units)
    layout = pinned_layout([u.numel for u in units], compute_bytes=2,
                           grads_in_flight=Cfg(device="cpu").overrides.inflight_depth)
    return layout["total"] / n, layout, n


def engine_pinned(engine) -> dict:
    """What ``engine`` pins now, by its parts' own counts: the host store's load sources, the
    transport's pool (gradient landing, window activations, the cast buffer), the disk tier's
    staging buffers when pinned; and its layout on paper (host_store.pinned_layout)."""
    from megatrain_nb.engine.tiers.host_store import pinned_layout

    store = engine.store.pinned_bytes()
    pool = engine.transport.pinned.total_held() if getattr(engine.transport.pinned, "pin", False) else 0
    on_disk = engine.plan.placement["master_weights"] == "disk"
    # (the disk tier's compute staging buffers, where pinned: fp32 compute, or its bf16 copy)
    staging = engine.weights.pinned_bytes() if on_disk else 0
    plan = pinned_layout([u.numel for u in engine.state_units],
                         compute_bytes=torch.empty((), dtype=engine.config.compute_dtype).element_size(),
                         grads_in_flight=engine.config.overrides.inflight_depth, params_on_disk=on_disk,
                         held_units=getattr(engine.weights, "held_units", 0) if on_disk else 0)
    return {"store": store["weights"] + store["grads"], "pool": pool, "staging": staging,
            "total": store["weights"] + store["grads"] + pool + staging, "plan": plan}


def cpu_side(device: str, quick: bool) -> dict:
    """The CPU side of a step: the fused AdamW's parameters/s, the link's GB/s both ways, pinned
    bytes per parameter of a 7B in bf16 by the engine's accounting."""
    numel = 1 << (20 if quick else 24)
    out = {"adamw_params_per_s": adamw_params_per_s(numel), "threads": torch.get_num_threads()}
    out.update(link_gbps(device, (16 << 20) if quick else (512 << 20)))
    out["pinned_per_param_7b_bf16"], layout, n = pinned_per_param_7b_bf16()
    print(f"cpu side ({device}): fused AdamW {out['adamw_params_per_s'] / 1e6:.0f} M params/s on "
          f"{out['threads']} threads; link " + ", ".join(f"{k} {v:.1f} GB/s" for k, v in out.items() if "_" in k
                                                       and k.startswith(("h2d", "d2h"))))
    print(f"pinned for a 7B ({n / 1e9:.2f}B params) in bf16: " + ", ".join(f"{k} {v / 2**30:.2f} GiB"
                                                                           for k, v in layout.items()))
    return out


@contextlib.contextmanager
def fake_registration():
    """pinned.py's CUDA branch on a machine without CUDA (the rehearsal): a cudart whose
    register/unregister only count, so registration, MADV_DONTFORK and the finalizers run."""
    from megatrain_nb.engine.transport import pinned

    class Rt:
        def __init__(self):
            self.live = {}

        def cudaHostRegister(self, ptr, size, flags):
            self.live[ptr] = size
            return 0

        def cudaHostUnregister(self, ptr):
            self.live.pop(ptr)
            return 0

        def cudaGetLastError(self):   # (the runtime's, which pinned opens through ctypes)
            return 0

    rt, saved = Rt(), (pinned._cudart, pinned._cuda_present, pinned._runtime_library, dict(pinned._state))
    pinned._cudart, pinned._cuda_present, pinned._runtime_library = (lambda: rt), (lambda: True), (lambda: rt)
    pinned.reset_for_tests(None)
    try:
        yield rt
    finally:
        pinned._cudart, pinned._cuda_present, pinned._runtime_library = saved[:3]
        pinned._state.update(saved[3])


def registered_rehearsal() -> dict:
    """registered_pinned's bookkeeping on the CPU (fake cudart): exact pages, not inherited by
    forks (VmFlags "dc"), every registration paired with its unregistration once dropped."""
    import gc

    from megatrain_nb.engine.transport import pinned

    with fake_registration() as rt:
        t = pinned.pinned_empty(3000)
        exact = list(rt.live.values()) == [12288]
        dontfork = False
        try:
            with open("/proc/self/smaps") as f:
                text = f.read()
            ptr, inside = t.data_ptr(), False
            for line in text.splitlines():
                head = line.split()[0] if line.split() else ""
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= ptr < hi
                elif inside and line.startswith("VmFlags:"):
                    dontfork = " dc" in line
                    break
        except OSError:
            pass
        del t
        gc.collect()
        out = {"exact": exact, "dontfork": dontfork, "left_registered": len(rt.live)}
    print("registered pinned buffer (cpu, fake cudart):", out)
    return out
