"""The image-text-to-text half of the registry sweep (megatrain_nb/sweep/vision.py): each family the
engine takes, built tiny, against Hugging Face autograd (loss and every gradient, vision tower and
projector included, at checkpoint intervals 1 and 2 and as a window of two); every other family
refused by the engine by name, or not a decoder stack, or not built, with the reason; the table
(docs/MODELS.md, `megatrain-nb models`) lists them beside the causal LMs."""
import pytest

from megatrain_nb.engine.vision import VISION_FAMILIES
from megatrain_nb.sweep import table
from megatrain_nb.sweep.check import FAILING, NOT_BUILT, NOT_DECODER, REFUSED, SUPPORTED
from megatrain_nb.sweep.vision import VISION_KIND, check_vision, sweep_all, vision_registry


@pytest.mark.slow
@pytest.mark.parametrize("family", VISION_FAMILIES)
def test_each_family_the_engine_takes_matches_hf(family):
    r = check_vision(family)
    assert r.kind == VISION_KIND and r.architecture == vision_registry()[family]
    assert r.status == SUPPORTED, r.reason
    assert r.modes == {"interval 1": "ok", "interval 2": "ok", "window of 2": "ok"}


@pytest.mark.slow
def test_the_check_can_fail(monkeypatch):
    """A reference from other pictures differs: the sweep says failing, naming the loss or a gradient."""
    import megatrain_nb.sweep.vision as v

    real = v.vlm_reference
    monkeypatch.setattr(v, "vlm_reference", lambda model, batches: real(
        model, [dict(b, pixel_values=b["pixel_values"].flip(0)) for b in batches]))
    r = check_vision("qwen2_vl", modes=("interval 1",))
    assert r.status == FAILING and ("loss" in r.reason or "gradient of model.visual" in r.reason), r.reason


@pytest.mark.parametrize("family,status,words", [
    ("paligemma", REFUSED, r"PaliGemmaForConditionalGeneration \(model_type 'paligemma'\) is a vision-language "
                           r"family the streaming engine does not support yet: its gradients are not checked"),
    ("fuyu", REFUSED, r"registers FuyuForCausalLM as a causal LM too: the engine trains it as one"),
    ("blip", NOT_DECODER, r"BlipForConditionalGeneration is not a decoder stack"),
    ("chameleon", NOT_BUILT, r"transformers cannot build it from its own default config")])
def test_other_families_are_said_with_their_reason(family, status, words):
    import re

    r = check_vision(family)
    assert r.status == status and re.search(words, r.reason), r.reason


def test_unknown_model_types_are_refused_by_name():
    with pytest.raises(ValueError, match=r"\['no_such_model'\] are in neither registry"):
        sweep_all(["llama", "no_such_model"])


def test_the_shipped_table_lists_every_image_text_family():
    stored = table.load()
    vision = {r["model_type"]: r for r in stored["results"] if r["kind"] == VISION_KIND}
    assert set(vision) == set(vision_registry())
    assert {t for t, r in vision.items() if r["status"] == SUPPORTED} == set(VISION_FAMILIES)
    assert all(r["reason"] for r in vision.values() if r["status"] != SUPPORTED)
    assert FAILING not in {r["status"] for r in vision.values()}
    md = table.markdown(stored["results"], stored["transformers"])
    head, _, rest = md.partition("## Image-text-to-text models")
    assert "| `qwen2_vl` | Qwen2VLForConditionalGeneration | image-text-to-text | supported |  |" in rest
    assert "| image-text-to-text |" not in head   # the causal table holds none
    assert f"image-text-to-text: {len(vision)} ({len(VISION_FAMILIES)} supported, " in head   # the summary


def test_cli_models_lists_the_image_text_families(capsys):
    from megatrain_nb.cli import main

    assert main(["models"]) == 0
    out = capsys.readouterr().out
    causal, _, vision = out.partition("image-text-to-text models of transformers")
    assert any(x.startswith("llama ") and "supported" in x for x in causal.splitlines())
    assert any(x.startswith("qwen2_vl ") and "supported" in x for x in vision.splitlines())
    assert any(x.startswith("paligemma ") and "refused" in x for x in vision.splitlines())


def test_cli_models_check_runs_both_registries(capsys):
    from megatrain_nb.cli import main

    assert main(["models", "--check", "paligemma", "gpt2"]) == 0
    out = capsys.readouterr().out
    causal, _, vision = out.partition("image-text-to-text models of transformers")
    assert any(x.startswith("gpt2 ") and "supported" in x for x in causal.splitlines())
    assert any(x.startswith("paligemma ") and "refused" in x for x in vision.splitlines())
