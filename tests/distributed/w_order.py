"""Worker: the sharded engine on the adversarial CPU transport (copies late, in threads of their
own, after random delays; MEGATRAIN_ADVERSARIAL_TRANSPORT=1 set by the test), each rank with a
different random timing; every collective the issuer issues is logged as (kind, key). Saves
each case's log and weights per rank (engine/transport/issuer.py)."""
import os
import random
import sys

import torch

from megatrain_nb.engine.ranks.dist import Dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import engine_flow  # noqa: E402
from zero3_flow import ACC  # noqa: E402


def main(out_dir: str, specs: str) -> None:
    torch.manual_seed(0)
    dist = Dist.from_env()
    from megatrain_nb.engine.transport import transport

    # the ranks' timings differ: each rank's copies land after delays of its own
    transport.ADVERSARIAL_MAX_DELAY_S = 0.004 * (1 + dist.rank)
    real = transport.CpuTransport.__init__

    def seeded(self, *a, **kw):
        kw["seed"] = 1000 * dist.rank + random.randrange(1000)
        real(self, *a, **kw)
    transport.CpuTransport.__init__ = seeded
    for spec in specs.split(","):
        case, kw = engine_flow._variant(spec)
        dist.issuer.log = []
        res = engine_flow.run_engine(dist, case, ACC, **kw)
        torch.save({"log": list(dist.issuer.log), "weights": res["weights"], "calls": res["calls_steps"]},
                   f"{out_dir}/{spec}-rank{dist.rank}.pt")
    dist.issuer.log = None
    dist.barrier()
    dist.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
