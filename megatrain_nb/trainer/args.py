"""Which ``transformers.TrainingArguments`` fields the Trainer honours, and the check that
rejects the rest.

Every field is in one of three sets:

- ``HONOURED``: the Trainer implements it (batch sizes, optimiser, schedule, logging, eval, save...);
- ``NO_EFFECT``: bookkeeping that cannot change a single-process run (names, log levels,
  hub credentials while ``push_to_hub`` is off, DDP knobs...);
- everything else: accepted only at its default value; a user-set value is rejected with a
  message naming the field, never silently ignored.

Some honoured fields only accept some values (``optim``, ``save_strategy``...); those are
checked too. A few map onto engine options: ``bf16`` -> ``precision="bf16"`` (bf16 compute with
fp32 master weights and gradients, which is what Hugging Face's bf16 mixed precision means),
``use_cpu`` -> ``device="cpu"``, the Adam fields and ``weight_decay`` -> the engine's AdamW.
``gradient_checkpointing`` / ``activation_checkpointing`` are accepted: the engine always
checkpoints layer inputs (see ``checkpoint_interval``).
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import os
from typing import Any

from megatrain_nb.learning_rate import MAX_LEARNING_RATE, check_learning_rate  # noqa: F401 - re-exported
from megatrain_nb.values import VALUES, ValueRefused, check

HONOURED = frozenset({
    "output_dir", "per_device_train_batch_size", "per_device_eval_batch_size", "num_train_epochs",
    "max_steps", "learning_rate", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps",
    "optim", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon",
    "gradient_accumulation_steps", "max_grad_norm", "bf16", "use_cpu",
    "gradient_checkpointing", "gradient_checkpointing_kwargs", "activation_checkpointing",
    "activation_checkpointing_kwargs", "logging_strategy", "logging_steps", "logging_first_step",
    "report_to", "eval_strategy", "eval_steps", "eval_delay", "eval_on_start", "save_strategy",
    "save_steps", "save_total_limit", "seed", "data_seed", "full_determinism",
    "dataloader_drop_last", "train_sampling_strategy", "ignore_data_skip", "resume_from_checkpoint",
    "disable_tqdm", "label_names",
})

NO_EFFECT = frozenset({
    "run_name", "project", "trackio_space_id", "trackio_bucket_id", "trackio_static_space_id",
    "log_level", "log_level_replica", "log_on_each_node", "logging_nan_inf_filter",
    "include_num_input_tokens_seen", "skip_memory_metrics", "do_train", "do_eval", "do_predict",
    "remove_unused_columns", "dataloader_pin_memory", "prediction_loss_only",
    "eval_do_concat_batches", "eval_use_gather_object", "eval_accumulation_steps",
    "save_on_each_node", "average_tokens_across_devices", "use_cache", "tf32",
    "hub_token", "hub_private_repo", "hub_model_id", "hub_strategy", "hub_revision",
    "ddp_find_unused_parameters", "ddp_bucket_cap_mb", "ddp_broadcast_buffers", "ddp_static_graph",
    "ddp_timeout", "local_rank", "length_column_name", "torch_empty_cache_steps",
    "dataloader_in_order",
})

_OPTIMS = ("adamw_torch", "adamw_torch_fused")
_SAVE_STRATEGIES = ("no", "steps", "epoch")
_SAMPLING = ("random", "sequential")


class UnsupportedArgumentError(ValueError):
    """A TrainingArguments field was set to something megatrain_nb does not do."""


def _value(v: Any) -> Any:
    return getattr(v, "value", v)  # enums -> their string


@functools.lru_cache(maxsize=1)
def default_values() -> dict:
    """Every TrainingArguments field's default value, by name."""
    from transformers import TrainingArguments

    ref = TrainingArguments(output_dir=os.path.join(os.getcwd(), "megatrain_outputs"))
    return {f.name: getattr(ref, f.name) for f in dataclasses.fields(ref)}


def training_arguments(fields: dict, *, where: str = "TrainingArguments"):
    """``transformers.TrainingArguments(**fields)``, checked (:func:`validate_training_args`); a
    misspelled field is named with the closest real one (``where``: how the message names the
    mapping, e.g. run.yaml's ``training``)."""
    from transformers import TrainingArguments

    known = {f.name for f in dataclasses.fields(TrainingArguments) if f.init}
    unknown = sorted(set(fields) - known)
    if unknown:
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
            hints.append(f"{where}.{name}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise UnsupportedArgumentError(f"unknown TrainingArguments field(s): {', '.join(hints)}. The fields are those "
                                       "of transformers.TrainingArguments")
    check_given(fields, where)   # before transformers sees them: the table's words, not its
    try:
        args = TrainingArguments(**fields)
    except (TypeError, ValueError) as e:
        raise UnsupportedArgumentError(f"{where}: {e}") from None
    validate_training_args(args, where=where)
    return args


#: the honoured fields whose values the table (megatrain_nb/values.py) checks; SFTConfig adds max_length
CHECKED = ("learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm",
           "lr_scheduler_type", "warmup_steps", "max_steps", "num_train_epochs", "per_device_train_batch_size",
           "per_device_eval_batch_size", "gradient_accumulation_steps", "logging_steps", "eval_steps",
           "save_steps", "save_total_limit", "eval_strategy", "seed", "data_seed", "max_length")


def check_given(fields: dict, where: str) -> None:
    """The table's check of a dict of fields before it becomes a TrainingArguments / SFTConfig."""
    problems = []
    for name in CHECKED:
        if name in fields:
            try:
                check(name, fields[name], f"{where}.{name}")
            except ValueRefused as e:
                problems.append(str(e))
    if problems:
        raise UnsupportedArgumentError("unusable training arguments: " + "; ".join(problems))


def _check_values(args, where: str) -> list[str]:
    """Values no run can use (the table's rules), named now rather than deep in the first step;
    a number given as text is stored as that number."""
    problems = []
    for name in CHECKED:
        if not hasattr(args, name):
            continue
        value = getattr(args, name)
        try:
            checked = check(name, value, f"{where}.{name}")
        except ValueRefused as e:
            problems.append(str(e))
            continue
        if VALUES[name].kind != "choice" and checked is not value:
            setattr(args, name, checked)
    return problems


def validate_training_args(args, *, where: str = "TrainingArguments") -> None:
    """Raise :class:`UnsupportedArgumentError` naming every field set to something unsupported
    or unusable (a value outside its rule in :mod:`megatrain_nb.values`: a batch size of 0, a NaN
    weight decay, a learning rate of 1e10).

    Example::

        validate_training_args(TrainingArguments(output_dir="o", fp16=True))
        # UnsupportedArgumentError: TrainingArguments field(s) not supported by megatrain_nb: fp16=True ...
    """
    bad = _check_values(args, where)
    if bad:
        raise UnsupportedArgumentError("unusable training arguments: " + "; ".join(bad))
    defaults = default_values()
    problems = []
    for f in dataclasses.fields(args):
        name = f.name
        if name in HONOURED or name in NO_EFFECT or name not in defaults:
            continue
        value, default = getattr(args, name), defaults[name]
        if _value(value) != _value(default):
            problems.append(f"{name}={_value(value)!r} (default {_value(default)!r})")
    if _value(args.optim) not in _OPTIMS:
        problems.append(f"optim={_value(args.optim)!r} (the engine runs AdamW: use one of {_OPTIMS})")
    if _value(args.save_strategy) not in _SAVE_STRATEGIES:
        problems.append(f"save_strategy={_value(args.save_strategy)!r} (use one of {_SAVE_STRATEGIES})")
    if args.train_sampling_strategy not in _SAMPLING:
        problems.append(f"train_sampling_strategy={args.train_sampling_strategy!r} (use one of {_SAMPLING})")
    if args.label_names not in (None, ["labels"]):
        problems.append(f"label_names={args.label_names!r} (only the 'labels' column is used)")
    if problems:
        raise UnsupportedArgumentError(
            "TrainingArguments field(s) not supported by megatrain_nb: " + "; ".join(problems)
            + ". Remove them (or set them back to their defaults); megatrain_nb never ignores a "
            "setting silently (the supported fields are listed in megatrain_nb.trainer.args)."
        )


def unusable_fields(args, config_cls, usable, why: dict, ignore=lambda name, value: False) -> list[str]:
    """The fields ``config_cls`` (a TRL config) adds to TrainingArguments that ``args`` sets away
    from their defaults and this trainer cannot apply (not in ``usable``; ``ignore(name, value)``:
    a value that means the default), each as "name=value (default d; why)"."""
    from transformers import TrainingArguments

    base = {f.name for f in dataclasses.fields(TrainingArguments)}
    problems = []
    for f in dataclasses.fields(config_cls):
        if f.name in base or f.name in usable:
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        value = getattr(args, f.name)
        if value != default and not ignore(f.name, value):
            reason = why.get(f.name, "")
            problems.append(f"{f.name}={value!r} (default {default!r}{'; ' + reason if reason else ''})")
    return problems


def check_eval_plan(args, eval_dataset) -> None:
    """An ``eval_strategy`` that evaluates during training needs an eval set (as transformers says)."""
    strategy = _value(args.eval_strategy)
    if strategy != "no" and eval_dataset is None:
        raise UnsupportedArgumentError(
            f"TrainingArguments.eval_strategy={strategy!r} evaluates during training, but no eval_dataset was "
            "given: pass eval_dataset=..., or set eval_strategy='no'")


def check_seq_len(seq_len, max_positions) -> None:
    """A block length the model can take: at most its ``max_position_embeddings``."""
    if seq_len is not None and max_positions and seq_len > max_positions:
        raise ValueError(f"seq_len={seq_len}: must be at most the model's max_position_embeddings "
                         f"({max_positions}); pass a smaller seq_len")


def engine_options_from_args(args) -> dict:
    """The EngineConfig fields that TrainingArguments decide."""
    opts = {
        "adam_betas": (float(args.adam_beta1), float(args.adam_beta2)),
        "adam_eps": float(args.adam_epsilon),
        "weight_decay": float(args.weight_decay),
    }
    if args.bf16:
        opts["precision"] = "bf16"
    if args.use_cpu:
        opts["device"] = "cpu"
    return opts
