"""megatrain_nb.model_source.resolve: one order of checks and one set of refusal words for every
entry point (Trainer, engine, Session, launcher, CLI, estimator); model_configs: one registry."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from megatrain_nb.hub import ModelNotFoundError
from megatrain_nb.model_configs import FAMILIES, PRESETS, check_preset, family_config, preset_config, tiny
from megatrain_nb.model_source import resolve


@pytest.fixture
def folder(tmp_path):
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(preset_config("micro")).save_pretrained(tmp_path / "m")
    return tmp_path / "m"


def test_each_kind_of_source(folder, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve(str(folder)).kind == "folder" and resolve(folder).need_folder() == str(folder)
    assert resolve(str(folder / "config.json")).kind == "file"
    assert resolve("micro").kind == "preset" and resolve("micro").config().hidden_size == 64
    cfg = preset_config("micro")
    assert resolve(cfg).kind == "config" and resolve(cfg).config() is cfg
    model = AutoModelForCausalLM.from_config(cfg)
    assert resolve(model).kind == "object" and resolve(model).config() is model.config
    # a path relative to a base folder (run.yaml's model:) wins over a preset of the same name
    (folder.parent / "micro").mkdir()
    assert resolve("micro", base=folder.parent).kind == "folder"
    assert resolve("m", base=folder.parent).folder == str(folder)


def test_refusals_name_the_value_and_what_to_pass(folder, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match=r"model='tiny' is a preset: mt.Trainer takes a model folder"):
        resolve("tiny").need_folder("mt.Trainer")
    with pytest.raises(FileNotFoundError, match="not a local model folder .no config.json."):
        resolve(tmp_path).need_folder()
    with pytest.raises(ModelNotFoundError, match="or a preset: micro, tiny"):
        resolve("org/absent")
    with pytest.raises(ValueError, match="neither a preset .* nor an existing model folder"):
        resolve("org/absent", hub=False)   # the estimator never downloads
    with pytest.raises(ValueError, match="revision='v2' was given with the local folder"):
        resolve(str(folder), revision="v2")
    with pytest.raises(ValueError, match="revision='v2' applies to a model given by name"):
        resolve(preset_config("micro"), revision="v2")
    with pytest.raises(ValueError, match="'big' is not a preset; use one of micro"):
        check_preset("big")


def test_one_registry_of_configs():
    assert set(PRESETS) >= {"micro", "tiny", "llama-100b"}
    assert tiny("micro").to_dict() == preset_config("micro").to_dict()
    for family in FAMILIES:
        assert tiny(family).to_dict() == family_config(family).to_dict()
    assert tiny("qwen3").num_hidden_layers <= 4   # any registered model type, shrunk
    with pytest.raises(KeyError, match="no tiny config"):
        family_config("bert")


def test_the_entry_points_refuse_in_the_same_words(tmp_path, monkeypatch):
    from transformers import TrainingArguments

    import megatrain_nb as mt
    from megatrain_nb.cli.config import UsageError, model_source
    from megatrain_nb.engine import StreamingEngine

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none")
    with pytest.raises(ValueError, match=r"model='micro' is a preset: mt.Trainer takes a model folder"):
        mt.Trainer(model="micro", args=args, device="cpu")
    with pytest.raises(ValueError, match=r"model='micro' is a preset: StreamingEngine.from_pretrained takes"):
        StreamingEngine.from_pretrained("micro")
    with pytest.raises(FileNotFoundError, match="not a local model folder .no config.json."):
        StreamingEngine.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="neither a preset .* nor an existing model folder"):
        mt.estimate("org/absent")
    with pytest.raises(UsageError, match="'micro' is a preset; write preset: micro"):
        model_source({"model": "micro"}, tmp_path)
    with pytest.raises(ModelNotFoundError, match="or a preset: micro"):
        model_source({"model": "org/absent"}, tmp_path)
