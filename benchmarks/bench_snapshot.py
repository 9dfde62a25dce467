"""What a snapshot costs (issue 21): its seconds against one training step's, and the bytes it
writes against the training state that lives in RAM.

    python benchmarks/bench_snapshot.py [--dir PATH] [--layers 8] [--hidden 512] [--reps 4]

Two runs of the same Llama-style model through ``mt.Trainer``, output_dir and offload_dir on
the same disk (hard links need one filesystem):

* **disk tier** (the bigger-than-RAM configuration): master weights and int8 optimizer states
  on the disk tier, host cache off. Blocks of two training steps alternate, one plain, one
  with a snapshot begun after its first step (``SnapshotStore.begin``: the trainer's files
  written, the engine's ordered links queued behind the step's updates -- it does not wait for
  them) and completed in the background during the second (``SnapshotStore.finish`` at the
  block's end). ``snapshot_seconds`` is the median difference of the two blocks (all the
  snapshot takes from training), ``snapshot_vs_step`` that over one step (target <= 0.05);
  ``snapshot_begin_seconds`` the training thread's part; ``snapshot_bytes_vs_disk_tier`` the
  bytes written over the disk tier's bytes (what a copying checkpoint would write).
* **weights in RAM** (states on the disk tier): here RAM holds real training state, so
  ``snapshot_bytes_vs_ram_state`` is the bytes the snapshot wrote over the RAM-resident state
  (fp32 weights + AdamW step counts + scheduler, RNG, data position, trainer state as
  serialised; target <= 1.1).

Bytes written = the snapshot folder's files that are not hard links (read from the files'
link counts right after it was taken) plus any bytes copied across filesystems.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, median, result  # noqa: E402


def build(a, out: Path, offload: Path, offload_params: bool):
    import datasets
    from transformers import AutoConfig, AutoModelForCausalLM, TrainingArguments

    from megatrain_nb.trainer import Trainer

    cfg = AutoConfig.for_model("llama", vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.hidden * 8 // 3,
                               num_hidden_layers=a.layers, num_attention_heads=8, max_position_embeddings=a.seq)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    g = torch.Generator().manual_seed(0)
    ds = datasets.Dataset.from_dict({"input_ids": torch.randint(0, a.vocab, (64, a.seq), generator=g).tolist()})
    args = TrainingArguments(output_dir=str(out), max_steps=1000, per_device_train_batch_size=a.batch,
                             learning_rate=1e-4, report_to="none", save_strategy="no", disable_tqdm=True,
                             use_cpu=True, logging_steps=1000, max_grad_norm=1.0)
    return Trainer(model=model, train_dataset=ds, args=args, device="cpu", offload_dir=str(offload),
                   offload_params=offload_params, host_cache_gb=0, optimizer_compression="int8")


def written_bytes(info, sizes) -> int:
    return info.bytes_unique + int(sizes.get("copied_bytes", 0))


def disk_tier_run(a, root: Path) -> None:
    from megatrain_nb.trainer.snapshot import SnapshotStore

    tr = build(a, root / "disk-out", root / "disk-offload", offload_params=True)
    store = SnapshotStore(root / "disk-out")
    it = tr.iter_steps()
    next(it)                 # warm-up step
    store.take(tr)           # warm-up snapshot
    # Blocks of two steps, alternated: A plain, B with a snapshot after its first step. The
    # snapshot is begun at the step boundary (store.begin: the trainer's files, the engine's
    # ordered links queued behind the step's updates) and completes in the background while the
    # second step trains; the block ends when it is complete (store.finish). So B - A is all it
    # costs training: its own work in the training thread, and what it takes from the step.
    plain, with_snap, begins, completes, written = [], [], [], [], []
    for _ in range(a.reps):
        t0 = time.perf_counter()
        next(it)
        next(it)
        plain.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        next(it)
        t1 = time.perf_counter()
        pending = store.begin(tr)
        t2 = time.perf_counter()
        next(it)
        info = store.finish(pending)
        t3 = time.perf_counter()
        with_snap.append(t3 - t0)
        begins.append(t2 - t1)
        completes.append(t3 - t1)
        written.append(info.bytes_unique)
    disk = tr.engine.disk
    tier = sum(disk.nbytes_of(k) for k in disk.keys())
    step = median(plain) / 2
    cost = median(with_snap) - median(plain)
    print(f"disk tier: {tr.engine.num_parameters() / 1e6:.1f}M params, {tier / 1e6:.1f} MB in files")
    print(f"  two plain steps {', '.join(f'{s:.2f}' for s in plain)} s; two steps + snapshot "
          f"{', '.join(f'{s:.2f}' for s in with_snap)} s")
    print(f"  snapshot begun in {', '.join(f'{s:.3f}' for s in begins)} s (the training thread's part), complete "
          f"{', '.join(f'{s:.2f}' for s in completes)} s after the step boundary; written "
          f"{', '.join(str(w) for w in written)} B")
    it.close()
    tr.close()
    result("snapshot_seconds", max(cost, 0.0), "s", "<=", 0.05 * step)
    result("snapshot_begin_seconds", median(begins), "s", "<=", 0.05 * step)
    result("snapshot_vs_step", max(cost, 0.0) / step, "x", "<=", 0.05)
    result("snapshot_bytes_vs_disk_tier", median(written) / tier, "x", "<=", 0.01)


def ram_weights_run(a, root: Path) -> None:
    from megatrain_nb.trainer.snapshot import SnapshotStore

    tr = build(a, root / "ram-out", root / "ram-offload", offload_params=False)
    store = SnapshotStore(root / "ram-out")
    it = tr.iter_steps()
    next(it)
    next(it)
    path = store.path_for(tr.state.global_step, tr.run_id)
    sizes = tr.save_snapshot(path)
    info = store.info(path)
    weights = tr.engine.num_parameters() * 4
    small = sum(f.stat().st_size for f in path.iterdir()
                if f.name in ("scheduler.json", "rng_state.json", "trainer_state.json", "megatrain_state.json"))
    steps = sum(t.numel() * 4 for t in tr.engine.adam.state_dict().values())
    ram_state = weights + small + steps
    print(f"weights in RAM: {weights / 1e6:.1f} MB fp32 weights, {small} B trainer state, {steps} B step counts; "
          f"snapshot wrote {written_bytes(info, sizes) / 1e6:.2f} MB, linked {sizes['linked_bytes'] / 1e6:.1f} MB")
    it.close()
    tr.close()
    result("snapshot_bytes_vs_ram_state", written_bytes(info, sizes) / ram_state, "x", "<=", 1.1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=None, help="folder for output_dir and offload_dir (one filesystem)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--reps", type=int, default=4)
    a = p.parse_args()
    print(machine())
    print(f"load average {os.getloadavg()[0]:.1f} (1 min) on {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory(dir=a.dir, prefix="bench-snapshot-") as d:
        disk_tier_run(a, Path(d))
        ram_weights_run(a, Path(d))
    print(f"load average {os.getloadavg()[0]:.1f} (1 min) at the end")


if __name__ == "__main__":
    main()
