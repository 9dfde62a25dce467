"""GRPO's evaluation, as trl.GRPOTrainer evaluates (transformers' evaluation loop around its
``prediction_step``): the eval prompts in TRL's ``RepeatSampler`` order (``num_generations_eval``
completions each, shuffled by its own generator seeded with ``args.seed``), one draw of the global
stream for the DataLoader's base seed, completions generated per ``per_device_eval_batch_size``
rows, the loss in evaluation mode (no accumulation, a generation serving one step), forward only;
``eval_loss`` the batches' losses weighted as transformers and accelerate weigh them, TRL's
metrics prefixed ``eval_``."""
from __future__ import annotations

import math
import time

import torch


from .grpo_data import micro_batch
from .kinds import MetricLists


def run_evaluation(trainer, ds, prefix: str = "eval") -> dict:
    """The metrics of one evaluation of ``trainer`` (an mt.GRPOTrainer) over ``ds``."""
    from trl.trainer.utils import RepeatSampler

    a = trainer.args
    G = a.num_generations_eval or a.num_generations
    sampler = RepeatSampler(data_source=ds, mini_repeat_count=G, seed=a.seed)
    torch.empty((), dtype=torch.int64).random_()   # the eval DataLoader's base seed
    order = list(iter(sampler))
    bs = a.per_device_eval_batch_size
    t0, total, rows, seen = time.time(), 0.0, 0, MetricLists(skip_nan=True)
    trainer.eval_metrics.clear()
    # transformers weighs each batch's loss by the batch size, and accelerate's gather_for_metrics
    # keeps len(eval_dataset) % batch size of the last batch's copies (the prompts' count, not the
    # completions'): TRL's eval_loss, exactly
    last = len(ds) % bs or bs
    for s in range(0, len(order), bs):
        examples = [ds[i] for i in order[s:s + bs]]
        # (every rank evaluates the whole batch: its generation split over the ranks, its loss the same on all)
        b = micro_batch(trainer.make_rollouts(examples, mode="eval"), 1, per_generation=1)
        out = trainer.engine.evaluate(b, loss_fn=trainer.objective)
        seen.add(out.objective_metrics)
        w = last if s + bs >= len(order) else bs
        total, rows = total + out.objective_loss * w, rows + w
    metrics = {f"{prefix}_loss": total / max(rows, 1)}
    runtime = time.time() - t0
    batches = -(-len(order) // bs)
    metrics.update({f"{prefix}_runtime": runtime, f"{prefix}_samples_per_second": len(order) / runtime,
                    f"{prefix}_steps_per_second": batches / runtime})
    for k, v in list(trainer.eval_metrics.items()):
        valid = [x for x in v if not math.isnan(x)]
        metrics[f"{prefix}_{k}"] = sum(valid) / len(valid) if valid else None
    metrics.update({f"{prefix}_{k}": v for k, v in seen.take().items()})
    trainer.eval_metrics.clear()
    return metrics


__all__ = ["run_evaluation"]
