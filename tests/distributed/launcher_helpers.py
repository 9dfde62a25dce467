"""What the launcher tests hand to worker processes by import path, and the torchrun job that
``test_launcher.py`` attaches to (``python -m torch.distributed.run ... launcher_helpers.py OUT``)."""
import os
import sys

from transformers import TrainerCallback


class RaiseOnRank1(TrainerCallback):
    """Rank 1 raises at the end of step 2 (rank 0 is then waiting in the next collective)."""

    def on_step_end(self, args, state, control, **kw):
        if os.environ.get("RANK") == "1" and state.global_step == 2:
            raise ValueError("boom on rank 1 at step 2")


class ExitOnRank1(TrainerCallback):
    """Rank 1 dies at the end of step 2: no exception, no cleanup (as if killed)."""

    def on_step_end(self, args, state, control, **kw):
        if os.environ.get("RANK") == "1" and state.global_step == 2:
            os._exit(9)


class SlowSteps(TrainerCallback):
    """Every rank sleeps 0.3 s after each step: time for the controls between steps (the
    numbers trained are not touched)."""

    def on_step_end(self, args, state, control, **kw):
        import time

        time.sleep(0.3)


def job(out_dir: str) -> None:
    """A plain mt.Trainer script, as a user runs it under torchrun: nothing notebook-specific."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from trainer.helpers import args, micro_model, token_dataset

    from megatrain_nb.trainer import Trainer

    t = Trainer(model=micro_model(), train_dataset=token_dataset(64), device="cpu",
                args=args(out_dir, max_steps=100000, logging_steps=2, learning_rate=1e-3,
                          lr_scheduler_type="constant"))
    t.train()
    t.save_model(out_dir + "/final")
    t.close()


if __name__ == "__main__":
    job(sys.argv[1])
