"""Worker (run by torchrun, 2 ranks): the step-boundary controller (``trainer/boundary.py``) across
ranks. Rank 0 takes the commands (as its inbox's door does); at each boundary one
``Dist.all_gather_json`` hands them to every rank, which applies them in the same order at the
same step. Each rank writes ``OUT/rank<r>.json``: what its trainer was asked and what it
recorded, for the test to compare across ranks and with one process."""
import json
import sys

from megatrain_nb.engine.ranks.dist import Dist

sys.path.insert(0, __file__.rsplit("/", 2)[0])   # tests/
from distributed.boundary_parts import Host, Trainer, drive  # noqa: E402

from megatrain_nb.trainer.boundary import BoundaryControl  # noqa: E402


def main(out_dir: str) -> None:
    d = Dist.from_env()
    trainer, host = Trainer(), Host()
    control = BoundaryControl(trainer, host, dist=d)
    refused = drive(control, host, main=d.is_main)
    with open(f"{out_dir}/rank{d.rank}.json", "w") as f:
        json.dump({"calls": trainer.calls, "events": host.events, "refused": refused}, f)


if __name__ == "__main__":
    main(sys.argv[1])
