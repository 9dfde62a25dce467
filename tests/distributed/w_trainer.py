"""Worker: the same mt.Trainer script run under torchrun (or alone); rank 0 alone writes the
output folder. ``w_trainer.py OUT GA [save | resume:<checkpoint> | resume:latest | crash]``.

``crash``: checkpoints every 2 steps and asks for ``resume_from_checkpoint="auto"``; in torchrun's
first attempt rank 1 dies (``os._exit``) as step 3 begins, after checkpoint-2 is complete, while
rank 0 goes into the step's collectives. torchrun ``--max-restarts`` starts both again; they
find checkpoint-2 themselves and finish the run."""
import json
import os
import sys

sys.path.insert(0, __file__.rsplit("/", 2)[0])   # tests/ (for the trainer test helpers)

from trainer.helpers import args, micro_model, token_dataset  # noqa: E402

from megatrain_nb.trainer import Trainer  # noqa: E402


def main(out_dir: str, ga: str, mode: str = "") -> None:
    kw = dict(gradient_accumulation_steps=int(ga), weight_decay=0.1, max_grad_norm=0.5, max_steps=3, seed=7,
              logging_steps=1)
    if mode in ("save", "crash"):
        kw.update(save_strategy="steps", save_steps=2)
    if mode == "crash":
        kw.update(resume_from_checkpoint="auto")
    kw.update(per_device_eval_batch_size=2)    # 9 rows: 5 batches, one rank runs a zero-weight pad
    t = Trainer(model=micro_model(), train_dataset=token_dataset(22, masked=True), args=args(out_dir, **kw),
                eval_dataset=token_dataset(9, seed=3, masked=True), device="cpu")
    if mode == "crash":
        from transformers import TrainerCallback

        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        open(f"{out_dir}/attempt-{attempt}-rank{t.dist.rank}", "w").close()

        class DieOnce(TrainerCallback):
            def on_step_begin(self, a, state, control, **k):
                if attempt == 0 and t.dist.rank == 1 and state.global_step == 2:
                    os._exit(9)     # no exception, no cleanup: as a killed process

        t.add_callback(DieOnce())
    resume = mode.split(":", 1)[1] if mode.startswith("resume:") else None
    t.train(resume_from_checkpoint=True if resume == "latest" else resume)
    calls = []
    evaluate = t.engine.evaluate
    t.engine.evaluate = lambda *a, **k: calls.append(1) or evaluate(*a, **k)   # batches this rank ran
    metrics = t.evaluate()
    with open(f"{out_dir}/eval-rank{t.dist.rank}.json", "w") as f:
        json.dump({"loss": metrics["eval_loss"], "tokens": metrics["eval_tokens"], "batches": len(calls)}, f)
    t.save_model(out_dir + "/final")
    t.engine.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
