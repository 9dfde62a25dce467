"""The StreamingEngine with its state sharded over ranks (ZeRO-3), driven like the Trainer
drives it: each optimizer step's micro-batches dealt out over ranks, loss normalised by the
target tokens of all ranks, the update overlapped with the last micro-batch's backward.
Importable (one-process runs) and runnable under torchrun (``python engine_flow.py OUT CASES``)."""
import os
import sys
import tempfile

import torch

from megatrain_nb.engine import StreamingEngine
from megatrain_nb.engine.ranks.dist import Dist
from megatrain_nb.trainer.sharding import deal

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zero3_flow import ACC, CASES, LR, STEPS, micro_batches, run_sharded, tiny_model  # noqa: E402


def _targets(b) -> int:
    return int((b["labels"][:, 1:] != -100).sum())


def run_engine(dist: Dist, case: str, acc: int, offload_dir=None, steps=(0, STEPS), load_from=None,
               save_to=None, window: bool = False, offload_params: bool = False) -> dict:
    """Optimizer steps ``steps[0]..steps[1]-1`` of the run (global micro-batches of those steps),
    after loading a sharded checkpoint ``load_from``; ``save_to``: save one after.
    ``window``: each rank's micro-batches of a step as one layer-major window (one
    ``forward_backward`` call with a list); ``offload_params``: master weights on the disk tier
    (``offload_dir`` made here when not given)."""
    tied, wd, clip, codec, moe = CASES[case]
    model = tiny_model(tied, moe)
    if offload_params and offload_dir is None:
        offload_dir = tempfile.mkdtemp(prefix=f"offp{dist.rank}-")
    # host_cache_gb=0: the states (and weights) must really reach each rank's disk tier (what is checked)
    engine = StreamingEngine(model, device="cpu", weight_decay=wd, optimizer_compression=codec,
                             offload_dir=offload_dir, dist=dist, offload_params=offload_params or None,
                             host_cache_gb=0)
    if load_from is not None:
        engine.load_checkpoint(load_from)
    data = micro_batches(STEPS * acc * dist.world)
    dist.traffic.reset()
    norms = []
    for step in range(*steps):
        chunk = data[step * acc * dist.world:(step + 1) * acc * dist.world]
        mine = deal([lambda b=b: b for b in chunk], dist.rank, dist.world, lambda b: b)
        n_items = dist.sum(sum(_targets(b) for b in mine))
        if window:
            out = engine.forward_backward(mine, num_items_in_batch=n_items, step_lr=LR, max_grad_norm=clip)
            norms.append(out.grad_norm)
            continue
        for i, b in enumerate(mine):
            last = i == len(mine) - 1
            extra = {"step_lr": LR, "max_grad_norm": clip} if last else {}
            out = engine.forward_backward(b["input_ids"], labels=b["labels"], num_items_in_batch=n_items, **extra)
        norms.append(out.grad_norm)
    # the steps' own traffic (the assembly of the weights below gathers every unit once more)
    steps_traffic = {"sent_steps": dict(dist.traffic.sent), "minimum_steps": dict(dist.traffic.minimum),
                     "calls_steps": dict(dist.traffic.calls)}
    if save_to is not None:
        engine.save_sharded_checkpoint(save_to)
    weights = {k: v.clone() for k, v in engine.named_parameters()}
    rep = engine.memory_report()
    engine.close()
    plan = engine.last_window_plan
    return {"weights": weights, "norms": norms, "sent": dict(dist.traffic.sent),
            "minimum": dict(dist.traffic.minimum), "host": rep["host"], "disk": rep["disk"],
            "window_groups": plan.groups if plan is not None else None, **steps_traffic}


def _variant(spec: str) -> tuple:
    """``case[+window][+params_on_disk]`` -> (case, run_engine keyword arguments)."""
    case, *flags = spec.split("+")
    unknown = set(flags) - {"window", "params_on_disk"}
    if unknown:
        raise ValueError(f"unknown variant flags {sorted(unknown)} in {spec!r}")
    return case, {"window": "window" in flags, "offload_params": "params_on_disk" in flags}


def _checkpoint_run(dist: Dist, out_dir: str, spec: str) -> None:
    """``save=<variant>``: the first 2 steps, then a sharded checkpoint into ``OUT/ckpt-save=<variant>``;
    ``resume=<variant>``: the last step from ``OUT/ckpt-one=<variant>``, a checkpoint one process
    wrote before the launch (``launch.engine_flow_runs``)."""
    mode, variant = spec.split("=", 1)
    case, kw = _variant(variant)
    if mode == "save":
        res = run_engine(dist, case, ACC, steps=(0, 2), save_to=f"{out_dir}/ckpt-{spec}", **kw)
    else:
        res = run_engine(dist, case, ACC, steps=(2, STEPS), load_from=f"{out_dir}/ckpt-one={variant}", **kw)
    torch.save(res, f"{out_dir}/{spec}-rank{dist.rank}.pt")


def main(out_dir: str, cases: str) -> None:
    torch.manual_seed(0)
    dist = Dist.from_env()
    for spec in cases.split(","):
        if spec.startswith(("save=", "resume=")):   # a checkpoint's two-rank side, beside the other runs
            _checkpoint_run(dist, out_dir, spec)
            continue
        if spec.startswith("zero3="):   # zero3_flow.py's harness (test_zero3_flow): rank 0 writes it
            res = run_sharded(dist, spec.split("=", 1)[1], ACC)
            if dist.is_main:
                torch.save(res, f"{out_dir}/{spec}.pt")
            continue
        case, kw = _variant(spec)
        off = None
        if CASES[case][3] != "none":          # compressed states on the disk tier
            off = tempfile.mkdtemp(prefix=f"off{dist.rank}-")
        res = run_engine(dist, case, ACC, offload_dir=off, **kw)
        torch.save(res, f"{out_dir}/{spec}-rank{dist.rank}.pt")
    dist.barrier()
    dist.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
