"""Soak: train a small model (master weights and int8 optimizer states on the disk tier) in a
notebook Session with a checkpoint every few steps, pauses, resumes and learning-rate changes
at seeded step boundaries, and kill -9 at random points, resuming each time; then compare the
final weights (bit-exact) and the learning rate of every step with an uninterrupted run that
takes the same controls at the same steps, and report RSS, open file descriptors, threads and
bytes under offload_dir over the run, and the heartbeat files left in the runtime folders once every
job has ended (none: an ended session's file goes when its process exits, and a killed process's
when the next one's beacon starts).

    python benchmarks/soak.py --steps 2000 --kills 8          # the long soak
    python benchmarks/soak.py --steps 100 --kills 2 --save-every 5 --seed 1   # what tests/trainer/test_soak.py runs

The controls go through the real paths: a callback at the end of a planned step calls
``session.pause()`` (or ``session.set_lr()``), which the Session applies at that step boundary;
while paused, the job sends the new learning rate and the resume either as notebook calls
(``session.set_lr``/``session.resume``) or as command files in the session beacon's inbox
(``lab.registry.enqueue_command``, what the JupyterLab sidebar does). A kill may land while paused.

A resumed job re-applies only the controls planned at its checkpoint's own step boundary (they
came after that checkpoint was written); earlier learning-rate changes must come back from the
checkpoint itself, or the weights would differ.

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


def plan_controls(steps: int, seed: int) -> dict[int, dict]:
    """Step boundary -> {"pause": bool, "lr": float | None, "via": "notebook" | "lab"}.
    At least one pause/resume and two learning-rate changes (one while paused, one without)."""
    rng = random.Random(seed * 7919 + steps)
    n = max(3, steps // 30)
    lo, hi = 3, max(4, steps - 2)
    bounds = sorted(rng.sample(range(lo, hi), min(n, hi - lo)))
    kinds = ["pause+lr", "lr", "pause"]
    plan = {}
    for i, b in enumerate(bounds):
        kind = kinds[i % 3] if i < 3 else rng.choice(kinds)
        lr = round(rng.uniform(5e-4, 5e-3), 6) if "lr" in kind else None
        plan[b] = {"pause": kind.startswith("pause"), "lr": lr, "via": rng.choice(["notebook", "lab"])}
    return plan


def _job(out: Path, steps: int, save_every: int, seed: int) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import TrainerCallback

    sys.path.insert(0, str(REPO))
    from megatrain_nb.channel import registry
    from megatrain_nb.notebook import Session
    from megatrain_nb.notebook.lifecycle import ENDED
    from megatrain_nb.trainer import Trainer, checkpoint as ckpt
    from tests.trainer.helpers import args, micro_model, token_dataset

    torch.set_num_threads(1)
    os.environ["MEGATRAIN_NB_RUNTIME_DIR"] = str(out / "runtime")
    plan = plan_controls(steps, seed)
    offload = out / "offload"
    offload.mkdir(parents=True, exist_ok=True)
    a = args(out / "run", max_steps=steps, save_strategy="steps", save_steps=save_every, save_total_limit=2,
             max_grad_norm=1.0, learning_rate=3e-3, lr_scheduler_type="cosine", warmup_steps=5)
    tr = Trainer(model=micro_model(), train_dataset=token_dataset(64), args=a, device="cpu",
                 optimizer_compression="int8", offload_dir=str(offload), offload_params=True)
    resume = ckpt.latest_checkpoint(out / "run")
    start = ckpt.read_json(resume / ckpt.STATE_FILE)["global_step"] if resume is not None else 0
    metrics = open(out / "metrics.jsonl", "a")

    class Controls(TrainerCallback):
        """At the end of a planned step: ask for a pause (or an LR change) through the Session."""

        def on_step_end(self, _args, state, control, **kw):
            step = state.global_step
            c = plan.get(step)
            if c is not None:
                if c["pause"]:
                    session.pause(source="soak")
                elif c["lr"] is not None:
                    session.set_lr(c["lr"], source="soak")
            metrics.write(json.dumps({"step": step, "rss": _rss(), "fds": len(os.listdir("/proc/self/fd")),
                                      "threads": _threads(), "offload_bytes": _tree_bytes(offload)}) + "\n")
            metrics.flush()

    tr.add_callback(Controls())
    session = Session.from_trainer(tr, name="soak", resume_from_checkpoint=str(resume) if resume else None)
    c = plan.get(start)
    if c is not None:  # planned at the checkpoint's own boundary: it came after the save, apply it again
        session.pause(source="soak")
        if c["lr"] is not None:
            session.set_lr(c["lr"], source="soak")
        session.resume(source="soak")
    handled = {start}
    rng = random.Random(os.getpid())
    session.train(dashboard=False)
    deadline = time.time() + 3600
    while session.wait(timeout=0.05) not in ENDED and time.time() < deadline:
        step = session.step
        if session.state != "paused" or step in handled or step not in plan:
            continue
        handled.add(step)
        c = plan[step]
        time.sleep(rng.random() * 0.3)  # held paused a while: a kill may land here
        if c["via"] == "lab":  # the sidebar's path: command files the beacon applies in order
            if c["lr"] is not None:
                registry.enqueue_command(session.id, "lr", c["lr"], source="soak-lab")
            registry.enqueue_command(session.id, "resume", source="soak-lab")
        else:
            if c["lr"] is not None:
                session.set_lr(c["lr"], source="soak")
            session.resume(source="soak")
    if session.state != "finished":
        raise RuntimeError(f"soak job ended {session.state} at step {session.step}: {session.error!r}")
    save_file({k: v.contiguous() for k, v in tr.engine.state_dict().items()}, str(out / "final.safetensors"))
    (out / "events.json").write_text(json.dumps([{k: e.get(k) for k in ("kind", "step", "value", "source")}
                                                 for e in session.events]))
    session.close()


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _tree_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in Path(root).rglob("*") if f.is_file())


def _start(out: Path, steps: int, save_every: int, seed: int) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, __file__, "--job", "--out", str(out), "--steps", str(steps),
                             "--save-every", str(save_every), "--seed", str(seed)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _finish(p: subprocess.Popen, timeout: float) -> None:
    try:
        _, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        _, err = p.communicate(timeout=30)
        raise RuntimeError(f"soak job did not finish within {timeout:.0f} s:\n{err[-3000:]}") from None
    if p.returncode != 0:
        raise RuntimeError(f"soak job failed ({p.returncode}):\n{err[-3000:]}")


def _last_step(out: Path) -> int:
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
        return json.loads(lines[-1])["step"] if lines else 0
    except (OSError, ValueError, IndexError):
        return 0


def _lr_by_step(run_dir: Path) -> dict[int, float]:
    """The learning rate each step trained with, from the Trainer's metrics.jsonl (for a step
    trained twice, once before a kill and again after the resume, the later run's)."""
    lrs = {}
    for r in _metrics(run_dir):
        if "event" not in r and "lr" in r:
            lrs[int(r["step"])] = float(r["lr"])
    return lrs


def _starts(run_dir: Path) -> int:
    return sum(1 for r in _metrics(run_dir) if r.get("event") == "run_start")


def _metrics(run_dir: Path) -> list[dict]:
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:  # the last line of a killed job may be cut short
            pass
    return rows


def run(out: Path, steps: int, kills: int, save_every: int, seed: int, timeout: float) -> dict:
    import torch
    from safetensors.torch import load_file

    t0 = time.time()
    rng = random.Random(seed)
    ref = out / "uninterrupted"
    ref.mkdir(parents=True)
    _finish(_start(ref, steps, save_every, seed), timeout)

    soak = out / "killed"
    soak.mkdir()
    plan = plan_controls(steps, seed)
    lr_steps = sorted(s for s, c in plan.items() if c["lr"] is not None)
    # the last kill comes after a checkpoint that holds an LR change (which the resume must keep)
    floor = min(lr_steps[0] + save_every + 1, steps - 1) if lr_steps else 0
    killed = 0
    while killed < kills:
        before = _last_step(soak)
        p = _start(soak, steps, save_every, seed)
        # kill at a random point, after the job got somewhere, spread over the run (every wait bounded)
        target = before + rng.randint(1, max(2, 3 * save_every, 2 * steps // (kills + 1)))
        if killed == kills - 1:
            target = max(target, floor)
        target = min(target, steps - save_every - 2)  # while steps are left (the job must not finish first)
        deadline = time.time() + timeout
        while _last_step(soak) < target and p.poll() is None and time.time() < deadline:
            time.sleep(0.01)
        time.sleep(rng.random() * 0.2)  # lands anywhere: mid-step, mid-checkpoint, mid-write, paused
        if p.poll() is not None:
            if p.returncode != 0:
                _finish(p, 1)  # raises with the job's error
            break  # finished before the kill: no more kills possible
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
        killed += 1
    _finish(_start(soak, steps, save_every, seed), timeout)

    a, b = load_file(str(ref / "final.safetensors")), load_file(str(soak / "final.safetensors"))
    exact = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    lr_ref, lr_soak = _lr_by_step(ref / "run"), _lr_by_step(soak / "run")
    # every planned control, as the uninterrupted run's Session recorded it (step, kind, value, path)
    seen = {(e["step"], e["kind"], e["value"], e["source"]) for e in json.loads((ref / "events.json").read_text())}
    wanted = [(b, kind, c["lr"] if kind == "lr" else None, "soak-lab" if c["via"] == "lab" and kind != "pause" else "soak")
              for b, c in plan.items() for kind in (["pause", "resume"] if c["pause"] else []) + (["lr"] if c["lr"] else [])]
    resumed_at = [r["step"] for r in _metrics(soak / "run") if r.get("event") == "run_start" and r["step"] > 0]
    ref_rows = _metrics(ref)
    rows = _metrics(soak)
    final_run = rows[[i for i, r in enumerate(rows) if i == 0 or r["step"] <= rows[i - 1]["step"]][-1]:]
    res = {"exact": exact, "lr_match": lr_ref == lr_soak and len(lr_ref) == steps, "kills": killed,
           "starts": _starts(soak / "run"), "seconds": time.time() - t0, "steps": steps,
           "controls": (sum(w in seen for w in wanted), len(wanted)),
           "resumed_at": resumed_at,
           "resumed_past_lr_change": bool(lr_steps) and any(r > lr_steps[0] for r in resumed_at),
           "pauses": sum(c["pause"] for c in plan.values()),
           "lr_changes": sum(c["lr"] is not None for c in plan.values()),
           "lr_changed_steps": sum(1 for s, lr in enumerate(_scheduled(steps), 1) if lr_ref.get(s, lr) != lr),
           "series": _series(ref_rows), "series_last_resume": _series(final_run),
           "heartbeats_left": _heartbeats(ref) + _heartbeats(soak)}
    return res


def _heartbeats(out: Path) -> list[str]:
    """Heartbeat files left in a job folder's runtime folder once its last process has exited (its
    session ended: none; the killed processes' ones are tidied by the next process's beacon)."""
    folder = out / "runtime" / "sessions"
    return sorted(p.name for p in folder.glob("*.json")) if folder.is_dir() else []


def _series(rows: list[dict]) -> dict:
    """(first, last, max) of each resource over one process's steps (the first step excluded:
    it sets up the buffers)."""
    out = {}
    for key in ("rss", "fds", "threads", "offload_bytes"):
        vals = [r[key] for r in rows[1:]] or [r[key] for r in rows]
        out[key] = (vals[0], vals[-1], max(vals))
    return out


def _scheduled(steps: int) -> list[float]:
    """The learning rate the schedule alone gives each step (to count the steps LR changes moved)."""
    from megatrain_nb.trainer.schedule import LRSchedule

    s = LRSchedule(learning_rate=3e-3, scheduler_type="cosine", num_training_steps=steps, num_warmup_steps=5)
    lrs = []
    for _ in range(steps):
        lrs.append(s.current())
        s.step()
    return lrs


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--kills", type=int, default=8)
    ap.add_argument("--save-every", type=int, default=7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--job", action="store_true")
    o = ap.parse_args(argv)
    if o.job:
        _job(o.out, o.steps, o.save_every, o.seed)
        return {}
    import tempfile
    out = o.out or Path(tempfile.mkdtemp(prefix="mtnb-soak-"))
    res = run(out, o.steps, o.kills, o.save_every, o.seed, o.timeout)
    print(f"RESULT soak_final_weights_bit_exact {int(res['exact'])} bool (target == 1)")
    print(f"RESULT soak_lr_every_step_matches {int(res['lr_match'])} bool (target == 1; {res['lr_changes']} LR "
          f"changes, {res['pauses']} pause/resume, {res['lr_changed_steps']} steps off the schedule)")
    print(f"RESULT soak_controls_applied_at_their_step {res['controls'][0]}/{res['controls'][1]} count (target all; "
          f"pause/resume/set_lr through the Session and the beacon inbox)")
    print(f"RESULT soak_kill9_resumes {res['kills']} count (target >= {o.kills}; {res['starts']} starts, resumed at "
          f"steps {res['resumed_at']}, past an LR change: {res['resumed_past_lr_change']})")
    for which, label in (("series", f"the uninterrupted process, {o.steps} steps"),
                         ("series_last_resume", "the last resumed process")):
        for key, (first, last, peak) in res[which].items():
            unit = "bytes" if "bytes" in key or key == "rss" else "count"
            name = f"soak_{key}_first_last_max" + ("" if which == "series" else "_after_resume")
            print(f"RESULT {name} {first}/{last}/{peak} {unit} (target flat: last <= first * 1.1 + slack; {label})")
    print(f"RESULT soak_heartbeat_files_left {len(res['heartbeats_left'])} count (target == 0; the runtime folders "
          f"after every job ended, {res['kills']} of them killed)")
    print(f"RESULT soak_wall {res['seconds']:.1f} s ({o.steps} steps)")
    return res


if __name__ == "__main__":
    main()
