"""Worker: the same mt.Trainer script run under torchrun (or alone); rank 0 alone writes the
output folder. ``w_trainer.py OUT GA [save | resume:<checkpoint>]``."""
import sys

sys.path.insert(0, __file__.rsplit("/", 2)[0])   # tests/ (for the trainer test helpers)

from trainer.helpers import args, micro_model, token_dataset  # noqa: E402

from megatrain_nb.trainer import Trainer  # noqa: E402


def main(out_dir: str, ga: str, mode: str = "") -> None:
    kw = dict(gradient_accumulation_steps=int(ga), weight_decay=0.1, max_grad_norm=0.5, max_steps=3, seed=7,
              logging_steps=1)
    if mode == "save":
        kw.update(save_strategy="steps", save_steps=2)
    t = Trainer(model=micro_model(), train_dataset=token_dataset(22, masked=True), args=args(out_dir, **kw),
                device="cpu")
    t.train(resume_from_checkpoint=mode.split(":", 1)[1] if mode.startswith("resume:") else None)
    t.save_model(out_dir + "/final")
    t.engine.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
