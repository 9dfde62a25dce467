"""``megatrain-nb demo``: the main job on the built-in default, no network needed.

It imports the Trainer (torch, transformers) at its top: ``megatrain_nb.cli`` loads it only when
the command runs, never for ``--help``."""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, TrainingArguments

from megatrain_nb.cli.demo_real import cmd_demo_real
from megatrain_nb.cli.report import disk_text, print_summary, run_with_progress
from megatrain_nb.engine.compute.sampling import sample_text
from megatrain_nb.engine.planning.planner import codec_bytes_per_param
from megatrain_nb.model_configs import preset_config
from megatrain_nb.trainer.default import cache_dir, load_default
from megatrain_nb.trainer.trainer import Trainer


#: The demo's host cache holds this share of its disk tier (the rest is read and written each step).
DEMO_CACHE_SHARE = 0.5


def demo_cache_gb(model, compression: str) -> float:
    """GiB of host cache for the demo: DEMO_CACHE_SHARE of its disk tier (the optimizer states
    in their stored form), so that both RAM and the disk carry the states. By default the cache
    takes what RAM allows, which at the demo's size is the whole tier: the disk would stay empty."""
    states = sum(p.numel() for p in model.parameters()) * codec_bytes_per_param(compression)
    return DEMO_CACHE_SHARE * states / (1 << 30)


def cmd_demo(ns) -> int:
    if getattr(ns, "real", False):   # a real pretrained model: cli/demo_real.py
        return cmd_demo_real(ns)
    if ns.quick:
        ns.steps = ns.steps or 20
        ns.seq_len = ns.seq_len or 64
    steps, seq_len = ns.steps or 250, ns.seq_len or 128
    out_dir = Path(ns.output_dir).resolve()
    offload = None if ns.no_disk else str(out_dir / "offload")
    if offload:
        os.makedirs(offload, exist_ok=True)
    print(f"megatrain-nb demo: preset {ns.preset!r}, {steps} steps of {ns.batch_size} x {seq_len} tokens; "
          f"disk tier {'off' if offload is None else 'at ' + offload}; optimizer states {ns.compression}")
    t0 = time.time()
    tokenizer, train_ds, eval_ds = load_default(seq_len=seq_len, vocab_size=ns.vocab_size,
                                                max_eval_blocks=16 if ns.quick else 64)
    print(f"data: the Python standard library's own source as a corpus, {len(train_ds):,} training blocks, "
          f"{len(eval_ds)} eval blocks; byte-level BPE tokenizer ({len(tokenizer)} tokens) cached in {cache_dir()} "
          f"[{time.time() - t0:.1f} s]")
    torch.manual_seed(ns.seed)
    model = AutoModelForCausalLM.from_config(preset_config(ns.preset, vocab_size=len(tokenizer),
                                                           max_position_embeddings=max(seq_len, 128)))
    print(f"model: Llama-style {ns.preset}, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, "
          "fp32 master weights")
    save_every = max(steps // 2, 1)
    args = TrainingArguments(output_dir=str(out_dir), per_device_train_batch_size=ns.batch_size,
                             per_device_eval_batch_size=ns.batch_size, learning_rate=ns.lr, max_steps=steps,
                             lr_scheduler_type="cosine", warmup_steps=max(steps // 10, 1), weight_decay=0.1,
                             logging_steps=max(min(10, steps // 5), 1), eval_strategy="steps", eval_steps=save_every,
                             save_steps=save_every, save_total_limit=2, report_to="none", disable_tqdm=True,
                             seed=ns.seed)
    engine_opts = {"optimizer_compression": ns.compression, "offload_dir": offload}
    if offload:   # the main job shows both tiers at work: RAM caches part of the disk tier, not all of it
        engine_opts["host_cache_gb"] = (ns.host_cache if ns.host_cache is not None
                                        else demo_cache_gb(model, ns.compression))
    if ns.device:
        engine_opts["device"] = ns.device
    trainer = Trainer(model=model, train_dataset=train_ds, eval_dataset=eval_ds, args=args, tokenizer=tokenizer,
                      **engine_opts)
    try:
        disk = disk_text(trainer.engine)
        if disk:
            print(f"disk tier: {disk}")
        summary = run_with_progress(trainer)
        metrics = trainer.evaluate()
        model_dir = trainer.save_model(str(out_dir / "model"))
        if not ns.quick:
            n_params = sum(p.numel() for _, p in trainer.engine.named_parameters())
            print(f"sample from this {n_params / 1e6:.1f}M-parameter model after {summary['steps']} steps "
                  f"({summary['seconds'] / 60:.1f} min of training); a model this small and this briefly trained "
                  "writes Python-flavoured noise, as expected: "
                  + repr(sample_text(trainer.engine, tokenizer, "def ", max_new_tokens=32, temperature=0.8,
                                     top_k=20, seed=ns.seed)))
        print_summary(trainer, summary, model_dir=model_dir, eval_metrics=metrics)
        print(f"total time {time.time() - t0:.1f} s")
    finally:
        trainer.close()
    return 0
