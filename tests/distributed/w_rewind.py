"""Worker: the ranks' run control takes "snapshot" and "rewind" (issue 21, item 3).
``w_rewind.py OUT ram|disk_int8[,...]``, in one torchrun of 2 ranks, for each variant two runs one
after the other, into ``OUT/<variant>/``:

- ``full``: 4 steps, uninterrupted;
- ``rewind``: rank 0's inbox gets "snapshot" during step 2 and "rewind 2" during step 4; every
  rank applies them at those steps' boundaries: a snapshot of each rank's shard at step 2, and
  after step 4 ``train()`` starts again from it as a branch and trains steps 3 and 4 again.

Each rank writes ``OUT/<variant>/<run>-rank<r>.pt``: its shard of every unit's weights and optimizer
states (stored form: int8 codes and scales), and the steps it trained."""
import os
import sys
from pathlib import Path

sys.path.insert(0, __file__.rsplit("/", 2)[0])   # tests/ (for the trainer test helpers)

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from trainer.helpers import args, micro_model, token_dataset  # noqa: E402

from megatrain_nb.trainer import Trainer  # noqa: E402

VARIANTS = {"ram": {}, "disk_int8": dict(offload_params=True, host_cache_gb=0, optimizer_compression="int8")}


class Steer(TrainerCallback):
    """Rank 0 asks for a snapshot during step 2 and a rewind to it during the first step 4."""

    def __init__(self, trainer):
        self.t, self.rewound, self.links = trainer, False, None

    def on_step_end(self, a, state, control, **k):
        rc = self.t.run_control
        if not self.t.dist.is_main or rc is None:
            return
        if state.global_step == 2 and not self.rewound:
            rc.command("snapshot", source="test")
        if state.global_step == 4 and not self.rewound:
            rc.command("rewind", 2, source="test")
            self.rewound = True


def count_links(trainer, steer) -> None:
    """Wrap ``SnapshotStore.take`` to count, as each snapshot completes, this rank's linked
    disk-tier files and how many of them share the live file (a hard link, not a copy)."""
    from megatrain_nb.trainer import snapshot

    take = snapshot.SnapshotStore.take

    def counted(store, t):
        info = take(store, t)
        d = t.dist
        disk = Path(info.path) / f"rank-{d.rank:05d}-of-{d.world:05d}" / "disk"
        files = list(disk.glob("*")) if disk.is_dir() else []
        steer.links = {"files": len(files), "shared": sum(f.stat().st_nlink > 1 for f in files)}
        return info

    snapshot.SnapshotStore.take = counted


def shards(t) -> dict:
    eng = t.engine
    out = {"weights": {}, "states": {}}
    for u in eng.state_units:
        out["weights"][u.name] = eng.weights.read_now(u).clone()
        out["states"][u.name] = {k: v.clone() for k, v in (eng.states.stored(u) or {}).items()}
    return out


def run(out_dir: str, variant: str, rewind: bool) -> None:
    rank = int(os.environ["RANK"])
    opts = dict(VARIANTS[variant], device="cpu")
    if opts.get("offload_params"):
        opts["offload_dir"] = f"{out_dir}/offload-rank{rank}"
    kw = dict(gradient_accumulation_steps=2, weight_decay=0.1, max_grad_norm=0.5, max_steps=4, seed=7)
    t = Trainer(model=micro_model(), train_dataset=token_dataset(40, masked=True), args=args(out_dir, **kw), **opts)
    steps = []
    steer = Steer(t) if rewind else None
    if steer is not None:
        t.add_callback(steer)
        count_links(t, steer)

    class Seen(TrainerCallback):
        def on_step_end(self, a, state, control, **k):
            steps.append(state.global_step)

    t.add_callback(Seen())
    t.train()
    assert t.run_control is not None, "train() under torchrun runs a RunControl"
    res = shards(t)
    res["steps"] = steps
    res["events"] = [{k: e[k] for k in ("kind", "step") if k in e} for e in t.run_control.applied]
    res["lineage"] = t.lineage
    res["links"] = steer.links if steer is not None else None
    torch.save(res, f"{out_dir}-rank{rank}.pt")
    t.close()


def main(out: str, variants: str) -> None:
    """``variants``: one, or several comma-separated, each into ``OUT/<variant>/``."""
    for variant in variants.split(","):
        run(f"{out}/{variant}/full", variant, rewind=False)
        run(f"{out}/{variant}/rewind", variant, rewind=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
