"""Long context: a training step's peak RSS and time per token as the sequence grows.

Llama with hidden 64, 2 layers, one sequence, ``StreamingEngine.forward_backward`` on the CPU;
each (intermediate size, sequence length, tile) runs in a fresh child process, whose peak RSS
(ru_maxrss) is the figure. Growth per token = (peak at 16,384 - peak at 8,192) / 8,192.
Step time per token at 16,384 vs 2,048 after removing attention's quadratic part (the
process's CPU time in the RESULT, wall time printed beside it): the attention kernel's own
time (SDPA causal forward without and with gradients and its backward, per layer, timed in
the child on the step's shapes) is subtracted from the step's.

Ends with:
  RESULT long_ctx_rss_growth_per_token <KiB/token> (target <= 6)
  RESULT long_ctx_rss_growth_i1024_vs_i4096 <ratio> (target within 20%)
  RESULT long_ctx_time_per_token_16k_vs_2k <ratio> x (target <= 1.15)
``--untiled`` also measures tile_tokens=0 (the engine without tiling) for comparison.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, peak_rss_bytes, result  # noqa: E402

HIDDEN, LAYERS, HEADS = 64, 2, 4


def child(inter: int, seq: int, tile, steps: int) -> dict:
    import torch
    import torch.nn.functional as F
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatrain_nb.engine import EngineConfig, StreamingEngine

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("llama", vocab_size=256, hidden_size=HIDDEN, intermediate_size=inter,
                               num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                               max_position_embeddings=seq, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    overrides = {} if tile is None else {"tile_tokens": tile}
    engine = StreamingEngine(model, EngineConfig(device="cpu", overrides=overrides))
    ids = torch.randint(1, 256, (1, seq), generator=torch.Generator().manual_seed(1))
    times, cpu = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        engine.forward_backward(ids)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    peak = peak_rss_bytes()
    report = engine.runner.tiling.report()
    engine.close()
    q = torch.randn(1, HEADS, seq, HIDDEN // HEADS, requires_grad=True)
    k, v = torch.randn_like(q).requires_grad_(), torch.randn_like(q).requires_grad_()
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.no_grad():
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    o.backward(torch.ones_like(o))
    attn = (time.perf_counter() - t0) * LAYERS   # per step: a no-grad forward, a forward with grad, a backward
    attn_cpu = (time.process_time() - c0) * LAYERS
    return {"peak": peak, "step_s": min(times), "attn_s": attn, "step_cpu_s": min(cpu), "attn_cpu_s": attn_cpu,
            "tile": report["tile_tokens"], "tiled": report["tiled"], "untiled": report["untiled"],
            "allocator": report.get("host_allocator")}


def run_child(inter: int, seq: int, tile, steps: int) -> dict:
    cmd = [sys.executable, __file__, "--child", json.dumps([inter, seq, tile, steps])]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child")
    ap.add_argument("--untiled", action="store_true", help="also measure the engine without tiling")
    ap.add_argument("--steps", type=int, default=2)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(*json.loads(a.child))))
        return
    print(machine(), "| load:", os.getloadavg())
    tiles = [None] + ([0] if a.untiled else [])
    r = {}
    for tile in tiles:
        for inter in (4096, 1024):
            for seq in (2048, 8192, 16384) if inter == 4096 else (8192, 16384):
                r[(tile, inter, seq)] = x = run_child(inter, seq, tile, a.steps)
                print(f"tile={x['tile']} inter={inter} seq={seq}: peak RSS {x['peak'] / 2**20:.0f} MiB, step "
                      f"{x['step_s']:.2f} s ({x['step_cpu_s']:.2f} s CPU), attention {x['attn_s']:.2f} s "
                      f"({x['attn_cpu_s']:.2f} s CPU); tiled {x['tiled']} untiled {x['untiled']}; {x['allocator']}",
                      flush=True)

    def growth(tile, inter):
        return (r[(tile, inter, 16384)]["peak"] - r[(tile, inter, 8192)]["peak"]) / 8192 / 1024
    if a.untiled:
        print(f"untiled (tile_tokens=0): growth {growth(0, 4096):.1f} KiB/token at intermediate 4096")
    g4, g1 = growth(None, 4096), growth(None, 1024)
    result("long_ctx_rss_growth_per_token", g4, "KiB/token", "<=", 6)
    result("long_ctx_rss_growth_i1024_vs_i4096", g1 / g4 if g4 else float("nan"), "ratio", "within", 0.2)
    ratio = {}
    for kind, step, attn in (("wall", "step_s", "attn_s"), ("CPU", "step_cpu_s", "attn_cpu_s")):
        per_tok = {s: (r[(None, 4096, s)][step] - r[(None, 4096, s)][attn]) / s for s in (2048, 16384)}
        share = {s: r[(None, 4096, s)][attn] / r[(None, 4096, s)][step] for s in (2048, 16384)}
        ratio[kind] = per_tok[16384] / per_tok[2048]
        print(f"{kind} time: attention share of the step {share[2048]:.1%} at 2,048, {share[16384]:.1%} at 16,384; "
              f"per token without it {per_tok[2048] * 1e6:.1f} us at 2,048, {per_tok[16384] * 1e6:.1f} us at 16,384 "
              f"({ratio[kind]:.2f} x)")
    # the process's CPU time: on a machine shared with other work, wall time measures the others too
    result("long_ctx_time_per_token_16k_vs_2k", ratio["CPU"], "x", "<=", 1.15)


if __name__ == "__main__":
    main()
