"""``megatrain-nb train --config run.yaml``: a training run (pretraining, or fine-tuning with
``mt.SFTTrainer`` when run.yaml has an ``sft:`` section or instruction/chat data, ``mt.DPOTrainer``
for ``dpo:``, ``mt.GRPOTrainer`` for ``grpo:``).

It imports the Trainer (torch, transformers) at its top: ``megatrain_nb.cli`` loads it only when
the command runs, never for ``--help``."""
from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from megatrain_nb.cli.config import (
    UsageError,
    check_max_steps,
    check_preset_field,
    trl_config,
    fine_tuner,
    load_files,
    load_run_config,
    model_source,
    training_fields,
)
from megatrain_nb.cli.report import print_header, print_summary, run_with_progress
from megatrain_nb.cli.train_dpo import cmd_train_dpo, wants_dpo
from megatrain_nb.cli.train_grpo import cmd_train_grpo
from megatrain_nb import assets
from megatrain_nb.model_configs import preset_config
from megatrain_nb.trainer.args import training_arguments
from megatrain_nb.trainer.default import load_default, load_default_tokens
from megatrain_nb.trainer.sft import SFTTrainer
from megatrain_nb.trainer.sft_data import FORMATS, detect_format, is_conversational_dataset, require_trl
from megatrain_nb.trainer.trainer import Trainer


def _data_text(data: dict, train_ds, eval_ds, seq_len: int) -> str:
    def one(spec, ds):
        what = "built-in corpus" if spec in (None, "builtin") else ", ".join([spec] if isinstance(spec, str) else spec)
        n = f"{len(ds):,} examples" if hasattr(ds, "__len__") else "streamed"
        return f"{what} ({n})"

    text = f"train {one(data.get('train', 'builtin'), train_ds)}"
    if eval_ds is not None:
        text += f", eval {one(data.get('eval', 'builtin'), eval_ds)}"
    return text + f"; blocks of {seq_len} tokens"


def cmd_train(ns) -> int:
    cfg = load_run_config(ns.config)
    base = Path(ns.config).resolve().parent
    data = cfg.get("data") or {}

    if "grpo" in cfg:   # learning from rewards: a grpo: section (GRPOConfig fields and reward_funcs)
        return cmd_train_grpo(ns, cfg, base)
    if wants_dpo(cfg):   # preference training: a dpo: section or data.format: preference
        return cmd_train_dpo(ns, cfg, base)
    if "sft" in cfg or "format" in data:   # fine-tuning on instructions / conversations
        return cmd_train_sft(ns, cfg, base)
    training = dict(cfg.get("training") or {})
    if ns.output_dir:
        training["output_dir"] = ns.output_dir
    if ns.max_steps is not None:
        training["max_steps"] = ns.max_steps
    check_max_steps(training.get("max_steps", -1), "--max-steps" if ns.max_steps is not None else
                     "training.max_steps")
    training.setdefault("output_dir", "megatrain_outputs")
    training.setdefault("disable_tqdm", True)
    training.setdefault("report_to", "none")
    if not os.path.isabs(training["output_dir"]):
        training["output_dir"] = str((base / training["output_dir"]).resolve())
    seq_len = data.get("seq_len") or 256   # checked by load_run_config (the table of values)
    check_preset_field(cfg)
    try:   # checked before any data is prepared; a misspelled field gets the closest name
        args = training_arguments(training, where="training")
    except ValueError as e:
        raise UsageError(str(e)) from None
    model_text = f"preset {cfg.get('preset')}"
    model = None
    if "model" in cfg:
        model, model_text = model_source(cfg, base)  # its own tokenizer, if it has one, is used
    tokenizer = None
    if cfg.get("tokenizer"):
        local = (base / cfg["tokenizer"]).resolve()
        tokenizer = AutoTokenizer.from_pretrained(str(local) if local.exists() else cfg["tokenizer"])
    train_ds = load_files(data.get("train", "builtin"), base=base, what="train")
    if train_ds is not None and is_conversational_dataset(train_ds, data.get("text_column", "text")):
        return cmd_train_sft(ns, cfg, base)   # instruction / chat rows: the format is detected
    eval_ds = load_files(data.get("eval"), base=base, what="eval") if data.get("eval") else None
    if train_ds is not None and tokenizer is None and model is None and "input_ids" not in train_ds.column_names:
        tokenizer = load_default_tokens()[0]   # a preset has no tokenizer of its own: the built-in one
    if train_ds is None:  # built-in corpus
        tok, train_ds, builtin_eval = load_default(seq_len=seq_len)
        tokenizer = tokenizer or tok
        eval_ds = eval_ds if eval_ds is not None else builtin_eval
    if model is None:
        torch.manual_seed(int(cfg.get("seed", training.get("seed", 42))))
        vocab = {"vocab_size": len(tokenizer)} if tokenizer is not None else {}
        model = AutoModelForCausalLM.from_config(preset_config(cfg["preset"], max_position_embeddings=max(seq_len, 128),
                                                               **vocab))
    engine_options = dict(cfg.get("engine") or {})
    if engine_options.get("offload_dir") and not os.path.isabs(os.path.expanduser(str(engine_options["offload_dir"]))):
        engine_options["offload_dir"] = str((base / engine_options["offload_dir"]).resolve())
    os.makedirs(args.output_dir, exist_ok=True)  # so an offload_dir inside it can be created
    trainer = Trainer(model=model, train_dataset=train_ds, eval_dataset=eval_ds, args=args, tokenizer=tokenizer,
                      seq_len=seq_len, text_column=data.get("text_column", "text"), **engine_options)
    try:
        print_header(trainer, model=model_text, data=_data_text(data, train_ds, eval_ds, seq_len))
        summary = run_with_progress(trainer, resume=ns.resume if ns.resume is not None else None)
        metrics = trainer.evaluate() if eval_ds is not None else None
        model_dir = trainer.save_model()
        print_summary(trainer, summary, model_dir=model_dir, eval_metrics=metrics)
    finally:
        trainer.close()
    return 0


def cmd_train_sft(ns, cfg: dict, base: Path) -> int:
    """run.yaml with an ``sft:`` section or an instruction/chat ``data.format``: mt.SFTTrainer.
    ``data.train: builtin`` is the shipped chat set (in ``data.format``); the tokenizer defaults to
    the model's own, else the shipped chat tokenizer."""
    try:
        require_trl()
    except ImportError as e:   # an optional extra, not a crash: one line, exit 2
        raise UsageError(f"fine-tuning on conversations needs TRL: {e}") from None
    from trl import SFTConfig

    data = cfg.get("data") or {}
    fmt = data.get("format")
    if fmt is not None and fmt not in FORMATS:
        raise UsageError(f"data.format: {fmt!r}; use one of {', '.join(FORMATS)} (or leave it out to detect it)")
    bad = {"seq_len", "text_column"} & set(data)
    if bad:
        raise UsageError(f"data: {sorted(bad)} do not apply to fine-tuning; use sft.max_length and "
                         "sft.dataset_text_field")
    fields = {**training_fields(ns, cfg, base), **(cfg.get("sft") or {})}
    if fields.get("chat_template_path") and not os.path.isabs(fields["chat_template_path"]):
        fields["chat_template_path"] = str((base / fields["chat_template_path"]).resolve())
    args = trl_config(SFTConfig, fields, cfg, "sft")
    builtin = data.get("train", "builtin") in (None, "builtin")
    train_ds = (assets.chat_dataset(fmt or "messages") if builtin
                else load_files(data["train"], base=base, what="train"))
    eval_ds = load_files(data.get("eval"), base=base, what="eval") if data.get("eval") not in (None, "builtin") else (
        assets.chat_dataset(fmt or "messages").select(range(200, 240)) if builtin else None)
    if builtin:
        train_ds = train_ds.select(range(200))
    found = detect_format([train_ds[i] for i in range(min(len(train_ds), 1000))], args.dataset_text_field)
    if fmt is not None and found != fmt:
        raise UsageError(f"data.format is {fmt!r} but data.train holds {found!r} rows; fix data.format or the data")
    trainer, model_text = fine_tuner(SFTTrainer, cfg, base, fields, args, train_ds, eval_ds)
    try:
        where = "built-in chat set" if builtin else data["train"]
        text = (f"{where}, format {found}, {len(trainer.train_dataset):,} rows"
                + (f" packed into {args.max_length}-token rows" if args.packing else ""))
        print_header(trainer, model=model_text, data=text)
        for report in trainer.prep_reports:
            if report.message():
                print(f"note:   {report.message()}")
        summary = run_with_progress(trainer, resume=ns.resume if ns.resume is not None else None)
        metrics = trainer.evaluate() if trainer.eval_dataset is not None else None
        model_dir = trainer.save_model()
        print_summary(trainer, summary, model_dir=model_dir, eval_metrics=metrics)
    finally:
        trainer.close()
    return 0
