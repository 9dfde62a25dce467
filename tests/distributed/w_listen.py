"""Worker (run by megatrain_nb.torchrun): join the group, one collective, say "ready" with its
pid, then hold the group open until the test has listed the sockets. ``args-first``: build
``TrainingArguments`` first, as every train.py of docs/TRAINING.md does (it initialises the process group
through accelerate before Dist.from_env can bind anything); else only Dist.from_env."""
import os
import sys
import time
from pathlib import Path

import torch

from megatrain_nb.engine.ranks.dist import Dist


def main(out_dir: str, mode: str = "") -> None:
    if mode == "args-first":
        from transformers import TrainingArguments

        TrainingArguments(output_dir=os.path.join(out_dir, "o"), use_cpu=True, report_to="none")
    d = Dist.from_env()
    t = torch.ones(1)
    d.all_reduce_(t)
    out = Path(out_dir)
    (out / f"ready{d.rank}").write_text(str(os.getpid()))
    end = time.monotonic() + 60
    while not (out / "listed").exists() and time.monotonic() < end:
        time.sleep(0.1)
    d.barrier()
    d.close()


if __name__ == "__main__":
    main(*sys.argv[1:])
