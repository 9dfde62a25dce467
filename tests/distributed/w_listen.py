"""Worker (run by megatrain_nb.torchrun): join the group through Dist.from_env, one collective,
say "ready" with its pid, then hold the group open until the test has listed the sockets."""
import os
import sys
import time
from pathlib import Path

import torch

from megatrain_nb.engine.dist import Dist


def main(out_dir: str) -> None:
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
    main(sys.argv[1])
