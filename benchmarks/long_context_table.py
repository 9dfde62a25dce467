"""Long sequences on paper: the longest row ``mt.estimate`` says fits one GPU's device working set,
for a Llama-3-8B-shaped and a Llama-3-70B-shaped model on an 80 GB and a 141 GB GPU.

Computed from the planner (no GPU, nothing downloaded, configs only): for each model and device,
``mt.estimate(..., seq=S)`` at batch 1, checkpoint interval 1, the MLP tiled as the planner
chooses from the budget; host RAM and the disk tier are not limited (a long row's boundary
activations wait there: the host RAM and disk a plan needs at that length are printed beside it).
The longest length is ``Estimate.plan.longest_seq`` (bisection over the planner's arithmetic) and
is checked: ``estimate`` at that length fits, one token more does not.

The devices' budgets are their reported memory: H100 80 GB 81,559 MiB, H200 141 GB 143,771 MiB
(the CUDA context and allocator slack are not planned; the engine measures them at run time).

Prints a markdown table and ends with:
  RESULT longest_seq_llama8b_80gb <N> tokens (on paper...)   (and _141gb, llama70b_..., bf16 compute)
  RESULT longest_seq_llama8b_80gb_fp32 <N> tokens   (the same at fp32 compute)
  RESULT llama8b_131072_fits_80gb <0|1> (device working set <X> GiB of 80)
"""
from __future__ import annotations

import sys

from transformers import AutoConfig

import megatrain_nb as mt

GiB = 1024 ** 3
MODELS = {   # the Llama 3 shapes (vocabulary 128,256; grouped-query attention, 8 KV heads)
    "llama8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32),
    "llama70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64),
}
DEVICES = {"80gb": 81559 / 1024, "141gb": 143771 / 1024}   # GiB


def config(name: str):
    return AutoConfig.for_model("llama", num_key_value_heads=8, vocab_size=128256, max_position_embeddings=1 << 24,
                                **MODELS[name])


def estimate(cfg, seq: int, vram_gb: float, precision: str):
    return mt.estimate(cfg, seq=seq, vram_gb=vram_gb, ram_gb=None, disk_gb=None, precision=precision)


def longest(cfg, vram_gb: float, precision: str) -> dict:
    """The longest row that fits, checked at that length and one token more."""
    z = estimate(cfg, 8192, vram_gb, precision).plan.longest_seq
    at, over = estimate(cfg, z, vram_gb, precision), estimate(cfg, z + 1, vram_gb, precision)
    if not at.feasible or over.feasible:
        raise SystemExit(f"longest_seq {z} is not the edge: fits at z {at.feasible}, at z+1 {over.feasible}")
    t = at.tiers()
    return {"seq": z, "tile": at.plan.tile_tokens, "device": t["device"]["total"], "host": t["host"]["total"],
            "boundary_where": at.placement.get("activations", "device"),
            "boundary": t["host"].get("activations") or t["disk"].get("activations") or 0}


def main() -> int:
    rows, results = [], []
    for precision in ("bf16", "fp32"):
        for name in MODELS:
            cfg = config(name)
            for dev, vram in DEVICES.items():
                r = longest(cfg, vram, precision)
                rows.append(f"| {name} | {dev.replace('gb', ' GB')} | {precision} | {r['seq']:,} | {r['tile']:,} | "
                            f"{r['device'] / GiB:.1f} GiB | {r['boundary'] / GiB:,.0f} GiB in {r['boundary_where']} "
                            f"| {r['host'] / GiB:,.0f} GiB |")
                suffix = "" if precision == "bf16" else "_fp32"
                results.append(f"RESULT longest_seq_{name}_{dev}{suffix} {r['seq']} tokens (on paper: the planner's arithmetic)")
    print("| model | GPU | compute | longest row (tokens) | MLP tile | device working set | boundary "
          "activations | host RAM needed |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    print("\n".join(rows))
    paper = estimate(config("llama8b"), 131072, 80, "bf16")
    for line in results:
        print(line)
    print(f"RESULT llama8b_131072_fits_80gb {int(paper.feasible)} (target == 1; device working set "
          f"{paper.tiers()['device']['total'] / GiB:.1f} GiB of 80, bf16 compute, MLP tiles of "
          f"{paper.plan.tile_tokens:,} tokens)")
    return 0 if paper.feasible else 1


if __name__ == "__main__":
    sys.exit(main())
