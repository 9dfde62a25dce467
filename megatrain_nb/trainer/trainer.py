"""``mt.Trainer``: the drop-in for ``transformers.Trainer`` on top of the StreamingEngine.

Example::

    import megatrain_nb as mt
    from transformers import AutoModelForCausalLM, TrainingArguments

    mt.init(offload_dir="/nvme/cache", max_vram_gb=80, optimizer_compression=True)
    model = AutoModelForCausalLM.from_pretrained(local_dir, dtype=torch.float32)
    trainer = mt.Trainer(model=model, train_dataset=ds,
                         args=TrainingArguments(per_device_train_batch_size=1,
                                                gradient_accumulation_steps=128, output_dir="out"))
    trainer.train()             # or: for record in trainer.iter_steps(): ...
    trainer.save_model()

The loop matches transformers.Trainer step for step: the same batches in the same order, the
loss normalised by the target tokens of the whole accumulation window (``num_items_in_batch``),
global-norm clipping, AdamW with the same decay set, and ``get_scheduler`` stepped after each
optimizer step. It is a generator (:meth:`Trainer.iter_steps`) so a notebook Session can act
between steps.
"""
from __future__ import annotations

import math
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Iterator, Optional

import torch

from megatrain_nb.model_source import is_engine as _is_engine, resolve
from megatrain_nb.values import check

from ..engine.config import EngineConfig
from ..engine.engine import StreamingEngine
from ..engine.family import max_positions
from ..engine.ranks.dist import Dist
from ..engine.planning.planner import Workload
from ..engine.planning.prediction_check import engine_prediction
from .. import export as export_model
from . import checkpoint as ckpt
from . import saving
from .control import RunControl, wanted
from .args import (
    check_eval_plan,
    check_learning_rate,
    check_seq_len,
    default_values,
    engine_options_from_args,
    training_arguments,
    validate_training_args,
)
from .data import (
    EXTRA_INPUTS,
    BatchStream,
    ColumnFilter,
    DataError,
    default_collator,
    eval_batches,
    model_inputs,
    prepare_dataset,
)
from .defaults import merge_engine_options
from .metrics_log import MetricsLog
from .prediction_watch import PredictionWatch
from .kinds import PlainKind, TrainingKind
from .run import NoHooks, Run, RunHooks
from .recovery import Recovery
from .schedule import LRSchedule
from .snapshot import BranchStart, begin_snapshot


def _coerce_args(args):
    from transformers import TrainingArguments

    if args is None:
        return TrainingArguments(output_dir="megatrain_outputs")
    if isinstance(args, dict):
        return training_arguments({"output_dir": "megatrain_outputs", **args}, where="args")
    if not isinstance(args, TrainingArguments):
        raise TypeError(f"args must be a transformers.TrainingArguments (or a dict of its fields), "
                        f"got {type(args).__name__}")
    return args


def _derived_engine_options(args) -> dict:
    """Engine options decided by TrainingArguments fields the user changed from their defaults."""
    defaults = default_values()
    fields_of = {"adam_betas": ("adam_beta1", "adam_beta2"), "adam_eps": ("adam_epsilon",),
                 "weight_decay": ("weight_decay",), "precision": ("bf16",), "device": ("use_cpu",)}
    opts = engine_options_from_args(args)
    return {k: v for k, v in opts.items()
            if any(getattr(args, f) != defaults[f] for f in fields_of[k])}


def data_row_tokens(dataset, sample: int = 64) -> Optional[int]:
    """The longest ``input_ids`` of a tokenized dataset's first ``sample`` rows (they train as they
    are: the plan and the prediction are made for them, not for a default length); None for text
    rows (packed to ``seq_len``), an iterable dataset or anything else."""
    try:
        lengths = [len(dataset[i]["input_ids"]) for i in range(min(len(dataset), sample))]
    except Exception:   # (a probe: a dataset it cannot read so is planned at the default length)
        return None
    return max(lengths) if lengths else None


def run_workload(args, seq_len: Optional[int]) -> Workload:
    """What a run's steps train on, for the planner's predicted pick (a row of ``seq_len``, else
    1024 tokens, which the engine cuts to the model's positions as _default_seq_len does)."""
    clipped = bool(args.max_grad_norm and args.max_grad_norm > 0)
    return Workload(batch=args.per_device_train_batch_size, seq=seq_len or 1024,
                    accumulation=args.gradient_accumulation_steps, gradients="held" if clipped else "none",
                    clipped=clipped)


class Trainer:
    """Train a causal LM with the StreamingEngine, driven like ``transformers.Trainer``.

    ``model``: a ``*ForCausalLM`` module, a local model folder, a Hugging Face Hub id
    (``"org/name"``; ``revision=``/``token=`` as for ``from_pretrained``, config, tokenizer and
    safetensors only, see :mod:`megatrain_nb.hub`), or an existing StreamingEngine.
    ``**engine_options``: any EngineConfig field; they override ``mt.init`` defaults.
    ``seq_len``/``text_column``/``packing``: how a text dataset is tokenised and packed.
    """

    _eval_set_later = False   # SFTTrainer prepares its eval set after this constructor (and checks it)
    _rows_seq: Optional[int] = None   # the tokens of a step's rows (GRPOTrainer sets its own before __init__)

    def __init__(self, model=None, train_dataset=None, args=None, eval_dataset=None, tokenizer=None,
                 data_collator=None, callbacks=None, *, processing_class=None, seq_len: Optional[int] = None,
                 text_column: str = "text", packing: bool = True, loss_fn=None, revision: Optional[str] = None,
                 token=None, **engine_options):
        from transformers.trainer_callback import CallbackHandler, DefaultFlowCallback
        from transformers.trainer_utils import enable_full_determinism, set_seed

        # loss_fn(logits_chunk, shifted_labels_chunk) -> summed loss of the chunk (see the engine).
        self.loss_fn = loss_fn
        self.args = _coerce_args(args)
        validate_training_args(self.args, where=type(self.args).__name__)   # SFTConfig names itself
        seq_len = check("seq_len", seq_len)
        if self.args.full_determinism:
            enable_full_determinism(self.args.seed)
        else:
            set_seed(self.args.seed)
        self.tokenizer = tokenizer if tokenizer is not None else processing_class
        source = resolve(model, revision=revision, token=token)   # a Hub id -> its cached folder
        if isinstance(model, (str, os.PathLike)):
            model = source.need_folder("mt.Trainer")
        # what the plan and the prediction price: seq_len, else the data's longest row, else a
        # subclass's own rows set before this (GRPOTrainer's rollouts), else None (the default row)
        self._rows_seq = seq_len or data_row_tokens(train_dataset) or self._rows_seq
        self.model, self._engine = self._build_engine(model, engine_options, self._rows_seq)
        # The engine this Trainer built is its own: released with it (close(), the with block,
        # or when the Trainer is collected, e.g. after a failed train() and `del trainer`).
        self._finalizer = (weakref.finalize(self, _release_engine, self._engine)
                           if not _is_engine(model) else None)
        if self.tokenizer is None and isinstance(model, (str, os.PathLike)):
            self.tokenizer = local_tokenizer(model)
        check_seq_len(seq_len, max_positions(self._engine.model_config))
        self.seq_len = seq_len or _default_seq_len(self._engine)
        prep = dict(tokenizer=self.tokenizer, seq_len=self.seq_len, text_column=text_column, packing=packing)
        self.train_dataset = (prepare_dataset(train_dataset, what="train_dataset", **prep)
                              if train_dataset is not None else None)
        self.eval_dataset = (prepare_dataset(eval_dataset, what="eval_dataset", **prep)
                             if eval_dataset is not None else None)
        if not self._eval_set_later:
            check_eval_plan(self.args, self.eval_dataset)
        self._prep = prep
        self.data_collator = (ColumnFilter(data_collator) if data_collator is not None
                              else default_collator(self.tokenizer))

        from transformers.integrations import get_reporting_integration_callbacks

        cbs = [DefaultFlowCallback] + get_reporting_integration_callbacks(self.args.report_to) + list(callbacks or [])
        self.callback_handler = CallbackHandler(cbs, self.model, self.tokenizer, None, None)
        self._init_run_fields()

    def _init_run_fields(self) -> None:
        """What a run holds besides its data and engine: HF's state and control, the schedule,
        the run's identity (run id, branch), its controls and recovery."""
        from transformers.trainer_callback import TrainerControl, TrainerState

        self.state = TrainerState()
        self.control = TrainerControl()
        self.schedule: Optional[LRSchedule] = None
        self._stream: Optional[BatchStream] = None
        #: a set_lr between runs: applied on top of the next run's schedule from its first step
        self.pending_lr: Optional[float] = None
        #: request_stop() was called: iter_steps returns after the current optimizer step
        self.stop_requested = False
        self._running = False
        #: this run's prediction and the telemetry its steps measured (None before a first run)
        self.prediction_watch: Optional[PredictionWatch] = None
        #: the run's tokens so far and (sum of step losses, steps) since the last log: a checkpoint keeps them
        self.tokens_seen = 0
        self.log_accum = (0.0, 0)
        # Data-parallel ranks: the engine's process group (one process: Dist.single()).
        # Rank 0 alone logs and writes shared files.
        self.dist = getattr(self._engine, "dist", None) or Dist.single()
        self.metrics_log = MetricsLog(Path(self.args.output_dir) / "metrics.jsonl", enabled=self.dist.is_main)
        # Which run this is: a fresh iter_steps() starts a new one, a resume continues the run of
        # its checkpoint. Tags metrics lines and checkpoints, so runs sharing output_dir stay apart.
        self.run_id: Optional[str] = None
        # Branches (trainer/snapshot.py): the run this one was forked from and at which step
        # (None for a root run); every metrics line carries them.
        self.parent_run_id: Optional[str] = None
        self.forked_at_step: Optional[int] = None
        #: how the next iter_steps() resumes from a snapshot as a branch (snapshot.BranchStart): start_branch
        self.branch_start = None
        self._pending_snapshot = None   # a snapshot completing in the background (wait_snapshot)
        # train() under torchrun: rank 0 announces the run and takes commands that every rank
        # applies at the same step boundary (trainer/control.py); None when a Session drives us
        self.run_control = None
        # on_nonfinite="rewind": the run recovers by itself (trainer/recovery.py); the hooks hear of
        # each recovery (a Session's tree) and say who else takes snapshots
        self.recovery = Recovery(self, self._engine.config) if self._engine.config.on_nonfinite == "rewind" else None
        #: what this run's driver gave it (use_hooks): a Session's thread and branches; else nobody
        self.hooks: RunHooks = NoHooks()
        #: what kind of training this is (trainer/kinds.py): a subclass sets its own after this
        self.kind: TrainingKind = PlainKind()

    # ------------------------------------------------------------------ construction helpers
    def _build_engine(self, model, explicit: dict, seq_len: Optional[int] = None):
        if model is None:
            raise ValueError("model is required: a *ForCausalLM model, a local model folder, or a StreamingEngine")
        if _is_engine(model):
            if explicit:
                raise ValueError(f"engine options {sorted(explicit)} were given with an already built engine")
            return getattr(model, "model", None), model
        options = merge_engine_options(_derived_engine_options(self.args), explicit)
        config = EngineConfig.from_options(**options)
        # optimizer_compression="auto" resuming: the checkpoint's codec, not a new pick (docs/TIERS.md)
        codec_from = (ckpt.resume_point(self.args.resume_from_checkpoint, self.args.output_dir)
                      if config.optimizer_compression == "auto" else None)
        if isinstance(model, (str, os.PathLike)):
            folder = Path(model)
            if not (folder / "config.json").is_file():
                raise ValueError(f"model={str(model)!r} is not a local model folder (no config.json in it); "
                                 "pass a folder written by save_pretrained, or a model object")
            return None, StreamingEngine.from_pretrained(str(folder), config, workload=self._planned_workload(seq_len),
                                                         codec_from=codec_from)
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a *ForCausalLM module, a local folder or a StreamingEngine; "
                            f"got {type(model).__name__}")
        return model, StreamingEngine(model, config, workload=self._planned_workload(seq_len), codec_from=codec_from)

    def _planned_workload(self, seq_len: Optional[int]) -> Workload:
        """The workload the engine is planned at (:func:`run_workload`; the SFT and DPO trainers
        add their vision rows' image tokens, counted before the engine is built)."""
        return run_workload(self.args, seq_len)

    @property
    def engine(self):
        """The StreamingEngine that holds the model's training state."""
        return self._engine

    @property
    def prediction(self):
        """The predicted optimizer step of this run (``engine/planning/prediction.py``: a StepPrediction
        with ``step_seconds``, ``phases``, ``bottleneck``, ``tokens_per_second``) for the plan the
        engine built and this run's batch, sequence length, accumulation and clipping, at
        ``engine.rates`` or the machine's cached rates; None when there are none (building a
        Trainer never measures the machine: ``trainer.engine.rates = mt.measure_machine()``)."""
        a = self.args
        work = Workload(batch=a.per_device_train_batch_size, seq=self._rows_seq or self.seq_len,
                        accumulation=a.gradient_accumulation_steps,
                        clipped=bool(a.max_grad_norm and a.max_grad_norm > 0))
        return engine_prediction(self.engine, work)

    def measured_vs_predicted(self) -> Optional[dict]:
        """The run's prediction against what it measured (``prediction_watch.PredictionWatch.report``:
        ``prediction``, ``measured`` per step, ``steps``, ``rows`` (phase, predicted, measured),
        ``difference``: the >25% line), from what each step's engine output carried: safe from
        any thread while the run trains. Before a run, the plan's prediction with nothing
        measured; None without rates."""
        watch = self.prediction_watch
        if watch is None:   # no run yet: nothing trains, the engine is asked for its plan's
            watch = PredictionWatch(self.prediction)
        return watch.report()

    @property
    def total_steps(self) -> int:
        """Optimizer steps this run plans (``max_steps`` or epochs x steps per epoch)."""
        a = self.args
        if a.max_steps is not None and a.max_steps > 0:
            return int(a.max_steps)
        if self.train_dataset is None:
            return 0
        ds = self.train_dataset
        if not hasattr(ds, "__len__") or isinstance(ds, torch.utils.data.IterableDataset):
            raise DataError("train_dataset has no length (an iterable dataset): set max_steps in TrainingArguments")
        n, bs = len(self.train_dataset), a.per_device_train_batch_size
        batches = n // bs if a.dataloader_drop_last else -(-n // bs)
        per_epoch = max(-(-batches // (a.gradient_accumulation_steps * self.dist.world)), 1)
        return int(math.ceil(a.num_train_epochs * per_epoch))

    # ------------------------------------------------------------------ live controls (Session seam)
    def set_lr(self, lr: float) -> None:
        """From the next optimizer step the learning rate is ``lr``; the schedule carries on relative to it."""
        lr = check_learning_rate(lr)
        if self._running:
            self.schedule.set_lr(lr)
        else:
            # Between runs: the next iter_steps() builds a new schedule (and a resume loads the
            # checkpoint's); the change applies on top of that, from its first step.
            self.pending_lr = float(lr)
            if self.schedule is not None:
                self.schedule.set_lr(lr)  # schedule.current() shows it meanwhile

    def request_stop(self) -> None:
        """Make :meth:`iter_steps` return after the current optimizer step."""
        self.stop_requested = True

    def use_hooks(self, hooks: RunHooks) -> None:
        """Let ``hooks`` (trainer/run.py's RunHooks: a Session's thread and branches) observe and
        steer this trainer's runs; None: nobody does."""
        if hooks is not None and not isinstance(hooks, RunHooks):
            raise TypeError(f"use_hooks takes a RunHooks (between_batches, on_recovery, snapshot_steps, "
                            f"hold_weights), got {type(hooks).__name__}")
        self.hooks = hooks if hooks is not None else NoHooks()

    def start_branch(self, start, *, replace: bool = True) -> None:
        """The next :meth:`iter_steps` resumes from a snapshot as a branch (``snapshot.BranchStart``);
        ``replace=False`` keeps one already set (a rewind's new run, not started yet, stays one)."""
        if replace or self.branch_start is None:
            self.branch_start = start

    @property
    def weight_decay(self) -> float:
        """The engine's decoupled weight decay (:meth:`set_weight_decay` changes it)."""
        return float(self._engine.config.weight_decay)

    def set_weight_decay(self, value: float) -> None:
        """The weight decay from the next optimizer step (a branch's own: ``notebook/branches.py``)."""
        self._engine.configure(weight_decay=value)   # (checked by EngineConfig, as at the start)

    def load_engine_state(self, path, *, verify: bool = True) -> None:
        """The weights and optimizer states of the checkpoint or snapshot at ``path`` (a branch's
        rewind or switch, between steps; its data position and schedule are the caller's)."""
        self._engine.load_checkpoint(path, verify=verify)

    def verify_whole(self, path) -> None:
        """Check the checkpoint or snapshot at ``path`` whole before anything changes
        (``saving.verify_whole``: manifest, the engine's linked files, the state file)."""
        saving.verify_whole(Path(path), self._engine, self.dist)

    def gather_layer_stats(self, on: bool = True) -> None:
        """Each step's record carries the engine's per-unit statistics (``record["layer_stats"]``,
        never written to metrics.jsonl) from the next step: ``EngineConfig.layer_stats``."""
        self._engine.configure(layer_stats=bool(on))

    # ------------------------------------------------------------------ the loop
    def iter_steps(self, resume_from_checkpoint=None) -> Iterator[dict]:
        """Train, yielding one plain-dict record per optimizer step (the loop: trainer/run.py)."""
        if self.train_dataset is None:
            raise ValueError("train_dataset is required to train")
        if self._running:
            raise RuntimeError("this Trainer is already training")
        if not self.kind.before_run(self):   # stopped before the run (DPO: in its reference pass)
            return
        if resume_from_checkpoint is None:
            resume_from_checkpoint = self.args.resume_from_checkpoint
        resume = saving.resolve_resume(resume_from_checkpoint, self.args.output_dir, self.dist)
        total = self.total_steps
        self._running, self.stop_requested = True, False
        try:
            yield from Run(self).steps(resume, total)
        finally:
            self._running = False

    def fresh_stream(self) -> BatchStream:
        """The training data stream at its start (a run's start, a recovery's load)."""
        args = self.args
        self._stream = BatchStream(self.train_dataset, batch_size=args.per_device_train_batch_size,
                                   collate=self.data_collator,
                                   seed=args.data_seed if args.data_seed is not None else args.seed,
                                   shuffle=args.train_sampling_strategy == "random",
                                   drop_last=args.dataloader_drop_last, rank=self.dist.rank, world=self.dist.world)
        return self._stream

    def log(self, logs: dict) -> None:
        """Record ``logs`` in the state's history and hand them to the callbacks (report_to, ...)."""
        if self.state.epoch is not None:
            logs = {**logs, "epoch": self.state.epoch}
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self.control = self.callback_handler.on_log(self.args, self.state, self.control, logs)

    def train(self, resume_from_checkpoint=None, trial=None, **kwargs):
        """Train to the end (blocking) and return ``transformers.trainer_utils.TrainOutput``."""
        from transformers.trainer_callback import ProgressCallback
        from transformers.trainer_utils import TrainOutput

        if trial is not None or kwargs:
            raise ValueError(f"train() does not support {['trial'] if trial is not None else list(kwargs)}")
        progress = None
        if not self.args.disable_tqdm and not any(isinstance(c, ProgressCallback)
                                                  for c in self.callback_handler.callbacks):
            progress = ProgressCallback()
            self.callback_handler.add_callback(progress)
        t0, losses, tokens = time.time(), [], 0
        self.run_control = RunControl(self).start() if wanted(self.dist) else None
        outcome = "failed"
        try:
            resume = resume_from_checkpoint
            while True:
                for record in self.iter_steps(resume_from_checkpoint=resume):
                    losses.append(record["loss"])
                    tokens += record["tokens"]
                # a "rewind" command (every rank at the same step): again from the snapshot, as a branch
                rc = self.run_control
                resume = rc.take_rewind() if rc is not None else None
                if resume is None or rc.stopped:   # (a stop at the same boundary wins)
                    break
                self.start_branch(BranchStart(new_run=True))
            outcome = "stopped" if self.run_control is not None and self.run_control.stopped else "finished"
        finally:
            if progress is not None:
                self.callback_handler.remove_callback(progress)
            if self.run_control is not None:
                self.run_control.close(outcome)
        runtime = time.time() - t0
        train_loss = sum(losses) / len(losses) if losses else float("nan")
        metrics = {"train_runtime": runtime, "train_loss": train_loss, "train_steps": len(losses),
                   "train_tokens_per_second": tokens / runtime if runtime > 0 else 0.0}
        self.log(dict(metrics))
        self.metrics_log.write({"event": "train_end", **metrics, "step": self.state.global_step, "time": time.time()})
        return TrainOutput(self.state.global_step, train_loss, metrics)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, eval_dataset=None, metric_key_prefix: str = "eval") -> dict:
        """Token-weighted mean loss over the eval set and its perplexity: ``{eval_loss, eval_ppl, ...}``."""
        ds = (prepare_dataset(eval_dataset, what="eval_dataset", **self._prep) if eval_dataset is not None
              else self.eval_dataset)
        if ds is None:
            raise ValueError("evaluate() needs an eval_dataset (give one to the Trainer or to evaluate())")
        t0, total, n = time.time(), 0.0, 0
        # Data parallel: each rank evaluates its share of the batches; loss and tokens are summed.
        for b in eval_batches(ds, batch_size=self.args.per_device_eval_batch_size, collate=self.data_collator,
                              rank=self.dist.rank, world=self.dist.world):
            out = (self._engine.evaluate(model_inputs(b), loss_fn=self.loss_fn) if b.get(EXTRA_INPUTS) else
                   self._engine.evaluate(b["input_ids"], attention_mask=b.get("attention_mask"), labels=b["labels"],
                                         loss_fn=self.loss_fn, position_ids=b.get("position_ids")))
            total += float(out.loss) * int(out.num_tokens)
            n += int(out.num_tokens)
        total, n = self.dist.sum(total), self.dist.sum(n)
        if n == 0:
            raise DataError("the eval dataset holds no target tokens")
        loss = total / n
        p = metric_key_prefix
        metrics = {f"{p}_loss": loss, f"{p}_ppl": math.exp(loss) if loss < 700 else float("inf"),
                   f"{p}_tokens": n, f"{p}_runtime": time.time() - t0}
        self.log(dict(metrics))
        self.metrics_log.write({"event": "evaluate", **metrics, "step": self.state.global_step, "time": time.time()})
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics=metrics)
        return metrics

    # ------------------------------------------------------------------ saving
    def save_model(self, output_dir: Optional[str] = None) -> str:
        """Write a folder ``AutoModelForCausalLM.from_pretrained`` loads (and the tokenizer, if any)."""
        self.hooks.hold_weights("save_model()")   # a branch sharing its engine: its own weights first
        return saving.save_model_folder(self._engine, self.tokenizer, self.dist,
                                        Path(output_dir or self.args.output_dir))

    def export(self, path, format: str = "safetensors", *, dtype: Optional[str] = None, tokenizer: bool = True) -> str:
        """Write the model to ``path`` as ``format`` "safetensors" (a Hugging Face folder), "gguf"
        (``dtype`` f32 | f16 | bf16 | q8_0) or "dcp", streamed unit by unit from wherever the
        weights live; returns the path written (``mt.export``, docs/EXPORT.md)."""
        return export_model.export(self, path, format, dtype=dtype, tokenizer=tokenizer)

    @property
    def lineage(self) -> dict:
        """``run_id``, ``parent_run_id`` and ``forked_at_step`` of this run (see trainer/snapshot.py)."""
        return {"run_id": self.run_id, "parent_run_id": self.parent_run_id, "forked_at_step": self.forked_at_step}

    def save_checkpoint(self, path=None) -> str:
        """Write a complete checkpoint (default ``output_dir/checkpoint-<step>``); returns its path."""
        if self.schedule is None or self._stream is None:
            raise RuntimeError("save_checkpoint() needs a training run (call train() or iter_steps() first)")
        self.hooks.hold_weights("save_checkpoint()")
        default = path is None
        final = (Path(path) if path is not None
                 else Path(self.args.output_dir) / f"{ckpt.PREFIX}-{self.state.global_step}")
        out, _ = self._write_state(final)
        if default and self.dist.is_main:
            ckpt.rotate(self.args.output_dir, self.args.save_total_limit, protect=out, run_id=self.run_id)
        self.metrics_log.write({"event": "checkpoint", "path": str(out), "step": self.state.global_step,
                                "time": time.time()})
        return str(out)

    def save_snapshot(self, path, wait: bool = True):
        """Write a snapshot to ``path``: a checkpoint whose disk-tier files are hard links and
        whose RAM-held state alone is written (see trainer/snapshot.py; ``Session.snapshot``
        takes them). Returns the bytes linked, copied and written. ``wait=False`` (one
        process): returns a :class:`~.snapshot.PendingSnapshot` at once, completed in the
        background while training goes on (its ``result()`` the bytes)."""
        if self.schedule is None or self._stream is None:
            raise RuntimeError("save_snapshot() needs a training run (call train() or iter_steps() first)")
        if self.dist.world > 1:
            _, sizes = self._write_state(Path(path), snapshot=True)
            return sizes
        self.wait_snapshot()   # one at a time (a save clears this process's unfinished temporaries)
        self._pending_snapshot = begin_snapshot(self, Path(path))
        return self._pending_snapshot.result() if wait else self._pending_snapshot

    def wait_snapshot(self) -> None:
        """Wait until a snapshot still completing in the background is done (its failure is
        its caller's to report, through its ``result()``)."""
        pending, self._pending_snapshot = getattr(self, "_pending_snapshot", None), None
        if pending is not None:
            pending.wait()

    def snapshot_files(self, snapshot: bool = True):
        """(the state file's dict, ``write_shared(tmp)``: the trainer's files of a checkpoint,
        the state file last) as of now -- what a snapshot completed later writes."""
        meta = {"format": 1, "global_step": self.state.global_step, "data": self._stream.state_dict(),
                "tokens_seen": self.tokens_seen, "total_steps": self.state.max_steps,
                "log_accum": list(self.log_accum),
                "dataset_len": len(self.train_dataset) if hasattr(self.train_dataset, "__len__") else None,
                "batch_size": self.args.per_device_train_batch_size,
                "gradient_accumulation_steps": self.args.gradient_accumulation_steps,
                "micro_batches_per_step": self.args.gradient_accumulation_steps * self.dist.world,
                "world_size": self.dist.world,
                "seed": self.args.seed, "data_seed": self.args.data_seed,
                "run_id": self.run_id, "parent_run_id": self.parent_run_id,
                "forked_at_step": self.forked_at_step, "snapshot": snapshot, "saved_at": time.time(),
                "model": ckpt.model_record(self._engine)}
        return meta, saving.shared_writer(meta, self.schedule, self.state, self.args, self.tokenizer)

    def _write_state(self, final: Path, snapshot: bool = False):
        """Checkpoints and snapshots: the one save protocol (trainer/saving.py), after any
        snapshot still completing in the background."""
        self.wait_snapshot()
        _, write_shared = self.snapshot_files(snapshot)
        return saving.write_state(self._engine, self.dist, final, write_shared, snapshot=snapshot)

    @property
    def data_stream(self) -> Optional[BatchStream]:
        """The training data stream of the run going on (None before one starts)."""
        return self._stream

    def load_state(self, path: Path, stream: BatchStream, quiet: bool = False) -> None:
        """Take the run's state from the checkpoint or snapshot at ``path`` (checked whole
        first): the engine's, the schedule's, ``stream``'s position, step, lineage."""
        self.wait_snapshot()   # (a snapshot completing in the background reads the engine's files)
        mine = {"batch_size": self.args.per_device_train_batch_size,
                "gradient_accumulation_steps": self.args.gradient_accumulation_steps,
                "micro_batches_per_step": self.args.gradient_accumulation_steps * self.dist.world,
                "dataset_len": len(self.train_dataset) if hasattr(self.train_dataset, "__len__") else None,
                "total_steps": self.total_steps, "seed": self.args.seed}
        r = saving.load_state(path, self._engine, self.schedule, stream, mine,
                              ignore_data_skip=self.args.ignore_data_skip, quiet=quiet, dist=self.dist)
        self.state, self.tokens_seen, self.log_accum = r.state, r.tokens_seen, r.log_accum
        self.run_id, self.parent_run_id, self.forked_at_step = r.run_id, r.parent_run_id, r.forked_at_step

    # ------------------------------------------------------------------ callbacks, lifetime
    def add_callback(self, callback) -> None:
        """Add a ``transformers.TrainerCallback`` (a class or an instance), as in transformers."""
        self.callback_handler.add_callback(callback)

    def pop_callback(self, callback):
        """Remove a callback and return it (None when it was not there)."""
        return self.callback_handler.pop_callback(callback)

    def remove_callback(self, callback) -> None:
        """Remove a callback (a class or an instance)."""
        self.callback_handler.remove_callback(callback)

    def close(self) -> None:
        """Release the engine (device memory, threads, disk-tier files). Also done at the end of
        a ``with`` block (whether or not training raised) and, for an engine the Trainer built,
        when the Trainer is garbage-collected: keep the Trainer while you use its ``engine``.

        >>> with mt.Trainer(model=model, train_dataset=ds, args=args) as trainer:   # doctest: +SKIP
        ...     trainer.train()
        """
        if self._finalizer is not None:
            self._finalizer.detach()
        self.wait_snapshot()
        self._engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _release_engine(engine) -> None:
    """The finalizer of a collected Trainer: close its engine (joins the engine's threads, so a
    failed run leaves none behind). On one of the engine's own worker threads (names
    ``mtnb-*``) joining could wait on itself: there the engine's own finalizer lets the
    workers exit by themselves instead."""
    if threading.current_thread().name.startswith("mtnb-"):
        return
    try:
        engine.close()
    except Exception:  # noqa: BLE001 - a finalizer cannot report; the engine says why on its next use
        pass


def _default_seq_len(engine) -> int:
    n = max_positions(engine.model_config)
    return min(n, 1024) if n else 1024


def local_tokenizer(folder):
    """The tokenizer saved in a local model folder (None when it holds none)."""
    p = Path(folder)
    if not any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(p))
