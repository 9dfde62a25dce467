"""Worker: the sharded step harness where one rank fails mid-run (raises, or dies outright);
the other rank is inside a collective at that moment."""
import os
import sys

import torch

from megatrain_nb.engine.ranks.dist import Dist
from megatrain_nb.engine.ranks.sharded import ShardedUnits
from megatrain_nb.engine.units import Unit


def main(mode: str) -> None:
    d = Dist.from_env()
    unit = Unit("layers.0", "layer", 1, [], 4096, 4096)
    su = ShardedUnits([unit], d)
    shard = torch.zeros(su.shard(unit).numel)
    for step in range(50):
        if d.rank == 1 and step == 3:
            if mode == "raise":
                raise RuntimeError("boom in rank 1 at step 3")
            if mode == "hang":  # alive but never joins the collective: rank 0's wait must time out
                import time
                time.sleep(1000)
            os._exit(9)        # killed: no exception, no cleanup
        full = su.gather(unit, shard)
        shard += su.reduce_grad(unit, torch.ones_like(full))
    d.close()


if __name__ == "__main__":
    main(sys.argv[1])
