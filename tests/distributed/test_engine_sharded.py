"""StreamingEngine with its training state sharded over 2 gloo ranks (accumulation A) against
one process (accumulation 2A) and torch.optim.AdamW: item 3's parity on the real engine
(streamed forward, recompute, overlapped updates, clipping, the disk tier)."""
import sys
from pathlib import Path

import pytest
import torch

from megatrain_nb.engine.ranks.dist import Dist

from . import zero3_flow as flow
from .launch import ENGINE_FLOW, check, engine_flow_runs, two_agents
from .test_zero3_flow import _max_rel

sys.path.insert(0, str(Path(__file__).parent))
import engine_flow  # noqa: E402

CASES = list(flow.CASES)


@pytest.fixture(scope="module")
def two_ranks():
    out = engine_flow_runs()   # (the launch test_sharded_window_disk's and test_estimate_sharded's read too)
    return {c: [torch.load(out / f"{c}-rank{r}.pt") for r in range(2)] for c in CASES}


@pytest.mark.xdist_group(ENGINE_FLOW)   # on the worker of the shared launch
@pytest.mark.parametrize("case", [c for c in CASES if flow.CASES[c][3] == "none"])
def test_two_ranks_match_one_process(two_ranks, case):
    r0, r1 = two_ranks[case]
    for k in r0["weights"]:            # every rank ends with the same (assembled) weights
        assert torch.equal(r0["weights"][k], r1["weights"][k])
    ref = flow.run_reference(case, 2 * flow.ACC)["weights"]
    assert _max_rel(r0["weights"], ref) <= 1e-5
    one = engine_flow.run_engine(Dist.single(), case, 2 * flow.ACC)
    assert _max_rel(r0["weights"], one["weights"]) <= 1e-5
    if flow.CASES[case][2]:            # clipping: the global norm, all-reduced, is the one-process norm
        assert r0["norms"] == pytest.approx(one["norms"], rel=1e-6)


@pytest.mark.xdist_group(ENGINE_FLOW)   # on the worker of the shared launch
def test_int8_states_on_disk_two_ranks_match_one_rank(two_ranks):
    """int8 Adam states on each rank's disk tier (see test_zero3_flow for why int8 agrees to the
    codec's re-drawn rounding, not to fp32 precision)."""
    r0 = two_ranks["int8"][0]
    assert r0["disk"]["optimizer_states"] > 0
    one = engine_flow.run_engine(Dist.single(), "int8", 2 * flow.ACC)["weights"]
    fp32 = engine_flow.run_engine(Dist.single(), "clip_wd", 2 * flow.ACC)["weights"]
    ranks_diff = _max_rel(r0["weights"], one, element=1e-4)
    assert ranks_diff <= 1e-4 and ranks_diff <= 0.1 * _max_rel(one, fp32, element=1.0)


@pytest.mark.xdist_group(ENGINE_FLOW)   # on the worker of the shared launch
def test_each_rank_holds_about_half(two_ranks):
    one = engine_flow.run_engine(Dist.single(), "adamw", 2 * flow.ACC)
    for r in range(2):
        host = two_ranks["adamw"][r]["host"]
        # shards are padded to whole 256-element blocks: a few blocks per unit beyond one half
        assert host["weights"] <= 0.5 * one["host"]["weights"] + 4 * 256 * 4 * 4
        assert host["optimizer_states"] <= 0.5 * one["host"]["optimizer_states"] + 2 * 4 * 256 * 4 * 4


@pytest.mark.xdist_group(ENGINE_FLOW)   # on the worker of the shared launch
def test_traffic_is_the_zero3_floor(two_ranks):
    """Per micro-batch: each unit gathered for the forward and again for the recompute, its
    gradient reduce-scattered once; bytes sent within 1.1x of (N-1)/N of that (shard padding)."""
    res = two_ranks["adamw"][0]
    sent = res["sent"]["gather"] + res["sent"]["reduce_scatter"]
    floor = res["minimum"]["gather"] + res["minimum"]["reduce_scatter"]
    assert sent <= 1.1 * floor
    assert res["minimum"]["gather"] == pytest.approx(2 * res["minimum"]["reduce_scatter"], rel=0.1)


def test_two_nodes_simulated_by_two_agents(tmp_path):
    """Two torchrun agents on localhost (--nnodes 2, one rank each) train like one process."""
    for proc in two_agents(Path(engine_flow.__file__), str(tmp_path), "clip_wd"):
        check(proc)
    got = torch.load(tmp_path / "clip_wd-rank0.pt")
    assert _max_rel(got["weights"], flow.run_reference("clip_wd", 2 * flow.ACC)["weights"]) <= 1e-5
