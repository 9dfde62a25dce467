"""mt.SFTTrainer against mt.Trainer on the same token batches (step time), and the packing
efficiency (real tokens / tokens computed) against trl.SFTTrainer's packing on the same data.

    python benchmarks/bench_sft.py            # ~1-2 minutes on 2 cores

Step time: the shipped chat set, prepared once by mt.SFTTrainer (assistant_only_loss, no
packing); mt.Trainer gets the same prepared rows (input_ids, labels), so both train on the same
batches in the same order. The two trainers' steps are alternated (``--reps`` each after a
warm-up), each timed from asking for the step to having it (batch loading and collation
included); logging every 10 steps, so the token metrics (counted on logging steps) are on the
path as in use. Target: SFTTrainer / Trainer <= 1.05 (preparation is done once, not per step).

Packing: every batch of one epoch, mt.SFTTrainer's (as handed to the engine) and
trl.SFTTrainer's (its train dataloader), with packing=True, bfd: real tokens (not padding) over
tokens computed. Target: mt / trl >= 1.0. Without packing, for reference: the padded efficiency.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import machine, median, result  # noqa: E402


def _model(vocab: int, preset: str):
    import torch
    from transformers import AutoModelForCausalLM

    from megatrain_nb.model_configs import preset_config

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(preset_config(preset, vocab_size=vocab))


def _sft_config(out, **kw):
    from trl import SFTConfig

    base = dict(output_dir=str(out), bf16=False, use_cpu=True, report_to="none", disable_tqdm=True,
                save_strategy="no", logging_steps=10, learning_rate=1e-3, seed=0)
    base.update(kw)
    return SFTConfig(**base)


def step_time(a, tmp: Path) -> float:
    import megatrain_nb as mt
    from datasets import Dataset
    from transformers import TrainingArguments

    from megatrain_nb.assets import chat_dataset, chat_tokenizer

    tok = chat_tokenizer()
    model = _model(len(tok), a.preset)
    steps = a.warmup + a.reps
    sft = mt.SFTTrainer(model=copy.deepcopy(model), processing_class=tok, train_dataset=chat_dataset(),
                        args=_sft_config(tmp / "sft", assistant_only_loss=True, max_length=128, max_steps=steps,
                                         per_device_train_batch_size=a.batch), device="cpu")
    rows = Dataset.from_dict({"input_ids": sft.train_dataset["input_ids"], "labels": sft.train_dataset["labels"]})
    plain = mt.Trainer(model=copy.deepcopy(model), train_dataset=rows, tokenizer=tok, device="cpu",
                       args=TrainingArguments(output_dir=str(tmp / "plain"), max_steps=steps, report_to="none",
                                              disable_tqdm=True, save_strategy="no", logging_steps=10,
                                              learning_rate=1e-3, per_device_train_batch_size=a.batch, seed=0))
    gens = {"sft": sft.iter_steps(), "plain": plain.iter_steps()}
    times = {"sft": [], "plain": []}
    tokens = {"sft": 0, "plain": 0}
    for i in range(steps):
        for name in (("sft", "plain") if i % 2 == 0 else ("plain", "sft")):
            t0 = time.perf_counter()
            rec = next(gens[name])
            dt = time.perf_counter() - t0
            if i >= a.warmup:
                times[name].append(dt)
                tokens[name] += rec["tokens"]
    for g in gens.values():
        g.close()
    assert tokens["sft"] == tokens["plain"], tokens   # the same batches
    ms = {k: median(v) * 1e3 for k, v in times.items()}
    print(f"step time (median of {a.reps}, {tokens['sft']:,} tokens each side): SFTTrainer {ms['sft']:.1f} ms, "
          f"Trainer {ms['plain']:.1f} ms")
    sft.close()
    plain.close()
    return ms["sft"] / ms["plain"]


def _efficiency(batches) -> tuple[int, int]:
    real = computed = 0
    for b in batches:
        ids = b["input_ids"]
        computed += ids.numel()
        m = b.get("attention_mask")
        real += int(m.sum()) if m is not None else ids.numel()
    return real, computed


def packing(a, tmp: Path) -> float:
    import trl

    import megatrain_nb as mt
    from megatrain_nb.assets import chat_dataset, chat_tokenizer
    from megatrain_nb.trainer.data import BatchStream

    tok = chat_tokenizer()
    model = _model(len(tok), "micro")
    out = {}
    for packed in (True, False):
        kw = dict(packing=packed, max_length=a.pack_length, per_device_train_batch_size=a.batch,
                  assistant_only_loss=True, max_steps=1)
        m = mt.SFTTrainer(model=copy.deepcopy(model), processing_class=copy.deepcopy(tok), train_dataset=chat_dataset(),
                          args=_sft_config(tmp / "m", **kw), device="cpu")
        stream = BatchStream(m.train_dataset, batch_size=a.batch, collate=m.data_collator, seed=0)
        mt_batches, ended = [], False
        while not ended:   # one epoch, in the order the trainer draws it (transformers' sampler order)
            window, ended = stream.next_window(1)
            mt_batches += window
        m.close()
        t = trl.SFTTrainer(model=copy.deepcopy(model), processing_class=copy.deepcopy(tok),
                           train_dataset=chat_dataset(), args=_sft_config(tmp / "t", **kw))
        trl_batches = list(t.get_train_dataloader())
        out[packed] = (_efficiency(mt_batches), _efficiency(trl_batches))
    for packed, ((mr, mc), (tr, tc)) in out.items():
        print(f"{'packed (bfd)' if packed else 'padded, no packing'}: mt.SFTTrainer {mr:,}/{mc:,} = {mr / mc:.3f}, "
              f"trl.SFTTrainer {tr:,}/{tc:,} = {tr / tc:.3f} real tokens per token computed")
    (mr, mc), (tr, tc) = out[True]
    return (mr / mc) / (tr / tc)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny", help="model shape for the step-time comparison")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--pack-length", type=int, default=256)
    a = p.parse_args()
    print(f"machine: {machine()}; load average {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory() as d:
        ratio = step_time(a, Path(d))
        eff = packing(a, Path(d))
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    result("sft_step_vs_trainer", ratio, "x", "<=", 1.05)
    result("sft_packing_efficiency_vs_trl", eff, "x", ">=", 1.0)


if __name__ == "__main__":
    main()
