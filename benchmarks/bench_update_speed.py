"""The optimizer update's speed: the compressed update chain against the plain fp32 AdamW, and
the plain CPU AdamW against DeepSpeed's ``DeepSpeedCPUAdam`` (issue 45, item 1).

    python benchmarks/bench_update_speed.py [--numel 16777216] [--rounds 5] [--threads 1]
        [--ds-numel 67108864] [--ds-threads 2] [--agree 33554432] [--no-deepspeed]

Contenders alternate round by round (this machine is shared and its speed moves within
minutes); each figure is the median over the rounds of a contender's median time, and a ratio
is the median of the rounds' ratios. What runs:

* ``update_<codec>_vs_fp32_adamw``: one unit of ``--numel`` parameters updated as the engine
  updates it with compressed states -- ``OptimizerStates.update`` (read the codes, decode, AdamW,
  encode, write the codes; the fused kernel of ``engine/updates/fused_update.py`` where it is built)
  -- in parameters/s, over torch's fused CPU AdamW (``torch._fused_adamw_``, fp32 states) on a
  unit of the same size, both on ``--threads`` threads (torch's intra-op threads; a fused chunk
  split over that many threads: ``OptimizerStates.fused_split``). The same chain on torch ops
  (``fused_update.torch_path()``, the path before the kernel: decode and encode threads beside
  AdamW) and the engine's own split (the AdamW worker and the two codec threads) are printed
  beside it.
* ``codes_differing_from_torch_path``: of ``--agree`` Adam-like moments per codec and moment,
  how many codes the kernel (IEEE square roots) and the torch path (MKL's) give differently.
* ``adamw_vs_deepspeed_cpu_adam``: the engine's plain AdamW (``UnitAdamW.fused``: the fused
  kernels' AdamW, torch's arithmetic bit for bit with one division fewer) against
  ``DeepSpeedCPUAdam`` (adamw_mode, fp32) on the same ``--ds-numel`` tensors, ``--ds-threads``
  threads each, in parameters/s. DeepSpeed is not a dependency: when it is not importable it is
  installed for this benchmark only (``pip install --no-deps --target .venv/bench-deps
  deepspeed`` and its small pure-Python dependencies; nothing is added to the package's
  environment) and its CPU Adam op is JIT-built with ninja and the C++ compiler. Where that
  fails the figure is printed as unavailable, with the reason.
"""
from __future__ import annotations

import argparse
import importlib
import os
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatrain_nb.engine.measure import adamw_step  # noqa: E402
from megatrain_nb.engine.updates import fused_update  # noqa: E402
from megatrain_nb.engine.updates.codecs import get_codec  # noqa: E402
from megatrain_nb.engine.updates.optimizer import UnitAdamW  # noqa: E402
from megatrain_nb.engine.updates.states import OptimizerStates  # noqa: E402
from megatrain_nb.engine.telemetry import Telemetry  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEPS = os.path.join(ROOT, ".venv", "bench-deps")
DS_PACKAGES = ["deepspeed", "hjson", "py-cpuinfo", "einops", "msgpack"]


def _median_time(fn, reps: int, cpu: list = None) -> float:
    """The median wall time of ``fn`` over ``reps`` calls (after one warm-up); ``cpu``: a list
    that gets the median of the calling thread's CPU time over the same calls."""
    fn()
    times, cpu_times = [], []
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.thread_time()
        fn()
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.thread_time() - c0)
    if cpu is not None:
        cpu.append(statistics.median(cpu_times))
    return statistics.median(times)


def _fp32_adamw(numel: int):
    p, g = torch.randn(numel), torch.randn(numel) * 1e-3
    m, v, step = torch.zeros(numel), torch.zeros(numel), torch.zeros(())

    def run():
        step.add_(1)
        torch._fused_adamw_([p], [g], [m], [v], [], [step], lr=1e-4, beta1=0.9, beta2=0.999, weight_decay=0.01,
                            eps=1e-8, amsgrad=False, maximize=False)
    return run


def _our_adamw(numel: int, threads: int = 1):
    """The engine's plain AdamW for fp32 states, as measure_machine times it (measure.adamw_step),
    on ``threads`` threads (EngineConfig.optimizer_threads: the caller and its mtnb-update helpers)."""
    return adamw_step(numel, threads)[0]


def _chain(codec: str, numel: int, split=None):
    """One unit's compressed update as the engine runs it (measure.measure_update_chain's);
    ``split``: the threads a fused chunk is split over (None: the engine's, 3)."""
    unit = SimpleNamespace(index=0, numel=numel, name="bench", decay_numel=numel)
    states = OptimizerStates([unit], SimpleNamespace(optimizer_compression=codec), Telemetry())
    if split is not None:
        states.fused_split = split
    adam = UnitAdamW(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    p, g = torch.randn(numel), torch.randn(numel) * 1e-3

    def run():
        r = adam.start_unit(unit, p, collect_stats=False)
        states.update(unit, lambda a, b, m, v, q=None: r.step(a, b, g, m, v, 1e-4, params=q))
        r.finish(g, grad_norm=None)
    return run, states


def update_ratios(numel: int, rounds: int, threads: int) -> None:
    torch.set_num_threads(threads)
    fused = fused_update.kernels()
    print(f"fused kernels: {fused.path if fused else 'unavailable: ' + str(fused_update.disabled_reason())}"
          f"{f' (torch AdamW vector width {fused.width})' if fused else ''}")
    plain, ours = _fp32_adamw(numel), _our_adamw(numel, threads)
    chains = {c: _chain(c, numel, threads) for c in ("int8", "int4")}
    engine_run, engine_states = _chain("int8", numel)
    times_engine = []
    times = {k: [] for k in ("fp32", "ours", "int8", "int4", "int8_torch", "int4_torch")}
    ratios = {c: [] for c in ("int8", "int4")}
    cpu = {c: [] for c in ("fp32", "int8", "int4")}   # the calling thread's CPU time (threads == 1: all the work)
    for r in range(rounds):
        t_plain = _median_time(plain, 3, cpu["fp32"])
        times["fp32"].append(t_plain)
        times["ours"].append(_median_time(ours, 3))
        for c, (run, _) in chains.items():
            t = _median_time(run, 3, cpu[c])
            times[c].append(t)
            ratios[c].append(t_plain / t)
            if r < 2:   # the path before the kernel, twice (it is slow)
                with fused_update.torch_path():
                    times[c + "_torch"].append(_median_time(run, 1))
        times_engine.append(_median_time(engine_run, 3))
    for _, states in list(chains.values()) + [(None, engine_states)]:
        states.close()
    rate = {k: numel / statistics.median(v) / 1e6 for k, v in times.items() if v}
    print(f"unit of {numel} parameters, {threads} thread(s), {rounds} rounds alternating: fp32 fused AdamW "
          f"{rate['fp32']:.0f} M params/s (the engine's, fused kernels: {rate['ours']:.0f}); int8 chain {rate['int8']:.0f} (torch path {rate['int8_torch']:.0f}); "
          f"int4 chain {rate['int4']:.0f} (torch path {rate['int4_torch']:.0f})")
    print(f"the engine's int8 chain (a chunk split over the AdamW worker and the two codec threads, as "
          f"mt.measure_machine times it): {numel / statistics.median(times_engine) / 1e6:.0f} M params/s")
    if threads == 1:   # on a loaded machine the wall times are mostly the scheduler's; a quiet core's:
        print("the same on the calling thread's CPU time (one thread does all the work; what a quiet core "
              "shows): " + ", ".join(f"{c} {statistics.median(cpu['fp32']) / statistics.median(cpu[c]):.3g} x"
                                     for c in ("int8", "int4")) + " of the fp32 AdamW")
    for c, target in (("int8", 0.5), ("int4", 0.4)):
        before = rate[c + "_torch"] / rate["fp32"]
        print(f"RESULT update_{c}_vs_fp32_adamw {statistics.median(ratios[c]):.3g} x (target >= {target}; "
              f"torch path {before:.3g} x)")


def codes_agreement(numel: int) -> None:
    """Codes the kernel and the torch path give differently on Adam-like moments."""
    if fused_update.kernels() is None:
        print("RESULT codes_differing_from_torch_path unavailable (no fused kernels)")
        return
    g = torch.Generator().manual_seed(0)
    rows = torch.pow(10.0, -9 + 6 * torch.rand(numel // 64 + 1, 1, generator=g)).expand(-1, 64).reshape(-1)[:numel]
    moments = {"exp_avg": torch.randn(numel, generator=g).mul_(rows),
               "exp_avg_sq": torch.randn(numel, generator=g).square_().mul_(rows.square())}
    differ, total, worst = 0, 0, 0
    for codec in ("int8", "int4"):
        for role, x in moments.items():
            c = get_codec(codec, role)
            a, b = c.encode(x), c.encode_torch(x)
            assert torch.equal(a["scales"], b["scales"])
            ca, cb = a["codes"], b["codes"]
            if c.codes_per_byte == 2:
                ca, cb = torch.stack([ca & 15, ca >> 4], 1), torch.stack([cb & 15, cb >> 4], 1)
            d = (ca.to(torch.int32) - cb.to(torch.int32)).abs()
            differ += int((d > 0).sum())
            worst = max(worst, int(d.max()))
            total += x.numel()
    print(f"RESULT codes_differing_from_torch_path {differ} of {total} (largest difference {worst} level)")


# ------------------------------------------------------------------------------------ DeepSpeed
def _deepspeed():
    """DeepSpeedCPUAdam's class, installed for this benchmark where it is missing; or the
    reason it is unavailable (a string)."""
    if DEPS not in sys.path:
        sys.path.insert(0, DEPS)
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        print(f"installing DeepSpeed for this benchmark only: pip install --no-deps --target {DEPS} "
              f"{' '.join(DS_PACKAGES)}", flush=True)
        r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", DEPS,
                            *DS_PACKAGES], capture_output=True, text=True)
        if r.returncode != 0:
            return f"pip could not install deepspeed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}"
        importlib.invalidate_caches()   # (the folder did not exist when it went on sys.path)
        sys.path_importer_cache.pop(DEPS, None)
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        probe = torch.nn.Parameter(torch.zeros(16))
        probe.grad = torch.zeros(16)
        DeepSpeedCPUAdam([probe], lr=1e-3).step()   # JIT-builds the op (ninja + the C++ compiler)
        return DeepSpeedCPUAdam
    except Exception as e:  # noqa: BLE001 - any failure: the figure is unavailable, said why
        return f"DeepSpeed's CPU Adam op could not be built or run: {type(e).__name__}: {str(e)[-300:]}"


def adamw_vs_deepspeed(numel: int, threads: int, rounds: int) -> None:
    got = _deepspeed()
    if isinstance(got, str):
        print(f"RESULT adamw_vs_deepspeed_cpu_adam unavailable ({got})")
        return
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    ours, torch_fused = _our_adamw(numel, threads), _fp32_adamw(numel)
    param = torch.nn.Parameter(torch.randn(numel))
    param.grad = torch.randn(numel) * 1e-3
    ds = got([param], lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, adamw_mode=True)
    t_ours, t_ds, t_torch, ratios = [], [], [], []
    for _ in range(rounds):
        a, b, c = _median_time(ours, 3), _median_time(ds.step, 3), _median_time(torch_fused, 3)
        t_ours.append(a)
        t_ds.append(b)
        t_torch.append(c)
        ratios.append(b / a)
    rate = lambda t: numel / statistics.median(t) / 1e9  # noqa: E731
    print(f"{numel} parameters, {threads} threads, {rounds} rounds alternating: ours (UnitAdamW.fused) "
          f"{rate(t_ours):.2f} G params/s, DeepSpeedCPUAdam {rate(t_ds):.2f}, torch._fused_adamw_ {rate(t_torch):.2f} "
          f"(torch over DeepSpeed {statistics.median(t_ds) / statistics.median(t_torch):.3g} x)")
    print(f"RESULT adamw_vs_deepspeed_cpu_adam {statistics.median(ratios):.3g} x (target >= 1.0)")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--numel", type=int, default=1 << 24)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ds-numel", type=int, default=1 << 26)
    ap.add_argument("--ds-threads", type=int, default=2)
    ap.add_argument("--agree", type=int, default=1 << 25, help="moments per codec and moment for the code count")
    ap.add_argument("--no-deepspeed", action="store_true")
    args = ap.parse_args(argv)
    print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    update_ratios(args.numel, args.rounds, args.threads)
    codes_agreement(args.agree)
    if not args.no_deepspeed:
        adamw_vs_deepspeed(args.ds_numel, args.ds_threads, args.rounds)
    print(f"load average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
