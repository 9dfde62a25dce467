"""mt.Trainer (everything in RAM) against transformers.Trainer: same model, data, order, arguments.

    python benchmarks/bench_trainer.py [--preset small] [--steps 24] [--reps 3] [--batch 8] [--seq 128]

Each contender runs in its own process (so peak RSS, from getrusage, is its own), alternating
HF, megatrain, HF, megatrain, ...; the step time of a run is the median of the wall time between
consecutive ``on_step_end`` callbacks after ``--warmup`` steps (data loading, the step and the
bookkeeping all included). For megatrain it also reports the share of a step spent outside the
engine's calls (the trainer's own cost: data, schedule, callbacks, logging). The ratio is the
median of the per-pair ratios (each megatrain run against the HF run just before it).

Both contenders run with ONE torch intra-op thread by default, because two OpenMP threads on
the shared 2-core build machines swing either way: when another process is busy, plain PyTorch
becomes several times slower (spin-waiting), flattering megatrain; on an idle machine megatrain's
smaller per-layer operations gain less from the second thread than HF's, so its ratio is worse.
``--threads 0`` runs with torch's default; quote both when it matters.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time


def run_one(kind: str, ns) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback, TrainingArguments

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from megatrain_nb.model_configs import preset_config

    if ns.threads:
        torch.set_num_threads(ns.threads)

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(preset_config(ns.preset, vocab_size=ns.vocab))
    g = torch.Generator().manual_seed(1)
    n = ns.batch * (ns.steps + 2)
    ids = torch.randint(0, ns.vocab, (n, ns.seq), generator=g)
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    stamps: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            stamps.append(time.perf_counter())

    out = os.path.join(ns.tmp, f"{kind}-{os.getpid()}")
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=ns.batch, max_steps=ns.steps,
                             learning_rate=1e-3, weight_decay=0.1, lr_scheduler_type="cosine", warmup_steps=2,
                             logging_steps=10, save_strategy="no", report_to="none", disable_tqdm=True)
    if kind == "hf":
        from transformers import Trainer

        trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[Clock()])
    else:
        from megatrain_nb.trainer import Trainer

        trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[Clock()], device="cpu",
                          checkpoint_interval=ns.checkpoint_interval)
    if kind == "hf":
        trainer.train()
        inside = None
    else:  # what train() does, keeping the records: step_time_s is the time inside the engine calls
        inside = statistics.median([r["step_time_s"] for r in trainer.iter_steps()][ns.warmup + 1:])
    steps = [b - a for a, b in zip(stamps[ns.warmup:], stamps[ns.warmup + 1:])]
    return {"kind": kind, "step_s": statistics.median(steps), "engine_s": inside,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads in both (0 = torch's default)")
    ap.add_argument("--checkpoint-interval", type=int, default=0,
                    help="engine checkpoint_interval for mt.Trainer: 0 keeps activations like transformers.Trainer "
                         "without gradient checkpointing (the fair pairing); 1 recomputes each layer")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--tmp", default=None, help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.child:
        print("CHILD " + json.dumps(run_one(ns.child, ns)))
        return

    import tempfile

    tmp = tempfile.mkdtemp(prefix="bench_trainer-")
    results: dict[str, list[dict]] = {"hf": [], "mt": []}
    base = [sys.executable, os.path.abspath(__file__), "--preset", ns.preset, "--vocab", str(ns.vocab),
            "--batch", str(ns.batch), "--seq", str(ns.seq), "--steps", str(ns.steps), "--warmup", str(ns.warmup),
            "--threads", str(ns.threads), "--checkpoint-interval", str(ns.checkpoint_interval), "--tmp", tmp]
    print(f"bench_trainer: preset {ns.preset}, batch {ns.batch} x seq {ns.seq}, {ns.steps} steps, {ns.reps} reps "
          f"each, {os.cpu_count()} CPUs, torch threads {ns.threads or 'default'}, "
          f"mt checkpoint_interval {ns.checkpoint_interval}")
    for rep in range(ns.reps):
        for kind in ("hf", "mt"):
            p = subprocess.run(base + ["--child", kind], capture_output=True, text=True)
            line = [x for x in p.stdout.splitlines() if x.startswith("CHILD ")]
            if p.returncode != 0 or not line:
                sys.exit(f"{kind} run failed:\n{p.stderr[-3000:]}")
            r = json.loads(line[0][6:])
            results[kind].append(r)
            print(f"  rep {rep} {kind:>2}: step {r['step_s'] * 1000:.1f} ms, "
                  f"peak RSS {r['peak_rss_bytes'] / 2**20:.0f} MiB")
    med = {k: statistics.median(r["step_s"] for r in v) for k, v in results.items()}
    rss = {k: statistics.median(r["peak_rss_bytes"] for r in v) / 2 ** 20 for k, v in results.items()}
    pairs = [m["step_s"] / h["step_s"] for h, m in zip(results["hf"], results["mt"])]
    ratio = statistics.median(pairs)  # pair by pair: each megatrain run against the HF run just before it
    print(f"median step: transformers.Trainer {med['hf'] * 1000:.1f} ms, mt.Trainer {med['mt'] * 1000:.1f} ms; "
          f"pair ratios {', '.join(f'{r:.3f}' for r in pairs)}")
    print(f"peak RSS (getrusage, whole process): transformers.Trainer {rss['hf']:.0f} MiB, "
          f"mt.Trainer {rss['mt']:.0f} MiB")
    overhead = statistics.median(1 - r["engine_s"] / r["step_s"] for r in results["mt"])
    print(f"mt.Trainer time outside the engine's calls (data, schedule, callbacks, logging): {overhead:.1%} of a step")
    print(f"RESULT trainer_step_time_ratio {ratio:.3f} x (target <= 1.15)")
    print(f"RESULT trainer_overhead_fraction {overhead:.4f} fraction (target <= 0.05)")
    print(f"RESULT trainer_peak_rss_mt {rss['mt']:.0f} MiB (target <= {1.25 * rss['hf']:.0f})")


if __name__ == "__main__":
    main()
