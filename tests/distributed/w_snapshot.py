"""Worker: snapshots on every rank (issue 21). ``w_snapshot.py OUT full|snap``: ``full`` trains 4
steps; ``snap`` takes a snapshot at step 2 (each rank its shard), trains on to 3, then goes back
to the snapshot as a branch and trains to 4. Both write ``OUT/final`` (rank 0)."""
import sys

sys.path.insert(0, __file__.rsplit("/", 2)[0])   # tests/ (for the trainer test helpers)

from trainer.helpers import args, micro_model, token_dataset  # noqa: E402

from megatrain_nb.trainer import Trainer  # noqa: E402
from megatrain_nb.trainer.snapshot import BranchStart, SnapshotStore  # noqa: E402


def main(out_dir: str, mode: str) -> None:
    kw = dict(gradient_accumulation_steps=2, weight_decay=0.1, max_grad_norm=0.5, max_steps=4, seed=7)
    t = Trainer(model=micro_model(), train_dataset=token_dataset(40, masked=True), args=args(out_dir, **kw),
                device="cpu")
    if mode == "full":
        t.train()
    else:
        store = SnapshotStore(out_dir)
        it = t.iter_steps()
        snap = None
        for rec in it:
            if rec["step"] == 2:
                snap = store.take(t)
            if rec["step"] == 3:
                break
        it.close()
        first = t.run_id
        t.branch_start = BranchStart(new_run=True)
        for rec in t.iter_steps(resume_from_checkpoint=snap.path):
            pass
        assert t.parent_run_id == first and t.forked_at_step == 2 and t.state.global_step == 4
    t.save_model(out_dir + "/final")
    t.engine.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
