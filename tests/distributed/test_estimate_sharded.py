"""The estimator's scale-out figures (``estimate --nodes M --gpus-per-node N``) against the
engine's own accounting on 2 gloo ranks: a rank's host and disk bytes per kind, and the bytes on
the wire per step (Dist.traffic's floor); one node with one GPU is today's table unchanged."""
import pytest
import torch

from megatrain_nb.cli import build_parser, estimate_from_words, main
from megatrain_nb.engine.planning.estimator import estimate
from megatrain_nb.engine.planning.estimator_dist import estimate_scale_out

from . import zero3_flow as flow
from .launch import ENGINE_FLOW, engine_flow_runs

RUNS = ["adamw", "clip_wd+window", "int8+params_on_disk"]


@pytest.fixture(scope="module")
def two_ranks():
    out = engine_flow_runs()   # (the launch test_engine_sharded's and test_sharded_window_disk's read too)
    return {v: torch.load(out / f"{v}-rank0.pt") for v in RUNS}   # rank 0 holds the largest shards


def _config(tied=False):
    return flow.tiny_model(tied).config


def _rank_estimate(**kw):
    base = dict(vram_gb=None, ram_gb=None, disk_gb=None, device="cpu", accumulation=flow.ACC)
    return estimate_scale_out(_config(), nodes=1, gpus_per_node=2, **{**base, **kw})


@pytest.mark.xdist_group(ENGINE_FLOW)   # on the worker of the shared launch
def test_rank_host_bytes_equal_the_engine(two_ranks):
    """fp32 states in RAM, micro-batch-major accumulation: master weights, gradient accumulators
    and Adam moments of one rank, byte for byte."""
    est = _rank_estimate(compression="none", offload_dir=False, layer_major=False, clipping=False)
    host = est.per_rank.tiers()["host"]
    real = two_ranks["adamw"]["host"]
    for kind in ("weights", "grads", "optimizer_states"):
        assert host[kind] == real[kind], kind
    one = estimate(_config(), vram_gb=None, ram_gb=None, disk_gb=None, device="cpu", accumulation=flow.ACC,
                   compression="none", offload_dir=False, layer_major=False, clipping=False)
    assert host["weights"] < 0.6 * one.tiers()["host"]["weights"]
    assert est.per_node()["host"] == 2 * host["total"]


@pytest.mark.xdist_group(ENGINE_FLOW)   # on the worker of the shared launch
def test_rank_disk_bytes_match_the_engine(two_ranks):
    """Master weights and int8 states on each rank's disk tier (files round up to 4 KiB pages)."""
    # a node RAM budget below two shards' weights and gradients puts the master weights on disk
    # (as offload_params=True does in the engine run)
    est = _rank_estimate(compression="int8", ram_gb=100e3 / 2**30)
    disk = est.per_rank.tiers()["disk"]
    assert est.per_rank.placement["master_weights"] == "disk"
    real = two_ranks["int8+params_on_disk"]["disk"]
    units = 4
    for kind in ("weights", "optimizer_states"):
        assert disk[kind] <= real[kind] <= disk[kind] + 2 * 4096 * units, (kind, disk[kind], real[kind])


@pytest.mark.xdist_group(ENGINE_FLOW)   # on the worker of the shared launch
@pytest.mark.parametrize("run,layer_major", [("adamw", False), ("clip_wd+window", True)])
def test_wire_bytes_are_the_engines_floor(two_ranks, run, layer_major):
    est = _rank_estimate(compression="none", offload_dir=False, layer_major=layer_major)
    got = two_ranks[run]["minimum_steps"]
    for kind in ("gather", "reduce_scatter"):
        assert est.wire[kind] == pytest.approx(got[kind] / flow.STEPS, rel=1e-3), kind


def test_one_node_one_gpu_is_todays_table(capsys):
    kw = dict(vram_gb=24, ram_gb=64, disk_gb=1000)
    assert str(estimate_scale_out("llama-7b", **kw)) == str(estimate("llama-7b", **kw))
    assert main(["estimate", "llama-7b", "--vram", "24", "--ram", "64", "--disk", "1000"]) == 0
    plain = capsys.readouterr().out
    assert main(["estimate", "llama-7b", "--vram", "24", "--ram", "64", "--disk", "1000", "--nodes", "1",
                 "--gpus-per-node", "1"]) == 0
    assert capsys.readouterr().out == plain


def test_cli_and_magic_share_the_parser(capsys):
    argv = ["llama-70b", "--vram", "80", "--ram", "512", "--disk", "4096", "--nodes", "2", "--gpus-per-node", "8"]
    est = estimate_from_words(argv)
    assert est.world == 16 and est.feasible
    rank = est.per_rank.tiers()
    # a node holds 8 ranks' shards: 1/2 of the model's master weights (2 nodes), in its RAM
    assert est.per_rank.placement["master_weights"] == "host"
    # (pinned on CUDA: each shard's buffer in whole pages; at its power of two if registration fails)
    assert 4 * est.per_rank.num_parameters * (1 - 1e-3) <= rank["host"]["weights"] * 16 \
        < 8 * est.per_rank.num_parameters
    assert est.per_node()["host"] == 8 * rank["host"]["total"]
    assert est.per_rank.budgets["host"] == 512 * 2**30 // 8
    assert main(["estimate", *argv]) == 0
    out = capsys.readouterr().out
    assert "2 node(s) x 8 GPU(s) = 16 ranks" in out and "per node (8 ranks): RAM" in out
    assert "on the wire per rank per step" in out and "device  80.0 GiB" in out
    with pytest.raises(ValueError, match="--nodes='0': must be a whole number >= 1"):
        estimate_from_words(["llama-7b", "--nodes", "0"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["estimate", "llama-7b", "--gpus-per-node", "x"])
