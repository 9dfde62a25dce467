"""Worker: on_nonfinite="rewind" with 2 ranks (trainer/recovery.py). ``w_recover.py OUT``, in one
torchrun, the same run twice (``OUT/a``, ``OUT/b``): 8 steps of one row per rank, read in order;
the loss is NaN on the rank holding a marked row (rows 3 and 9: steps 2 and 4, the first window skipped), so every rank
meets a non-finite global norm at the same step and recovers at the same boundary. Each rank
writes ``OUT/<run>-rank<r>.pt``: its shard of every unit's weights, the steps, the recoveries."""
import os
import sys

sys.path.insert(0, __file__.rsplit("/", 2)[0])   # tests/ (for the trainer test helpers)

import torch  # noqa: E402

from trainer.helpers import args, micro_model  # noqa: E402
from trainer.test_recovery import _dataset, nan_on_marked_rows  # noqa: E402

from megatrain_nb.trainer import Trainer  # noqa: E402


def run(out_dir: str) -> None:
    rank = int(os.environ["RANK"])
    a = args(out_dir, max_steps=8, per_device_train_batch_size=1, max_grad_norm=1.0, lr_scheduler_type="constant",
             train_sampling_strategy="sequential")
    t = Trainer(model=micro_model(), train_dataset=_dataset(n=24, marked=(3, 9)), args=a, device="cpu",
                loss_fn=nan_on_marked_rows, on_nonfinite="rewind")
    t.train()
    eng = t.engine
    res = {"weights": {u.name: eng.weights.read_now(u).clone() for u in eng.state_units},
           "step": t.state.global_step, "recoveries": [dict(x) for x in t.recovery.attempts], "run_id": t.run_id}
    torch.save(res, f"{out_dir}-rank{rank}.pt")
    t.close()


if __name__ == "__main__":
    run(f"{sys.argv[1]}/a")
    run(f"{sys.argv[1]}/b")
