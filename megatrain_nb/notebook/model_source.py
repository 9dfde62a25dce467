"""Turn what a user hands ``Session(model, ...)`` into a Trainer.

``model`` may be
- a model object (a transformers ``*ForCausalLM``, possibly on the meta device);
- a local folder path (``config.json`` + safetensors; the engine streams it unit by unit,
  and the folder's tokenizer is used when none is given);
- a Hugging Face Hub id (``"Qwen/Qwen2.5-0.5B"``; ``revision=``/``token=`` among the options):
  its config, tokenizer and safetensors are fetched into the HF cache (see
  :mod:`megatrain_nb.hub`) and then used as a local folder;
- a preset name of the built-in default (``"micro"``, ``"tiny"``, ``"small"``, ...): the
  model is built from that config, and when no data is given the built-in corpus and
  tokenizer are used (nothing is downloaded).
"""
from __future__ import annotations

import os
from typing import Any, Optional

from megatrain_nb.model_configs import preset_config
from megatrain_nb.model_source import resolve
from megatrain_nb.trainer.default import load_default
from megatrain_nb.trainer.sft_data import is_conversational_dataset


def build_trainer(
    model: Any,
    *,
    train_dataset: Any = None,
    args: Any = None,
    tokenizer: Any = None,
    eval_dataset: Any = None,
    seq_len: Optional[int] = None,
    trainer_options: dict,
) -> tuple[Any, Any]:
    """(trainer, tokenizer) for a Session. ``trainer_options`` go to ``Trainer`` as keywords
    (engine options, ``loss_fn``...)."""
    # light: the Trainer (transformers) away from a kernel whose ranks train elsewhere (launch_spec reads this module)
    from megatrain_nb.trainer import Trainer

    if isinstance(model, (str, os.PathLike)):
        source = resolve(model, revision=trainer_options.get("revision"), token=trainer_options.get("token"))
        if source.kind == "hub":   # fetched once here: the Trainer gets the cached snapshot folder
            trainer_options = {k: v for k, v in trainer_options.items() if k not in ("revision", "token")}
        if source.kind == "preset":
            model, tokenizer, train_dataset, eval_dataset, args = _builtin(
                source.name, tokenizer, train_dataset, eval_dataset, args, seq_len)
        else:   # the Trainer picks up the folder's tokenizer when none is given
            model = source.need_folder("mt.Session")
    if train_dataset is None:
        raise ValueError("train_dataset is required (a datasets.Dataset, IterableDataset or torch "
                         "Dataset of token ids); or pass a preset name such as 'tiny' as the model "
                         "to train on the built-in corpus")
    fine_tuner = _fine_tuner(args, train_dataset, trainer_options)   # mt.GRPO/DPO/SFTTrainer, or None
    if fine_tuner is not None:
        cls, config = fine_tuner
        if seq_len is not None or "loss_fn" in trainer_options:
            raise ValueError(f"seq_len / loss_fn do not apply to {cls.__name__}: use {config}(max_length=...) "
                             f"and {config}(loss_type=...)")
        trainer = cls(model=model, args=args, train_dataset=train_dataset, eval_dataset=eval_dataset,
                      processing_class=tokenizer, **trainer_options)
        return trainer, trainer.tokenizer
    if seq_len is not None:
        trainer_options = dict(trainer_options, seq_len=seq_len)
    trainer = Trainer(model=model, train_dataset=train_dataset, args=args,
                      eval_dataset=eval_dataset, tokenizer=tokenizer, **trainer_options)
    return trainer, trainer.tokenizer


def _fine_tuner(args, train_dataset, options: dict):
    """(trainer class, its config's name) for a GRPOConfig or ``reward_funcs`` (learning from
    rewards), preference rows or a DPOConfig, instruction / chat rows or an SFTConfig; None for
    plain token data."""
    # light: the fine-tuners (transformers; trl for GRPO) only when a Session builds its trainer
    from megatrain_nb.trainer import dpo, grpo, sft

    grpo_config = type(args).__name__ == "GRPOConfig" and type(args).__module__.startswith("trl")
    if grpo_config or "reward_funcs" in options:
        if not (grpo_config or args is None):
            raise ValueError(f"reward_funcs= trains with mt.GRPOTrainer: give args=trl.GRPOConfig(...), not a "
                             f"{type(args).__name__}")
        if "reward_funcs" not in options:
            raise ValueError("a GRPOConfig trains from rewards: pass reward_funcs= (a callable, a reward model, or "
                             "a list of them; megatrain_nb.rewards has some)")
        return grpo.GRPOTrainer, "GRPOConfig"
    if _wants_dpo(args, train_dataset):
        return dpo.DPOTrainer, "DPOConfig"
    if _wants_sft(args, train_dataset):
        return sft.SFTTrainer, "SFTConfig"
    return None


def _wants_dpo(args, train_dataset) -> bool:
    """A DPOConfig, or rows with 'chosen' and 'rejected' (without importing trl otherwise)."""
    if type(args).__name__ == "DPOConfig" and type(args).__module__.startswith("trl"):
        return True
    try:
        first = train_dataset[0] if isinstance(train_dataset, (list, tuple)) else next(iter(train_dataset))
        return isinstance(first, dict) and "chosen" in first and "rejected" in first
    except Exception:   # a torch dataset of tensors, an empty one: not preference data
        return False


def _wants_sft(args, train_dataset) -> bool:
    """An SFTConfig, or rows in an instruction / chat format (without importing trl otherwise)."""
    if type(args).__name__ == "SFTConfig" and type(args).__module__.startswith("trl"):
        return True
    if train_dataset is None:
        return False
    try:
        return is_conversational_dataset(train_dataset)
    except Exception:   # a torch dataset of tensors, an iterable without rows: not chat data
        return False


def default_args(output_dir: str, **overrides: Any):
    """Small TrainingArguments for the built-in default (constant LR, frequent logging)."""
    from transformers import TrainingArguments

    fields = dict(output_dir=output_dir, max_steps=200, per_device_train_batch_size=8,
                  learning_rate=1e-3, lr_scheduler_type="constant", logging_steps=10,
                  eval_strategy="steps", eval_steps=50, save_strategy="no", report_to="none")
    fields.update(overrides)
    return TrainingArguments(**fields)


def _builtin(name, tokenizer, train_dataset, eval_dataset, args, seq_len):
    if train_dataset is None:
        tok, train_dataset, default_eval = load_default(seq_len=seq_len or 128)
        tokenizer = tokenizer or tok
        if eval_dataset is None:
            eval_dataset = default_eval
    vocab = len(tokenizer) if tokenizer is not None else None
    config = preset_config(name, vocab_size=vocab)
    if args is None:
        args = default_args(os.path.join("megatrain_outputs", name),
                            eval_strategy="steps" if eval_dataset is not None else "no")
    _seed(getattr(args, "seed", 42))   # as the CLI does: same seed, same initial weights, in any kernel
    return _model_from_config(config), tokenizer, train_dataset, eval_dataset, args


def _seed(seed: int) -> None:
    """Seed every generator before a preset's weights are drawn: the Trainer seeds only later,
    so without this the initial weights depended on what the process had drawn before."""
    from transformers.trainer_utils import set_seed

    set_seed(int(seed))


def _model_from_config(config):
    import torch
    from transformers import AutoModelForCausalLM

    h, layers = config.hidden_size, config.num_hidden_layers
    approx = layers * (4 * h * h + 3 * h * config.intermediate_size) + 2 * config.vocab_size * h
    if approx > 300_000_000:
        # Too big to materialise: the engine initialises each unit in its own tier.
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
