"""mt.GRPOTrainer's training step against a plain (SFT) step of the engine on the same tokens.

    python benchmarks/bench_grpo.py            # ~1 minute on 2 cores (noisy when shared: medians of 30)

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny", help="model shape")
    p.add_argument("--batch", type=int, default=8, help="completions per micro-batch")
    p.add_argument("--completion", type=int, default=48, help="max_completion_length")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default="/tmp/bench_grpo")
    a = p.parse_args()
    print(machine())
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


if __name__ == "__main__":
    main()
