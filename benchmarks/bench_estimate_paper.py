"""Qwen2.5-32B on one H100, on paper: the figure issue 45 opens with, printed by the documented call.

    python benchmarks/bench_estimate_paper.py          # seconds; no GPU, nothing downloaded

``mt.estimate(config, rates="h100-pcie5-gen4nvme", ...)`` for Qwen2.5-32B's published config.json
(huggingface.co/Qwen/Qwen2.5-32B: hidden 5120, MLP 27648, 64 layers, 40 heads, 8 key/value heads,
vocabulary 152064, untied head), 96 x 1024 tokens a step (batch 1 x 1024, 96 micro-batches of
accumulation: MegaTrain's published setting), bf16 compute over fp32 master weights, int8
optimizer states, ``ram_gb=330`` (what MegaTrain reports using), the disk tier the plan needs.
Model TFLOPS = 6 x parameters x tokens per second (MegaTrain's count; ~259 published for this
model and batch on one H100).

The profile publishes the GPU's, the link's and the disk's rates and the host's cores (14 per
GPU); it publishes no CPU rates, so the AdamW and codec rates per thread are the ones measured on
the machine running this (``mt.measure_machine()``'s cache, ``MachineRates.with_cpu_from``),
priced at the threads the update gets on the profile's host (``EngineConfig.optimizer_threads``'
default: its cores less the engine's 3). They are printed, with the load, because on a shared
or slow host the optimizer bounds the figure.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from common import result  # noqa: E402

PROFILE = "h100-pcie5-gen4nvme"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ram", type=float, default=330.0, help="host RAM in GiB")
    p.add_argument("--accumulation", type=int, default=96)
    p.add_argument("--seq", type=int, default=1024)
    a = p.parse_args(argv)
    import megatrain_nb as mt
    from megatrain_nb.engine.planning.prediction import update_threads
    from megatrain_nb.engine.planning.rates import rates_for
    from megatrain_nb.engine.planning.rates_cache import cached_rates
    from megatrain_nb.model_configs import published_config

    config = published_config("qwen2.5-32b")
    print(f"load average {os.getloadavg()[0]:.2f} (this machine's CPU rates feed the optimizer's phase)")
    est = mt.estimate(config, vram_gb=80, ram_gb=a.ram, disk_gb=4000, batch=1, seq=a.seq,
                      accumulation=a.accumulation, precision="bf16", compression="int8", rates=PROFILE)
    print(est.table() if hasattr(est, "table") else est)
    pred = est.prediction
    tokens = a.accumulation * a.seq
    tflops = 6 * est.num_parameters * pred.tokens_per_second / 1e12
    cpu = cached_rates(device="cpu")
    est_rates = rates_for(PROFILE)
    if cpu is None:
        print("CPU rates: none cached on this machine (mt.measure_machine() measures them): the optimizer counts 0 s")
    else:
        print(f"CPU rates (this machine's cache, measured {time.ctime(cpu.measured_at)}): AdamW "
              f"{cpu.adamw_per_thread / 1e6:,.1f} M params/s per thread, int8 update chain "
              f"{cpu.update_chain.get('int8', 0) / 1e6:,.1f} M params/s on {cpu.chain_threads()} thread(s); the H100 "
              f"host's update threads: {update_threads(True, cores=est_rates.cores)} of its {est_rates.cores} cores "
              f"(EngineConfig.optimizer_threads' default)")
    print(f"{est.num_parameters / 1e9:.2f}B parameters, {tokens:,} tokens a step, step {pred.step_seconds:.1f} s, "
          f"bottleneck {pred.bottleneck}; MegaTrain publishes ~259 model TFLOPS for this run")
    result("estimate_qwen2_5_32b_h100_96x1024_330gb_tflops", tflops, "TFLOPS", ">=", 310)


if __name__ == "__main__":
    main()
