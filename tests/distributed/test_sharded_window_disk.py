"""Sharded state (2 gloo ranks) with the engine's other paths: layer-major windows (one
``forward_backward`` call per rank with its micro-batches) and master weights on the disk tier
(``offload_params=True``), alone and together; parity against one process and torch's AdamW
(item 3's rule), and sharded checkpoints of disk-tier weights moving between world sizes."""
import sys
from pathlib import Path

import pytest
import torch

from megatrain_nb.engine.ranks.dist import Dist

from . import zero3_flow as flow
from .launch import ENGINE_FLOW, engine_flow_runs
from .test_zero3_flow import _max_rel

sys.path.insert(0, str(Path(__file__).parent))
import engine_flow  # noqa: E402

VARIANTS = ["clip_wd+window", "tied_clip_wd+window", "clip_wd+params_on_disk", "clip_wd+window+params_on_disk",
            "int8+params_on_disk"]


@pytest.fixture(scope="module")
def two_ranks():
    out = engine_flow_runs()   # (the launch test_engine_sharded's and test_estimate_sharded's read too)
    return {v: [torch.load(out / f"{v}-rank{r}.pt") for r in range(2)] for v in VARIANTS}


@pytest.mark.xdist_group(ENGINE_FLOW)   # on the worker of the shared launch
@pytest.mark.parametrize("spec", [v for v in VARIANTS if not v.startswith("int8")])
def test_two_ranks_match_one_process(two_ranks, spec):
    case, kw = engine_flow._variant(spec)
    r0, r1 = two_ranks[spec]
    assert all(torch.equal(r0["weights"][k], r1["weights"][k]) for k in r0["weights"])
    one = engine_flow.run_engine(Dist.single(), case, 2 * flow.ACC, **kw)
    assert _max_rel(r0["weights"], one["weights"]) <= 1e-5
    assert _max_rel(r0["weights"], flow.run_reference(case, 2 * flow.ACC)["weights"]) <= 1e-5
    assert r0["norms"] == pytest.approx(one["norms"], rel=1e-6)     # clipping's global norm
    if kw["window"]:    # each rank ran its 2 micro-batches as one layer-major pass
        assert r0["window_groups"] == 1 and one["window_groups"] == 1
    if kw["offload_params"]:   # each rank's disk tier holds its half of the master weights
        assert one["disk"]["weights"] >= 4 * sum(w.numel() for w in one["weights"].values())
        for r in (r0, r1):
            assert 0 < r["disk"]["weights"] <= 0.5 * one["disk"]["weights"] + 4 * 256 * 4 * 4


@pytest.mark.xdist_group(ENGINE_FLOW)   # on the worker of the shared launch
def test_int8_states_and_weights_on_disk(two_ranks):
    """int8 states re-draw their stochastic rounding on any ulp difference: agreement far inside
    the codec's own error (as test_engine_sharded's int8 case)."""
    r0 = two_ranks["int8+params_on_disk"][0]
    assert r0["disk"]["weights"] > 0 and r0["disk"]["optimizer_states"] > 0
    one = engine_flow.run_engine(Dist.single(), "int8", 2 * flow.ACC, offload_params=True)["weights"]
    fp32 = engine_flow.run_engine(Dist.single(), "clip_wd", 2 * flow.ACC)["weights"]
    diff = _max_rel(r0["weights"], one, element=1e-4)
    assert diff <= 1e-4 and diff <= 0.1 * _max_rel(one, fp32, element=1.0)


@pytest.mark.xdist_group(ENGINE_FLOW)   # on the worker of the shared launch
def test_window_traffic_is_one_pass_per_step(two_ranks):
    """A one-group window gathers each layer twice per step and reduce-scatters each gradient
    once per step (micro-batch-major: per micro-batch)."""
    win = two_ranks["clip_wd+window"][0]
    assert win["calls_steps"]["reduce_scatter"] == flow.STEPS * 4        # embed, 2 layers, head
    assert win["calls_steps"]["gather"] == flow.STEPS * (1 + 2 * 2 + 1)


SPEC = "clip_wd+params_on_disk"


def _uninterrupted():
    return engine_flow.run_engine(Dist.single(), "clip_wd", 2 * flow.ACC, offload_params=True)["weights"]


@pytest.mark.xdist_group(ENGINE_FLOW)   # on the worker of the shared launch
def test_disk_weights_checkpoint_two_ranks_to_one():
    ck = engine_flow_runs() / f"ckpt-save={SPEC}"   # written by the 2 ranks of the shared launch
    got = engine_flow.run_engine(Dist.single(), "clip_wd", 2 * flow.ACC, steps=(2, flow.STEPS), load_from=str(ck),
                                 offload_params=True)
    assert _max_rel(got["weights"], _uninterrupted()) <= 1e-5


@pytest.mark.xdist_group(ENGINE_FLOW)   # on the worker of the shared launch
def test_disk_weights_checkpoint_one_to_two_ranks():
    # this process's checkpoint after 2 steps (engine_flow_runs: "clip_wd", offload_params=True),
    # resumed by the 2 ranks of the shared launch
    got = torch.load(engine_flow_runs() / f"resume={SPEC}-rank0.pt")
    assert got["disk"]["weights"] > 0
    assert _max_rel(got["weights"], _uninterrupted()) <= 1e-5
