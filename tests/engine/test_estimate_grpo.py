"""mt.estimate(..., rollouts=, completion_length=): a GRPO step's generation (issue 48 item 5): the
KV cache's bytes against the cache a transformers model builds and the streamed decoder's count,
where generation runs (the engine's rule: resident when a compute-dtype copy and its cache in
the compute dtype fit the device budget between training steps, beside what stays allocated
between them, else streamed), the streamed decoder priced as the
compute-dtype weights over the link per decoded token for all rollouts at once, and the refusals."""
import dataclasses
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import megatrain_nb as mt
from megatrain_nb.cli import main
from megatrain_nb.engine.compute import decode
from megatrain_nb.engine.planning.estimator_grpo import kv_cache_bytes
from megatrain_nb.engine.planning.planner import persistent_device_bytes
from megatrain_nb.engine.planning.rates import rates_for
from megatrain_nb.model_configs import family_config, tiny_config

PROFILE = "h100-pcie5-gen4nvme"


def _config():
    return family_config("llama", layers=2, vocab=64, max_position_embeddings=256)


@pytest.mark.slow
def test_the_kv_cache_is_the_bytes_of_the_cache_transformers_builds():
    cfg = _config()
    model = AutoModelForCausalLM.from_config(cfg).eval()
    rows, tokens = 3, 17
    with torch.no_grad():
        out = model(torch.randint(0, 64, (rows, tokens)), use_cache=True)
    cache = out.past_key_values
    built = sum(layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
                for layer in cache.layers)
    assert kv_cache_bytes(cfg, rows, tokens, 4) == built == decode.kv_cache_bytes(cfg, rows, tokens, 4)
    gemma = tiny_config("gemma2")   # sliding-window layers hold their window at most
    assert kv_cache_bytes(gemma, 2, 300, 2) == decode.kv_cache_bytes(gemma, 2, 300, 2)


def _est(**kw):
    base = dict(vram_gb=8, ram_gb=8, disk_gb=8, batch=4, seq=96, rollouts=16, completion_length=64)
    base.update(kw)
    return mt.estimate(_config(), **base)


@pytest.mark.slow
def test_generation_is_resident_when_it_fits_and_streamed_when_not():
    est = _est()
    gp = est.grpo
    assert gp.mode == "resident" and gp.kv_tier == "device"
    assert (gp.rollouts, gp.prompt_length, gp.completion_length) == (16, 32, 64)
    assert est.to_dict()["grpo"]["kv_bytes"] == kv_cache_bytes(_config(), 16, 96, 4)
    # the training step is the generation batch: 16 rollouts in micro-batches of 4
    assert "accumulation 4" in str(est)
    assert "GRPO KV cache" in est._repr_html_()   # the notebook's view of it too
    assert gp.weights_bytes == 4 * est.num_parameters   # fp32 compute: the copy is fp32 (grpo_rollout.resident_fits)
    # generation runs between training steps: its room is the budget less the weight slots and gradient
    # buffers that stay allocated (persistent_device_bytes), not less the step's activations and boundaries
    assert gp.room_bytes == 8 * 2 ** 30 - est.plan.device["weights"] - est.plan.device["grads"]
    assert gp.room_bytes > 8 * 2 ** 30 - est.plan.device["total"]
    # a device budget that holds the training step (micro-batches of one row: its boundaries in host RAM) but
    # between the steps not the fp32 copy + its cache, nor the decoder's cache and logits, nor its device part
    # with the K/V in host RAM (the logits, two layers' K/V): the rollouts decode in sub-batches that each fit
    # (priced: test_decode_host_kv)
    left = 650 << 10
    small = _est(batch=1, vram_gb=left / 2 ** 30)
    k = small.grpo.kv_batches
    assert small.plan.feasible and small.plan.device["total"] <= left and small.plan.window["tier"] == "host"
    assert small.grpo.room_bytes == left - persistent_device_bytes(small.plan) < small.grpo.weights_bytes + gp.kv_bytes
    assert small.grpo.mode == "streamed" and small.grpo.kv_tier == "device" and k > 1
    assert f"decoded in {k} sub-batches" in str(small) and "the streamed decoder refuses" not in str(small)


def test_host_rooms_are_counted_between_the_steps_too():
    """The host room the KV cache's host tier gets is the host budget less what the plan keeps in RAM
    between steps (planner.persistent_host_bytes): a window's boundary activations parked in host
    RAM are the step's, freed at its end."""
    from megatrain_nb.engine.planning.estimator_dpo import format_bytes
    from megatrain_nb.engine.planning.estimator_grpo import plan_generation
    from megatrain_nb.engine.planning.planner import persistent_host_bytes, unit_specs_from_config

    est = _est(batch=1, vram_gb=(650 << 10) / 2 ** 30)   # (its window's boundaries in host RAM)
    plan = est.plan
    assert plan.window["tier"] == "host" and plan.host["activations"] > 0
    assert persistent_host_bytes(plan) == plan.host["total"] - plan.host["activations"]
    parked = 10 << 20   # a step's boundaries in RAM of 10 MiB: the budget holds them and 1 KiB more
    wide = dataclasses.replace(plan, host=dict(plan.host, activations=parked,
                                               total=plan.host["total"] - plan.host["activations"] + parked))
    budgets = dict(est.budgets, host=wide.host["total"] + 1024)
    gp = plan_generation(_config(), unit_specs_from_config(_config()), wide, budgets, 16, 32, 64, precision="fp32")
    assert f"host room beside the host plan {format_bytes(parked + 1024)}" in gp.kv_why, gp.kv_why


def test_a_streamed_token_is_the_weights_over_the_link_for_all_rollouts():
    """Streamed: each decoded token moves the compute-dtype weights once (bf16: 2 bytes a
    parameter) whatever the number of rollouts; its time is the longer of that and the compute."""
    r = rates_for(PROFILE)
    wide = family_config("llama", layers=2, vocab=64, max_position_embeddings=256, intermediate_size=1024)
    # (micro-batches of one row, many rollouts: a cache that outweighs a training step's activations, so a budget
    # that holds the step can leave too little room between the steps for the copy beside the cache)
    base = dict(ram_gb=8, disk_gb=8, batch=1, seq=96, completion_length=64, precision="bf16")
    for rollouts in (256, 384, 512):
        fits = mt.estimate(wide, vram_gb=8, rollouts=rollouts, **base)   # resident (bf16 copy)
        logits = 3 * rollouts * 64 * 4
        assert fits.grpo.mode == "resident" and fits.grpo.weights_bytes > logits   # (the premise: the copy outweighs
        # the decoder's logits); room between the steps for the decoder's cache and logits, not for the copy beside it
        vram = persistent_device_bytes(fits.plan) + fits.grpo.kv_bytes + logits
        est = mt.estimate(wide, vram_gb=vram / 2 ** 30, rollouts=rollouts, rates=r, **base)
        gp = est.grpo
        assert est.plan.feasible and est.plan.device["total"] <= vram   # (the training step fits the budget)
        assert gp.mode == "streamed" and gp.kv_tier == "device" and gp.kv_batches == 1
        assert gp.link_bytes_per_token == 2 * est.num_parameters
        assert gp.token_s >= gp.link_bytes_per_token / r.h2d_pinned
        assert gp.generation_s == pytest.approx(gp.prefill_s + 64 * gp.token_s)
        assert gp.step_s == pytest.approx(gp.generation_s + est.prediction.step_seconds)
        assert gp.tokens_per_second == pytest.approx(rollouts * 96 / gp.step_s)
        assert "per decoded token, bound by link" in str(est)


def test_the_refusals_name_what_to_give():
    with pytest.raises(ValueError, match="shorter than seq"):
        _est(completion_length=96)
    with pytest.raises(ValueError, match="give rollouts= too"):
        mt.estimate(_config(), vram_gb=8, ram_gb=8, disk_gb=8, completion_length=32)
    with pytest.raises(ValueError, match="must equal it"):
        _est(accumulation=3)
    with pytest.raises(ValueError, match="rollouts"):
        _est(rollouts=0)


def test_the_cli_takes_rollouts_and_completion_length(capsys):
    args = ["estimate", "micro", "--ram", "8", "--disk", "8", "--seq", "96", "--batch", "4", "--rollouts", "16",
            "--completion-length", "64"]
    assert main(args + ["--json"]) == 0
    d = json.loads(capsys.readouterr().out)["grpo"]
    assert d["rollouts"] == 16 and d["completion_length"] == 64 and d["mode"] == "resident"
    assert main(args + ["--profile", PROFILE]) == 0
    out = capsys.readouterr().out
    assert "GRPO KV cache" in out and "GRPO step: generation" in out and "training" in out
