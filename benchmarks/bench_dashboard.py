"""Step time with the live dashboard attached against none, alternating in one run, and the
messages per second the dashboard sends.

    python benchmarks/bench_dashboard.py [--preset tiny] [--pairs 8] [--block-seconds 4] [--seq 64]

One Session trains a real model (mt.Trainer, random tokens) in its background thread. Its
dashboard publishes into counting comms that do what ipykernel does on the sending thread (clean,
serialise and sign each message) but count instead of writing to the IOPub socket: the kernel-side
cost is what can slow training down. The run is cut into blocks of
about ``--block-seconds``; the publisher is switched on or off per block in ABBA order
(off/on, on/off, ...) so that drift cancels. A block's step time is the median wall time
between consecutive step records (everything in the loop counted); the ratio of a pair is
on/off, and the result is the median over pairs. Prints the blocks, medians and RESULT lines.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _Counter:
    def __init__(self):
        self.n = 0
        self.lock = threading.Lock()


def install_recording_comm() -> _Counter:
    """Comms that do the sender-side work of ipykernel's (JSON cleaning, serialising and
    signing the message, on the sending thread) and count instead of writing to a socket."""
    import comm
    from comm.base_comm import BaseComm
    from ipykernel.jsonutil import json_clean
    from jupyter_client.session import Session as WireSession

    wire = WireSession(key=b"benchmark-key")
    counter = _Counter()

    class CountingComm(BaseComm):
        kernel = True  # ipywidgets sends only when a comm has a kernel

        def publish_msg(self, msg_type, data=None, metadata=None, buffers=None, **keys):
            content = json_clean(dict(data=data or {}, comm_id=self.comm_id, **keys))
            wire.serialize(wire.msg(msg_type, content, metadata=json_clean(metadata or {})))
            if msg_type == "comm_msg":
                with counter.lock:
                    counter.n += 1

    comm.create_comm = lambda *a, **k: CountingComm(*a, **k)
    return counter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--block-seconds", type=float, default=4.0)
    ap.add_argument("--warmup-steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0 = torch default)")
    ns = ap.parse_args()

    counter = install_recording_comm()
    import numpy as np
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainingArguments

    from megatrain_nb.notebook import Session
    from megatrain_nb.model_configs import preset_config

    if ns.threads:
        torch.set_num_threads(ns.threads)
    torch.manual_seed(0)
    config = preset_config(ns.preset)
    model = AutoModelForCausalLM.from_config(config)
    rng = np.random.default_rng(0)
    ds = Dataset.from_dict({"input_ids": rng.integers(0, config.vocab_size, size=(4096, ns.seq)).tolist()})
    args = TrainingArguments(output_dir=os.path.join("megatrain_outputs", "bench_dashboard"), max_steps=1_000_000,
                             per_device_train_batch_size=ns.batch, learning_rate=1e-3, lr_scheduler_type="constant",
                             logging_steps=10, save_strategy="no", report_to="none", disable_tqdm=True)
    session = Session(model, train_dataset=ds, args=args, name="bench-dashboard")
    session.dashboard()  # built before training (as train() does in a notebook)
    session.train()
    session.dashboard()  # outside a kernel train() displays nothing: this attaches the publisher
    pub = session.publisher
    pub.enabled = False
    session.wait(until_step=ns.warmup_steps)
    t0, s0 = time.perf_counter(), session.step
    session.wait(until_step=s0 + 30)
    step_s = (time.perf_counter() - t0) / max(1, session.step - s0)
    block = max(20, int(ns.block_seconds / step_s))
    print(f"preset {ns.preset}, batch {ns.batch} x seq {ns.seq}, torch threads {torch.get_num_threads()}, "
          f"~{step_s * 1000:.1f} ms/step -> blocks of {block} steps")

    blocks = []  # (dashboard on?, first step, last step, messages, seconds)
    order = []
    for i in range(ns.pairs):
        order += [False, True] if i % 2 == 0 else [True, False]
    for on in order:
        pub.enabled = on
        start, n0, w0 = session.step, counter.n, time.perf_counter()
        session.wait(until_step=start + block)
        blocks.append((on, start, session.step, counter.n - n0, time.perf_counter() - w0))
    pub.enabled = False
    busy_s = pub.busy_s
    session.stop()
    session.close()

    times = {r["step"]: r["time"] for r in session.history}

    def median_step(first: int, last: int) -> float:
        # skip the first step of a block: it may straddle the switch
        dts = [times[s] - times[s - 1] for s in range(first + 2, last + 1) if s in times and s - 1 in times]
        return statistics.median(dts)

    meds = []
    for on, first, last, msgs, secs in blocks:
        m = median_step(first, last)
        meds.append(m)
        print(f"  dashboard {'on ' if on else 'off'} steps {first + 1:6d}-{last:6d}: median step {m * 1000:8.3f} ms, "
              f"{msgs:5d} messages in {secs:6.2f} s")
    ratios = []
    for i in range(0, len(blocks), 2):
        a_on = blocks[i][0]
        on_t, off_t = (meds[i], meds[i + 1]) if a_on else (meds[i + 1], meds[i])
        ratios.append(on_t / off_t)
    on_msgs = sum(b[3] for b in blocks if b[0])
    on_secs = sum(b[4] for b in blocks if b[0])
    off_msgs = sum(b[3] for b in blocks if not b[0])
    ratio = statistics.median(ratios)
    rate = on_msgs / on_secs
    print(f"pair ratios (on/off): {', '.join(f'{r:.3f}' for r in ratios)}")
    print(f"median step: on {statistics.median(m for m, b in zip(meds, blocks) if b[0]) * 1000:.3f} ms, "
          f"off {statistics.median(m for m, b in zip(meds, blocks) if not b[0]) * 1000:.3f} ms")
    print(f"messages while off: {off_msgs}; publisher busy {busy_s:.2f} s over the run")
    print(f"RESULT dashboard_step_time_ratio {ratio:.3f} x (target <= 1.02)")
    print(f"RESULT dashboard_messages_per_second {rate:.1f} msg/s (target <= 30)")


if __name__ == "__main__":
    main()
