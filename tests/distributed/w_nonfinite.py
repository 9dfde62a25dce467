"""Worker: a sharded (ZeRO-3) engine, no clipping, 3 optimizer steps of 2 micro-batches per
rank; at step 2 a NaN is put into rank 1's gradient shard of one unit only (after the
reduce-scatter, so no other rank sees it in its own shards). Each rank saves what it saw."""
import os
import sys

import torch

from megatrain_nb.engine import StreamingEngine
from megatrain_nb.engine.ranks.dist import Dist
from megatrain_nb.engine.updates.finite import NonFiniteError
from megatrain_nb.trainer.sharding import deal

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zero3_flow import LR, micro_batches, tiny_model  # noqa: E402

ACC, STEPS, BAD_STEP, BAD_UNIT = 2, 3, 2, "model.layers.0"


def main(out_dir: str, policies: str) -> None:
    """``policies``: one on_nonfinite policy, or several comma-separated, one engine each in turn."""
    dist = Dist.from_env()
    for policy in policies.split(","):
        run(dist, out_dir, policy)
    dist.barrier()
    dist.close()


def run(dist: Dist, out_dir: str, policy: str) -> None:
    torch.manual_seed(0)
    engine = StreamingEngine(tiny_model(False), device="cpu", on_nonfinite=policy, dist=dist)
    updates = engine.updates
    real = updates.intake.arrived   # gradients arrive as this rank's shard, reduce-scattered
    state = {"step": 0, "mb": 0}

    def poisoned(unit, grad):
        if (dist.rank == 1 and state["step"] == BAD_STEP and state["mb"] == ACC - 1 and unit.name == BAD_UNIT
                and grad.numel() > 0):
            grad.view(-1)[0] = float("nan")
        return real(unit, grad)
    updates.intake.arrived = poisoned

    data = micro_batches(STEPS * ACC * dist.world)
    res = {"skipped": [], "norms": [], "error": None, "weights": []}
    n_targets = lambda b: int((b["labels"][:, 1:] != -100).sum())  # noqa: E731
    for step in range(1, STEPS + 1):
        state["step"] = step
        window = data[(step - 1) * ACC * dist.world: step * ACC * dist.world]
        mine = deal([lambda b=b: b for b in window], dist.rank, dist.world, lambda b: b)
        n_items = dist.sum(sum(n_targets(b) for b in mine))
        try:
            for i, b in enumerate(mine):
                state["mb"] = i
                extra = {"step_lr": LR} if i == len(mine) - 1 else {}
                out = engine.forward_backward(b["input_ids"], labels=b["labels"], num_items_in_batch=n_items, **extra)
        except NonFiniteError as e:
            res["error"] = str(e)
        else:
            res["skipped"].append(bool(out.skipped))
            res["norms"].append(out.grad_norm)
        try:
            res["weights"].append({k: v.clone() for k, v in engine.named_parameters()})  # collective
        except NonFiniteError as e:   # an unclipped step stopped part-way: delivered by the updates' wait
            res["error"] = res["error"] or str(e)
        except RuntimeError as e:     # and then refused until load_checkpoint()
            res["refused"] = str(e)
        if res["error"] is not None:
            break
    res["skipped_steps"] = engine.telemetry().get("skipped_steps")
    engine.close()
    torch.save(res, f"{out_dir}/nonfinite-{policy}-rank{dist.rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
