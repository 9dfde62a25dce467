"""``megatrain-nb train --config run.yaml`` for learning from rewards: ``mt.GRPOTrainer`` when
run.yaml has a ``grpo:`` section (trl.GRPOConfig fields, plus ``reward_funcs``: the reward
functions, each ``module:function``, ``path/to/file.py:function`` relative to the file, or the
name of a shipped one in :mod:`megatrain_nb.rewards`)."""
from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

from megatrain_nb.cli.config import UsageError, fine_tune_parts, load_files, training_fields, trl_config
from megatrain_nb.cli.report import print_header, print_summary, run_with_progress
from megatrain_nb import rewards
from megatrain_nb.assets import arithmetic_dataset


def reward_function(spec, base: Path):
    """The callable ``spec`` names: ``module:function``, ``file.py:function`` (relative to ``base``)
    or a shipped reward's name (``megatrain_nb.rewards.SHIPPED``)."""
    if not isinstance(spec, str) or not spec:
        raise UsageError(f"grpo.reward_funcs: {spec!r} is not a name; write module:function, file.py:function or "
                         f"one of {', '.join(rewards.SHIPPED)}")
    if ":" not in spec:
        if spec in rewards.SHIPPED:
            return rewards.SHIPPED[spec]
        raise UsageError(f"grpo.reward_funcs: {spec!r} is not a shipped reward ({', '.join(rewards.SHIPPED)}); "
                         "name your own as module:function or path/to/file.py:function")
    where, name = spec.rsplit(":", 1)
    try:
        if where.endswith(".py"):
            path = (base / where).resolve()
            loaded = importlib.util.spec_from_file_location(path.stem, path)
            if loaded is None or not path.is_file():
                raise FileNotFoundError(f"no file {path}")
            module = importlib.util.module_from_spec(loaded)
            loaded.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except (ImportError, OSError) as e:
        raise UsageError(f"grpo.reward_funcs: {spec!r}: cannot load {where!r} ({e})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise UsageError(f"grpo.reward_funcs: {spec!r}: {where!r} has no function {name!r}")
    return fn


def _datasets(data: dict, base: Path):
    """(train, eval, text): ``data.train: builtin`` is the shipped arithmetic task (its first 80
    prompts; with ``eval: builtin`` the other 10)."""
    bad = {"seq_len", "text_column"} & set(data)
    if bad:
        raise UsageError(f"data: {sorted(bad)} do not apply to GRPO; use grpo.max_completion_length")
    if data.get("format", "prompt") not in ("prompt",):
        raise UsageError(f"data.format: {data['format']!r} with a grpo: section; GRPO reads rows with a 'prompt' "
                         "column (text or a list of messages): data.format: prompt, or leave it out")
    builtin = data.get("train", "builtin") in (None, "builtin")
    if builtin:
        rows = arithmetic_dataset()
        train = rows.select(range(80))
        ev = rows.select(range(80, len(rows))) if data.get("eval") == "builtin" else None
    else:
        train = load_files(data["train"], base=base, what="train")
        ev = None
    if data.get("eval") and data["eval"] != "builtin":
        ev = load_files(data["eval"], base=base, what="eval")
    return train, ev, "built-in arithmetic prompts" if builtin else data["train"]


def cmd_train_grpo(ns, cfg: dict, base: Path) -> int:
    # light: the GRPO trainer's modules import trl, which a plain or SFT `megatrain-nb train` never needs
    from megatrain_nb.trainer.grpo import GRPOTrainer, require_trl

    require_trl()
    from trl import GRPOConfig

    section = dict(cfg.get("grpo") or {})
    specs = section.pop("reward_funcs", None)
    if not specs:
        raise UsageError("grpo.reward_funcs: name at least one reward function (module:function, file.py:function, "
                         f"or a shipped one: {', '.join(rewards.SHIPPED)})")
    funcs = [reward_function(s, base) for s in (specs if isinstance(specs, list) else [specs])]
    fields = {**training_fields(ns, cfg, base), **section}
    args = trl_config(GRPOConfig, fields, cfg, "grpo")
    train_ds, eval_ds, where = _datasets(cfg.get("data") or {}, base)
    model, model_text, tokenizer, engine_options = fine_tune_parts(cfg, base, fields, args.max_completion_length + 64)
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    trainer = GRPOTrainer(model=model, reward_funcs=funcs, args=args, train_dataset=train_ds, eval_dataset=eval_ds,
                          processing_class=tokenizer, **engine_options)
    try:
        print_header(trainer, model=model_text, data=f"{where}, {len(train_ds):,} prompts x {args.num_generations} "
                                                     f"completions, rewards {', '.join(trainer.reward_func_names)}, "
                                                     f"loss {args.loss_type}, beta {args.beta}")
        print(f"generation: {trainer.generation_text(64)}")   # (prompts of 64 tokens at most: fine_tune_parts' seq)
        summary = run_with_progress(trainer, resume=ns.resume if ns.resume is not None else None)
        _print_rewards(trainer)
        metrics = trainer.evaluate() if trainer.eval_dataset is not None else None
        model_dir = trainer.save_model()
        print_summary(trainer, summary, model_dir=model_dir, eval_metrics=None)
        if metrics is not None:
            print(f"eval reward {metrics.get('eval_reward', 0.0):.3f}")
    finally:
        trainer.close()
    return 0


def _print_rewards(trainer) -> None:
    """The reward of the first and the last step, and the split of the run's time."""
    recs = [r for r in trainer.metrics_log.read() if "reward" in r and "step" in r and "event" not in r]
    if not recs:
        return
    gen = sum(r.get("generation_s", 0.0) for r in recs)
    train = sum(r.get("step_time_s", 0.0) for r in recs)
    print(f"reward: {recs[0]['reward']:.3f} at step {recs[0]['step']} -> {recs[-1]['reward']:.3f} at step "
          f"{recs[-1]['step']}; time: generation {gen:.1f} s, training {train:.1f} s")
