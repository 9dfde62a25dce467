"""A training job run in a separate process by test_checkpoint.py.

    python ckpt_job.py MODE OUTPUT_DIR COMPRESSION
MODE: full | resume:<checkpoint path or "latest"> | kill-at:<step> (SIGKILL while writing that checkpoint)
"""
import os
import signal
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.trainer.helpers import args, micro_model, token_dataset  # noqa: E402

from megatrain_nb.trainer import Trainer  # noqa: E402


def make_trainer(out, compression, **kw):
    torch.set_num_threads(1)
    disk = {}
    if compression != "none":
        disk["offload_dir"] = os.path.join(out, "offload")
        os.makedirs(disk["offload_dir"], exist_ok=True)
    # fp32 runs clip (updates after the backward, overlapping the next forward); compressed runs
    # overlap each update with the backward (no clipping)
    kw.setdefault("max_grad_norm", 1.0 if compression == "none" else 0.0)
    a = args(out, gradient_accumulation_steps=2, weight_decay=0.1, lr_scheduler_type="cosine", warmup_steps=2,
             max_steps=8, save_strategy="steps", save_steps=kw.pop("save_steps", 3), **kw)
    return Trainer(model=micro_model(), train_dataset=token_dataset(20), args=a, device="cpu",
                   optimizer_compression=compression, **disk)


def main(mode, out, compression):
    tr = make_trainer(out, compression, save_steps=2 if mode.startswith("kill") else 3)
    if mode.startswith("kill-at:"):
        step = int(mode.split(":")[1])
        real = tr.engine.save_checkpoint

        def dying_save(path):
            real(path)  # the big files are written...
            if tr.state.global_step == step:
                os.kill(os.getpid(), signal.SIGKILL)  # ...and the process dies before the checkpoint is complete
        tr.engine.save_checkpoint = dying_save
        tr.train()
        return
    resume = None
    if mode.startswith("resume:"):
        resume = mode.split(":", 1)[1]
        resume = True if resume == "latest" else resume
    tr.train(resume_from_checkpoint=resume)
    torch.save(tr.engine.state_dict(), os.path.join(out, "final.pt"))
    tr.close()


if __name__ == "__main__":
    main(*sys.argv[1:4])
