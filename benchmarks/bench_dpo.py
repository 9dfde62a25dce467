"""mt.DPOTrainer against mt.Trainer on the same tokens: step time, the reference pass, peak host
RAM and the reference cache's size.

    python benchmarks/bench_dpo.py            # ~1-2 minutes on 2 cores

Data: preference pairs made from the shipped chat set (the chosen reply a conversation's own, the
rejected one another conversation's), prepared once by mt.DPOTrainer; mt.Trainer gets the same
rows as plain sequences (each batch's chosen rows, then its rejected rows, the labels -100 outside
the completion), so with sequential sampling both train on the same batches (asserted by token
counts). Steps alternate between the two (``--reps`` each after ``--warmup``; the DPO trainer's
first step, which runs the reference pass, is a warm-up). Targets:

- DPO step <= 1.05x a Trainer step, reference precomputed;
- the reference pass <= 0.4x the training time of the same data (one epoch at the measured step);
- peak host RAM of a DPO run <= 1.05x that of the Trainer run on the same data plus the cache
  (each in a child process of its own, ``ru_maxrss``); the cache <= 16 bytes per pair.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, median, peak_rss_bytes, result  # noqa: E402


def _pairs():
    from megatrain_nb.assets import chat_dataset

    convs = list(chat_dataset())
    rows = []
    for i, c in enumerate(convs):
        msgs = c["messages"]
        other = convs[(i + 7) % len(convs)]["messages"][-1]["content"]
        if other == msgs[-1]["content"]:
            other += " no"
        rows.append({"prompt": msgs[:-1], "chosen": [msgs[-1]],
                     "rejected": [{"role": "assistant", "content": other}]})
    return rows


def _model_and_tok(a):
    import torch
    from transformers import AutoModelForCausalLM

    from megatrain_nb.assets import chat_tokenizer
    from megatrain_nb.model_configs import preset_config

    tok = chat_tokenizer()
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(preset_config(a.preset, vocab_size=len(tok))), tok


def _common(steps: int) -> dict:
    return dict(max_steps=steps, report_to="none", disable_tqdm=True, save_strategy="no", logging_steps=10,
                learning_rate=1e-5, seed=0, train_sampling_strategy="sequential")


def _dpo(a, out: Path, steps: int, model, tok):
    from trl import DPOConfig

    import megatrain_nb as mt

    return mt.DPOTrainer(model=copy.deepcopy(model), processing_class=tok, train_dataset=_pairs(), device="cpu",
                         args=DPOConfig(output_dir=str(out / "dpo"), bf16=False, use_cpu=True,
                                        max_length=a.max_length, per_device_train_batch_size=a.batch,
                                        **_common(steps)))


def _plain(a, out: Path, steps: int, model, tok):
    """mt.Trainer on the DPO batches' rows as plain sequences (prepared without an engine)."""
    from datasets import Dataset
    from transformers import TrainingArguments
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    import megatrain_nb as mt
    from megatrain_nb.trainer.dpo_data import PreferenceCollator, prepare_preference_dataset

    ds, _ = prepare_preference_dataset(_pairs(), tok, max_length=a.max_length, truncation_mode="keep_start",
                                       what="train_dataset")
    collate = PreferenceCollator(DataCollatorForPreference(pad_token_id=tok.pad_token_id, max_length=a.max_length))
    rows = []
    for s in range(0, len(ds), a.batch):
        b = collate([ds[i] for i in range(s, min(s + a.batch, len(ds)))])
        for ids, am, lab in zip(b["input_ids"], b["attention_mask"], b["labels"]):
            n = int(am.sum())
            rows.append({"input_ids": ids[:n].tolist(), "labels": lab[:n].tolist()})
    return mt.Trainer(model=copy.deepcopy(model), train_dataset=Dataset.from_list(rows), tokenizer=tok, device="cpu",
                      args=TrainingArguments(output_dir=str(out / "plain"), per_device_train_batch_size=2 * a.batch,
                                             **_common(steps)))


def step_times(a, out: Path):
    steps = a.warmup + a.reps
    model, tok = _model_and_tok(a)
    dpo, plain = _dpo(a, out, steps, model, tok), _plain(a, out, steps, model, tok)
    gens = {"dpo": dpo.iter_steps(), "plain": plain.iter_steps()}
    times, tokens = {"dpo": [], "plain": []}, {"dpo": 0, "plain": 0}
    for i in range(steps):
        for name in (("dpo", "plain") if i % 2 == 0 else ("plain", "dpo")):
            t0 = time.perf_counter()
            rec = next(gens[name])
            if i >= a.warmup:
                times[name].append(time.perf_counter() - t0)
                tokens[name] += rec["tokens"]
    for g in gens.values():
        g.close()
    assert tokens["dpo"] == tokens["plain"], tokens   # the same batches
    ms = {k: median(v) * 1e3 for k, v in times.items()}
    pairs = len(dpo.train_dataset)
    epoch = -(-pairs // a.batch) * ms["dpo"] / 1e3
    ref = dpo.reference_seconds["train"]
    print(f"step time (median of {a.reps}, {tokens['dpo']:,} tokens each side): DPOTrainer {ms['dpo']:.1f} ms, "
          f"Trainer {ms['plain']:.1f} ms; reference pass {ref:.2f} s for {pairs} pairs, one epoch of training "
          f"{epoch:.2f} s")
    dpo.close()
    plain.close()
    return ms["dpo"] / ms["plain"], ref / epoch


def child(a, which: str) -> None:
    """One run in this process; prints its peak RSS and (DPO) the cache's size."""
    from megatrain_nb.trainer.dpo_reference import cache_bytes

    with tempfile.TemporaryDirectory() as d:
        model, tok = _model_and_tok(a)
        trainer = (_dpo if which == "dpo" else _plain)(a, Path(d), a.warmup + a.reps, model, tok)
        del model
        trainer.train()
        info = {"peak": peak_rss_bytes(), "cache": cache_bytes(Path(d) / "dpo"), "pairs": len(trainer.train_dataset)}
        trainer.close()
    print("CHILD " + json.dumps(info), flush=True)


def memory(a):
    got = {}
    for which in ("plain", "dpo"):
        cmd = [sys.executable, __file__, "--child", which, "--preset", a.preset, "--batch", str(a.batch),
               "--reps", str(a.reps), "--warmup", str(a.warmup), "--max-length", str(a.max_length)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        got[which] = json.loads([x for x in out.splitlines() if x.startswith("CHILD ")][-1][6:])
    d, p = got["dpo"], got["plain"]
    print(f"peak RSS: DPOTrainer {d['peak'] / 2**20:.0f} MiB, Trainer {p['peak'] / 2**20:.0f} MiB; reference cache "
          f"{d['cache']:,} bytes for {d['pairs']} pairs")
    return d["peak"] / (p["peak"] + d["cache"]), d["cache"] / d["pairs"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny", help="model shape")
    p.add_argument("--batch", type=int, default=4, help="pairs per micro-batch")
    p.add_argument("--reps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--child", choices=("dpo", "plain"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return child(a, a.child)
    print(f"machine: {machine()}; load average {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory() as d:
        step, ref = step_times(a, Path(d))
    ram, per_pair = memory(a)
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    result("dpo_step_vs_trainer", step, "x", "<=", 1.05)
    result("dpo_reference_pass_vs_training", ref, "x", "<=", 0.4)
    result("dpo_peak_ram_vs_trainer_plus_cache", ram, "x", "<=", 1.05)
    result("dpo_reference_cache_bytes_per_pair", per_pair, "B", "<=", 16)


if __name__ == "__main__":
    main()
