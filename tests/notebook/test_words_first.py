"""Words before networks (issue 46 item 6): a preset's typo is answered with "did you mean" and
the presets before any Hub request; ``mt.estimate``'s unknown keyword gets the name it has there;
an estimate on a machine without a GPU says which device budget it assumed."""
import pytest
import torch

import megatrain_nb as mt
from megatrain_nb import hub, model_source
from megatrain_nb.hub import ModelNotFoundError
from megatrain_nb.model_configs import preset_names


@pytest.fixture
def no_network(monkeypatch):
    """Any Hub request fails the test (and HF_HUB_OFFLINE is unset: one would be made)."""
    asked = []

    def download(name, **kw):
        asked.append(name)
        raise AssertionError(f"a Hub request for {name!r} was made")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(hub, "_download", download)
    return asked


@pytest.mark.parametrize("typo, meant", [("tinyy", "tiny"), ("Tiny", "tiny"), ("llama7b", "llama-7b"),
                                         ("lama-7b", "llama-7b"), ("smal", "small")])
def test_a_preset_typo_gets_did_you_mean_before_any_hub_request(no_network, typo, meant):
    with pytest.raises(ModelNotFoundError) as e:
        mt.Session(typo)
    text = str(e.value)
    assert text.startswith(f"model={typo!r} is not a preset: did you mean {meant!r}? The presets: ")
    assert ", ".join(preset_names()) in text and "Hub" not in text.split("?")[0]
    assert no_network == []


def test_the_estimator_and_the_resolver_say_the_same_without_the_hub(no_network):
    with pytest.raises(ValueError, match=r"model='tinyy' is not a preset: did you mean 'tiny'\?"):
        mt.estimate("tinyy", vram_gb=80)
    with pytest.raises(ModelNotFoundError, match="did you mean 'micro'"):
        model_source.resolve("micr0")
    assert no_network == []


def test_names_far_from_every_preset_still_go_to_the_hub(no_network):
    for name in ("gpt2", "org/tinyy"):   # a Hub id (an organisation's "tinyy" too) is asked for
        with pytest.raises(AssertionError, match="a Hub request"):
            model_source.resolve(name)
    assert no_network == ["gpt2", "org/tinyy"]


@pytest.mark.parametrize("kw, meant", [("vram", "vram_gb"), ("max_vram_gb", "vram_gb"), ("ram", "ram_gb"),
                                       ("seq_len", "seq"), ("batchh", "batch")])
def test_an_unknown_estimate_keyword_gets_its_name_here(kw, meant):
    with pytest.raises(TypeError) as e:
        mt.estimate("micro", **{kw: 80})
    assert str(e.value).startswith(f"mt.estimate() got an unknown keyword {kw}=80: did you mean {meant}=80? "
                                   "It takes vram_gb, ram_gb, disk_gb, batch, seq, ")


def test_a_gpu_less_estimate_says_which_device_budget_it_assumed(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    est = mt.estimate("micro", ram_gb=64, disk_gb=1000)
    assert est.budgets["device"] == 80 * 1024 ** 3
    line = ("device budget: 80 GiB assumed (vram_gb's default): this machine has no GPU; pass vram_gb= the "
            "memory of the GPU you will train on")
    assert est.notes[0] == line and line in str(est)
    given = mt.estimate("micro", vram_gb=80, ram_gb=64, disk_gb=1000)   # said by the caller: not repeated
    assert not any("assumed" in n for n in given.notes)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)   # a GPU here: nothing assumed to say
    assert not any("assumed" in n for n in mt.estimate("micro", ram_gb=64, disk_gb=1000).notes)
