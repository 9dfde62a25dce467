"""One run of a trainer: the step loop, the one place a step's record is built, the run's
learning rate (its schedule and a pending ``set_lr``) and the boundary where commands apply.

``Trainer.iter_steps`` is ``Run(trainer).steps(resume)``. Whoever drives a run -- the notebook's
training thread, a rank's run control, a plain ``for record in trainer.iter_steps()`` -- observes
and steers it only through what it yields and the :class:`RunHooks` it gave the trainer
(``Trainer.use_hooks``); what differs between training kinds (plain, SFT, DPO, ...) plugs in
through the kind's public hooks (trainer/kinds.py).

A run's life:

0. (``Trainer.iter_steps``, before the run starts) the kind's ``before_run``: DPO's reference
   pass, on the policy as it starts, before a checkpoint is loaded;
1. ``begin``: the data stream at its start, a fresh LR schedule (a checkpoint's or a branch's
   when resuming), the run id and the run_start line, a pending ``set_lr`` applied on top,
   ``on_train_begin``;
2. each step (``step``): the window of micro-batches, the kind's ``before_window``, the engine's
   forward/backward/update at the schedule's rate, the record (``_record``: the one place it is
   built), recovery's check, callbacks, logging, the boundary (commands: ``run_control``), the
   metrics line, a checkpoint when due;
3. the end: ``on_train_end``.
"""
from __future__ import annotations

import math
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Optional, Protocol, runtime_checkable

from ..engine.updates.finite import NonFiniteError
from . import saving
from .data import EXTRA_INPUTS, OBJECTIVE_DATA, BatchStream, DataError, count_targets, count_tokens, model_inputs
from .prediction_watch import PredictionWatch
from .recovery import Diverged, reason_of
from .schedule import LRSchedule
from .snapshot import apply_branch_start

if TYPE_CHECKING:
    from .trainer import Trainer


@runtime_checkable
class RunHooks(Protocol):
    """What a run's driver gives it (``Trainer.use_hooks``), instead of setting attributes on the
    trainer from above: the notebook's training thread and its branches give one."""

    def between_batches(self) -> bool:
        """Asked between the batches of a long pass before the first step (a DPO reference pass):
        apply queued commands (a pause holds here); True ends the run before its first step."""

    def on_recovery(self, event: dict) -> None:
        """A non-finite step was rewound (``on_nonfinite="rewind"``): the recovery's event."""

    def snapshot_steps(self) -> Optional[int]:
        """Snapshots someone else takes every so many steps (recovery rewinds to them), or None."""

    def hold_weights(self, what: str) -> None:
        """Before ``what`` (a save) reads the engine's weights: this branch's weights in it."""


class NoHooks:
    """A run nobody steers from outside (a script's ``trainer.train()``)."""

    def between_batches(self) -> bool:
        return False

    def on_recovery(self, event: dict) -> None:
        return None

    def snapshot_steps(self) -> Optional[int]:
        return None

    def hold_weights(self, what: str) -> None:
        return None


class Run:
    """One run of ``trainer`` (see the module)."""

    def __init__(self, trainer: "Trainer"):
        self.t = trainer
        self.step_out = None     # the engine's output of the latest step: memory, telemetry, layer stats
        self.tiled_calls = 0     # the engine's count of tiled MLP calls so far

    # ------------------------------------------------------------------ the loop
    def steps(self, resume: Optional[Path], total: int) -> Iterator[dict]:
        """Train, yielding one plain-dict record per optimizer step."""
        t = self.t
        stream = self.begin(resume, total)
        epoch_open = False
        while t.state.global_step < total and not t.stop_requested:
            try:
                record, epoch_open = self.step(stream, total, epoch_open)
            except (NonFiniteError, Diverged) as e:
                if t.recovery is None:
                    raise
                step = e.step if isinstance(e, Diverged) else int(t.state.global_step) + 1
                applied = e.applied if isinstance(e, Diverged) else e.partial
                stream, epoch_open = t.recovery.recover(step, reason_of(e), applied, total), False
                continue
            if record is not None and t.recovery is not None:
                t.recovery.after_step(int(record["step"]))
            if record is not None:
                if t.run_control is not None:   # paused: the ranks wait here, together
                    t.run_control.hold()
                yield record
            if t.control.should_training_stop:
                break
        t.control = t.callback_handler.on_train_end(t.args, t.state, t.control)

    def begin(self, resume: Optional[Path], total: int) -> BatchStream:
        """A run's start: the data stream, the LR schedule, the state (a checkpoint's, when
        resuming; a branch's lineage), the run_start line and ``on_train_begin``."""
        from transformers.trainer_callback import TrainerControl, TrainerState

        t = self.t
        args, ga = t.args, t.args.gradient_accumulation_steps
        stream = t.fresh_stream()
        t.schedule = LRSchedule(learning_rate=args.learning_rate, scheduler_type=args.lr_scheduler_type,
                                num_training_steps=total, num_warmup_steps=args.get_warmup_steps(total),
                                scheduler_kwargs=args.lr_scheduler_kwargs)
        t.state = TrainerState()
        t.tokens_seen, t.log_accum, t.run_id = 0, (0.0, 0), None
        start, t.branch_start = t.branch_start, None
        if resume is not None:
            t.load_state(resume, stream, quiet=start is not None)
        else:
            t.engine.zero_grad()
        if start is not None:
            t.schedule = apply_branch_start(t, start, stream, total)
        t.run_id = t.run_id or uuid.uuid4().hex[:12]
        if t.dist.world > 1:   # one run: every rank takes rank 0's id
            t.run_id = t.dist.all_gather_json(t.run_id)[0]
        t.metrics_log.run_id, t.metrics_log.lineage = t.run_id, t.lineage
        pred = t.prediction   # (with rates only: the predicted step and what bounds it)
        t.prediction_watch = PredictionWatch(pred)
        t.metrics_log.write({"event": "run_start", "step": t.state.global_step, "total_steps": total,
                             "resumed_from": str(resume) if resume is not None else None, "time": time.time(),
                             "kind": t.kind.name,
                             **({"predicted_step_seconds": pred.step_seconds, "predicted_bottleneck":
                                 pred.bottleneck} if pred is not None else {})})
        if t.pending_lr is not None:   # a set_lr between runs applies on top of the new schedule
            t.schedule.set_lr(t.pending_lr)
            t.pending_lr = None
        st = t.state
        # callbacks (report_to, progress bars) act on the main process only, as under transformers
        st.is_world_process_zero = t.dist.is_main
        st.is_local_process_zero = t.dist.local_rank == 0
        st.max_steps, st.train_batch_size = total, args.per_device_train_batch_size
        st.num_train_epochs = (math.ceil(total / max(-(-stream.batches_per_epoch // (ga * t.dist.world)), 1))
                               if stream.batches_per_epoch else 1)
        st.compute_steps(args, total)
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
        t.control = t.callback_handler.on_train_begin(args, st, TrainerControl())
        if args.eval_on_start and t.eval_dataset is not None and resume is None:
            t.evaluate()
        if t.recovery is not None:
            elsewhere = t.hooks.snapshot_steps() or getattr(t.run_control, "snapshot_steps", None)
            t.recovery.start(total, elsewhere)
        if t.run_control is not None:   # a run rewound while paused stays paused at its new step
            t.run_control.hold()
        return stream

    def step(self, stream: BatchStream, total: int, epoch_open: bool):
        """One optimizer step with its callbacks, logging, commands and checkpoint:
        ``(record or None when the epoch ended first, whether an epoch is open)``."""
        t = self.t
        args, st, cb = t.args, t.state, t.callback_handler
        if not epoch_open:
            t.control = cb.on_epoch_begin(args, st, t.control)
            epoch_open = True
        t.control = cb.on_step_begin(args, st, t.control)
        if t.recovery is not None:   # (where this step's window starts; one a recovery marked is stepped over)
            t.recovery.window_at(st.global_step + 1, stream)
        window, ended = stream.next_window(args.gradient_accumulation_steps)
        record = None
        if window:
            record = self.train_window(window, total)
            if t.recovery is not None:   # a spike: recovered before it is logged or saved
                t.recovery.check(record)
            st.global_step += 1
            steps_in_epoch = stream.batches_per_epoch or total * args.gradient_accumulation_steps
            st.epoch = stream.epoch + stream.consumed / steps_in_epoch
            record["epoch"] = st.epoch
            t.control = cb.on_step_end(args, st, t.control)
        elif stream.consumed == 0:
            raise DataError(f"train_dataset yielded no examples in epoch {stream.epoch}; it is empty or exhausted")
        if ended or t.control.should_epoch_stop:  # a callback may end the epoch early
            t.control = cb.on_epoch_end(args, st, t.control)
            stream.start_next_epoch()
            epoch_open = False
        self.after_step(record)
        if record is not None:
            if t.run_control is not None:   # commands reach every rank at this step
                t.run_control.boundary(record)
            # logged before the checkpoint that holds its step: a kill after the save
            # must not leave a step in a checkpoint without its line in metrics.jsonl
            t.metrics_log.write({k: v for k, v in record.items() if k != "layer_stats"})
        self.save_if_due(record)
        return record, epoch_open

    # ------------------------------------------------------------------ one window
    def train_window(self, window: list, total: int) -> dict:
        """The step's micro-batches through the engine at the schedule's rate; its record."""
        t = self.t
        args, engine, cb, st = t.args, t.engine, t.callback_handler, t.state
        t0 = time.perf_counter()
        # The loss is normalised by the target tokens of the whole step, over all ranks.
        n_items = t.dist.sum(sum(count_targets(b) for b in window))
        # (a kind may step on zero targets: GRPO's all-truncated completions masked, a zero-gradient step as TRL's)
        if n_items == 0 and not getattr(t.kind, "steps_without_targets", False):
            raise DataError(f"optimizer step {st.global_step + 1}: its batches hold no target tokens "
                            "(every label is -100 or every sequence is padding)")
        extra = t.kind.before_window(t, window)
        max_norm = args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None
        # The engine runs each unit's AdamW update in a worker (step_lr on the last micro-batch):
        # without clipping, overlapped with the backward; with clipping, once the global norm is
        # known at the end of the backward, overlapped with the next forward.
        with engine.lock:
            lr = t.schedule.current()
            if len(window) > 1:
                # Layer-major: the whole window in one call, each layer on the device twice per
                # step (the engine's planner may split it into groups and says so).
                micro = [model_inputs(b) for b in window]
                for _ in window[:-1]:
                    t.control = cb.on_substep_end(args, st, t.control)
                t.control = cb.on_pre_optimizer_step(args, st, t.control)
                out = engine.forward_backward(micro, num_items_in_batch=n_items, loss_fn=t.loss_fn,
                                              step_lr=lr, max_grad_norm=max_norm)
            elif window[0].get(EXTRA_INPUTS):   # one micro-batch with images: as a dict, its extras inside
                t.control = cb.on_pre_optimizer_step(args, st, t.control)
                out = engine.forward_backward(model_inputs(window[0]), num_items_in_batch=n_items,
                                              loss_fn=t.loss_fn, step_lr=lr, max_grad_norm=max_norm)
            else:  # one micro-batch: the step's update rides on its backward
                b = window[0]
                t.control = cb.on_pre_optimizer_step(args, st, t.control)
                out = engine.forward_backward(b["input_ids"], attention_mask=b.get("attention_mask"),
                                              labels=b["labels"], num_items_in_batch=n_items,
                                              loss_fn=t.loss_fn, step_lr=lr, max_grad_norm=max_norm,
                                              position_ids=b.get("position_ids"), objective_data=b.get(OBJECTIVE_DATA))
            loss_sum = float(out.loss) * int(out.num_tokens)
            t.control = cb.on_optimizer_step(args, st, t.control)
            t.schedule.step()
        loss_sum = t.dist.sum(loss_sum)
        dt = time.perf_counter() - t0
        tokens = t.dist.sum(sum(count_tokens(b) for b in window))
        loss = t.kind.step_loss(t, out, loss_sum, n_items)
        record = self._record(out, loss=loss, lr=lr, tokens=tokens, seconds=dt, total=total)
        record.update(extra)
        t.kind.after_window(t, window, out, record)
        return record

    def _record(self, out, *, loss: float, lr: float, tokens: int, seconds: float, total: int) -> dict:
        """The step's record: the one place it is built (the kind adds its metrics after)."""
        t = self.t
        st = t.state
        t.tokens_seen += tokens
        st.num_input_tokens_seen = t.tokens_seen
        s, k = t.log_accum
        t.log_accum = (s + loss, k + 1)
        counters = getattr(t.engine, "counters", None)
        self.step_out = out   # the step's memory, telemetry and layer statistics: after_step
        tile, self.tiled_calls = tiled_this_step(t.engine, self.tiled_calls)
        grad_norm = out.grad_norm
        return {"step": st.global_step + 1, "epoch": st.epoch, "loss": loss, "lr": lr,
                "skipped_steps": int(getattr(counters, "skipped_steps", 0) or 0),
                "grad_norm": float(grad_norm) if grad_norm is not None else None, "tokens": tokens,
                "tokens_seen": t.tokens_seen, "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
                "step_time_s": seconds, "time": time.time(), "total_steps": total,
                "tile_tokens": tile, **t.lineage}

    def after_step(self, record: Optional[dict]) -> None:
        """The step's record completed from the engine's output (its memory and telemetry on
        logging steps; its layer statistics, when the engine gathers them: the dashboard's, never
        written to metrics.jsonl), logging and evaluation as the callbacks' control asks (the
        checkpoint: save_if_due)."""
        t = self.t
        c, out = t.control, self.step_out
        if record is not None and out is not None and t.prediction_watch is not None:
            t.prediction_watch.on_step(out.telemetry)
        if record is not None and out is not None and out.layer_stats is not None:
            record["layer_stats"] = out.layer_stats
        if c.should_log and t.log_accum[1] > 0:
            s, k = t.log_accum
            t.log_accum = (0.0, 0)
            logs = {"loss": s / k, "learning_rate": record["lr"] if record else t.schedule.current()}
            if record is not None:
                if record["grad_norm"] is not None:
                    logs["grad_norm"] = record["grad_norm"]
                record["memory"], record["telemetry"] = out.memory, out.telemetry
            t.log(logs)
        if c.should_evaluate and t.eval_dataset is not None:
            metrics = t.evaluate()
            if record is not None:
                record["eval_loss"], record["eval_ppl"] = metrics["eval_loss"], metrics.get("eval_ppl")

    def save_if_due(self, record: Optional[dict]) -> None:
        """The checkpoint the callbacks' control asks for at this step."""
        t = self.t
        if t.control.should_save:
            path = t.save_checkpoint()
            if record is not None:
                record["checkpoint"] = path   # the yielded record (the log has a "checkpoint" event line)
            t.control = t.callback_handler.on_save(t.args, t.state, t.control)


def tiled_this_step(engine, calls_before: int) -> tuple:
    """``(tile, calls)``: the tile a layer's MLP ran this step's rows in (engine/compute/tiling.py), 0
    where no row was longer than a tile (or the engine does not tile), and the engine's count of
    tiled calls so far (the next step's ``calls_before``)."""
    tiling = getattr(getattr(engine, "runner", None), "tiling", None)
    calls = int(getattr(tiling, "tiled_calls", 0) or 0)
    return (int(tiling.tile) if calls > calls_before else 0), calls


__all__ = ["NoHooks", "Run", "RunHooks", "tiled_this_step"]
