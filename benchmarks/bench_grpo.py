"""mt.GRPOTrainer's figures: the streamed decoder's weight loads and speed, and the training step
against a plain (SFT) step of the engine on the same tokens.

    python benchmarks/bench_grpo.py            # ~3 minutes on 2 cores (noisy when shared)
    python benchmarks/bench_grpo.py --only decode   # the decoder's figures alone

**Decoding** (engine/compute/decode.py), on a model of ``--decode-preset`` built from its config,
prompts of 16 random tokens in groups of 4 (a GRPO group's shared prompt), ``--decode-tokens``
new tokens per row, greedy, no end of sequence (every row decodes every token):

- ``grpo_decode_weight_loads_per_token[N]``: the transport's copies into a device slot per unit
  per decoded token, for N = 8, 32 and 128 rollouts (the engine's load counters, one per transport
  copy; the largest over the units). Target: exactly 1 whatever N.
- ``grpo_streamed_decode_vs_resident_generate``: the streamed decoder's tokens/s over
  transformers' ``generate`` on a resident copy of the same weights, ``--rows`` rollouts (64).
  Target >= 0.8.
- ``grpo_streamed_decode_tokens_per_s_8_to_64``: the streamed decoder's tokens/s at 64 rollouts
  over 8 (each unit's weights cross once per token for all rows: the more rows, the more tokens
  per crossing). Target >= 6. (On a CPU "device" the rows' matrix products grow with the rows:
  the crossing is a memory copy, not a PCIe transfer, so the growth is the compute's.)
- ``grpo_resident_generate_tokens_per_s_8_to_64``: the same ratio for transformers' ``generate``
  on the resident copy, timed in the same rounds (no target: the CPU's own growth with the rows).

Beside them: the arithmetic floor (:func:`floor`): FLOPs per row per pass of the model's matrix
products, their best rate at 64 rows on this machine, and the best 64/8 the decoder could reach
were nothing but them to grow with the rows; and a pass's time split at 8 and 64 rows
(:func:`pass_split`: timers of this bench around the decoder's parts, on a decoding of their own).

The decodings (streamed and resident at 8, 64 and ``--rows``) are timed in turn,
round after round (``--decode-reps`` rounds after one to warm up); the figures use each one's best
round, the run least disturbed by whatever else the machine runs, and the medians are printed.

**Training step**:

Rollouts are made once by an mt.GRPOTrainer (prompts from the shipped chat set, completions
sampled by ``generate`` on the resident copy, a rule-based reward); then the same micro-batches
(prompt + completion tokens, labels on the completions) go through the engine's
``forward_backward`` with the update, alternating between GRPO's objective (fed its advantages,
old and reference log-probs as a ``num_iterations=2, beta=0.04`` run feeds them) and the token
loss an SFT step uses, ``--reps`` each after ``--warmup``. Target:

- ``grpo_train_step_vs_sft_step`` <= 1.1x (the objective's extra cost: one more forward of the
  head per chunk, as DPO's; ``docs/GRPO.md``).

Generation time is not part of this figure (a resident ``generate`` is transformers' own).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, median, result  # noqa: E402


def _trainer(a, out: Path):
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig

    import megatrain_nb as mt
    from megatrain_nb.assets import chat_dataset, chat_tokenizer
    from megatrain_nb.model_configs import preset_config

    tok = chat_tokenizer()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(preset_config(a.preset, vocab_size=len(tok)))
    rows = [{"prompt": c["messages"][:1]} for c in list(chat_dataset())[:64]]

    def reward_len(completions, **kw):
        return [-abs(12 - len(c[0]["content"].split())) for c in completions]

    args = GRPOConfig(output_dir=str(out), bf16=False, use_cpu=True, per_device_train_batch_size=a.batch,
                      num_generations=4, max_completion_length=a.completion, beta=0.04, num_iterations=2,
                      report_to="none", save_strategy="no", disable_tqdm=True, max_steps=1, seed=0)
    return mt.GRPOTrainer(model=model, reward_funcs=reward_len, args=args, train_dataset=Dataset.from_list(rows),
                          processing_class=tok, device="cpu")


# ---------------------------------------------------------------------------------- decoding
def _decode_setup(a):
    """(engine, a resident copy of the same weights, the vocabulary size) of ``--decode-preset``."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    from megatrain_nb.engine import StreamingEngine
    from megatrain_nb.model_configs import preset_config

    cfg = preset_config(a.decode_preset)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    resident = copy.deepcopy(model)
    return StreamingEngine(model, device="cpu"), resident, cfg.vocab_size


def _rows(vocab: int, n: int):
    """``n`` rollouts: prompts of 16 tokens, each shared by a group of 4."""
    import torch

    g = torch.Generator().manual_seed(n)
    prompts = [torch.randint(3, vocab, (16,), generator=g).tolist() for _ in range(max(1, n // 4))]
    return [p for p in prompts for _ in range(min(4, n))]


def _greedy(tokens: int):
    from transformers import GenerationConfig

    return GenerationConfig(max_new_tokens=tokens, do_sample=False, eos_token_id=None, pad_token_id=0)


def decode_loads(engine, vocab: int, tokens: int) -> None:
    """The loads per unit per decoded token for 8, 32 and 128 rollouts (the engine's load counters:
    one per transport copy of a unit into a device slot)."""
    from megatrain_nb.engine.compute.decode import StreamedDecoder

    for n in (8, 32, 128):
        before = dict(engine.counters.loads_per_unit)
        out = StreamedDecoder(engine).generate(_rows(vocab, n), _greedy(tokens))
        engine.pager.reset()   # (nothing left in flight)
        decoded = max(map(len, out.completions))
        per = [(engine.counters.loads_per_unit.get(u.name, 0) - before.get(u.name, 0)) / decoded for u in engine.units]
        print(f"{n} rollouts x {decoded} tokens: loads per unit per token min {min(per):g} max {max(per):g} "
              f"({len(per)} units, {out.stats['prefill_rows']} prompts prefilled)")
        result(f"grpo_decode_weight_loads_per_token[{n}]", max(per), "loads/unit/token", "==", 1)


def _linears(resident, rows: int, prompts: int, prompt_len: int, tokens: int):
    """The matrix products of a streamed decoding of ``rows`` rollouts on the model's own weights:
    (a function running one decoding pass's, on random inputs: every decoder layer's linear layers
    and the head; FLOPs per row per pass; FLOPs of the whole decoding: the prefill's ``prompts`` x
    ``prompt_len`` tokens through the layers and the head on their last position, then ``tokens -
    1`` passes of ``rows`` rows)."""
    import torch
    import torch.nn.functional as F

    top = resident.get_output_embeddings()
    ws = [m.weight.detach() for m in resident.modules() if isinstance(m, torch.nn.Linear)]   # (the head's too)
    xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in ws}

    def one_pass():
        with torch.no_grad():
            for w in ws:
                F.linear(xs[w.shape[1]], w)

    head = 2 * top.weight.numel()
    layer = 2 * sum(w.numel() for w in ws) - head
    return (one_pass, layer + head,
            layer * (prompts * prompt_len + (tokens - 1) * rows) + head * (prompts + (tokens - 1) * rows))


def decode_speed(engine, resident, vocab: int, a) -> None:
    """Streamed vs resident tokens/s at ``--rows``; tokens/s at 64 over 8 rollouts, streamed and
    resident; the matrix products' own growth from 8 to 64 rows (the arithmetic floor)."""
    import torch

    from megatrain_nb.engine.compute.decode import StreamedDecoder
    from megatrain_nb.trainer.grpo_rollout import left_pad

    dec, gc = StreamedDecoder(engine), _greedy(a.decode_tokens)
    clock = time.process_time if a.clock == "cpu" else time.perf_counter

    def streamed(rows):
        dec.generate(rows, gc)

    def generate(rows):
        ids, mask = left_pad(rows, 0)
        with torch.no_grad():
            resident.generate(input_ids=ids, attention_mask=mask, generation_config=gc)

    def rates(runs):
        """tokens/s of each ``name: (fn, rows)``, interleaved round by round (the first round warms
        up); the best of ``--decode-reps`` rounds and their median."""
        times = {k: [] for k in runs}
        for i in range(1 + a.decode_reps):
            for k, (fn, rows) in runs.items():
                t0 = clock()
                fn(rows)
                if i:
                    times[k].append(clock() - t0)
        tok = {k: len(rows) * a.decode_tokens for k, (_, rows) in runs.items()}
        return ({k: tok[k] / min(v) for k, v in times.items()}, {k: tok[k] / median(v) for k, v in times.items()})

    sets = {n: _rows(vocab, n) for n in sorted({8, 64, a.rows})}
    mm = {n: _linears(resident, n, len(set(map(tuple, sets[n]))), 16, a.decode_tokens) for n in (8, 64)}
    runs = {f"streamed {n}": (streamed, sets[n]) for n in sets}
    runs.update({f"resident {n}": (generate, sets[n]) for n in sets})
    best, med = rates(runs)
    for k in best:
        print(f"{k}: {best[k]:.0f} tokens/s best, {med[k]:.0f} median of {a.decode_reps}")
    s, r = f"streamed {a.rows}", f"resident {a.rows}"
    print(f"medians: streamed/resident {med[s] / med[r]:.3g}x, 64/8 streamed "
          f"{med['streamed 64'] / med['streamed 8']:.3g}x, resident {med['resident 64'] / med['resident 8']:.3g}x")
    result("grpo_streamed_decode_vs_resident_generate", best[s] / best[r], "x", ">=", 0.8)
    result("grpo_streamed_decode_tokens_per_s_8_to_64", best["streamed 64"] / best["streamed 8"], "x", ">=", 6)
    print(f"RESULT grpo_resident_generate_tokens_per_s_8_to_64 {best['resident 64'] / best['resident 8']:.4g} x "
          "(transformers' generate on the resident copy, the same rounds: the CPU's own growth; no target)", flush=True)
    floor(best, mm, a.decode_tokens, clock)
    print_split({n: pass_split(engine, dec, sets[n], gc, a.clock) for n in (8, 64)})


def floor(best, mm, tokens: int, clock, samples: int = 40) -> None:
    """The matrix products' own growth from 8 to 64 rows: the extra FLOPs of a 64-row decoding
    over an 8-row one at the best rate one 64-row pass's products reach (the least disturbed of
    ``samples`` short timings): the best 64/8 the streamed decoder could reach were nothing but
    them to grow with the rows, its 8-row time as measured."""
    run, per_row, _ = mm[64]
    times = []
    for _ in range(samples):
        t0 = clock()
        run()
        times.append(clock() - t0)
    rate = per_row * 64 / min(times)
    grow = (mm[64][2] - mm[8][2]) / rate
    t8 = 8 * tokens / best["streamed 8"]
    print(f"matrix products (the layers' linear layers and the head): {per_row / 1e6:.2f} MFLOP per row per pass, "
          f"{rate / 1e9:.0f} GFLOP/s at 64 rows (best of {samples}) = {per_row / rate * 1e3:.3f} ms per row per pass; "
          f"64 rows over 8 add {(mm[64][2] - mm[8][2]) / 1e9:.1f} GFLOP a decoding = {grow * 1e3:.0f} ms; streamed 8 rows "
          f"{t8 * 1e3:.0f} ms a decoding, so with nothing but the matrix products growing 64/8 would be at most "
          f"{8 * t8 / (t8 + grow):.2f}x")


def pass_split(engine, dec, rows, gc, clock: str = "wall") -> dict:
    """ms per pass of one streamed decoding of ``rows``, split by timers around its parts (hooks
    of this bench, removed after; the figures' decodings run without them): the weight copies (the
    compute's wait on them; the copy thread's own time, overlapped, beside), the layers' linear
    layers, the attention and KV cache (the attention modules less their linear layers), the rest
    of the layers (norms, activation, residuals), the engine around each layer (slot, binding;
    less the wait), the head's product, the sampling and log-probs (``decode.pick``), and the rest
    (the embedding, the base model's masks and rotary tables, the head's call, the decoder's loop).
    ``clock="cpu"``: the parts timed by the decoding thread's CPU time (its waits for the copies
    then cost it nothing: they are printed, wall time, but not taken off the parts)."""
    import torch

    from megatrain_nb.engine.compute import decode
    from megatrain_nb.engine.proxies import LayerProxy

    spent = dict.fromkeys(("linear", "attn_linear", "attention", "layer", "proxy", "proxy_wait", "head", "pick"), 0.0)
    now = time.thread_time if clock == "cpu" else time.perf_counter
    waits = clock != "cpu"   # (a wait spends no CPU time: nothing to take off the parts then)
    hooks, at, tel = [], {}, engine.counters

    def timed(keys, mod):
        def pre(m, *_):
            at[m] = (now(), tel.stall_seconds.get("device", 0.0))

        def post(m, *_):
            for k in keys:
                spent[k] += now() - at[m][0]
            if "proxy" in keys and waits:   # (a layer's wait for its weights: inside its proxy's call)
                spent["proxy_wait"] += tel.stall_seconds.get("device", 0.0) - at[m][1]
        hooks.extend([mod.register_forward_pre_hook(pre, with_kwargs=True),
                      mod.register_forward_hook(post, with_kwargs=True)])

    for m in engine.model.modules():
        if isinstance(m, LayerProxy):
            timed(("proxy",), m)
            timed(("layer",), m._mt_unit.module)
            for name, sub in m._mt_unit.module.named_modules():
                if isinstance(sub, torch.nn.Linear):
                    timed(("linear", "attn_linear") if "attn" in name else ("linear",), sub)
                elif name.endswith("attn"):
                    timed(("attention",), sub)
    timed(("head",), engine.model.get_output_embeddings())
    pick = decode.pick

    def timed_pick(*args):
        t0 = now()
        try:
            return pick(*args)
        finally:
            spent["pick"] += now() - t0
    stall0, copy0 = tel.stall_seconds.get("device", 0.0), tel.link_seconds.get("host_to_device", 0.0)
    decode.pick = timed_pick
    try:
        t0 = now()
        passes = dec.generate(rows, gc).stats["passes"]
        total = now() - t0
    finally:
        decode.pick = pick
        for h in hooks:
            h.remove()
    stall = tel.stall_seconds.get("device", 0.0) - stall0
    got = spent
    parts = {"weight copies, the compute's wait" + ("" if waits else " (wall; its CPU is nil)"): stall,
             "layers' linear layers": got["linear"],
             "attention and KV cache (less its linear layers)": got["attention"] - got["attn_linear"],
             "the layers' norms, activation, residuals": got["layer"] - got["attention"] - got["linear"]
             + got["attn_linear"],
             "engine around each layer (slot, binding)": got["proxy"] - got["layer"] - got["proxy_wait"],
             "head product": got["head"],
             "sampling and log-probs": got["pick"],
             "rest (embedding, masks, rotary, head call, loop)": total - got["proxy"] - got["head"] - got["pick"]
             - (stall - got["proxy_wait"] if waits else 0.0)}
    ms = 1e3 / passes
    return {"passes": passes, "pass ms": total * ms, "copy thread ms (overlapped)":
            (tel.link_seconds.get("host_to_device", 0.0) - copy0) * ms, **{k: v * ms for k, v in parts.items()}}


def print_split(splits) -> None:
    """The splits of :func:`pass_split` side by side, ms per pass."""
    ns = list(splits)
    print("a pass's time split, ms per pass (timers on): " + " | ".join(f"{n} rows" for n in ns))
    for k in splits[ns[0]]:
        print(f"  {k}: " + " | ".join(f"{splits[n][k]:.2f}" for n in ns))


# ---------------------------------------------------------------------------------- training step
def train_step(a) -> None:
    t = _trainer(a, Path(a.out))
    stream = t.fresh_stream()
    window, _ = stream.next_window(1)   # generation, rewards, old and reference log-probs
    b = window[0]
    side = b["objective_data"]   # the rollouts' advantages and log-probs, carried by the micro-batch
    engine, obj = t.engine, t.objective
    tokens = int((b["labels"] != -100).sum())
    print(f"micro-batch: {tuple(b['input_ids'].shape)} tokens, {tokens} completion tokens")

    def grpo():
        engine.forward_backward(b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"],
                                loss_fn=obj, objective_data=side, step_lr=1e-6)

    def sft():
        engine.forward_backward(b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"],
                                num_items_in_batch=tokens, step_lr=1e-6)

    times = {"grpo": [], "sft": []}
    for i in range(a.warmup + a.reps):
        for name, fn in (("grpo", grpo), ("sft", sft)):
            t0 = time.perf_counter()
            fn()
            if i >= a.warmup:
                times[name].append(time.perf_counter() - t0)
    g, s = median(times["grpo"]), median(times["sft"])
    print(f"GRPO step {g * 1e3:.1f} ms, SFT step {s * 1e3:.1f} ms (medians of {a.reps})")
    result("grpo_train_step_vs_sft_step", g / s, "x", "<=", 1.1)
    t.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", choices=("decode", "step"), help="one part of the figures")
    p.add_argument("--preset", default="tiny", help="model shape of the training step")
    p.add_argument("--batch", type=int, default=8, help="completions per micro-batch")
    p.add_argument("--completion", type=int, default=48, help="max_completion_length")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--decode-preset", default="small", help="model shape of the decoding figures")
    p.add_argument("--decode-tokens", type=int, default=16, help="new tokens per rollout")
    p.add_argument("--rows", type=int, default=64, help="rollouts of the streamed-vs-resident figure")
    p.add_argument("--decode-reps", type=int, default=5)
    p.add_argument("--threads", type=int, help="torch's intra-op threads (default: torch's own)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="cpu: the decodings timed by the process's CPU time (every thread's, the copies' "
                        "included), which a shared machine's load does not stretch; with --threads 1")
    p.add_argument("--out", default="/tmp/bench_grpo")
    a = p.parse_args()
    if a.threads:
        import torch
        torch.set_num_threads(a.threads)
    print(machine())
    if a.only != "step":
        engine, resident, vocab = _decode_setup(a)
        decode_loads(engine, vocab, a.decode_tokens)
        decode_speed(engine, resident, vocab, a)
        engine.close()
    if a.only != "decode":
        train_step(a)


if __name__ == "__main__":
    main()
