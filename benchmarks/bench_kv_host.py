"""The streamed decoder's KV cache in host RAM (engine/compute/kv_offload.py) against the device
cache, on the same engine and the same rollouts, side by side.

    python benchmarks/bench_kv_host.py           # ~1 minute on 2 cores (noisy when shared)

A llama of ``--layers`` layers (hidden ``--hidden``) built from its config, ``--rows`` rollouts
(prompts of 16 random tokens in groups of 4), ``--tokens`` new tokens each, greedy, no end of
sequence; the device cache and the host cache (``StreamedDecoder(engine, kv_tier="host")``)
decoded in turn, ``--reps`` rounds after one to warm up, each one's best round kept.

- ``grpo_kv_host_same_tokens``: 1 when the host cache's completions are the device cache's.
- ``grpo_kv_host_crossings_per_layer_per_token``: the link crossings the host cache counted per
  full-attention layer per decoding pass. Target: exactly 2 (in for the attention, the new
  token's entries back).
- ``grpo_kv_host_bytes_over_expected``: the bytes counted over rows x tokens so far (in) and the
  prompts then one token a row (back), times a token's K+V of a layer. Target: exactly 1.
- ``grpo_kv_host_vs_device_decode``: tokens/s of the host cache over the device cache. On a CPU
  "device" the crossings are memory copies (no PCIe link): the figure is the copies' and the
  buffer's bookkeeping cost, not a GPU's transfer time (docs/GRPO.md prices that).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import result  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from megatrain_nb.engine import StreamingEngine
    from megatrain_nb.engine.compute.decode import StreamedDecoder
    from megatrain_nb.model_configs import family_config

    cfg = family_config("llama", layers=a.layers, hidden=a.hidden, max_position_embeddings=256)
    torch.manual_seed(0)
    engine = StreamingEngine(AutoModelForCausalLM.from_config(cfg).eval(), device="cpu")
    g = torch.Generator().manual_seed(1)
    distinct = [torch.randint(3, cfg.vocab_size, (16,), generator=g).tolist() for _ in range(max(1, a.rows // 4))]
    rows = [p for p in distinct for _ in range(4)][:a.rows]
    gc = GenerationConfig(max_new_tokens=a.tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    decoders = {"device": StreamedDecoder(engine), "host": StreamedDecoder(engine, kv_tier="host")}
    best, outs = {k: float("inf") for k in decoders}, {}
    for rep in range(a.reps + 1):
        for name, dec in decoders.items():
            t = time.perf_counter()
            outs[name] = dec.generate(rows, gc)
            if rep:
                best[name] = min(best[name], time.perf_counter() - t)
    s = outs["host"].stats
    print(f"llama {a.layers} layers, hidden {a.hidden}, {a.rows} rollouts x {a.tokens} new tokens, CPU device; "
          f"best of {a.reps}: device cache {best['device']:.3f} s, host cache {best['host']:.3f} s; "
          f"load {open('/proc/loadavg').read().split()[0]}")
    result("grpo_kv_host_same_tokens", float(outs["host"].completions == outs["device"].completions), "", "==", 1)
    result("grpo_kv_host_crossings_per_layer_per_token", s["kv_crossings"] / (s["kv_host_layers"] * s["passes"]),
           "crossings", "==", 2)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    per = 2 * cfg.num_key_value_heads * head_dim * 4 * s["kv_host_layers"]   # a token's K+V over the layers, fp32
    groups, prompt, n = len(distinct), 16, a.tokens
    want_in = per * a.rows * sum(prompt + t for t in range(n - 1))
    want_out = per * (groups * prompt + a.rows * (n - 1))
    result("grpo_kv_host_bytes_over_expected", (s["kv_h2d_bytes"] + s["kv_d2h_bytes"]) / (want_in + want_out), "x",
           "==", 1)
    result("grpo_kv_host_vs_device_decode", best["device"] / best["host"], "x", ">=", 0.8)
    engine.close()


if __name__ == "__main__":
    main()
