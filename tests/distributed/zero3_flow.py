"""The sharded (ZeRO-3) training step, driven by hand around a plain HF model: what the
streaming engine's pager and update scheduler will do per unit, built only from the pieces
that carry it (engine.dist, engine.sharded, UnitAdamW, OptimizerStates, trainer.sharding).

Every rank keeps a whole model only as compute scratch (its weights are overwritten by each
unit's gather before use); the authoritative fp32 weights, gradient accumulators and Adam
states are this rank's shards. Importable (the test's one-process runs) and runnable under
torchrun (``python zero3_flow.py OUT_DIR CASE``).
"""
import os
import sys
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from megatrain_nb.engine.ranks.dist import Dist
from megatrain_nb.engine.updates.optimizer import UnitAdamW
from megatrain_nb.engine.ranks.sharded import ShardedUnits
from megatrain_nb.engine.updates.states import OptimizerStates
from megatrain_nb.engine.telemetry import Telemetry
from megatrain_nb.engine.units import build_units, decay_parameter_names, find_layer_list
from megatrain_nb.model_configs import family_config
from megatrain_nb.trainer.sharding import deal

VOCAB = 96
CASES = {
    # name: (tied embeddings, weight decay, max_grad_norm, codec, mixture of experts)
    "adamw": (False, 0.0, None, "none", False),
    "clip_wd": (False, 0.1, 0.05, "none", False),
    "tied_clip_wd": (True, 0.1, 0.05, "none", False),
    "tied": (True, 0.0, None, "none", False),      # head = the final norm only: rank 1's shard is empty
    "int8": (False, 0.1, 0.05, "int8", False),
    "moe": (False, 0.1, 0.05, "none", True),
}
STEPS, ACC, LR = int(os.environ.get("ZERO3_STEPS", 3)), 2, 3e-3


def tiny_model(tied: bool, moe: bool = False):
    torch.manual_seed(0)
    cfg = family_config("mixtral" if moe else "llama", layers=2, tie=tied, vocab=VOCAB)
    return AutoModelForCausalLM.from_config(cfg).float()


def micro_batches(n: int, bs: int = 2, seq: int = 12):
    """n micro-batches; labels partly ignored so micro-batches weigh differently."""
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(n):
        ids = torch.randint(1, VOCAB, (bs, seq), generator=g)
        labels = ids.clone()
        labels[:, : (i * 3) % 7] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def _loss_sum(model, b):
    logits = model(input_ids=b["input_ids"]).logits.float()
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), b["labels"][:, 1:].flatten(), ignore_index=-100,
                           reduction="sum")


def _targets(b) -> int:
    return int((b["labels"][:, 1:] != -100).sum())


def run_sharded(dist: Dist, case: str, acc: int) -> dict:
    """STEPS optimizer steps of ``acc`` micro-batches per rank; returns the final weights
    (assembled unit by unit) and the traffic."""
    tied, wd, clip, codec, moe = CASES[case]
    model = tiny_model(tied, moe)
    _, _, layers = find_layer_list(model)
    units = [u for u in build_units(model, layers) if u.numel > 0]
    su = ShardedUnits(units, dist)
    named = dict(model.named_parameters())

    def flat(u, grad=False):
        ts = [(named[p.name].grad if grad else named[p.name].data).reshape(-1) for p in u.params]
        return torch.cat(ts)

    master = {u.index: su.take_own(u, flat(u)) for u in units}         # fp32 shards: the weights
    grads = {u.index: torch.zeros_like(master[u.index]) for u in units}
    adam = UnitAdamW(betas=(0.9, 0.999), eps=1e-8, weight_decay=wd)
    states = OptimizerStates(su.shards, SimpleNamespace(optimizer_compression=codec), Telemetry())
    data = micro_batches(STEPS * acc * dist.world)
    dist.traffic.reset()
    for step in range(STEPS):
        window = data[step * acc * dist.world:(step + 1) * acc * dist.world]
        mine = deal([lambda b=b: b for b in window], dist.rank, dist.world, lambda b: b)
        n_items = dist.sum(sum(_targets(b) for b in mine))
        for b in mine:
            for u in units:                  # the pager: gather each unit before it runs
                full = su.gather(u, master[u.index])
                for p in u.params:
                    named[p.name].data.copy_(full[p.offset:p.offset + p.numel].view(p.shape))
            model.zero_grad(set_to_none=False)
            (_loss_sum(model, b) / n_items).backward()
            for u in units:                  # the reduce point: reduce-scatter, accumulate the shard
                grads[u.index].add_(su.reduce_grad(u, flat(u, grad=True)))
        coef = None
        if clip:                             # global norm: one all-reduce of per-shard squares
            total = su.global_norm_sq(sum(float(grads[u.index].norm()) ** 2 for u in units)) ** 0.5
            coef = clip / (total + 1e-6)
            coef = coef if coef < 1.0 else None
        for u in units:                      # AdamW on this rank's shard only
            sh = su.shard(u)
            g = grads[u.index]
            if coef is not None:
                g.mul_(coef)
            m, v = states.load(sh)
            adam.step_unit(sh, master[u.index], g, m, v, LR, collect_stats=False)
            states.store(sh, m, v)
            g.zero_()
    out = {}
    for u in units:
        full = su.assemble(u, master[u.index])
        for p in u.params:
            out[p.name] = full[p.offset:p.offset + p.numel].view(p.shape).clone()
    return {"weights": out, "sent": dict(dist.traffic.sent), "minimum": dict(dist.traffic.minimum),
            "state_numel": sum(s.numel for s in su.shards), "model_numel": sum(u.numel for u in units)}


def run_reference(case: str, acc: int) -> dict:
    """One process, torch.optim.AdamW, ``acc`` micro-batches per step, torch's clipping."""
    tied, wd, clip, codec, moe = CASES[case]
    model = tiny_model(tied, moe)
    decay = decay_parameter_names(model)
    params = dict(model.named_parameters())
    opt = torch.optim.AdamW([{"params": [p for n, p in params.items() if n in decay], "weight_decay": wd},
                             {"params": [p for n, p in params.items() if n not in decay], "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.999), eps=1e-8)
    data = micro_batches(STEPS * acc)
    for step in range(STEPS):
        window = data[step * acc:(step + 1) * acc]
        n_items = sum(_targets(b) for b in window)
        for b in window:
            (_loss_sum(model, b) / n_items).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return {"weights": {n: p.detach().clone() for n, p in params.items()}}


def main(out_dir: str, cases: str) -> None:
    torch.manual_seed(0)
    dist = Dist.from_env()
    for case in cases.split(","):
        res = run_sharded(dist, case, ACC)
        if dist.is_main:
            torch.save(res, f"{out_dir}/{case}.pt")
    dist.barrier()
    dist.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
