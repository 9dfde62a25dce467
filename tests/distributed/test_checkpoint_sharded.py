"""Sharded checkpoints through the engine: written by 2 ranks and resumed by 1, and the other
way; the resumed run ends where the uninterrupted one-process run does."""
import sys
from pathlib import Path

import pytest
import torch

from megatrain_nb.engine.ranks.dist import Dist
from megatrain_nb.engine.ranks.reshard import read_meta

from . import zero3_flow as flow
from .launch import ENGINE_FLOW, engine_flow_runs
from .test_zero3_flow import _max_rel

sys.path.insert(0, str(Path(__file__).parent))
import engine_flow  # noqa: E402

CASE = "clip_wd"


def _uninterrupted():
    return engine_flow.run_engine(Dist.single(), CASE, 2 * flow.ACC)["weights"]


@pytest.mark.xdist_group(ENGINE_FLOW)   # on the worker of the shared launch
def test_two_ranks_save_one_resumes():
    ck = engine_flow_runs() / f"ckpt-save={CASE}"   # written by the 2 ranks of the shared launch
    assert [m["rank"] for m in read_meta(ck)] == [0, 1]
    got = engine_flow.run_engine(Dist.single(), CASE, 2 * flow.ACC, steps=(2, flow.STEPS), load_from=str(ck))
    assert _max_rel(got["weights"], _uninterrupted()) <= 1e-5


@pytest.mark.xdist_group(ENGINE_FLOW)   # on the worker of the shared launch
def test_one_saves_two_ranks_resume():
    # this process's checkpoint after 2 steps, resumed by the 2 ranks of the shared launch
    out = engine_flow_runs()
    assert [m["world"] for m in read_meta(out / f"ckpt-one={CASE}")] == [1]
    got = torch.load(out / f"resume={CASE}-rank0.pt")["weights"]
    assert _max_rel(got, _uninterrupted()) <= 1e-5


def test_stopping_at_a_checkpoint_changes_nothing_in_one_process(tmp_path):
    ck = tmp_path / "ck"
    engine_flow.run_engine(Dist.single(), CASE, 2 * flow.ACC, steps=(0, 2), save_to=str(ck))
    got = engine_flow.run_engine(Dist.single(), CASE, 2 * flow.ACC, steps=(2, flow.STEPS), load_from=str(ck))
    ref = _uninterrupted()
    assert all(torch.equal(got["weights"][k], ref[k]) for k in ref)   # exact: same process count
