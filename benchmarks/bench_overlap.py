"""Step time with optimizer states and master weights on the disk tier against
max(compute-only step, pure I/O of the same bytes, optimizer + codec time), same run; and the optimizer time left
exposed after the backward (no clipping: updates overlap the backward). Also prints, without a
target, the same step with global-norm clipping (updates after the backward, overlapped with the
next forward).

    python benchmarks/bench_overlap.py [--dir PATH]
Prints RESULT overlap_step_vs_bound (target <= 1.25), RESULT optimizer_exposed_share
(target <= 0.10), RESULT clipped_optimizer_exposed_share (with max_grad_norm; target <= 0.3) and
RESULT disk_cache_bytes_vs_min: the disk bytes a step moved through the host cache of the disk
tier against the minimum the simulator finds for that schedule and budget (target <= 1.05).
``--host-cache-gb 0`` runs without the cache (the disk tier as it was).
"""
from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, median, result  # noqa: E402

from megatrain_nb.engine import EngineConfig, StreamingEngine  # noqa: E402
from megatrain_nb.engine.disk_store import DiskStore, aligned_empty  # noqa: E402


def pure_io(folder: str, unit_numel: int, read_bytes: int, write_bytes: int) -> float:
    """Seconds for the disk tier to write then read the same bytes in unit-sized files."""
    store = DiskStore(folder)
    buf = aligned_empty(unit_numel).normal_()  # page-aligned, as the engine's staging buffers
    nbytes = unit_numel * 4
    n_w = max(1, round(write_bytes / nbytes))
    n_r = max(1, round(read_bytes / nbytes))
    t0 = time.perf_counter()
    futs = [store.write(f"u{i % n_w}", {"w": buf}) for i in range(n_w)]
    for f in futs:
        f.result()
    outs = [aligned_empty(unit_numel) for _ in range(4)]
    futs = [store.read(f"u{i % n_w}", out={"w": outs[i % 4]}) for i in range(n_r)]
    for f in futs:
        f.result()
    dt = time.perf_counter() - t0
    store.close()
    return dt


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
    ap.add_argument("--host-cache-gb", type=float, default=None,
                    help="host RAM cache of the disk tier (default: the engine's, from free RAM; 0 = off)")
    a = ap.parse_args(argv)
    print(machine())
    cfg = AutoConfig.for_model("llama", vocab_size=8192, hidden_size=a.hidden, intermediate_size=a.hidden * 8 // 3,
                               num_hidden_layers=a.layers, num_attention_heads=8, max_position_embeddings=a.seq)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    ids = torch.randint(0, 8192, (a.batch, a.seq))
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        # the same step with everything in RAM (same optimizer codec): the compute bound, and
        # its optimizer + codec seconds per step (no disk waits inside them): the optimizer bound
        ram = StreamingEngine(copy.deepcopy(model), EngineConfig(device="cpu", optimizer_compression=a.codec))
        clipped = StreamingEngine(copy.deepcopy(model), EngineConfig(device="cpu", offload_dir=d, offload_params=True,
                                                                     optimizer_compression=a.codec,
                                                                     host_cache_gb=a.host_cache_gb))
        disk = StreamingEngine(model, EngineConfig(device="cpu", offload_dir=d, offload_params=True,
                                                   optimizer_compression=a.codec, host_cache_gb=a.host_cache_gb))
        print(f"llama {a.layers}x{a.hidden}: {disk.num_parameters() / 1e6:.1f}M params; batch {a.batch}x{a.seq}; "
              f"weights and '{a.codec}' optimizer states on disk under {d}")
        for e in (ram, disk):  # warm-up: the first step creates the states
            e.forward_backward(ids, step_lr=1e-4)
        clipped.forward_backward(ids, step_lr=1e-4, max_grad_norm=1.0)
        t_ram, t_disk, t_io, moved, t_clip, cached, t_opt = [], [], [], [], [], [], []
        clip_exposed = clip_overlappable = 0.0
        max_unit = max(u.numel for u in disk.units)
        disk.disk.flush()
        k = a.steps_per_rep
        for _ in range(a.reps):
            # k consecutive steps each (steady state: write-behind of one step overlaps the next);
            # the disk run ends with its write-behind drained, so its time covers all its bytes.
            o0 = ram.telemetry()["optimizer_seconds"]
            t0 = time.perf_counter()
            for _ in range(k):
                ram.forward_backward(ids, step_lr=1e-4)
            ram.zero_grad()
            t_ram.append((time.perf_counter() - t0) / k)
            t_opt.append((ram.telemetry()["optimizer_seconds"] - o0) / k)
            s0, c0 = disk.disk.stats(), disk.disk.report()
            t0 = time.perf_counter()
            for _ in range(k):
                disk.forward_backward(ids, step_lr=1e-4)
            disk.zero_grad(); disk.disk.flush()
            t_disk.append((time.perf_counter() - t0) / k)
            s1, c1 = disk.disk.stats(), disk.disk.report()
            cached.append(((c1["disk_read_bytes"] - c0["disk_read_bytes"]) / k,
                           (c1["disk_write_bytes"] - c0["disk_write_bytes"]) / k))
            moved.append(((s1["bytes_read"] - s0["bytes_read"]) // k, (s1["bytes_written"] - s0["bytes_written"]) // k))
            # the same bytes (per step), in the same rep
            t_io.append(pure_io(d, max_unit, moved[-1][0] * k, moved[-1][1] * k) / k)
            # with global-norm clipping (updates after the backward, overlapped with the next forward)
            # Exposed = time the forwards of steps 2..k waited for the previous step's updates;
            # the drain after step k (nothing left to overlap with) is not a training step's cost,
            # so the share is taken over the updates of steps 1..k-1 (every step's are alike).
            c0 = clipped.telemetry()
            t0 = time.perf_counter()
            for _ in range(k):
                clipped.forward_backward(ids, step_lr=1e-4, max_grad_norm=1.0)
            c1 = clipped.telemetry()
            clipped.zero_grad(); clipped.disk.flush()
            t_clip.append((time.perf_counter() - t0) / k)
            c2 = clipped.telemetry()
            clip_exposed += c1["optimizer_exposed_seconds"] - c0["optimizer_exposed_seconds"]
            clip_overlappable += (c2["optimizer_seconds"] - c0["optimizer_seconds"]) * (k - 1) / k
        tel = disk.telemetry()
        read_b, write_b = moved[-1]
        t_io = median(t_io)
        mr, md, mo = median(t_ram), median(t_disk), median(t_opt)
        bound = max(mr, t_io, mo)
        print(f"compute-only step (all in RAM): median {mr:.3f}s {[round(x, 3) for x in t_ram]}")
        print(f"optimizer + codec ('{a.codec}') per step, in RAM: median {mo:.3f}s {[round(x, 3) for x in t_opt]}")
        print(f"bound = max(compute in RAM, pure I/O, optimizer + codec) = {bound:.3f}s")
        print(f"disk-tier step:                 median {md:.3f}s {[round(x, 3) for x in t_disk]}")
        print(f"pure I/O of the same bytes ({read_b / 2**20:.0f} MiB read, {write_b / 2**20:.0f} MiB written per step): "
              f"{t_io:.3f}s")
        print(f"weight reads saved (backward's buffer kept for the update, or a fresh copy): {tel['weight_reads_saved']}")
        pf = tel["prefetch"]["disk"]
        print(f"disk prefetch: {pf['ahead']} issued ahead, {pf['late']} late; stall {tel['stall_seconds']}")
        share = tel["optimizer_exposed_seconds"] / max(tel["optimizer_seconds"], 1e-9)
        print(f"optimizer: {tel['optimizer_seconds']:.3f}s total, {tel['optimizer_exposed_seconds']:.3f}s exposed")
        ct = clipped.telemetry()
        clip_share = clip_exposed / max(clip_overlappable, 1e-9)
        print(f"with clipping (max_grad_norm=1.0): step median {median(t_clip):.3f}s {[round(x, 3) for x in t_clip]}; "
              f"optimizer {ct['optimizer_seconds']:.3f}s total; the next forward waited {clip_exposed:.3f}s for "
              f"{clip_overlappable:.3f}s of updates it could overlap (share {clip_share:.3f}); with the drains "
              f"after each rep {ct['optimizer_exposed_seconds']:.3f}s exposed")
        rep = disk.disk.report()
        plan = rep["planned"] or {"read_bytes_per_step": 0, "write_bytes_per_step": 0, "hits_per_step": 0}
        got_r, got_w = cached[-1]
        want = plan["read_bytes_per_step"] + plan["write_bytes_per_step"]
        vs_min = (got_r + got_w) / want if want else (1.0 if got_r + got_w == 0 else float("inf"))
        print(f"host cache of the disk tier: budget {rep['capacity_bytes'] / 2**20:.0f} MiB, resident "
              f"{rep['ram_bytes'] / 2**20:.0f} MiB (peak {rep['ram_peak_bytes'] / 2**20:.0f}); per step disk read "
              f"{got_r / 2**20:.1f} MiB, written {got_w / 2**20:.1f} MiB; simulator's minimum for this schedule "
              f"{plan['read_bytes_per_step'] / 2**20:.1f} / {plan['write_bytes_per_step'] / 2**20:.1f} MiB; "
              f"{rep['hits']} hits, {rep['bytes_saved'] / 2**20:.0f} MiB saved in all")
        ram.close(); disk.close(); clipped.close()
    result("overlap_step_vs_bound", md / bound, "x", "<=", 1.25)
    result("optimizer_exposed_share", share, "x", "<=", 0.10)
    result("clipped_optimizer_exposed_share", clip_share, "x", "<=", 0.3)
    result("disk_cache_bytes_vs_min", vs_min, "x", "<=", 1.05)


if __name__ == "__main__":
    main()
