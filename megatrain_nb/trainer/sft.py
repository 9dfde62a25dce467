"""``mt.SFTTrainer``: a drop-in for ``trl.SFTTrainer`` on the streaming engine.

Example::

    import megatrain_nb as mt
    from trl import SFTConfig

    trainer = mt.SFTTrainer(model="path/or/org-name", train_dataset=chat_ds, processing_class=tok,
                            args=SFTConfig(output_dir="out", assistant_only_loss=True, max_length=2048,
                                           packing=True, bf16=False),
                            max_vram_gb=40)            # any EngineConfig field, as for mt.Trainer
    trainer.train()
    trainer.save_model()

The data is prepared once, as TRL prepares it (:mod:`.sft_data`, on TRL's public utilities);
batches are made by TRL's own ``DataCollatorForLanguageModeling`` (padding-free rows for
``packing`` with the "bfd" strategies: per-document ``position_ids``, no attention across
documents); the loop is :class:`~megatrain_nb.trainer.trainer.Trainer`'s (layer-major accumulation,
sharding, checkpoints, resume, ``on_nonfinite``). ``mean_token_accuracy`` and ``entropy`` are
logged for evaluation, and for training on the steps that log. SFTConfig fields that cannot
apply are refused by name. ``trl`` is the optional extra ``pip install "megatrain-nb[sft]"``.

Images (TRL's vision format: an ``images``/``image`` column, a processor as ``processing_class``,
a vision-language model): the rows are not prepared ahead, TRL's
``DataCollatorForVisionLanguageModeling`` makes each batch, image tokens are never truncated
(:mod:`.sft_vision`); ``frozen=("vision_tower",)`` (an EngineConfig field) freezes a part by name.
"""
from __future__ import annotations

import dataclasses
import math
import os
import warnings
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from transformers import TrainerCallback

from megatrain_nb.values import SFT_FIELDS, check, check_fields, row_name

from ..engine.vision import is_image_text_model
from .args import check_eval_plan, check_given
from .data import DataError, prepare_dataset
from .kinds import kind
from .sft_data import (PrepReport, SFTDataOptions, as_dataset, detect_format, first_row, head_rows,
                       require_trl, to_trl_rows)
from .sft_prepare import prepare_sft_dataset
from .sft_vision import (VISION_HEAD, UserVisionCollator, VisionCollator, check_vision_args, check_vision_rows,
                         vision_rows_plan, with_image_tokens,
                         is_processor, is_vision_row, save_with_processor, with_row_index)
from .trainer import Trainer

# SFTConfig fields that the trainer honours (beyond TrainingArguments'), and those that cannot
# change a run here; every other SFTConfig-only field must keep its default.
SFT_HONOURED = frozenset({
    "chat_template_path", "dataset_text_field", "dataset_kwargs", "dataset_num_proc", "eos_token", "max_length",
    "truncation_mode", "shuffle_dataset", "packing", "packing_strategy", "padding_free", "pad_to_multiple_of",
    "eval_packing", "completion_only_loss", "assistant_only_loss", "loss_type", "pad_token",
})
SFT_NO_EFFECT = frozenset({
    "activation_offloading",   # the engine keeps activations off the device already
    "model_init_kwargs",       # checked: only a float32 dtype (the engine keeps fp32 master weights)
})
SFT_KEYS = ("input_ids", "labels", "seq_lengths")   # what TRL's collator receives (its signature columns)


class SFTArgumentError(ValueError):
    """An SFTConfig field was set to something megatrain_nb does not do."""


def coerce_sft_args(args):
    """``args`` as a ``trl.SFTConfig`` (TrainingArguments are converted as TRL converts them)."""
    require_trl()
    from transformers import TrainingArguments
    from trl import SFTConfig

    if args is None:
        return SFTConfig(output_dir="megatrain_outputs")
    if isinstance(args, dict):
        check_given(args, "args")
        check_fields(args, "args", names=SFT_FIELDS, family="sft")
        return SFTConfig(**{"output_dir": "megatrain_outputs", **args})
    if isinstance(args, SFTConfig):
        return args
    if isinstance(args, TrainingArguments):
        d = args.to_dict()
        d["hub_token"] = args.hub_token
        return SFTConfig(**d)
    raise TypeError(f"args must be a trl.SFTConfig or transformers.TrainingArguments, got {type(args).__name__}")


def validate_sft_args(args) -> None:
    """Refuse, by name, the SFTConfig-only fields set to something that cannot apply."""
    from transformers import TrainingArguments
    from trl import SFTConfig

    where = type(args).__name__
    for name in SFT_FIELDS:   # the table's rules (megatrain_nb/values.py), before anything else
        if hasattr(args, name):
            setattr(args, name, check(row_name(name, "sft"), getattr(args, name), f"{where}.{name}"))
    base = {f.name for f in dataclasses.fields(TrainingArguments)}
    problems = []
    for f in dataclasses.fields(SFTConfig):
        name = f.name
        if name in base or name in SFT_HONOURED or name in SFT_NO_EFFECT:
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if getattr(args, name) != default:
            problems.append(f"{name}={getattr(args, name)!r} (default {default!r})")
    dtype = (args.model_init_kwargs or {}).get("dtype", (args.model_init_kwargs or {}).get("torch_dtype"))
    if dtype not in (None, "float32", torch.float32, "auto"):
        problems.append(f"model_init_kwargs dtype={dtype!r} (the engine keeps float32 master weights; use "
                        "bf16=True for bf16 compute)")
    extra = set(args.model_init_kwargs or {}) - {"dtype", "torch_dtype", "revision", "attn_implementation"}
    if extra:
        problems.append(f"model_init_kwargs keys {sorted(extra)} (only dtype, revision, attn_implementation apply)")
    if args.pad_to_multiple_of not in (None, "auto") and not isinstance(args.pad_to_multiple_of, int):
        problems.append(f"pad_to_multiple_of={args.pad_to_multiple_of!r} (an int or None)")
    extra = set(args.dataset_kwargs or {}) - {"skip_prepare_dataset"}
    if extra:
        problems.append(f"dataset_kwargs keys {sorted(extra)} (only skip_prepare_dataset applies)")
    if args.chat_template_path is not None and not (
            os.path.isfile(args.chat_template_path) and args.chat_template_path.endswith((".jinja", ".j2"))):
        problems.append(f"chat_template_path={args.chat_template_path!r} (give a .jinja/.j2 file: cloning another "
                        "tokenizer's template adds tokens and resizes the embeddings, which a built engine cannot "
                        "do; resize the model first, or use that template file)")
    if problems:
        raise SFTArgumentError(
            "SFTConfig field(s) not supported by megatrain_nb: " + "; ".join(problems)
            + ". Remove them (or set them back to their defaults); megatrain_nb never ignores a setting silently "
            "(the supported fields are listed in megatrain_nb.trainer.sft).")


class TokenMetrics:
    """The loss function the engine calls per chunk of logits (``loss_fn``): the summed token loss
    (TRL's "nll", or "dft"), and, while ``collect`` is on, the counts behind TRL's
    ``mean_token_accuracy`` and ``entropy`` over the tokens counted in the loss."""

    def __init__(self, loss_type: str = "nll"):
        self.loss_type = loss_type
        self.collect = False
        self.reset()

    def reset(self) -> None:
        self.tokens, self.correct, self.entropy = 0, 0, 0.0

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        flat, lab = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
        if self.collect:
            with torch.no_grad():
                keep = lab != -100
                lg = flat[keep].float()
                if lg.numel():
                    logp = torch.log_softmax(lg, dim=-1)
                    self.entropy += float(-(logp.exp() * logp).sum())
                    self.correct += int((lg.argmax(-1) == lab[keep]).sum())
                    self.tokens += int(keep.sum())
        if self.loss_type == "dft":   # https://huggingface.co/papers/2508.05629, as TRL computes it
            keep = lab != -100
            logp = torch.log_softmax(flat.float(), dim=-1).gather(1, lab.clamp(min=0)[:, None])[:, 0]
            return -(logp * logp.exp().detach())[keep].sum()
        return F.cross_entropy(flat, lab, ignore_index=-100, reduction="sum")

    def take(self, prefix: str = "", total: Optional[Callable] = None) -> dict:
        """``{mean_token_accuracy, entropy}`` since the last take (empty when nothing was counted).
        ``total``: sums a number over the ranks (``Dist.sum``; every rank calls take together), so
        the figures are over every rank's tokens, as one process would count them."""
        tokens, correct, entropy = self.tokens, self.correct, self.entropy
        if total is not None:
            tokens, correct, entropy = int(total(tokens)), int(total(correct)), float(total(entropy))
        self.reset()
        if not tokens:
            return {}
        return {f"{prefix}mean_token_accuracy": correct / tokens, f"{prefix}entropy": entropy / tokens}


def _pad_multiple(args) -> Optional[int]:
    return args.pad_to_multiple_of if args.pad_to_multiple_of != "auto" else None


class SFTCollator:
    """TRL's collator on the columns TRL hands it (``input_ids``, ``labels``, ``seq_lengths``)."""

    def __init__(self, collator: Callable):
        self.collator = collator

    def __call__(self, examples: list) -> dict:
        return self.collator([{k: e[k] for k in SFT_KEYS if k in e} for e in examples])


class SFTTrainer(Trainer):
    """Supervised fine-tuning driven like ``trl.SFTTrainer``, trained by the StreamingEngine.

    Same constructor as ``trl.SFTTrainer`` (``model``, ``args``, ``data_collator``,
    ``train_dataset``, ``eval_dataset``, ``processing_class``, ``callbacks``,
    ``formatting_func``), plus any EngineConfig field as a keyword (as ``mt.Trainer``).
    ``prep_reports`` holds what preparation decided (truncated, dropped examples).
    """

    _eval_set_later = True   # prepared below, after Trainer.__init__; checked before it

    def __init__(self, model=None, args=None, data_collator=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, compute_loss_func=None, compute_metrics=None, callbacks=None,
                 optimizers=(None, None), optimizer_cls_and_kwargs=None, preprocess_logits_for_metrics=None,
                 quantization_config=None, peft_config=None, formatting_func=None, **engine_options):
        require_trl()
        unsupported = {"compute_loss_func": compute_loss_func, "compute_metrics": compute_metrics,
                       "optimizer_cls_and_kwargs": optimizer_cls_and_kwargs,
                       "preprocess_logits_for_metrics": preprocess_logits_for_metrics,
                       "quantization_config": quantization_config, "peft_config": peft_config}
        given = [k for k, v in unsupported.items() if v is not None] + (["optimizers"] if any(optimizers) else [])
        if given:
            raise ValueError(f"SFTTrainer arguments not supported by megatrain_nb: {given} (the engine trains every "
                             "weight in full precision with its own AdamW and the token loss; SFTConfig.loss_type "
                             "picks 'nll' or 'dft')")
        if train_dataset is None:
            raise ValueError("`train_dataset` is required")
        args = coerce_sft_args(args)
        validate_sft_args(args)
        check_eval_plan(args, eval_dataset)
        self.metrics = TokenMetrics(args.loss_type)
        self._eval_prefix, self._eval_extra = None, {}
        # vision rows: the engine is planned at their length and image tokens (counted ahead of it)
        self._vision_rows = (vision_rows_plan(processing_class, train_dataset, args.max_length,
                                              args.dataset_text_field)
                             if is_processor(processing_class) and is_vision_row(first_row(train_dataset,
                                                                                           "train_dataset")) else None)
        super().__init__(model=model, train_dataset=None, args=args, processing_class=processing_class,
                         callbacks=[MetricsSchedule(self.metrics)] + list(callbacks or []), loss_fn=self.metrics,
                         **engine_options)
        tok = self.tokenizer
        if tok is None:
            raise ValueError("SFTTrainer needs a tokenizer: pass processing_class=... (or a model folder that "
                             "holds one)")
        # A processor (vision-language model): its tokenizer makes the text, it makes the batches of images.
        self.processor = tok if is_processor(tok) else None
        if self.processor is not None:
            tok = self.tokenizer = self.processor.tokenizer
        self.processing_class = self.processor or tok
        self._setup_tokens(tok, args)
        self.prep_reports: list[PrepReport] = []
        self.vision = is_vision_row(first_row(train_dataset, "train_dataset"))
        setup = self._setup_vision if self.vision else self._setup_text
        self.data_collator = setup(train_dataset, args, data_collator, formatting_func)
        self.kind = kind("sft")
        self.formatting_func = formatting_func
        self._skip_prepare = bool((args.dataset_kwargs or {}).get("skip_prepare_dataset", False))
        self.train_dataset = self._prepare(train_dataset, args.packing, "train_dataset")
        if eval_dataset is not None:
            self.eval_dataset = self._prepare(eval_dataset, self._eval_packing, "eval_dataset")

    def _planned_workload(self, seq_len):
        # text rows are at most max_length tokens (packed rows exactly): the plan is made for them
        return with_image_tokens(super()._planned_workload(seq_len or self.args.max_length), self._vision_rows)

    def _setup_text(self, train_dataset, args, data_collator, formatting_func):
        """The collator of text rows (TRL's DataCollatorForLanguageModeling); the loss settings."""
        tok = self.tokenizer
        self.padding_free = args.padding_free or (args.packing and args.packing_strategy in ("bfd", "bfd_split"))
        if self.padding_free and data_collator is not None:
            raise ValueError("Passing a custom data collator is not supported when using padding-free.")
        if self.padding_free and not args.packing and args.max_length is not None:
            raise ValueError("padding_free=True without packing does not enforce max_length: enable packing, or "
                             "set max_length=None with inputs already truncated")
        text_field = args.dataset_text_field if formatting_func is None else None
        sample = head_rows(as_dataset(train_dataset, "train_dataset", text_field), 1)
        if formatting_func is not None:
            trl_sample = {"text": formatting_func(sample[0])}
        else:
            fmt = detect_format(sample, text_field)
            trl_sample = to_trl_rows(sample, fmt, "train_dataset")[0] if fmt in ("alpaca", "sharegpt") else sample[0]
        self._loss_settings(trl_sample, args)
        if self.completion_only_loss and formatting_func is not None:
            raise ValueError("A formatting function was given while completion_only_loss=True: a formatter makes the "
                             "dataset plain text; apply it before, or set completion_only_loss=False")
        if data_collator is None:
            from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

            self._set_pad_token(tok, args)
            data_collator = DataCollatorForLanguageModeling(pad_token_id=tok.pad_token_id,
                                                            padding_free=self.padding_free,
                                                            pad_to_multiple_of=_pad_multiple(args))
        return SFTCollator(data_collator)

    def _setup_vision(self, train_dataset, args, data_collator, formatting_func):
        """TRL's vision contract (trainer/sft_vision.py): a processor, a vision-language model,
        TRL's vision collator on the rows as they are."""
        if self.processor is None:
            raise ValueError("train_dataset has images (an 'image' or 'images' column), but processing_class is a "
                             f"tokenizer ({type(self.tokenizer).__name__}): pass the model's processor "
                             "(transformers.AutoProcessor, a ProcessorMixin) as processing_class")
        if self.model is not None and not is_image_text_model(self.model):
            raise ValueError(f"train_dataset has images (an 'image' or 'images' column), but the model "
                             f"({type(self.model).__name__}) is not a vision-language model; load it with "
                             "AutoModelForImageTextToText")
        if formatting_func is not None:
            raise ValueError("formatting_func cannot apply to a vision dataset (TRL does not prepare vision rows: "
                             "its collator reads them as they are); put the text in 'messages' or "
                             "'prompt'/'completion' instead")
        check_vision_args(args)
        self.padding_free = False
        self._loss_settings(first_row(train_dataset, "train_dataset"), args)
        if data_collator is not None:
            return UserVisionCollator(data_collator)
        self._set_pad_token(self.tokenizer, args)
        collator = VisionCollator(self.processor, max_length=args.max_length,
                                  completion_only_loss=self.completion_only_loss,
                                  dataset_text_field=args.dataset_text_field,
                                  assistant_only_loss=args.assistant_only_loss, chat_template=self.chat_template,
                                  pad_to_multiple_of=_pad_multiple(args))
        self.prep_reports.append(collator.report)   # (its rows truncated by their text, counted as batches are made)
        return collator

    def _loss_settings(self, trl_sample: dict, args) -> None:
        """assistant_only_loss's template and completion_only_loss's default, as TRL decides them."""
        from trl.data_utils import is_conversational

        if args.assistant_only_loss and not is_conversational(trl_sample):
            raise ValueError("You set `assistant_only_loss=True`, but the dataset is not conversational. This option "
                             "is only supported for conversational datasets (messages, or prompt/completion as lists "
                             "of messages).")
        self.chat_template = self._training_template(self.processing_class, args)
        self.completion_only_loss = (("prompt" in trl_sample and "completion" in trl_sample)
                                     if args.completion_only_loss is None else args.completion_only_loss)

    def _set_pad_token(self, tok, args) -> None:
        pad = args.pad_token or tok.pad_token or tok.eos_token
        if pad is None or pad not in tok.get_vocab():
            raise ValueError(f"pad_token {pad!r} is not in the tokenizer's vocabulary; set SFTConfig.pad_token "
                             "to a token it has")
        tok.pad_token = pad
        if self.model is not None:
            self.model.config.pad_token_id = tok.pad_token_id
            self.model.config.get_text_config().pad_token_id = tok.pad_token_id

    # ------------------------------------------------------------------ preparation
    @property
    def _eval_packing(self) -> bool:
        return self.args.packing if self.args.eval_packing is None else self.args.eval_packing

    def _setup_tokens(self, tok, args) -> None:
        if args.eos_token is not None:
            if args.eos_token not in tok.get_vocab():
                raise ValueError(f"eos_token {args.eos_token!r} is not in the tokenizer's vocabulary; use a token it "
                                 "has (SFTConfig.eos_token)")
            tok.eos_token = args.eos_token
            if self.model is not None:
                self.model.config.eos_token_id = tok.eos_token_id
        if args.chat_template_path is not None:   # (a processor's: the one its chat template renders with)
            with open(args.chat_template_path, encoding="utf-8") as f:
                (self.processor or tok).chat_template = f.read()

    def _training_template(self, tok, args) -> Optional[str]:
        """The template to tokenise with (None: the tokenizer's). For assistant_only_loss a template
        without {% generation %} marks is swapped for TRL's training version, when TRL has one."""
        if not args.assistant_only_loss:
            return None
        from trl.chat_template_utils import get_training_chat_template, has_generation_markers

        if not getattr(tok, "chat_template", None):
            raise DataError("assistant_only_loss=True needs a chat template with {% generation %} marks, and the "
                            "tokenizer has none: give one with SFTConfig(chat_template_path='template.jinja')")
        if has_generation_markers(tok.chat_template):
            return None
        try:
            return get_training_chat_template(tok)
        except ValueError as e:
            raise DataError("assistant_only_loss=True, but the chat template has no {% generation %} ... "
                            "{% endgeneration %} marks around the assistant's turns, so no token would be known as "
                            "the assistant's. Add the marks to the template (SFTConfig.chat_template_path) or set "
                            f"assistant_only_loss=False. ({e})") from e

    def _prepare(self, ds, packing: bool, what: str):
        if self.vision:   # as TRL: not prepared ahead; checked at its head, its rows numbered to be named
            ds = as_dataset(ds, what, None)
            check_vision_rows(head_rows(ds, VISION_HEAD), what, self.args.dataset_text_field)
            return with_row_index(ds, what)
        if self._skip_prepare:
            cols = getattr(ds, "column_names", None) or (list(ds[0]) if isinstance(ds, (list, tuple)) and ds else [])
            if "labels" not in cols and ("completion_mask" in cols or "assistant_masks" in cols):
                raise DataError(f"{what} has mask columns but no 'labels', and skip_prepare_dataset=True skips label "
                                "building, so it would train on the full sequence. Add a 'labels' column (-100 for "
                                "tokens outside the loss) or drop skip_prepare_dataset")
            return prepare_dataset(ds, what=what)
        a = self.args
        opts = SFTDataOptions(max_length=a.max_length, truncation_mode=a.truncation_mode,
                              dataset_text_field=a.dataset_text_field, packing=packing,
                              packing_strategy=a.packing_strategy, shuffle_dataset=a.shuffle_dataset, seed=a.seed,
                              completion_only_loss=self.completion_only_loss,
                              assistant_only_loss=a.assistant_only_loss, chat_template=self.chat_template,
                              dataset_num_proc=a.dataset_num_proc)
        out, report = prepare_sft_dataset(ds, self.tokenizer, opts, formatting_func=self.formatting_func, what=what)
        self.prep_reports.append(report)
        if report.message():
            warnings.warn(report.message(), stacklevel=3)
        return out

    def save_model(self, output_dir: Optional[str] = None) -> str:
        """As ``Trainer.save_model``; with a processor, its files too (``AutoProcessor`` loads the folder)."""
        if self.processor is None:
            return super().save_model(output_dir)
        return save_with_processor(self, output_dir)

    # ------------------------------------------------------------------ metrics
    def log(self, logs: dict) -> None:
        """As ``Trainer.log``, with ``mean_token_accuracy`` and ``entropy`` added as TRL adds them."""
        p = self._eval_prefix
        total = self.dist.sum if self.dist.world > 1 else None   # (every rank logs the same steps)
        if p is not None and f"{p}_loss" in logs:
            self._eval_extra = self.metrics.take(f"{p}_", total)
            logs = {**logs, **self._eval_extra}
        elif "loss" in logs:
            logs = {**logs, **self.metrics.take(total=total)}
        super().log(logs)

    def evaluate(self, eval_dataset=None, metric_key_prefix: str = "eval") -> dict:
        """Loss, perplexity, ``mean_token_accuracy`` and ``entropy`` over the eval set (prepared as the train set)."""
        kept = self.eval_dataset
        if eval_dataset is not None:
            eval_dataset = self._prepare(eval_dataset, self._eval_packing, "eval_dataset")
            if self.vision:   # rows the collator takes as they are: the base's evaluate would want tokens
                self.eval_dataset, eval_dataset = eval_dataset, None
        self.metrics.reset()
        self.metrics.collect, self._eval_prefix, self._eval_extra = True, metric_key_prefix, {}
        try:
            metrics = super().evaluate(eval_dataset, metric_key_prefix)
        finally:
            self.metrics.collect, self._eval_prefix, self.eval_dataset = False, None, kept
        return {**metrics, **self._eval_extra}


class MetricsSchedule(TrainerCallback):
    """Turns the token metrics on for the steps that log (they cost a softmax pass over the logits)."""

    def __init__(self, metrics: TokenMetrics):
        self.metrics = metrics

    def on_step_begin(self, args, state, control, **kw):
        steps = (args.logging_steps if args.logging_steps >= 1
                 else max(math.ceil(state.max_steps * args.logging_steps), 1))
        step = state.global_step + 1
        self.metrics.collect = (step % int(steps) == 0 or (args.logging_first_step and step == 1)
                                or step == state.max_steps)

    def on_step_end(self, args, state, control, **kw):
        self.metrics.collect = False
