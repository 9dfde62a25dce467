"""megatrain-nb: demo (the main job), train --config, estimate."""
import json

import pytest
import yaml

from megatrain_nb.cli import main
from tests.test_hub import hub  # noqa: F401 - the offline hub-cache fixture


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


def test_estimate_prints_the_100b_comparison(capsys):
    assert main(["estimate", "llama-100b", "--vram", "80", "--ram", "1024", "--disk", "4096"]) == 0
    out = capsys.readouterr().out
    assert "GPU-resident fp32 AdamW" in out and "≈401 GB" in out and "≈1.60 TB" in out
    assert "feasible: yes" in out and "optimizer states -> disk" in out
    assert main(["estimate", "llama-100b", "--ram", "16", "--disk", "4096", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["feasible"] is False and d["limiting_tier"] == "host"


def test_estimate_bad_model_is_one_clear_line(capsys):
    assert main(["estimate", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert "no-such-model" in err and "preset" in err and "Traceback" not in err


BIG = "1" + "0" * 400


@pytest.mark.parametrize("flag,value", [("--batch", BIG), ("--seq", BIG), ("--nodes", BIG), ("--pairs", BIG),
                                        ("--gpus-per-node", BIG), ("--accumulation", str(10 ** 18)),
                                        ("--vram", "1e300"), ("--ram", "nan"), ("--disk", "-1"), ("--batch", "abc")])
def test_every_estimate_number_goes_through_the_values_table(capsys, flag, value):
    with pytest.raises(SystemExit) as e:
        main(["estimate", "tiny", flag, value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}:" in err and "must be" in err and "Traceback" not in err and "Overflow" not in err, err


def test_a_huge_accumulation_within_the_table_returns_at_once(capsys):
    """The window's group search bisects (a linear one never returned for 10**18); a window of
    2**40 micro-batches is priced from a few groups, not listed load by load."""
    import megatrain_nb as mt
    from megatrain_nb.engine.planning.planner import window_plan

    wp = window_plan(10 ** 18, tokens=2048, hidden_size=4096, num_layers=32, checkpoint_interval=1,
                     compute_bytes=4, device_free=80 << 30, host_free=1 << 40, disk_free=0)
    assert wp.groups * wp.group_size >= 10 ** 18 and 1 < wp.group_size < 10 ** 18
    est = mt.estimate("tiny", accumulation=2 ** 40, ram_gb=64, disk_gb=1000, rates="h100-pcie5-gen4nvme")
    assert est.plan.window["groups"] > 10 ** 6 and est.prediction.step_seconds > 0
    assert main(["estimate", "tiny", "--accumulation", str(2 ** 40), "--nodes", "2", "--ram", "64"]) == 0


def test_a_slow_machines_estimate_never_says_zero_tokens_per_second(monkeypatch, capsys):
    """``--profile here`` on a CPU for a 100B model: a fraction of a token a second, said as one."""
    from megatrain_nb import estimate_words
    from tests.engine.test_prediction import rates

    monkeypatch.setattr(estimate_words, "profile_rates", lambda name: rates(matmul_flops=4e10, attention_flops=2e10))
    assert main(["estimate", "llama-100b", "--ram", "1024", "--disk", "4096", "--profile", "here"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("time:"))
    assert "(0 tokens/s)" not in line and "tokens/s" in line, line
    assert float(line.split("(")[1].split(" tokens/s")[0]) > 0, line


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
    # the disk tier really carries bytes (issue 25: the default host cache held it all, the disk got 0 B)
    last = [r for r in records if r.get("telemetry")][-1]
    assert last["telemetry"]["bytes"]["host_to_disk"] > 0 and last["telemetry"]["bytes"]["disk_to_host"] > 0
    assert last["telemetry"]["disk_cache"]["disk_read_bytes"] > 0
    assert any(r.get("memory", {}).get("disk", {}).get("optimizer_states") for r in records)
    summary = out[out.index("== summary =="):]
    disk_line = next(x for x in summary.splitlines() if x.startswith("disk   peak"))
    assert "disk   peak 0 B" not in disk_line and "optimizer_states" in disk_line
    assert "host cache of the disk tier:" in summary and "reached the disk:" in summary
    host_line = next(x for x in summary.splitlines() if x.startswith("host   peak"))
    assert "optimizer_states" in host_line   # the cached half counted as what it is
    assert "disk tier: " + str(out_dir / "offload") + " on " in out and " free of " in out


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


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith("megatrain-nb train: error: "), err
    return err


@pytest.mark.parametrize("cfg,text", [
    ({"model": "m", "preset": "tiny"}, "exactly one of 'model'"),
    ({"preset": "micro", "training": {"fp16": True}}, "fp16"),
    ({"preset": "micro", "training": {"no_such_field": 1}}, "no_such_field"),
    ({"preset": "micro", "training": {"learning_rte": 1e-4}}, "training.learning_rte (did you mean 'learning_rate'?)"),
    ({"preset": "micro", "training": {"per_device_train_batch_size": 0}}, "training.per_device_train_batch_size=0"),
    ({"preset": "micro", "training": {"gradient_accumulation_steps": -1}}, "training.gradient_accumulation_steps=-1"),
    # named before any data is read (the train file does not even exist)
    ({"preset": "micro", "training": {"learning_rate": -1}, "data": {"train": "missing.jsonl"}},
     "training.learning_rate=-1: must be a finite number > 0"),
    ({"preset": "nope"}, "'nope' is not a preset; use one of micro"),
    ({"preset": "micro", "colour": 1}, "unknown section(s) ['colour']"),
    ({"preset": "micro", "data": {"train": "missing.jsonl"}}, r"data.train: file\(s\) not found: .*missing.jsonl"),
    ({"preset": "micro", "data": {"trian": "x"}}, "unknown data field(s) ['trian']"),
    ({"preset": "micro", "data": {"seq_len": "long"}}, "data.seq_len='long': must be a whole number >= 2"),
    ({"preset": "micro", "engine": "cpu"}, "'engine' must be a mapping"),
    ({"model": "./no/such/folder"}, "not a local model folder"),
    ({"preset": "micro", "training": {"max_steps": 1}, "data": {"train": "t.jsonl"}},
     r"data.train: .*use files of one kind"),
])
def test_every_train_input_error_exits_2_with_one_line(tmp_path, capsys, cfg, text):
    import re

    (tmp_path / "t.jsonl").write_text("{}\n")
    if cfg.get("data", {}).get("train") == "t.jsonl":
        (tmp_path / "t.jsonl").rename(tmp_path / "t.weird")
        cfg["data"]["train"] = ["t.weird"]
        (tmp_path / "t.weird").write_text("x")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["train", "--config", str(tmp_path / "run.yaml"), "--output-dir", str(tmp_path / "o")]) == 2
    line = _error_line(capsys)
    assert (re.search(text, line) if ".*" in text else text in line), (text, line)


def test_train_file_errors_exit_2(tmp_path, capsys):
    assert main(["train", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml: no such file (see examples/run.yaml" in _error_line(capsys)
    (tmp_path / "cfgdir").mkdir()
    (tmp_path / "cfgdir" / "run.yaml").write_text("preset: micro\n")
    assert main(["train", "--config", str(tmp_path / "cfgdir")]) == 2
    line = _error_line(capsys)
    assert "cfgdir: is a directory, not a config file" in line and "run.yaml" in line, line
    (tmp_path / "broken.yaml").write_text("preset: [tiny\n")
    assert main(["train", "--config", str(tmp_path / "broken.yaml")]) == 2
    assert "not valid YAML" in _error_line(capsys)
    with pytest.raises(SystemExit) as e:  # argparse's own usage errors: status 2, same prefix
        main(["train"])
    assert e.value.code == 2
    assert "megatrain-nb train: error: the following arguments are required: --config" in capsys.readouterr().err


def test_config_help_points_at_the_example_that_exists(capsys):
    from pathlib import Path

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "examples/run.yaml" in out and "docs/TRAINING.md" in out
    page = Path(__file__).resolve().parent.parent / "docs" / "TRAINING.md"
    assert "\n## run.yaml\n" in page.read_text()
    example = Path(__file__).resolve().parent.parent / "examples" / "run.yaml"
    assert example.is_file()


def test_the_example_run_yaml_is_complete_and_runs(tmp_path, monkeypatch, shared_cache, capsys):
    """Every field examples/run.yaml sets (or shows commented out) is one train reads, and it runs."""
    import dataclasses
    from pathlib import Path

    from transformers import TrainingArguments

    from megatrain_nb.cli import load_run_config
    from megatrain_nb.engine import EngineConfig

    example = Path(__file__).resolve().parent.parent / "examples" / "run.yaml"
    cfg = load_run_config(example)
    text = example.read_text()
    for key in ("model:", "revision:", "tokenizer:", "eval:"):
        assert f"# {key}" in text, key  # the alternatives are shown
    engine_fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert set(cfg["engine"]) <= engine_fields
    assert set(cfg["training"]) <= {f.name for f in dataclasses.fields(TrainingArguments)}
    monkeypatch.setenv("MEGATRAIN_NB_CACHE", str(shared_cache))
    run = tmp_path / "examples"
    run.mkdir()
    (run / "run.yaml").write_text(text.replace("seq_len: 128", "seq_len: 32"))
    assert main(["train", "--config", str(run / "run.yaml"), "--max-steps", "2"]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "megatrain_runs" / "example" / "model.safetensors").is_file()
    header = out[:out.index("== summary ==")]
    for label in ("model:  preset tiny", "data:   train built-in corpus", "device: cpu", "tiers:  ",
                  "optimizer states in disk (" + str(tmp_path / "megatrain_runs" / "example" / "offload"),
                  "codec:  optimizer states int8"):
        assert label in header, label
    # issue 25: where the disk tier is and how much is free; what the cache held and what reached the disk
    disk = next(x for x in header.splitlines() if x.startswith("disk:   "))
    assert str(tmp_path / "megatrain_runs" / "example" / "offload") in disk
    assert "mounted at" in disk and "free of" in disk and "room for the whole tier" in disk
    assert "host cache of the disk tier:" in out[out.index("== summary =="):]


def test_train_a_hub_id_from_the_offline_cache(tmp_path, hub, capsys):
    from tests.trainer.helpers import token_rows

    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in token_rows(8, seq=8)))
    cfg = {"model": "org/micro", "revision": "v2", "data": {"train": "train.jsonl", "seq_len": 8},
           "training": {"output_dir": "run", "max_steps": 2, "per_device_train_batch_size": 2},
           "engine": {"device": "cpu"}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["train", "--config", str(tmp_path / "run.yaml")]) == 0
    out = capsys.readouterr().out
    assert "model:  org/micro (Hugging Face Hub, revision v2; " + str(hub) in out
    assert "steps 2" in out
    cfg["model"] = "org/absent"
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["train", "--config", str(tmp_path / "run.yaml")]) == 2
    assert "org/absent" in _error_line(capsys)


def test_progress_labels_and_streaming_wording():
    from megatrain_nb.cli import _tier_text, streaming_text

    mem = {t: {"used_bytes": 3 << 20} for t in ("device", "host", "disk")}
    assert _tier_text(mem) == "device 3.0M host 3.0M disk 3.0M"
    line = streaming_text({"prefetch": {"device": {"ahead": 30, "late": 0}},
                           "stall_seconds": {"device": 26.0, "disk": 0.0, "optimizer": 1.5}})
    assert line == ("100% of 30 weight loads issued ahead of need; time spent waiting: for weights to reach "
                    "the device 26.00 s, for optimizer updates 1.50 s")
    assert "hit rate" not in line
    assert streaming_text({"prefetch": {"device": {"ahead": 0, "late": 0}}, "stall_seconds": {"device": 0.0}}) \
        == "no time spent waiting"
    # a forward's wait for its pending updates is in the "device" wait (it waits for their weights):
    # it is named the updates', with the part they waited for the disk tier themselves
    line = streaming_text({"stall_seconds": {"device": 3.0, "disk": 0.5}, "optimizer_exposed_seconds": 2.0,
                           "optimizer_exposed_disk_seconds": 1.25})
    assert line == ("time spent waiting: for weights to reach the device 1.00 s, for disk reads 0.50 s, "
                    "for optimizer updates 2.00 s (1.25 s of it theirs for the disk)")


def test_demo_again_into_the_same_folder_is_a_new_run(tmp_path, monkeypatch, shared_cache, capsys):
    from megatrain_nb.trainer import list_checkpoints

    monkeypatch.setenv("MEGATRAIN_NB_CACHE", str(shared_cache))
    out_dir = tmp_path / "demo"
    assert main(["demo", "--quick", "--steps", "4", "--output-dir", str(out_dir)]) == 0
    capsys.readouterr()
    assert main(["demo", "--steps", "2", "--seq-len", "32", "--output-dir", str(out_dir)]) == 0
    out = capsys.readouterr().out
    offered = [line for line in out.splitlines() if "checkpoints (resume" in line]
    assert offered and "checkpoint-2" in offered[0] and "checkpoint-4" not in offered[0]
    assert [c.name for c in list_checkpoints(out_dir)] == ["checkpoint-1", "checkpoint-2"]  # save_total_limit 2
    starts = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines() if "run_start" in x]
    assert len(starts) == 2 and starts[0]["run_id"] != starts[1]["run_id"]
    sample = [line for line in out.splitlines() if line.startswith("sample from this ")]
    assert sample and "M-parameter model after 2 steps" in sample[0] and "as expected" in sample[0]


# ------------------------------------------------------------------ issue 25: counts, version, presets
@pytest.mark.parametrize("argv,text", [
    (["demo", "--steps", "0"], "argument --steps: takes a whole number >= 1, not '0'"),
    (["demo", "--steps", "-3"], "argument --steps: takes a whole number >= 1, not '-3'"),
    (["demo", "--quick", "--steps", "0"], "argument --steps"),
    (["demo", "--seq-len", "0"], "argument --seq-len"),
    (["demo", "--batch-size", "-1"], "argument --batch-size"),
    (["train", "--config", "run.yaml", "--max-steps", "0"], "--max-steps='0': must be a whole number >= 1"),
    (["train", "--config", "run.yaml", "--max-steps", "-2"], "or -1 (optimizer steps to train; -1 = num_train_epochs decides)"),
])
def test_zero_and_negative_counts_are_refused(argv, text, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert text in capsys.readouterr().err


def test_max_steps_zero_in_the_config_is_refused(tmp_path, capsys):
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({"preset": "micro", "training": {"max_steps": 0}}))
    assert main(["train", "--config", str(tmp_path / "run.yaml"), "--output-dir", str(tmp_path / "o")]) == 2
    assert "training.max_steps=0: must be a whole number >= 1 and <= 2**63-1, or -1" in _error_line(capsys)


def test_max_steps_minus_one_says_it_trains_by_epochs(tmp_path, capsys):
    from tests.trainer.helpers import micro_model, token_rows

    micro_model().save_pretrained(tmp_path / "model")
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in token_rows(8)))
    cfg = {"model": "model", "data": {"train": "train.jsonl"},
           "training": {"output_dir": "run", "max_steps": 5, "num_train_epochs": 1, "per_device_train_batch_size": 2,
                        "save_strategy": "no"},
           "engine": {"device": "cpu"}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["train", "--config", str(tmp_path / "run.yaml"), "--max-steps", "-1"]) == 0
    out = capsys.readouterr().out
    assert ("steps:  max_steps -1 means no step limit: num_train_epochs 1 epochs give 4 optimizer steps" in out), out
    assert "steps 4 in" in out


def test_version_and_every_preset_in_estimate_help(capsys):
    from megatrain_nb import __version__
    from megatrain_nb.model_configs import preset_names

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"megatrain-nb {__version__}"
    with pytest.raises(SystemExit):
        main(["estimate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert all(name in text for name in preset_names()) and "micro" in text


def test_the_summary_says_plainly_what_the_host_cache_held_and_what_reached_the_disk():
    from megatrain_nb.cli import cache_text

    whole = {"disk_cache_stats": {"capacity_bytes": 8 << 20, "ram_bytes": 4 << 20, "disk_read_bytes": 0,
                                  "disk_write_bytes": 0, "by_kind": {"optimizer_states": 4 << 20}}}
    assert cache_text(whole) == ("host cache of the disk tier: 4.0 MiB in RAM (optimizer states 4.0 MiB) of its "
                                 "8.0 MiB; nothing reached the disk: the cache held the whole tier")
    part = {"disk_cache_stats": {**whole["disk_cache_stats"], "disk_read_bytes": 3 << 20, "disk_write_bytes": 5 << 20}}
    assert cache_text(part).endswith("reached the disk: 5.0 MiB written, 3.0 MiB read back")
    none = {"disk_cache_stats": {"capacity_bytes": 0, "ram_bytes": 0, "disk_read_bytes": 1, "disk_write_bytes": 1}}
    assert cache_text(none) == "no host cache of the disk tier: every access went to the disk"
    assert cache_text({"weights": 1}) == ""


@pytest.mark.parametrize("text,said", [
    ('{"text": "a"}\n{"text": "b"\n', r"bad.jsonl line 2 is not JSON .*each line must be one JSON object"),
    ('{"text": "a"}\n[1, 2]\n', r"bad.jsonl line 2 is a list, not a JSON object"),
])
def test_an_invalid_jsonl_file_is_one_line_and_exit_2(tmp_path, capsys, text, said):
    """Issue 33 item 6: a DatasetGenerationError traceback with exit 1."""
    import re

    (tmp_path / "bad.jsonl").write_text(text)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({"preset": "micro", "data": {"train": "bad.jsonl"},
                                                      "training": {"max_steps": 1}}))
    assert main(["train", "--config", str(tmp_path / "run.yaml"), "--output-dir", str(tmp_path / "o")]) == 2
    assert re.search(said, _error_line(capsys))


def test_a_preset_trains_on_a_text_jsonl_with_the_built_in_tokenizer(tmp_path, capsys):
    """Issue 33 item 6: refused with "no tokenizer was given" though the README promises the built-in one."""
    rows = [{"text": f"def f{i}(x):\n    return x + {i}\n" * 8} for i in range(24)]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({
        "preset": "micro", "data": {"train": "t.jsonl", "seq_len": 32},
        "training": {"max_steps": 1, "per_device_train_batch_size": 2, "save_strategy": "no"}}))
    assert main(["train", "--config", str(tmp_path / "run.yaml"), "--output-dir", str(tmp_path / "o")]) == 0
    assert "train loss" in capsys.readouterr().out
