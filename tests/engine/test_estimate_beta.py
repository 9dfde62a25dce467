"""mt.estimate(..., beta=): a GRPO/DPO run's KL weight (issue 45 item 7). Above 0 the trainer keeps
a reference model's engine, built with the policy's config, on the same device
(``decode.share_device``): its weight slots and gradient buffers stay there between the steps, so
generation's room falls by exactly those bytes (``estimator_grpo.plan_generation(reference=)``),
and a copy that fits resident without the reference may have to stream with it."""
import inspect
import json

import pytest

import megatrain_nb as mt
from megatrain_nb.cli import main
from megatrain_nb.engine.planning.estimator_grpo import resident_need
from megatrain_nb.engine.planning.planner import persistent_device_bytes
from megatrain_nb.model_configs import family_config

GIB = 2 ** 30


def _config():
    return family_config("llama", layers=2, vocab=64, max_position_embeddings=256)


def _est(**kw):
    base = dict(vram_gb=8, ram_gb=8, disk_gb=8, batch=4, seq=96, rollouts=16, completion_length=64)
    base.update(kw)
    return mt.estimate(_config(), **base)


@pytest.mark.slow   # (importing trl: about 6 s)
def test_the_default_is_trls_grpo_beta_and_keeps_no_reference():
    assert inspect.signature(mt.estimate).parameters["beta"].default == 0.0   # trl.GRPOConfig().beta
    trl = pytest.importorskip("trl")
    assert trl.GRPOConfig(output_dir="unused", report_to="none", use_cpu=True).beta == 0.0
    assert _est().grpo.room_bytes == _est(beta=0).grpo.room_bytes


def test_a_reference_engine_takes_its_persistent_bytes_out_of_generations_room():
    plain, kl = _est(), _est(beta=0.04)
    kept = persistent_device_bytes(plain.plan)
    assert kept > 0 and kl.plan.device == plain.plan.device   # the training step's plan is the same
    assert plain.grpo.room_bytes == 8 * GIB - kept
    assert kl.grpo.room_bytes == plain.grpo.room_bytes - kept
    assert "reference engine (beta > 0)" in str(kl) and "reference engine" not in str(plain)
    # a budget whose room between the steps holds the resident copy and its cache without the
    # reference, and not with it: generation streams (micro-batches of one row: the step fits it)
    need = resident_need(_config(), plain.num_parameters, 16, 96, 4)
    vram = (kept + need + kept // 2) / GIB
    fits, streams = _est(vram_gb=vram, batch=1), _est(vram_gb=vram, batch=1, beta=0.04)
    assert fits.plan.feasible and streams.plan.feasible and fits.plan.device["total"] <= vram * GIB
    kept = persistent_device_bytes(fits.plan)
    assert fits.grpo.mode == "resident" and fits.grpo.room_bytes >= need
    assert streams.grpo.mode == "streamed" and streams.grpo.room_bytes == fits.grpo.room_bytes - kept < need


def test_dpo_says_what_a_live_reference_keeps_and_bad_betas_are_refused():
    dpo = mt.estimate(_config(), vram_gb=8, ram_gb=8, disk_gb=8, seq=96, pairs=100, beta=0.1)
    assert "DPO live reference" in str(dpo) and "DPO reference pass" in str(dpo)
    assert "DPO live reference" not in str(mt.estimate(_config(), vram_gb=8, ram_gb=8, disk_gb=8, seq=96, pairs=100))
    for bad in (-0.1, float("nan"), "0.1", True):
        with pytest.raises(ValueError, match=r"beta=.*a number >= 0"):
            _est(beta=bad)


def test_the_cli_takes_beta(capsys):
    args = ["estimate", "micro", "--ram", "8", "--disk", "8", "--seq", "96", "--batch", "4", "--rollouts", "16",
            "--completion-length", "64", "--json"]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(args + ["--beta", "0.04"]) == 0
    kl = json.loads(capsys.readouterr().out)
    kept = kl["tiers"]["device"]["weights"] + kl["tiers"]["device"]["grads"]   # (persistent_device_bytes)
    assert kl["grpo"]["room_bytes"] == plain["grpo"]["room_bytes"] - kept
