"""Optimizer parity, streaming counts, device peak, saving, and bad input."""
import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from megatrain_nb.engine import EngineConfig, StreamingEngine

from megatrain_nb.model_configs import FAMILY_VOCAB as VOCAB, family_config


def _data(steps, batch=2, seq=12):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(1, VOCAB, (batch, seq), generator=g) for _ in range(steps)]


@pytest.mark.parametrize("family,wd", [("llama", 0.0), ("gpt2", 0.1)])
def test_20_adamw_steps_match_torch_adamw(family, wd):
    model = AutoModelForCausalLM.from_config(family_config(family, tie=family == "gpt2")).eval()
    ref = copy.deepcopy(model)
    from transformers import Trainer

    decay = set(Trainer.get_decay_parameter_names(None, ref))
    groups = [{"params": [p for n, p in ref.named_parameters() if n in decay], "weight_decay": wd},
              {"params": [p for n, p in ref.named_parameters() if n not in decay], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    engine = StreamingEngine(model, EngineConfig(device="cpu", adam_betas=(0.9, 0.95), weight_decay=wd))
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}
    ref_losses, losses = [], []
    for ids in _data(4) * 5:  # 5 epochs of 4 batches, so the loss falls
        out = ref(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(float(out.loss.detach()))
        losses.append(engine.forward_backward(ids).loss)
        engine.optimizer_step(3e-3)
        engine.zero_grad()
    assert losses == pytest.approx(ref_losses, abs=1e-4)
    refp = dict(ref.named_parameters())
    moved = 0.0
    for name, p in engine.named_parameters():
        assert float((p - refp[name].detach()).abs().max()) <= 1e-4, name
        moved = max(moved, float((p - start[name]).abs().max()))
    assert moved > 1e-2  # training really moved the weights
    assert losses[-1] < losses[0]


def test_each_layer_loaded_twice_per_step_at_interval_1():
    model = AutoModelForCausalLM.from_config(family_config("llama", layers=4))
    engine = StreamingEngine(model, EngineConfig(device="cpu", checkpoint_interval=1))
    for ids in _data(3):
        engine.forward_backward(ids)
        engine.optimizer_step(1e-3)
        engine.zero_grad()
    loads = engine.telemetry()["loads_per_unit"]
    layer_loads = {k: v for k, v in loads.items() if "layers" in k}
    assert len(layer_loads) == 4
    assert set(layer_loads.values()) == {2 * 3}
    assert loads["embed"] == 3 and loads["head"] == 3
    pf = engine.telemetry()["prefetch"]["device"]
    assert pf["ahead"] + pf["late"] == sum(loads.values())


def test_device_peak_is_flat_in_depth():
    def peak(layers):
        cfg = AutoConfig.for_model("llama", vocab_size=256, hidden_size=128, intermediate_size=512,
                                   num_hidden_layers=layers, num_attention_heads=4, max_position_embeddings=64)
        engine = StreamingEngine(AutoModelForCausalLM.from_config(cfg), EngineConfig(device="cpu"))
        engine.forward_backward(torch.randint(0, 256, (1, 32)))
        rep = engine.memory_report()["device"]
        engine.close()
        return rep["peak_bytes"]

    p4, p16 = peak(4), peak(16)
    assert p16 <= 1.3 * p4, (p4, p16)


def test_save_pretrained_round_trip(tmp_path):
    model = AutoModelForCausalLM.from_config(family_config("gemma2", tie=True)).eval()
    engine = StreamingEngine(model, EngineConfig(device="cpu"))
    ids = _data(1)[0]
    engine.forward_backward(ids)
    engine.optimizer_step(1e-2)
    engine.save_pretrained(tmp_path / "out")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        ref = loaded(input_ids=ids).logits
    mine = engine.forward_logits(ids)
    torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-5)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]


def test_bf16_precision_keeps_fp32_master_and_tracks_fp32():
    model = AutoModelForCausalLM.from_config(family_config("llama")).eval()
    ref = copy.deepcopy(model)
    ids = _data(1)[0]
    e16 = StreamingEngine(model, EngineConfig(device="cpu", precision="bf16"))
    e32 = StreamingEngine(ref, EngineConfig(device="cpu"))
    o16, o32 = e16.forward_backward(ids), e32.forward_backward(ids)
    assert o16.loss == pytest.approx(o32.loss, rel=2e-2)
    g16 = dict(e16.named_gradients())
    for name, g in e32.named_gradients():
        assert g16[name].dtype == torch.float32
        assert float((g16[name] - g).norm() / (g.norm() + 1e-12)) < 0.1


def test_close_releases_and_refuses_further_use():
    engine = StreamingEngine(AutoModelForCausalLM.from_config(family_config("llama")), EngineConfig(device="cpu"))
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.forward_backward(_data(1)[0])


# ---------------------------------------------------------------------------- bad input
def test_rejects_encoder_only_and_encoder_decoder():
    from transformers import AutoModel, AutoModelForSeq2SeqLM

    bert = AutoModel.from_config(AutoConfig.for_model("bert", vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                                      num_attention_heads=2, intermediate_size=32))
    with pytest.raises(TypeError, match="decoder-only"):
        StreamingEngine(bert, EngineConfig(device="cpu"))
    t5 = AutoModelForSeq2SeqLM.from_config(AutoConfig.for_model("t5", vocab_size=64, d_model=32, d_ff=32,
                                                                num_layers=1, num_heads=2, d_kv=16))
    with pytest.raises(TypeError, match="encoder-decoder"):
        StreamingEngine(t5, EngineConfig(device="cpu"))


def test_vram_budget_below_one_unit_says_how_much():
    model = AutoModelForCausalLM.from_config(family_config("llama"))
    with pytest.raises(ValueError, match=r"max_vram_gb=1e-05 .*at least [0-9.]+"):
        StreamingEngine(model, EngineConfig(device="cpu", max_vram_gb=1e-5))


@pytest.mark.parametrize("kwargs,match", [
    ({"precision": "fp8"}, "precision"),
    ({"optimizer_compression": "zip"}, "optimizer_compression"),
    ({"checkpoint_interval": -1}, "checkpoint_interval"),
    ({"device": "tpu"}, "device"),
])
def test_unknown_option_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_unknown_option_name():
    with pytest.raises(TypeError, match="unknown engine option"):
        StreamingEngine(AutoModelForCausalLM.from_config(family_config("llama")), devcie="cpu")


def test_input_longer_than_positions_and_ids_outside_vocab():
    engine = StreamingEngine(AutoModelForCausalLM.from_config(family_config("llama")), EngineConfig(device="cpu"))
    with pytest.raises(ValueError, match="at most 64 positions"):
        engine.forward_backward(torch.randint(0, VOCAB, (1, 65)))
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        engine.forward_backward(torch.tensor([[1, 2, VOCAB + 3]]))
    # the engine is still usable after refusing input
    assert engine.forward_backward(torch.tensor([[1, 2, 3]])).num_tokens == 2


def test_optimizer_overlapped_with_backward_matches_separate_step():
    model = AutoModelForCausalLM.from_config(family_config("mixtral", tie=True)).eval()
    twin = copy.deepcopy(model)
    a = StreamingEngine(model, EngineConfig(device="cpu", weight_decay=0.05))
    b = StreamingEngine(twin, EngineConfig(device="cpu", weight_decay=0.05, checkpoint_interval=2))
    for i, ids in enumerate(_data(6)):
        la = a.forward_backward(ids).loss
        a.optimizer_step(2e-3)
        a.zero_grad()
        # two micro-batches on b: the second one carries the update
        if i % 2 == 0:
            lb = b.forward_backward(ids).loss
            b.optimizer_step(2e-3)
            b.zero_grad()
        else:
            lb = b.forward_backward(ids, step_lr=2e-3).loss
        assert la == pytest.approx(lb, abs=1e-6)
    pb = dict(b.named_parameters())
    for name, p in a.named_parameters():
        assert float((p - pb[name]).abs().max()) <= 1e-6, name
    assert all(float(g.abs().max()) == 0 for _, g in b.named_gradients())
    assert b.telemetry()["steps"] == 6


def test_meta_model_initialised_in_place_and_from_pretrained(tmp_path):
    cfg = family_config("gemma2", tie=True)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(cfg)
    engine = StreamingEngine(meta, EngineConfig(device="cpu"))
    params = dict(engine.named_parameters())
    assert 0.01 < float(params["model.layers.0.mlp.up_proj.weight"].std()) < 0.03  # the model's own init
    ids = _data(1)[0]
    engine.forward_backward(ids)
    engine.optimizer_step(1e-2)
    engine.save_pretrained(tmp_path / "m")
    again = StreamingEngine.from_pretrained(tmp_path / "m", EngineConfig(device="cpu"))
    torch.testing.assert_close(again.forward_logits(ids), engine.forward_logits(ids))
    with pytest.raises(FileNotFoundError, match="not a local model folder"):
        StreamingEngine.from_pretrained(tmp_path / "nope", EngineConfig(device="cpu"))


def test_interval_0_keeps_activations_loads_once_and_matches_interval_1():
    model = AutoModelForCausalLM.from_config(family_config("phi3", layers=4)).eval()
    twin = copy.deepcopy(model)
    keep = StreamingEngine(model, EngineConfig(device="cpu", checkpoint_interval=0))
    recompute = StreamingEngine(twin, EngineConfig(device="cpu", checkpoint_interval=1))
    for ids in _data(3):
        a = keep.forward_backward(ids, step_lr=1e-3).loss
        b = recompute.forward_backward(ids, step_lr=1e-3).loss
        assert a == pytest.approx(b, abs=1e-6)
    loads = keep.telemetry()["loads_per_unit"]
    assert {v for k, v in loads.items() if "layers" in k} == {3}
    pb = dict(recompute.named_parameters())
    for name, p in keep.named_parameters():
        assert float((p - pb[name]).abs().max()) <= 1e-6, name
