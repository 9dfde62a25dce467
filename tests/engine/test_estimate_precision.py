"""Issue 45 item 6: ``mt.estimate`` (and ``megatrain-nb estimate``) says what the run header says
on CUDA when fp32 compute with TF32 off leaves most of the GPU idle, with the profile's rates
when given; nothing for bf16 or a CPU device."""
from __future__ import annotations

import megatrain_nb as mt
from megatrain_nb.engine.planning.rates import PROFILES, precision_words
from megatrain_nb.estimate_words import estimate_from_words


def test_an_fp32_estimate_says_what_bf16_and_tf32_would_give():
    est = mt.estimate("tiny", seq=256)
    lines = str(est).splitlines()
    assert lines[1].startswith("fp32 compute with TF32 off") and "an H100's published" in lines[1]
    assert "15x" in lines[1] and "kept as set" in lines[1]
    assert est.to_dict()["precision_note"] == lines[1]


def test_the_profile_gives_the_rates_and_bf16_or_cpu_say_nothing():
    est = mt.estimate("tiny", seq=256, rates="h100-pcie5-gen4nvme")
    p = PROFILES["h100-pcie5-gen4nvme"]
    assert f"{p.matmul_flops / 1e12:,.0f} TFLOPS against {p.bf16_matmul_flops / 1e12:,.0f}" in est.precision_note
    assert "the h100-pcie5-gen4nvme profile" in est.precision_note
    assert mt.estimate("tiny", seq=256, precision="bf16").precision_note is None
    assert mt.estimate("tiny", seq=256, device="cpu").precision_note is None
    assert precision_words("fp32", tf32=True) is None


def test_the_command_line_prints_it():
    assert "fp32 compute with TF32 off" in str(estimate_from_words(["tiny", "--seq", "256"]))
    assert "TF32 off" not in str(estimate_from_words(["tiny", "--seq", "256", "--precision", "bf16"]))
