"""``megatrain-nb train --config run.yaml`` for preference training: ``mt.DPOTrainer`` when
run.yaml has a ``dpo:`` section (trl.DPOConfig fields) or ``data.format: preference``."""
from __future__ import annotations

from pathlib import Path

from megatrain_nb.cli.config import UsageError, fine_tuner, load_files, training_fields, trl_config
from megatrain_nb.cli.report import print_header, print_summary, run_with_progress
from megatrain_nb.trainer.dpo import DPOTrainer
from megatrain_nb.trainer.dpo_data import builtin_preference_pairs
from megatrain_nb.trainer.sft_data import require_trl


def wants_dpo(cfg: dict) -> bool:
    return "dpo" in cfg or (cfg.get("data") or {}).get("format") == "preference"


def cmd_train_dpo(ns, cfg: dict, base: Path) -> int:
    """``data.train: builtin`` is a preference set generated from the shipped chat set; the
    tokenizer defaults to the model's own, else the shipped chat tokenizer."""
    require_trl()
    from trl import DPOConfig

    data = cfg.get("data") or {}
    if data.get("format", "preference") != "preference":
        raise UsageError(f"data.format: {data['format']!r} with a dpo: section; preference training reads "
                         "data.format: preference (rows of prompt/chosen/rejected)")
    bad = {"seq_len", "text_column"} & set(data)
    if bad:
        raise UsageError(f"data: {sorted(bad)} do not apply to preference training; use dpo.max_length")
    fields = {**training_fields(ns, cfg, base), **(cfg.get("dpo") or {})}
    args = trl_config(DPOConfig, fields, cfg, "dpo")
    builtin = data.get("train", "builtin") in (None, "builtin")
    pairs = builtin_preference_pairs() if builtin else None
    train_ds = pairs[:200] if builtin else load_files(data["train"], base=base, what="train")
    eval_ds = (pairs[200:] if builtin and data.get("eval", "builtin") == "builtin"
               else load_files(data["eval"], base=base, what="eval") if data.get("eval") else None)
    trainer, model_text = fine_tuner(DPOTrainer, cfg, base, fields, args, train_ds, eval_ds)
    try:
        where = "built-in preference set" if builtin else data["train"]
        print_header(trainer, model=model_text, data=f"{where}, {len(trainer.train_dataset):,} pairs, loss "
                                                     f"{'+'.join(args.loss_type)}, beta {args.beta}")
        for report in trainer.prep_reports:
            if report.message():
                print(f"note:   {report.message()}")
        summary = run_with_progress(trainer, resume=ns.resume if ns.resume is not None else None)
        print(f"reference log-probs: {trainer.reference_seconds.get('train', 0.0):.1f} s "
              f"({'read from the cache' if not trainer.reference_seconds.get('train') else 'one streamed pass'})")
        metrics = trainer.evaluate() if trainer.eval_dataset is not None else None
        model_dir = trainer.save_model()
        print_summary(trainer, summary, model_dir=model_dir, eval_metrics=None)
        if metrics is not None:
            print(f"eval loss {metrics['eval_loss']:.4f}, reward margin {metrics.get('eval_rewards/margins', 0.0):.4f}, "
                  f"reward accuracy {metrics.get('eval_rewards/accuracies', 0.0):.2f}")
    finally:
        trainer.close()
    return 0
