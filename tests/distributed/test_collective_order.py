"""Data parallel: every collective -- the pager's gathers (copy thread), the gradients'
reduce-scatters and finiteness votes (gradient thread), the norms and token counts (the
program's thread) -- is issued in one order, the same on every rank, whatever the threads'
timing (engine/transport/issuer.py; NCCL can deadlock when ranks launch collectives of different
communicators in different orders). Two gloo ranks on the adversarial CPU transport, each with
delays of its own: the ranks' logs of issued collectives are identical, and the run trains
as it does without the issuer's ordering mattering (the same weights on both ranks)."""
from pathlib import Path

import torch

from .launch import check, torchrun

HERE = Path(__file__).parent
SPECS = ["adamw", "clip_wd+window"]   # per-unit votes (no clipping); the norm (clipping), a layer-major window


def test_every_rank_issues_the_collectives_in_one_order(tmp_path):
    proc = torchrun(HERE / "w_order.py", str(tmp_path), ",".join(SPECS), nproc=2, timeout=150, dist_timeout_s=30,
                    env={"MEGATRAIN_ADVERSARIAL_TRANSPORT": "1", "ZERO3_STEPS": "2"})
    check(proc)
    for spec in SPECS:
        r0, r1 = (torch.load(tmp_path / f"{spec}-rank{r}.pt") for r in range(2))
        log = r0["log"]
        assert log == r1["log"], f"{spec}: the ranks issued their collectives in different orders"
        kinds = [k for k, _ in log]
        # everything the steps sent went through the issuer, in one log
        assert kinds.count("gather") >= r0["calls"]["gather"] > 0
        assert kinds.count("reduce_scatter") == r0["calls"]["reduce_scatter"] > 0
        # the two worker threads' collectives interleave (a gather issued after a reduce-scatter
        # and before the step's last one): the order was imposed across threads, not one after the other
        first_rs = kinds.index("reduce_scatter")
        last_rs = len(kinds) - 1 - kinds[::-1].index("reduce_scatter")
        assert "gather" in kinds[first_rs:last_rs]
        if spec == "adamw":   # unclipped: each final gradient voted on, right after its reduce-scatter
            votes = [i for i, (k, _) in enumerate(log) if k == "vote"]
            assert votes and all(log[i - 1] == ("reduce_scatter", log[i][1]) for i in votes)
        else:
            assert "norm" in kinds and "vote" not in kinds
        assert all(torch.equal(r0["weights"][k], r1["weights"][k]) for k in r0["weights"])
