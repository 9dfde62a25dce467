"""mt.estimate: bytes per tier, placement, feasibility, and the GPU-resident comparison."""
import json

import pytest

from megatrain_nb.estimator import estimate

GiB = 1024 ** 3


def test_100b_reproduces_the_seed_article_comparison():
    est = estimate("llama-100b", vram_gb=80, ram_gb=1024, disk_gb=4096)
    g = est.gpu_resident
    assert 395e9 < g["weights"] < 405e9                       # ≈400 GB of fp32 weights
    assert 1.58e12 < g["weights"] + g["grads"] + g["optimizer_states"] < 1.62e12  # ≈1.6 TB with grads + Adam
    assert g["total"] > 20 * 80 * GiB                          # nowhere near one 80 GB GPU
    assert est.feasible and est.limiting_tier is None
    assert est.tiers()["device"]["total"] <= 80 * GiB          # our placement fits the one GPU
    assert est.placement["optimizer_states"] == "disk"
    text = str(est)
    assert "GPU-resident fp32 AdamW" in text and "≈401 GB" in text and "≈1.60 TB" in text
    assert "feasible: yes" in text and est._repr_html_().startswith("<div>")
    json.dumps(est.to_dict(), default=str)


def test_limiting_tier_is_reported():
    # (64 GiB fit since clipping may hold the final gradients on the disk tier with the weights)
    est = estimate("llama-100b", vram_gb=80, ram_gb=16, disk_gb=4096)
    assert not est.feasible and est.limiting_tier == "host"
    assert "limiting tier: host" in str(est)
    assert estimate("llama-7b", vram_gb=0.5, ram_gb=None, disk_gb=None).limiting_tier == "device"


def test_model_folder_config_file_and_objects(tmp_path):
    from megatrain_nb.trainer.presets import preset_config

    cfg = preset_config("micro")
    cfg.save_pretrained(tmp_path)
    by_folder = estimate(str(tmp_path), ram_gb=None, disk_gb=None)
    by_file = estimate(str(tmp_path / "config.json"), ram_gb=None, disk_gb=None)
    by_config = estimate(cfg, ram_gb=None, disk_gb=None)
    assert by_folder.num_parameters == by_file.num_parameters == by_config.num_parameters == 172352
    with pytest.raises(ValueError, match="preset"):
        estimate("no-such-model")
