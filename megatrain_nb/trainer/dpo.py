"""``mt.DPOTrainer``: a drop-in for ``trl.DPOTrainer`` on the streaming engine.

Example::

    import megatrain_nb as mt
    from trl import DPOConfig

    trainer = mt.DPOTrainer(model="path/or/org-name", train_dataset=pairs, processing_class=tok,
                            args=DPOConfig(output_dir="out", beta=0.1, loss_type=["sigmoid"], bf16=False),
                            max_vram_gb=40)            # any EngineConfig field, as for mt.Trainer
    trainer.train()

The pairs are prepared as TRL prepares them (:mod:`.dpo_data`) and batched by TRL's own
``DataCollatorForPreference`` (chosen rows, then rejected rows, in one micro-batch). The loss is
a sequence-level objective of the engine's chunked head (:mod:`.dpo_loss`), so the logits never
exist whole. The reference is data: its log-probs come from one forward-only streamed pass before
the first step, cached in ``<output_dir>/reference_logps`` (:mod:`.dpo_reference`). The loop is
:class:`~megatrain_nb.trainer.trainer.Trainer`'s. Metrics are TRL's (``rewards/*``, ``logps/*``,
``logits/*``, ``mean_token_accuracy``, ``entropy``, ``num_tokens``). DPOConfig fields that cannot
apply are refused by name.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import time
import warnings
from typing import Optional

import torch

from megatrain_nb.engine import StreamingEngine
from megatrain_nb.engine.compute.decode import share_device
from megatrain_nb.engine.inputs import OBJECTIVE_DATA

from megatrain_nb.values import DPO_FIELDS, ValueRefused, check, check_fields, row_name

from .args import check_eval_plan, check_given, unusable_fields
from .data import EXTRA_INPUTS, DataError, count_tokens, eval_batches
from .sharding import ZERO_WEIGHT
from .dpo_data import PreferenceCollator, prepare_preference_dataset
from .dpo_vision import VisionPreferenceCollator, check_vision_dpo_args, prepare_vision_pairs, vision_fingerprint
from .dpo_loss import DPOObjective, DPOSettings, PairBatch, ReferenceLogps
from .kinds import MetricLists, register_kind
from .dpo_reference import (ReferenceCache, ReferenceStopped, cache_parts, check_reference_values, key_of,
                            reference_pass, weights_fingerprint, with_reference)
from .sft_data import first_row, require_trl
from ..engine.vision import is_image_text_model
from .sft_vision import is_processor, is_vision_row, save_with_processor, vision_rows_plan, with_image_tokens
from .trainer import Trainer

# DPOConfig fields (beyond TrainingArguments') that the trainer honours, and those that cannot
# change a run here; every other DPOConfig-only field must keep its default.
DPO_HONOURED = frozenset({
    "beta", "loss_type", "loss_weights", "label_smoothing", "ld_alpha", "f_divergence_type",
    "f_alpha_divergence_coef", "use_weighting", "discopop_tau", "max_length", "truncation_mode",
    "precompute_ref_log_probs", "precompute_ref_batch_size", "dataset_num_proc", "pad_to_multiple_of",
    "disable_dropout", "padding_free", "model_init_kwargs", "trust_remote_code", "pad_token",
})
DPO_NO_EFFECT = frozenset({
    "activation_offloading",   # the engine keeps activations off the device already
    "ref_model_mixup_alpha", "ref_model_sync_steps",   # only read with sync_ref_model (refused)
})
METRIC_NAMES = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected", "logits/chosen", "logits/rejected", "mean_token_accuracy", "entropy")


def coerce_dpo_args(args):
    """``args`` as a ``trl.DPOConfig`` (a dict of its fields, or TrainingArguments converted)."""
    require_trl()
    from transformers import TrainingArguments
    from trl import DPOConfig

    if args is None:
        return DPOConfig(output_dir="megatrain_outputs")
    if isinstance(args, dict):
        check_given(args, "args")   # the table's words before TRL's dataclass sees them
        check_fields(args, "args", names=DPO_FIELDS, family="dpo")
        return DPOConfig(**{"output_dir": "megatrain_outputs", **args})
    if isinstance(args, DPOConfig):
        return args
    if isinstance(args, TrainingArguments):
        d = args.to_dict()
        d["hub_token"] = args.hub_token
        return DPOConfig(**d)
    raise TypeError(f"args must be a trl.DPOConfig or transformers.TrainingArguments, got {type(args).__name__}")


def check_dpo_values(args, where: str = "DPOConfig") -> None:
    """Every DPOConfig field the table of values holds (``values.DPO_FIELDS``: beta, label_smoothing,
    loss_type, ...) checked by its rule, each refusal naming ``where.field``; a number given as text
    (run.yaml's "1e-1") is stored as that number, a single loss type as a list of one."""
    problems = []
    for name in DPO_FIELDS:
        if not hasattr(args, name):
            continue
        try:
            setattr(args, name, check(row_name(name, "dpo"), getattr(args, name), f"{where}.{name}"))
        except ValueRefused as e:
            problems.append(str(e))
    if problems:
        raise ValueRefused("unusable DPO settings: " + "; ".join(problems))


def validate_dpo_args(args) -> None:
    """Refuse, by name, the DPOConfig-only fields set to something that cannot apply here, and
    the values outside the table's rules (:func:`check_dpo_values`)."""
    from trl import DPOConfig

    check_dpo_values(args, type(args).__name__)
    problems = unusable_fields(args, DPOConfig, DPO_HONOURED | DPO_NO_EFFECT, {
        "sync_ref_model": "the reference is precomputed data (TR-DPO's moving reference is not supported)",
        "router_aux_loss_coef": "Mixture-of-Experts auxiliary losses are not supported"})
    dtype = (args.model_init_kwargs or {}).get("dtype", (args.model_init_kwargs or {}).get("torch_dtype"))
    if dtype not in (None, "float32", torch.float32, "auto"):
        problems.append(f"model_init_kwargs dtype={dtype!r} (the engine keeps float32 master weights; use bf16=True)")
    if problems:
        raise ValueError("DPOConfig field(s) not supported by megatrain_nb: " + "; ".join(problems)
                         + ". Remove them (or set them back to their defaults); megatrain_nb never ignores a "
                         "setting silently (the supported fields are listed in megatrain_nb.trainer.dpo).")


def _disable_dropout(model) -> None:
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0


def _is_iterable(ds) -> bool:
    try:
        import datasets
    except ImportError:
        return False
    return isinstance(ds, datasets.IterableDataset)


def pair_batch(b: dict, scale: float = 1.0) -> PairBatch:
    """The objective's side data of the preference batch ``b`` (its loss multiplied by ``scale``)."""
    if "ref_chosen_logps" not in b:
        raise DataError("a preference batch reached the engine without reference log-probs")
    return PairBatch(b["ref_chosen_logps"], b["ref_rejected_logps"], b["completion_mask"].sum(dim=1),
                     count_tokens(b), 0.0 if b.get(ZERO_WEIGHT) else 1.0, scale)


class DPOKind:
    """DPO as a training kind (trainer/kinds.py): the reference log-probs before the run, each
    micro-batch's pairs as its ``objective_data``, the objective's own loss and metrics (from the
    engine's output) in the record."""

    name = "dpo"

    def before_run(self, trainer: "DPOTrainer") -> bool:
        """The reference log-probs (streamed once, or read from the cache), on the policy as it starts."""
        try:
            trainer._ensure_reference()
        except ReferenceStopped:   # stopped before the first step: nothing trained, nothing cached
            return False
        return True

    def before_window(self, trainer: "DPOTrainer", window: list) -> dict:
        # transformers divides by the accumulation steps (and DDP averages over ranks): 1 / the
        # step's real micro-batches over every rank (a rank's filler micro-batch weighs nothing)
        scale = 1.0 / max(trainer.dist.sum(sum(not b.get(ZERO_WEIGHT) for b in window)), 1)
        t_ref = trainer._live_reference(window)
        for b in window:
            b[OBJECTIVE_DATA] = pair_batch(b, scale)
        trainer._total_train_tokens += trainer.dist.sum(sum(count_tokens(b) for b in window))
        return {"reference_s": t_ref} if t_ref is not None else {}   # this step's forward-only reference pass

    def step_loss(self, trainer: "DPOTrainer", out, loss_sum: float, n_items: int) -> float:
        """TRL's logged loss: the step's micro-batch losses (each already scaled) summed over the ranks."""
        return float(trainer.dist.sum(out.objective_loss))

    def after_window(self, trainer: "DPOTrainer", window: list, out, record: dict) -> None:
        record.update(trainer.train_metrics.add(out.objective_metrics))
        record["num_tokens"] = trainer._total_train_tokens


register_kind("dpo", DPOKind)


class DPOTrainer(Trainer):
    """Preference training driven like ``trl.DPOTrainer``, trained by the StreamingEngine.

    Same constructor as ``trl.DPOTrainer`` (``model``, ``ref_model``, ``args``, ``data_collator``,
    ``train_dataset``, ``eval_dataset``, ``processing_class``, ``callbacks``), plus any EngineConfig
    field as a keyword. ``ref_model``: None (the policy as it starts), a model object or a local
    folder; either way its log-probs are computed once, streamed, and cached.
    """

    _eval_set_later = True   # the pairs are prepared after Trainer.__init__; the eval plan is checked before it

    def __init__(self, model=None, ref_model=None, args=None, data_collator=None, train_dataset=None,
                 eval_dataset=None, processing_class=None, compute_metrics=None, callbacks=None,
                 optimizers=(None, None), quantization_config=None, peft_config=None, *, tokenizer=None,
                 loss_fn=None, seq_len=None, **engine_options):
        # (tokenizer / loss_fn / seq_len: what a Session's fork hands any Trainer type: the
        # tokenizer, this trainer's own objective, and a sequence length that DPOConfig.max_length
        # decides here)
        require_trl()
        processing_class = processing_class if processing_class is not None else tokenizer
        if loss_fn is not None and not isinstance(loss_fn, DPOObjective):
            raise ValueError("loss_fn does not apply to DPOTrainer: DPOConfig.loss_type picks the loss")
        unsupported = {"compute_metrics": compute_metrics, "quantization_config": quantization_config,
                       "peft_config": peft_config}
        given = [k for k, v in unsupported.items() if v is not None] + (["optimizers"] if any(optimizers) else [])
        if given:
            raise ValueError(f"DPOTrainer arguments not supported by megatrain_nb: {given} (the engine trains every "
                             "weight in full precision with its own AdamW; PEFT adapters and quantization do not apply)")
        if train_dataset is None:
            raise ValueError("`train_dataset` is required")
        self.vision = is_vision_row(first_row(train_dataset))
        self.processor = processing_class if is_processor(processing_class) else None
        if ref_model is not None and ref_model is model:
            raise ValueError("`model` and `ref_model` cannot be the same object. In most cases you should omit "
                             "`ref_model`: the reference is then the policy as it starts.")
        args = coerce_dpo_args(args)
        validate_dpo_args(args)
        if self.vision:
            self._check_vision(model, args)
        check_eval_plan(args, eval_dataset)
        self.settings = DPOSettings.from_args(args)
        self.objective = DPOObjective(self.settings)
        if isinstance(model, torch.nn.Module) and args.disable_dropout:
            _disable_dropout(model)
        self._streamed = _is_iterable(train_dataset)
        if self._streamed and ref_model is None:
            # read as it trains: the reference runs beside every step, so the policy as it starts
            # is kept as a model of its own (a frozen copy, or the same folder)
            if isinstance(model, (str, os.PathLike, torch.nn.Module)):
                ref_model = copy.deepcopy(model) if isinstance(model, torch.nn.Module) else model
            else:
                raise ValueError("an IterableDataset with an engine as the model needs a ref_model: the policy as it "
                                 "started cannot be read back from an engine")
        self.ref_model = ref_model
        self._live_ref = None   # the reference's engine, kept while a streamed dataset trains
        ref_source = ref_model if ref_model is not None else model
        self._ref_weights = weights_fingerprint(ref_source) if isinstance(ref_source, torch.nn.Module) else None
        # vision pairs: the engine is planned at their rows' length and image tokens (counted ahead of it)
        self._vision_rows = (vision_rows_plan(self.processor, train_dataset, args.max_length, preference=True)
                             if self.vision and self.processor is not None else None)
        super().__init__(model=model, train_dataset=None, args=args, processing_class=processing_class,
                         callbacks=callbacks, loss_fn=self.objective, **engine_options)
        if self._ref_weights is None:
            self._ref_weights = weights_fingerprint(ref_source if ref_model is not None else self._engine)
        self._tokens(args)
        self.processing_class = self.processor or self.tokenizer
        self.data_collator = self._collator(data_collator, args)
        self.prep_reports = []
        self.train_dataset = self._prepare(train_dataset, "train")
        self.eval_dataset = self._prepare(eval_dataset, "eval") if eval_dataset is not None else None
        self.reference_cache = ReferenceCache(args.output_dir)
        self.reference_seconds: dict = {}   # per split: seconds of the reference pass (0.0: read from the cache)
        self._total_train_tokens = 0
        self.train_metrics = MetricLists()   # the objective's metrics since the last log
        self._eval_prefix, self._eval_extra = None, {}
        self.kind = DPOKind()

    # ------------------------------------------------------------------ construction helpers
    def _tokens(self, args):
        """The tokenizer, its pad token set as TRL sets it (and mirrored onto the model's config)."""
        if self.processor is not None:   # a processor: its tokenizer makes the text, it makes the batches of images
            self.tokenizer = self.processor.tokenizer
        tok = self.tokenizer
        if tok is None:
            raise ValueError("DPOTrainer needs a tokenizer: pass processing_class=... (or a model folder that holds one)")
        pad = args.pad_token or tok.pad_token or tok.eos_token
        if pad not in tok.get_vocab():
            raise ValueError(f"The specified `pad_token` ({pad!r}) is not found in the vocabulary of the given "
                             "processing_class; set DPOConfig.pad_token to a token it has")
        tok.pad_token = pad
        if self.model is not None:   # (TRL sets the text config's, which is the config itself for a text model)
            self.model.config.get_text_config().pad_token_id = tok.pad_token_id
        if args.padding_free:
            warnings.warn("padding_free=True is temporarily unavailable in trl.DPOTrainer and falls back to padding; "
                          "so does megatrain_nb's DPOTrainer", stacklevel=3)
        return tok

    def _collator(self, data_collator, args):
        """TRL's preference collator (or the one given), with the labels the engine takes."""
        if isinstance(data_collator, (PreferenceCollator, VisionPreferenceCollator)):   # a fork hands the parent's
            return data_collator
        if self.vision:
            if data_collator is not None:
                raise ValueError("a data_collator for vision preference rows is not supported: megatrain_nb's "
                                 "DPOTrainer batches them with TRL's DataCollatorForVisionPreference")
            return VisionPreferenceCollator(self.processor, max_length=args.max_length)
        if data_collator is None:
            from trl.trainer.dpo_trainer import DataCollatorForPreference

            pad_multiple = args.pad_to_multiple_of if args.pad_to_multiple_of != "auto" else None
            data_collator = DataCollatorForPreference(pad_token_id=self.tokenizer.pad_token_id,
                                                      max_length=args.max_length,
                                                      truncation_mode=args.truncation_mode,
                                                      pad_to_multiple_of=pad_multiple)
        return PreferenceCollator(data_collator)

    # ------------------------------------------------------------------ data and reference
    def _planned_workload(self, seq_len):
        # a micro-batch holds each pair's chosen and rejected rows, each at most max_length tokens
        work = super()._planned_workload(seq_len or self.args.max_length)
        return with_image_tokens(dataclasses.replace(work, batch=2 * work.batch), self._vision_rows)

    def _check_vision(self, model, args) -> None:
        """TRL's vision contract (trainer/dpo_vision.py): a processor, a vision-language model, its settings."""
        if self.processor is None:
            raise ValueError("train_dataset has images (an 'image' or 'images' column), but processing_class is not a "
                             "processor: pass the model's processor (transformers.AutoProcessor, a ProcessorMixin) as "
                             "processing_class")
        if isinstance(model, torch.nn.Module) and not is_image_text_model(model):
            raise ValueError("The dataset appears to be vision-related (contains 'image' or 'images' keys), but the "
                             f"model ({type(model).__name__}) is not a vision-language model; load it with "
                             "AutoModelForImageTextToText")
        check_vision_dpo_args(args)

    def _prepare(self, ds, what: str):
        a = self.args
        if self.vision:
            return prepare_vision_pairs(ds, f"{what}_dataset")
        out, report = prepare_preference_dataset(ds, self.tokenizer, max_length=a.max_length,
                                                 truncation_mode=a.truncation_mode, what=f"{what}_dataset",
                                                 num_proc=a.dataset_num_proc)
        self.prep_reports.append(report)
        if report.message():
            warnings.warn(report.message(), stacklevel=3)
        return out

    def _with_reference(self, ds, what: str, batch_size: int):
        """``ds`` with its reference log-probs: given in the data, cached, or one streamed pass."""
        if _is_iterable(ds):   # read lazily: each batch gets its reference as it is read (_live_reference)
            return ds
        if "ref_chosen_logps" in ds.column_names:   # given in the data, or added before
            if what not in self.reference_seconds:
                check_reference_values(ds["ref_chosen_logps"], ds["ref_rejected_logps"], f"{what}_dataset",
                                       "given in the data")
            self.reference_seconds.setdefault(what, 0.0)
            return ds
        data = vision_fingerprint(ds, self.processor) if self.vision else None
        parts = cache_parts(ds, self.tokenizer, self._ref_weights, self.args, self._engine.config.precision, data=data)
        key = key_of(parts)
        got = self.reference_cache.load(what, key, len(ds), parts)
        why = self.reference_cache.reason
        t0 = time.perf_counter()
        if got is None:
            engine, own = self._reference_engine()
            bar = None
            if not self.args.disable_tqdm and self.dist.is_main:
                from tqdm.auto import tqdm

                bar = tqdm(total=len(ds), desc=f"reference log-probs ({what}, one forward-only pass)", unit="pair")
            try:
                got = reference_pass(engine, ds, self.data_collator, batch_size, self.settings,
                                     progress=(lambda done, n: bar.update(done - bar.n)) if bar is not None else None,
                                     stop=self._reference_stop)
            finally:
                if bar is not None:
                    bar.close()
                if own:
                    engine.close()
            seconds = time.perf_counter() - t0
            check_reference_values(*got, f"{what}_dataset", "the reference model's own pass gave it: the reference "
                                   "overflows on that pair")
            if self.dist.is_main:
                self.reference_cache.save(what, key, got[0], got[1], seconds, parts)
        else:
            seconds = 0.0
        self.reference_seconds[what] = seconds
        self.metrics_log.write({"event": "reference", "split": what, "pairs": len(ds), "seconds": seconds,
                                "cached": seconds == 0.0, "key": key, "time": time.time(),
                                **({"recomputed": why} if why else {})})
        return with_reference(ds, *got)

    def _reference_stop(self) -> bool:
        # whoever drives this trainer applies its queued pause / resume / stop between the pass's
        # batches (the pass is minutes on a big model): True stops
        if self.hooks.between_batches():
            self.request_stop()
        return self.stop_requested

    def _reference_engine(self):
        """The engine the reference streams through: the policy's own (before its first step), or
        one built for ``ref_model`` (closed after the pass)."""
        if self.ref_model is None:
            steps = getattr(getattr(self._engine, "counters", None), "steps", 0)
            if self.state.global_step > 0 or steps > 0:
                raise ValueError("Cannot compute reference log-probs after training has started when the reference "
                                 "is the policy as it started (no ref_model): pass the dataset as eval_dataset at "
                                 "construction, or give a ref_model.")
            return self._engine, False

        config = self._engine.config
        if isinstance(self.ref_model, torch.nn.Module):
            if self.args.disable_dropout:
                _disable_dropout(self.ref_model)
            return StreamingEngine(self.ref_model, config), True
        return StreamingEngine.from_pretrained(str(self.ref_model), config), True

    def _ensure_reference(self) -> None:
        a = self.args
        if "train" not in self.reference_seconds and not self._streamed:
            self.train_dataset = self._with_reference(self.train_dataset, "train",
                                                      a.precompute_ref_batch_size or a.per_device_train_batch_size)
        if self.eval_dataset is not None and "eval" not in self.reference_seconds:
            self.eval_dataset = self._with_reference(self.eval_dataset, "eval",
                                                     a.precompute_ref_batch_size or a.per_device_eval_batch_size)

    # ------------------------------------------------------------------ the loop
    def _live_reference(self, window: list):
        """A streamed dataset's batches get their reference log-probs here, one forward-only pass
        of the reference's own engine per micro-batch; returns its seconds (None: precomputed)."""
        todo = [b for b in window if "ref_chosen_logps" not in b]
        if not todo:
            return None
        t0 = time.perf_counter()
        engine = self._live_ref
        if engine is None:   # the policy itself is the reference only before its first step (checked there)
            engine, own = self._reference_engine()
            if own:
                self._live_ref = engine
                share_device(self._engine, engine)   # (kept beside the policy: counted in its device room)
        obj = ReferenceLogps(self.settings)
        for b in todo:
            out = engine.evaluate(b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"], loss_fn=obj,
                                  **(b.get(EXTRA_INPUTS) or {}))
            b["ref_chosen_logps"], b["ref_rejected_logps"] = out.objective_metrics[0]["logps"].chunk(2, dim=0)
        return time.perf_counter() - t0

    def save_model(self, output_dir: Optional[str] = None) -> str:
        """As ``Trainer.save_model``; with a processor, its files too (``AutoProcessor`` loads the folder)."""
        if self.processor is None:
            return super().save_model(output_dir)
        return save_with_processor(self, output_dir)

    def close(self) -> None:
        """As :meth:`Trainer.close`, and the reference's own engine when one was kept."""
        if self._live_ref is not None:
            self._live_ref.close()
            self._live_ref = None
        super().close()

    # ------------------------------------------------------------------ metrics
    def log(self, logs: dict) -> None:
        """As ``Trainer.log``, with TRL's DPO metrics (their means since the last log)."""
        p = self._eval_prefix
        if p is not None and f"{p}_loss" in logs:
            logs = {**logs, **self._eval_extra}
        elif "loss" in logs:
            metrics = self.train_metrics.take()
            if self.dist.world > 1:   # every rank logs the same steps: the mean over ranks, as TRL gathers them
                metrics = {k: float(self.dist.sum(v)) / self.dist.world for k, v in sorted(metrics.items())}
            logs = {**logs, **metrics, "num_tokens": float(self._total_train_tokens)}
        super().log(logs)

    def evaluate(self, eval_dataset=None, metric_key_prefix: str = "eval") -> dict:
        """The DPO loss (mean over pairs, as transformers averages it over samples) and TRL's
        metrics over the eval set, its reference log-probs streamed once."""
        a = self.args
        if eval_dataset is not None:
            ds = self._with_reference(self._prepare(eval_dataset, "eval"), "eval",
                                      a.precompute_ref_batch_size or a.per_device_eval_batch_size)
        else:
            self._ensure_reference()
            ds = self.eval_dataset
        if ds is None:
            raise ValueError("evaluate() needs an eval_dataset (give one to the DPOTrainer or to evaluate())")
        t0, total, rows, seen = time.time(), 0.0, 0, MetricLists()
        for b in eval_batches(ds, batch_size=a.per_device_eval_batch_size, collate=self.data_collator,
                              rank=self.dist.rank, world=self.dist.world):
            self._live_reference([b])
            out = self._engine.evaluate(b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"],
                                        loss_fn=self.objective, objective_data=pair_batch(b),
                                        **(b.get(EXTRA_INPUTS) or {}))
            seen.add(out.objective_metrics)
            n = 0 if b.get(ZERO_WEIGHT) else int(b["input_ids"].shape[0])
            total, rows = total + out.objective_loss * n, rows + n
        total, rows = self.dist.sum(total), self.dist.sum(rows)
        if rows == 0:
            raise DataError("the eval dataset holds no pairs")
        p = metric_key_prefix
        self._eval_extra = {f"{p}_{k}": v for k, v in seen.take().items()}
        self._eval_extra[f"{p}_num_tokens"] = float(self._total_train_tokens)
        metrics = {f"{p}_loss": total / rows, f"{p}_runtime": time.time() - t0}
        self._eval_prefix = p
        try:
            self.log(dict(metrics))
        finally:
            self._eval_prefix = None
        metrics.update(self._eval_extra)
        self.metrics_log.write({"event": "evaluate", **metrics, "step": self.state.global_step, "time": time.time()})
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics=metrics)
        return metrics


__all__ = ["DPOTrainer", "METRIC_NAMES", "coerce_dpo_args", "validate_dpo_args"]
