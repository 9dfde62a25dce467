"""megatrain-nb: demo (the main job), train --config, estimate."""
import json

import pytest
import yaml

from megatrain_nb.cli import main


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


def test_estimate_prints_the_100b_comparison(capsys):
    assert main(["estimate", "llama-100b", "--vram", "80", "--ram", "1024", "--disk", "4096"]) == 0
    out = capsys.readouterr().out
    assert "GPU-resident fp32 AdamW" in out and "≈401 GB" in out and "≈1.60 TB" in out
    assert "feasible: yes" in out and "optimizer states -> disk" in out
    assert main(["estimate", "llama-100b", "--ram", "16", "--disk", "4096", "--json"]) == 0  # 64 GiB fit now
    d = json.loads(capsys.readouterr().out)
    assert d["feasible"] is False and d["limiting_tier"] == "host"


def test_estimate_bad_model_is_one_clear_line(capsys):
    assert main(["estimate", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert "no-such-model" in err and "preset" in err and "Traceback" not in err


def test_demo_quick_runs_the_main_job(tmp_path, monkeypatch, shared_cache, capsys):
    monkeypatch.setenv("MEGATRAIN_NB_CACHE", str(shared_cache))
    out_dir = tmp_path / "demo"
    assert main(["demo", "--quick", "--steps", "6", "--output-dir", str(out_dir)]) == 0
    out = capsys.readouterr().out
    assert "disk tier at" in out and "optimizer states int8" in out
    assert "== summary ==" in out and "eval loss" in out and str(out_dir / "model") in out
    assert (out_dir / "model" / "config.json").is_file()
    records = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r and "event" not in r] == list(range(1, 7))
    assert any(r.get("memory", {}).get("disk", {}).get("used_bytes") for r in records)  # the disk tier was used


def test_train_from_a_config_file(tmp_path, capsys):
    from tests.trainer.helpers import micro_model, token_rows

    micro_model().save_pretrained(tmp_path / "model")
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in token_rows(8)))
    cfg = {"model": "model", "data": {"train": ["train.jsonl"], "eval": "train.jsonl"},
           "training": {"output_dir": "run", "max_steps": 3, "per_device_train_batch_size": 2, "save_steps": 2},
           "engine": {"device": "cpu"}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["train", "--config", str(tmp_path / "run.yaml")]) == 0
    out = capsys.readouterr().out
    assert "steps 3" in out and "eval loss" in out
    assert (tmp_path / "run" / "model.safetensors").is_file() and (tmp_path / "run" / "metrics.jsonl").is_file()
    assert main(["train", "--config", str(tmp_path / "run.yaml"), "--max-steps", "4", "--resume"]) == 0
    assert "steps 4" in capsys.readouterr().out


def test_train_config_errors_are_named(tmp_path, capsys):
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({"model": "m", "preset": "tiny"}))
    with pytest.raises(SystemExit, match="exactly one of 'model'"):
        main(["train", "--config", str(tmp_path / "bad.yaml")])
    (tmp_path / "bad2.yaml").write_text(yaml.safe_dump({"preset": "micro", "training": {"fp16": True}}))
    assert main(["train", "--config", str(tmp_path / "bad2.yaml")]) == 2
    assert "fp16" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--config", str(tmp_path / "missing.yaml")])
