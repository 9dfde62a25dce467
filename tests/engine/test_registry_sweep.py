"""Every causal LM transformers registers (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES of the installed
version), built tiny from its own defaults (megatrain_nb/tiny_configs.py), against Hugging
Face autograd: loss and every parameter's gradient at checkpoint intervals 1 and 2 and as a
layer-major window of two micro-batches (megatrain_nb/sweep/check.py).

Each entry must come out supported, refused with a stated reason, not a decoder stack, or not
built by transformers itself (the reason recorded); entries known to fail are listed in
KNOWN_FAILING with why, so a new failure -- or a fix -- shows. The whole registry is slow; ten
representative architectures run in the fast set.
"""
import pytest

from megatrain_nb.sweep.check import FAILING, REFUSED, SUPPORTED, check, registry

#: Ten representative architectures (dense, GQA, MoE, MLA, hybrid linear attention, state
#: space, sliding window + softcapping, learned positions, encoder as decoder, tuple layers).
FAST = ["llama", "gpt2", "mixtral", "deepseek_v3", "qwen3_next", "mamba2", "gemma2", "bamba", "bert",
        "gpt_neo"]

#: Entries the engine gets wrong today, each with the reason (docs/MODELS.md lists them too).
KNOWN_FAILING: dict = {}

#: What each structural case of the model's forward exercises (fast; beside FAST):
#: layer arguments that need gradients -- the embedding output handed to every layer (zamba2),
#: per-layer embeddings (gemma4_text), a position bias from weights after the layer list (cpmant);
#: integer outputs passed to the next layer (hy_v4's reused top-k indices).
STRUCTURAL = ["zamba2", "gemma4_text", "cpmant", "hy_v4"]

#: Slower cases: a float output passed to the next layer, with gradients (zaya's router
#: states); key/value states one layer stores for another in a shared argument
#: (gemma3n_text); refused with its reason: layers called inside a custom autograd function
#: (reformer's reversible layers).
STRUCTURAL_SLOW = {"zaya": SUPPORTED, "gemma3n_text": SUPPORTED, "reformer": REFUSED}

ALL = list(registry())


def _assert_result(r):
    assert r.status != "crash"
    if r.model_type in KNOWN_FAILING:
        assert r.status == FAILING, f"{r.model_type} now {r.status}: update KNOWN_FAILING"
        return
    assert r.status != FAILING, f"{r.model_type}: {r.reason}"
    if r.status == SUPPORTED:
        assert r.modes and set(r.modes.values()) == {"ok"}
    else:
        assert r.reason, f"{r.model_type}: {r.status} without a reason"
    if r.status == REFUSED:
        assert "not supported" in r.reason or "supports" in r.reason


@pytest.mark.parametrize("model_type", FAST)
def test_representative_architecture_matches_hf(model_type):
    r = check(model_type)
    assert r.status == SUPPORTED, r.reason
    assert r.layers is not None and 2 <= r.layers <= 4


@pytest.mark.parametrize("model_type", STRUCTURAL)
def test_structural_case_matches_hf(model_type):
    r = check(model_type)
    assert r.status == SUPPORTED, r.reason


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(STRUCTURAL_SLOW))
def test_slow_structural_case(model_type):
    r = check(model_type)
    assert r.status == STRUCTURAL_SLOW[model_type], r.reason
    if r.status == REFUSED:
        assert "gradients off" in r.reason


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ALL)
def test_registry_entry_supported_or_refused_with_reason(model_type):
    _assert_result(check(model_type))


def test_check_detects_a_wrong_gradient(monkeypatch):
    """The comparison can fail: a reference from other inputs differs."""
    import megatrain_nb.sweep.check as chk

    real = chk.reference
    monkeypatch.setattr(chk, "reference", lambda model, batches: real(model, [b.flip(1) for b in batches]))
    r = chk.check("llama", modes=("interval 1",))
    assert r.status == FAILING and ("loss" in r.reason or "gradient" in r.reason)


def test_tiny_config_keeps_one_layer_of_each_kind():
    from megatrain_nb.tiny_configs import tiny_config

    cfg = tiny_config("qwen3_next")   # 3 linear-attention layers, then a full one, repeated
    assert cfg.num_hidden_layers == 2 and sorted(set(cfg.layer_types)) == ["full_attention", "linear_attention"]
    assert cfg.hidden_size == 32 and cfg.vocab_size == 128 and cfg.num_experts == 4


def test_models_table_is_generated_from_the_shipped_results():
    """docs/MODELS.md is what scripts/models_table.py writes from megatrain_nb/data/models.json."""
    import os

    from megatrain_nb.sweep import table

    stored = table.load()
    assert stored["results"], "no shipped sweep results"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "docs", "MODELS.md")) as f:
        assert f.read() == table.markdown(stored["results"], stored["transformers"])
    statuses = {r["status"] for r in stored["results"]}
    assert statuses <= {"supported", "refused", "not a decoder stack", "not built"} | (
        {"failing"} if KNOWN_FAILING else set())


def test_cli_models_prints_the_table(capsys):
    from megatrain_nb.cli import main

    assert main(["models"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("llama "))
    assert "supported" in line
    assert "decoder-only" in out and "% " not in out.splitlines()[0]


def test_cli_models_check_runs_here(capsys):
    from megatrain_nb.cli import main

    assert main(["models", "--check", "gpt2"]) == 0
    out = capsys.readouterr().out
    assert any(x.startswith("gpt2 ") and "supported" in x for x in out.splitlines())


def test_frozen_parameter_is_left_as_it_is():
    """requires_grad=False (here the input embedding): zero gradient, no decay, unchanged by steps,
    while the other parameters train."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    from megatrain_nb.engine import EngineConfig, StreamingEngine

    from megatrain_nb.model_configs import FAMILY_VOCAB as VOCAB, family_config

    model = AutoModelForCausalLM.from_config(family_config("llama")).eval()
    model.model.embed_tokens.weight.requires_grad_(False)
    before = copy.deepcopy(dict(model.named_parameters()))
    engine = StreamingEngine(model, EngineConfig(device="cpu", weight_decay=0.1))
    ids = torch.randint(1, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        engine.forward_backward(ids, step_lr=1e-2)
    after = dict(engine.named_parameters())
    assert torch.equal(after["model.embed_tokens.weight"], before["model.embed_tokens.weight"])
    assert not torch.equal(after["lm_head.weight"], before["lm_head.weight"])
    engine.close()
