"""The disk tier really used: step time with master weights and optimizer states streamed from
disk every step (the host cache of the disk tier off, or sized below the state) against
max(compute alone, pure I/O of the same bytes, optimizer alone, CPU), all measured in the same
run. On a CPU device the compute, the updates and the disk tier's I/O threads share the cores;
"compute alone" is the whole step in RAM (its updates overlapped on those cores), so it already
counts their sharing, and the CPU term, (its core-seconds + dd's core-seconds moving the same
bytes) / cores, counts what moving the bytes costs the same cores (see ``cpu_report``). Each
kind of thread's core-seconds, its wait for a core (the scheduler's run-queue delay) and its
sleeps and pre-emptions are printed per step, and the disk-tier step's time beyond its bound
is split into the compute's waits for loads, the extra CPU work and the extra wait for a core.

Each contender's steps are timed in steady state: a lead-in step, then ``--steps-per-rep`` steps
timed from its end to theirs (the same work in flight at both ends); the drain after the last
(its updates and writes, nothing left to overlap) is printed apart, as a run pays it once.

Contenders, run one after the other in every repetition (alternating, medians over the reps):

* ``compute``: the same step with everything in RAM (same codec): the compute bound; its
  optimizer + codec seconds per step (no disk waits inside them) are the optimizer bound;
* ``disk-tier``: weights and states on disk, the host cache at ``--disk-cache-gb`` (default 0:
  off), no clipping (updates overlap the backward);
* ``disk-tier clipped``: the same with ``max_grad_norm=1.0`` (updates after the backward,
  overlapped with the next forward);
* ``pure I/O``: ``dd`` with direct I/O (``oflag=direct conv=fdatasync``, ``iflag=direct``) on the
  same disk, writing then reading the bytes the disk-tier step moved in this rep, in blocks of
  the largest unit;
* ``cache``: weights and states on the disk tier with the engine's default host cache (the
  cache figure, labelled as such: with a budget that holds the whole tier it moves no disk
  bytes and measures RAM, not the disk).

Every figure prints the disk bytes it moved per step; a disk-tier figure that moved none says
that it measured the cache.

    python benchmarks/bench_overlap.py [--dir PATH] [--reps N] [--disk-cache-gb G]

RESULT lines: ``overlap_step_vs_bound`` (disk-tier step / bound, target <= 1.10) and
``clipped_step_vs_unclipped`` (target <= 1), each the median over the reps of the ratio within a
rep; ``optimizer_exposed_share`` (target <= 0.10), ``clipped_optimizer_exposed_share`` (target
<= 0.3: the next forward's loads' wait for the updates, on the copy thread that prefetches them),
``clipped_compute_wait_share`` (the compute thread's own waits for its loads in the same steps over
the same updates, target <= 0.3), ``cache_step_vs_bound`` (the cache figure against max(compute, optimizer), target
<= 1.25) and ``disk_cache_bytes_vs_min`` (the cache figure's disk bytes against the simulator's
minimum for its budget, target <= 1.05); where the machine's cached rates made a disk-tier engine
pick another plan than the rules', ``disk_tier_pick_vs_rules`` / ``disk_tier_clipped_pick_vs_rules``
(its step over the same engine's on the rules' plan, run beside it, target <= 1.0).
"""
from __future__ import annotations

import argparse
import copy
import os
import re
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, median, result  # noqa: E402

from megatrain_nb.engine import EngineConfig, StreamingEngine  # noqa: E402

MiB = 2 ** 20
TIERS = ("device", "disk", "host_cache", "decode", "optimizer", "grad_return")
CLIP = 1.0   # max_grad_norm of the clipped figures (TrainingArguments' default)


def dd_seconds(args: list) -> float:
    """Run dd; the seconds it reports."""
    proc = subprocess.run(["dd", *args], capture_output=True, text=True, check=True)
    m = re.search(r"copied, ([0-9.eE+-]+) s", proc.stderr)
    if not m:
        raise RuntimeError(f"cannot parse dd's output: {proc.stderr!r}")
    return float(m.group(1))


def children_cpu() -> float:
    """CPU seconds (user + system) of this process's finished children (the dd runs)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def pure_io(folder: str, block: int, read_bytes: int, write_bytes: int) -> tuple:
    """(seconds, CPU seconds) dd (direct I/O) takes to write ``write_bytes`` then read
    ``read_bytes`` in ``block``-byte blocks on ``folder``'s disk: the CPU seconds (the kernel's
    direct I/O: pinning the pages, building the requests) are the least CPU work moving those
    bytes costs, which the step's cores must find room for beside the compute."""
    path = os.path.join(folder, "dd-probe.bin")
    c0 = children_cpu()
    n_w = max(1, -(-write_bytes // block))
    n_r = max(1, -(-read_bytes // block))
    try:
        t = dd_seconds(["if=/dev/zero", f"of={path}", f"bs={block}", f"count={max(n_w, n_r)}",
                        "oflag=direct", "conv=fdatasync"]) * n_w / max(n_w, n_r)
        c1 = children_cpu()   # (the write's CPU scaled as its seconds are: it wrote max(n_w, n_r) blocks)
        t += dd_seconds([f"if={path}", "of=/dev/null", f"bs={block}", f"count={n_r}", "iflag=direct"])
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return t, (c1 - c0) * n_w / max(n_w, n_r) + (children_cpu() - c1)


def thread_cpu() -> dict:
    """CPU seconds (user + system) and minor page faults so far, per thread kind: the disk tier's
    I/O threads (``mtnb-disk*``), the other named threads (``mtnb-*``: the update, the copies)
    and the rest (the compute: the main thread and torch's)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {"io": [0.0, 0, 0.0, 0, 0], "engine": [0.0, 0, 0.0, 0, 0], "compute": [0.0, 0, 0.0, 0, 0]}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/status") as f:
                status = f.read()
        except OSError:
            continue
        name = names.get(int(tid), "")
        kind = "io" if name.startswith("mtnb-disk") else "engine" if name.startswith("mtnb-") else "compute"
        out[kind][0] += (int(fields[11]) + int(fields[12])) / tick
        out[kind][1] += int(fields[7])
        # seconds runnable but waiting for a core (the scheduler's run-queue delay), and the
        # thread's voluntary (it slept: a wait, an idle OpenMP worker) and involuntary (a core
        # taken from it) context switches
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                out[kind][2] += int(f.read().split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            pass
        for i, key in ((3, "\nvoluntary_ctxt_switches:"), (4, "nonvoluntary_ctxt_switches:")):
            if key in status:
                out[kind][i] += int(status.split(key)[1].split()[0])
    return out


KERNEL_WORKERS = ("kworker", "jbd2", "ksoftirqd")


def kernel_workers_cpu() -> float:
    """CPU seconds so far of the machine's kernel worker threads (kworker, jbd2, ksoftirqd): work
    the kernel defers out of the process's own threads -- a direct-I/O read into shmem pages has
    its pages dirtied by a kworker, say -- which the process's CPU does not count but which
    pre-empts its threads all the same (machine-wide: other processes' share too)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    total = 0.0
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/comm") as f:
                if not f.read().startswith(KERNEL_WORKERS):
                    continue
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def timed_steps(engine, ids, k: int, clip=None) -> dict:
    """k consecutive steps in steady state, timed from the end of a lead-in step to the end of
    the k-th: at both ends the same work is in flight (a clipped step's updates, which overlap
    the next forward; the write-behind), so the time and the bytes between them are k steps'.
    The drain after the last step (its updates and writes with nothing left to overlap) is timed
    apart: a run pays it once, at its end or a checkpoint, not every step (timed inside the k
    steps, as before the ninth session, it added a clipped step's whole update round over k).
    Per step: seconds, disk bytes read / written, stall seconds per tier, optimizer seconds."""
    disk = engine.disk
    engine.forward_backward(ids, step_lr=1e-4, max_grad_norm=clip)   # the lead-in: steady state from here
    r0 = disk.report() if disk is not None else None
    t0_tel = engine.telemetry()
    th0, kw0 = thread_cpu(), kernel_workers_cpu()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(k):
        engine.forward_backward(ids, step_lr=1e-4, max_grad_norm=clip)
    dt = (time.perf_counter() - t0) / k
    cpu = (time.process_time() - c0) / k   # core-seconds of every thread of this process
    th1, kw1 = thread_cpu(), kernel_workers_cpu()
    t1_tel = engine.telemetry()
    r1 = disk.report() if disk is not None else None
    t_end = time.perf_counter()
    engine.zero_grad()
    if disk is not None:
        disk.flush()
    drain = time.perf_counter() - t_end
    out = {"s": dt, "cpu": cpu, "read": 0, "written": 0, "drain": drain,
           "stall": {t: (t1_tel["stall_seconds"].get(t, 0.0) - t0_tel["stall_seconds"].get(t, 0.0)) / k
                     for t in TIERS},
           "opt": (t1_tel["optimizer_seconds"] - t0_tel["optimizer_seconds"]) / k,
           # the forwards' waits for the previous step's updates (clipped: every timed step's)
           "exposed": t1_tel["optimizer_exposed_seconds"] - t0_tel["optimizer_exposed_seconds"],
           # of them, the part the updates themselves spent waiting for the disk tier
           "exposed_disk": t1_tel["optimizer_exposed_disk_seconds"] - t0_tel["optimizer_exposed_disk_seconds"],
           # the compute thread's own waits for its loads in the k steps (a CPU "device": every wait
           # of the compute for a unit, the updates' included): what the copy thread's wait above hid
           "device": t1_tel["stall_seconds"].get("device", 0.0) - t0_tel["stall_seconds"].get("device", 0.0),
           "opt_total": t1_tel["optimizer_seconds"] - t0_tel["optimizer_seconds"],
           # per thread kind: core-seconds and page faults per step (/proc/self/task)
           "threads": {kind: tuple((th1[kind][i] - th0[kind][i]) / k for i in range(5)) for kind in th0},
           "kworkers": (kw1 - kw0) / k}
    if r0 is not None:
        out["read"] = (r1["disk_read_bytes"] - r0["disk_read_bytes"]) // k
        out["written"] = (r1["disk_write_bytes"] - r0["disk_write_bytes"]) // k
    return out


def describe(name: str, runs: list) -> str:
    secs = [r["s"] for r in runs]
    rd, wr = median([r["read"] for r in runs]), median([r["written"] for r in runs])
    line = (f"{name:<26} median {median(secs):.3f}s {[round(x, 3) for x in secs]}; disk per step: "
            f"read {rd / MiB:.1f} MiB, written {wr / MiB:.1f} MiB; drain after the last step (once a run) "
            f"{median([r['drain'] for r in runs]):.3f}s")
    if rd + wr == 0 and name.startswith("disk-tier"):
        line += "  <- NO DISK BYTES: this figure measured the host cache, not the disk"
    return line


def stalls(runs: list) -> str:
    return ", ".join(f"{t} {median([r['stall'][t] for r in runs]):.3f}s" for t in TIERS)


def build(model, a, d: str):
    def cfg(**kw):
        return EngineConfig(device="cpu", optimizer_compression=a.codec, **kw)
    on_disk = dict(offload_dir=d, offload_params=True)
    engines = {
        "compute": StreamingEngine(copy.deepcopy(model), cfg()),
        "disk-tier": StreamingEngine(copy.deepcopy(model), cfg(host_cache_gb=a.disk_cache_gb, **on_disk)),
        "disk-tier clipped": StreamingEngine(copy.deepcopy(model), cfg(host_cache_gb=a.disk_cache_gb, **on_disk)),
    }
    # the picker against the rules, side by side: where the machine's cached rates made an engine
    # take another plan than the rules', the same engine on the rules' plan runs beside it
    for name in ("disk-tier", "disk-tier clipped"):
        if engines[name].plan.choice:
            engines[f"{name} (rules)"] = StreamingEngine(copy.deepcopy(model), cfg(
                host_cache_gb=a.disk_cache_gb, overrides=dict(plan_by="rules"), **on_disk))
    engines["cache"] = StreamingEngine(model, cfg(host_cache_gb=a.cache_gb, **on_disk))
    return engines


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps-per-rep", type=int, default=3)
    ap.add_argument("--codec", default="none")
    ap.add_argument("--dir", default=".")
    ap.add_argument("--disk-cache-gb", type=float, default=0.0,
                    help="host cache of the disk-tier figures (default 0: off; keep it below the state)")
    ap.add_argument("--cache-gb", type=float, default=None,
                    help="host cache of the cache figure (default: the engine's, from free RAM)")
    a = ap.parse_args(argv)
    print(machine())
    print(f"load average at start: {os.getloadavg()}")
    cfg = AutoConfig.for_model("llama", vocab_size=8192, hidden_size=a.hidden, intermediate_size=a.hidden * 8 // 3,
                               num_hidden_layers=a.layers, num_attention_heads=8, max_position_embeddings=a.seq)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    ids = torch.randint(0, 8192, (a.batch, a.seq))
    k = a.steps_per_rep
    if a.dir:
        os.makedirs(a.dir, exist_ok=True)   # a folder on the disk to measure, created if missing
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        eng = build(model, a, d)
        disk = eng["disk-tier"]
        print(f"llama {a.layers}x{a.hidden}: {disk.num_parameters() / 1e6:.1f}M params; batch {a.batch}x{a.seq}; "
              f"weights and '{a.codec}' optimizer states on disk under {d}")
        for name, e in eng.items():   # warm-up: the first step creates the states
            e.forward_backward(ids, step_lr=1e-4, max_grad_norm=CLIP if "clipped" in name else None)
            e.zero_grad()
            if e.disk is not None:
                e.disk.flush()
        state_bytes = disk.disk.nbytes()
        for name, e in eng.items():   # (with the machine's rates cached the engine may pick its plan)
            print(f"{name}: plan checkpoint_interval {e.plan.checkpoint_interval}, gradients held on the "
                  f"{e.plan.placement.get('gradients')}: {e.plan.chosen_by}")
        for name in ("disk-tier", "disk-tier clipped", "cache"):
            rep = eng[name].disk.report()
            print(f"{name}: host cache budget {rep['capacity_bytes'] / MiB:.0f} MiB for a disk tier of "
                  f"{state_bytes / MiB:.0f} MiB")
        block = -(-max(u.numel for u in disk.units) * 4 // 4096) * 4096
        runs = {n: [] for n in eng}
        t_io = []
        for _ in range(a.reps):
            for name, e in eng.items():
                runs[name].append(timed_steps(e, ids, k, clip=CLIP if "clipped" in name else None))
            last = runs["disk-tier"][-1]
            t_io.append(pure_io(d, block, last["read"], last["written"]))
        report(a, eng, runs, t_io)
        for e in eng.values():
            e.close()


def cpu_report(runs, t_io, io_cpu, cores, bound) -> list:
    """The step's CPU against its cores, and where the disk-tier step's time beyond the bound
    goes; returns each rep's disk-tier step over that rep's bound.

    On a CPU device the compute (torch's threads), the updates (the AdamW worker, the codec
    threads) and the disk tier's I/O threads share the same cores. The compute figure is the
    whole step in RAM with its updates overlapped on those cores, so its time already counts their
    sharing; what it does not count is the CPU work moving the disk bytes takes. So the bound is
    max(compute, pure I/O, optimizer, CPU), the CPU term being (the compute figure's core-seconds
    + dd's core-seconds for the same bytes) / cores: no schedule on these cores can run the step
    faster than its least CPU work allows. Each rep is taken against the bound measured in that
    rep (the load of a shared machine drifts between reps)."""
    page = os.sysconf("SC_PAGE_SIZE")
    for name in ("compute", "disk-tier", "disk-tier clipped"):
        rs = runs[name]
        cpu, s = median([r["cpu"] for r in rs]), median([r["s"] for r in rs])
        parts = "; ".join(
            f"{kind} {median([r['threads'][kind][0] for r in rs]):.3f} core-s, waited "
            f"{median([r['threads'][kind][2] for r in rs]):.3f}s for a core, "
            f"{median([r['threads'][kind][3] for r in rs]):.0f} sleeps / "
            f"{median([r['threads'][kind][4] for r in rs]):.0f} pre-emptions, "
            f"{median([r['threads'][kind][1] for r in rs]) * page / MiB:.0f} MiB faulted in"
            for kind in ("compute", "engine", "io"))
        print(f"CPU per step, {name}: {cpu:.3f} core-s in {s:.3f}s = {cpu / max(s * cores, 1e-9):.0%} of {cores} "
              f"cores; by thread (compute: the main thread and every OpenMP team's; engine: the update and copy "
              f"threads; io: the disk tier's): {parts}; beside them the machine's kernel workers "
              f"{median([r['kworkers'] for r in rs]):.3f} core-s")
    print(f"pure I/O's CPU (dd, direct I/O, the same bytes): median {median(io_cpu):.3f} core-s "
          f"{[round(x, 3) for x in io_cpu]}")
    d, c = runs["disk-tier"], runs["compute"]
    over = median([r["s"] for r in d]) - bound
    waits = median([sum(r["stall"].values()) for r in d])
    extra_cpu = (median([r["cpu"] for r in d]) - median([r["cpu"] for r in c])) / cores
    extra_q = median([r["threads"]["compute"][2] for r in d]) - median([r["threads"]["compute"][2] for r in c])
    print(f"disk-tier beyond its bound: {over:+.3f}s a step, of which the compute's waits for loads "
          f"{waits:.3f}s, the extra CPU work over {cores} cores {extra_cpu:+.3f}s (I/O threads and the rest), the "
          f"compute threads' extra wait for a core {extra_q:+.3f}s (summed over its threads)")
    return [dr["s"] / max(cr["s"], io, cr["opt"], (cr["cpu"] + ic) / cores)
            for dr, cr, io, ic in zip(d, c, t_io, io_cpu)]


def report(a, eng, runs, t_io):
    m = {n: median([r["s"] for r in rs]) for n, rs in runs.items()}
    mo = median([r["opt"] for r in runs["compute"]])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    io_cpu = [c for _, c in t_io]
    t_io = [t for t, _ in t_io]
    mio = median(t_io)
    # the CPU term: the compute figure's CPU work (its compute and its updates, every thread) plus
    # the least CPU work the disk bytes cost (dd's, moving the same bytes), over the cores
    cpu_bound = (median([r["cpu"] for r in runs["compute"]]) + median(io_cpu)) / cores
    bound = max(m["compute"], mio, mo, cpu_bound)
    print(f"load average at end: {os.getloadavg()}")
    for name in runs:
        print(describe(name, runs[name]))
    picked = [n for n in ("disk-tier", "disk-tier clipped") if f"{n} (rules)" in runs]
    for name in picked:   # a pick must never do worse than the rules' plan
        ratio = median([p["s"] / r["s"] for p, r in zip(runs[name], runs[f"{name} (rules)"])])
        result(f"{name.replace('-', '_').replace(' ', '_')}_pick_vs_rules", ratio, "x", "<=", 1.0)
    if not picked:
        print("every engine built the rules' plan (no cached rates, MEGATRAIN_NB_PLAN_BY=rules, or no plan "
              "predicted 10% faster): no pick to compare with the rules")
    print(f"optimizer + codec ('{a.codec}') per step, in RAM: median {mo:.3f}s")
    rd = median([r["read"] for r in runs["disk-tier"]])
    wr = median([r["written"] for r in runs["disk-tier"]])
    print(f"pure I/O (dd, direct I/O) of the disk-tier step's bytes ({rd / MiB:.0f} MiB read, {wr / MiB:.0f} MiB "
          f"written): median {mio:.3f}s {[round(x, 3) for x in t_io]}")
    print(f"bound = max(compute {m['compute']:.3f}, pure I/O {mio:.3f}, optimizer {mo:.3f}, CPU {cpu_bound:.3f}) "
          f"= {bound:.3f}s")
    per_rep = cpu_report(runs, t_io, io_cpu, cores, bound)
    clip_rep = [c["s"] / d["s"] for c, d in zip(runs["disk-tier clipped"], runs["disk-tier"])]
    print(f"per rep: disk-tier / bound {[round(x, 3) for x in per_rep]} (ratio of the medians "
          f"{m['disk-tier'] / bound:.3f}); clipped / unclipped {[round(x, 3) for x in clip_rep]} "
          f"(ratio of the medians {m['disk-tier clipped'] / m['disk-tier']:.3f})")
    for name in (n for n in runs if n != "compute"):
        print(f"stalls per step, {name}: {stalls(runs[name])}")
    tel = eng["disk-tier"].telemetry()
    pf = tel["prefetch"]["disk"]
    print(f"disk-tier: {tel['weight_reads_saved']} weight reads saved; disk prefetch {pf['ahead']} ahead, "
          f"{pf['late']} late")
    share = tel["optimizer_exposed_seconds"] / max(tel["optimizer_seconds"], 1e-9)
    # clipped: every timed step's forward overlapped (and waited for) the previous step's updates;
    # the drain after the last (nothing left to overlap with) is not a training step's cost
    clip_exposed = sum(r["exposed"] for r in runs["disk-tier clipped"])
    clip_overlappable = sum(r["opt_total"] for r in runs["disk-tier clipped"])
    clip_share = clip_exposed / max(clip_overlappable, 1e-9)
    clip_compute = sum(r["device"] for r in runs["disk-tier clipped"])
    clip_disk = sum(r["exposed_disk"] for r in runs["disk-tier clipped"])
    print(f"disk-tier optimizer exposed {tel['optimizer_exposed_seconds']:.3f}s of {tel['optimizer_seconds']:.3f}s; "
          f"clipped: the next forward's loads (the copy thread, prefetching a unit ahead) waited {clip_exposed:.3f}s "
          f"for {clip_overlappable:.3f}s of updates; the compute itself waited {clip_compute:.3f}s for all its loads "
          f"(share {clip_compute / max(clip_overlappable, 1e-9):.3f}, an upper bound of its wait for the updates); "
          f"of the loads' wait, the updates themselves waited {clip_disk:.3f}s for the disk tier "
          f"(optimizer_exposed_disk_seconds: {clip_disk / max(clip_exposed, 1e-9):.0%} of it)")
    crep = eng["cache"].disk.report()
    plan = crep["planned"] or {"read_bytes_per_step": 0, "write_bytes_per_step": 0}
    got = runs["cache"][-1]["read"] + runs["cache"][-1]["written"]
    want = plan["read_bytes_per_step"] + plan["write_bytes_per_step"]
    vs_min = got / want if want else (1.0 if got == 0 else float("inf"))
    cache_bound = max(m["compute"], mo)
    print(f"cache figure: budget {crep['capacity_bytes'] / MiB:.0f} MiB, resident {crep['ram_bytes'] / MiB:.0f} MiB; "
          f"simulator's minimum {plan['read_bytes_per_step'] / MiB:.1f} / {plan['write_bytes_per_step'] / MiB:.1f} "
          f"MiB per step" + ("; 0 disk bytes: it measured the host cache (RAM), not the disk" if got == 0 else ""))
    dbytes = rd + wr
    result("overlap_step_vs_bound", median(per_rep), "x", "<=", 1.10)   # (issue 45: 1.10)
    print(f"  (disk-tier: {dbytes / MiB:.0f} MiB of disk per step"
          + (", NONE: measured the cache" if dbytes == 0 else "") + ")")
    result("clipped_step_vs_unclipped", median(clip_rep), "x", "<=", 1.0)
    result("optimizer_exposed_share", share, "x", "<=", 0.10)
    result("clipped_optimizer_exposed_share", clip_share, "x", "<=", 0.3)
    result("clipped_compute_wait_share", clip_compute / max(clip_overlappable, 1e-9), "x", "<=", 0.3)
    result("cache_step_vs_bound", m["cache"] / cache_bound, "x", "<=", 1.25)
    print(f"  (cache figure: {got / MiB:.0f} MiB of disk per step; bound max(compute, optimizer))")
    result("disk_cache_bytes_vs_min", vs_min, "x", "<=", 1.05)


if __name__ == "__main__":
    main()
