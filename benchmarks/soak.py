"""Soak: train a small model (master weights and int8 optimizer states on the disk tier) with
a checkpoint every few steps, a learning-rate change, and kill -9 at random points, resuming
each time; then compare the final weights with an uninterrupted run (bit-exact) and report
RSS, open file descriptors, threads and bytes under offload_dir over the run.

    python benchmarks/soak.py --steps 2000 --kills 8          # the long soak
    python benchmarks/soak.py --steps 200 --kills 2           # what tests/trainer/test_soak.py runs

Prints ``RESULT`` lines. A job process is this script with ``--job``.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _job(out: Path, steps: int, save_every: int) -> None:
    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, str(REPO))
    from tests.trainer.helpers import args, micro_model, token_dataset
    from megatrain_nb.trainer import Trainer, latest_checkpoint

    torch.set_num_threads(1)
    offload = out / "offload"
    offload.mkdir(parents=True, exist_ok=True)
    a = args(out / "run", max_steps=steps, save_strategy="steps", save_steps=save_every, save_total_limit=2,
             max_grad_norm=1.0, learning_rate=3e-3, lr_scheduler_type="cosine", warmup_steps=5)
    tr = Trainer(model=micro_model(), train_dataset=token_dataset(64), args=a, device="cpu",
                 optimizer_compression="int8", offload_dir=str(offload), offload_params=True)
    resume = latest_checkpoint(out / "run") is not None or None
    metrics = open(out / "metrics.jsonl", "a")
    for record in tr.iter_steps(resume_from_checkpoint=resume):
        step = record["step"]
        if step == steps // 2:
            tr.set_lr(1e-3)  # keyed on the step: a resumed run re-applies it at the same point
        metrics.write(json.dumps({"step": step, "rss": _rss(), "fds": len(os.listdir("/proc/self/fd")),
                                  "threads": _threads(), "offload_bytes": _tree_bytes(offload)}) + "\n")
        metrics.flush()
    save_file({k: v.contiguous() for k, v in tr.engine.state_dict().items()}, str(out / "final.safetensors"))
    tr.close()


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _tree_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in Path(root).rglob("*") if f.is_file())


def _start(out: Path, steps: int, save_every: int) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, __file__, "--job", "--out", str(out), "--steps", str(steps),
                             "--save-every", str(save_every)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def _finish(p: subprocess.Popen, timeout: float) -> None:
    _, err = p.communicate(timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"soak job failed ({p.returncode}):\n{err[-3000:]}")


def _last_step(out: Path) -> int:
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
        return json.loads(lines[-1])["step"] if lines else 0
    except (OSError, ValueError, IndexError):
        return 0


def run(out: Path, steps: int, kills: int, save_every: int, seed: int, timeout: float) -> dict:
    from safetensors.torch import load_file

    t0 = time.time()
    rng = random.Random(seed)
    ref = out / "uninterrupted"
    ref.mkdir(parents=True)
    _finish(_start(ref, steps, save_every), timeout)

    soak = out / "killed"
    soak.mkdir()
    killed = 0
    while killed < kills:
        before = _last_step(soak)
        p = _start(soak, steps, save_every)
        # kill at a random point, after the job got somewhere (every wait bounded)
        target = before + rng.randint(1, max(2, 3 * save_every))
        deadline = time.time() + timeout
        while _last_step(soak) < target and p.poll() is None and time.time() < deadline:
            time.sleep(0.01)
        time.sleep(rng.random() * 0.2)  # lands anywhere: mid-step, mid-checkpoint, mid-write
        if p.poll() is not None:
            break  # finished before the kill: no more kills possible
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
        killed += 1
    _finish(_start(soak, steps, save_every), timeout)

    a, b = load_file(str(ref / "final.safetensors")), load_file(str(soak / "final.safetensors"))
    import torch
    exact = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = [json.loads(x) for x in (soak / "metrics.jsonl").read_text().splitlines()]
    final_run = rows[[i for i, r in enumerate(rows) if i == 0 or r["step"] <= rows[i - 1]["step"]][-1]:]
    res = {"exact": exact, "kills": killed, "seconds": time.time() - t0, "steps": steps, "series": {}}
    for key in ("rss", "fds", "threads", "offload_bytes"):
        vals = [r[key] for r in final_run[1:]] or [r[key] for r in final_run]
        res["series"][key] = (vals[0], vals[-1], max(vals))
    return res


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--kills", type=int, default=8)
    ap.add_argument("--save-every", type=int, default=7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--job", action="store_true")
    o = ap.parse_args(argv)
    if o.job:
        _job(o.out, o.steps, o.save_every)
        return {}
    import tempfile
    out = o.out or Path(tempfile.mkdtemp(prefix="mtnb-soak-"))
    res = run(out, o.steps, o.kills, o.save_every, o.seed, o.timeout)
    print(f"RESULT soak_final_weights_bit_exact {int(res['exact'])} bool (target == 1)")
    print(f"RESULT soak_kill9_resumes {res['kills']} count (target >= {o.kills})")
    for key, (first, last, peak) in res["series"].items():
        print(f"RESULT soak_{key}_first_last_max {first}/{last}/{peak} {'bytes' if 'bytes' in key or key == 'rss' else 'count'} "
              f"(target flat: last <= first * 1.1 + slack)")
    print(f"RESULT soak_wall {res['seconds']:.1f} s ({o.steps} steps)")
    return res


if __name__ == "__main__":
    main()
