"""EngineConfig.lr_scale: a learning rate per part (engine/vision.py ``lr_scale_names``, the
layout's runs in engine/units.py ``Unit.lr_segments``, one fused AdamW call per run in
updates/optimizer.py), against torch.optim.AdamW with the same parameter groups: a vision
tower at lr x 0.1 beside the rest at lr, a plain LLM's prefixes, and a checkpoint resume."""
import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, Trainer

from megatrain_nb.engine import EngineConfig, StreamingEngine
from megatrain_nb.engine.vision import lr_scale_names
from megatrain_nb.model_configs import FAMILY_VOCAB as VOCAB, family_config
from tests.engine.test_vlm import _batch, _model

LR, WD, BETAS = 3e-3, 0.1, (0.9, 0.95)


def _groups(model, scales):
    """torch.optim.AdamW over ``model`` with a parameter group per (weight decay, scale)."""
    decay = set(Trainer.get_decay_parameter_names(None, model))
    groups = {}
    for n, p in model.named_parameters():
        key = (n in decay, scales.get(n, 1.0))
        groups.setdefault(key, []).append(p)
    return torch.optim.AdamW([{"params": ps, "weight_decay": WD if d else 0.0, "lr": LR * s}
                              for (d, s), ps in groups.items()], lr=LR, betas=BETAS, eps=1e-8)


def _train_both(engine, ref, opt, batches):
    for batch in batches:
        out = ref(**batch)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        assert engine.forward_backward(batch).loss == pytest.approx(float(out.loss), rel=1e-5)
        engine.optimizer_step(LR)
        engine.zero_grad()


def _max_err(engine, ref) -> float:
    mine = dict(engine.named_parameters())
    return max(float((mine[n] - p).abs().max()) / max(1.0, float(p.abs().max())) for n, p in ref.named_parameters())


def _llm_batches(steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (2, 12), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


def test_a_vision_tower_at_a_tenth_of_the_rate_matches_torch_param_groups():
    """Qwen2-VL, weight decay on, three steps on two batches: the tower at lr x 0.1 in the embed
    unit beside the token embedding and the merger at lr, equal to torch's four groups to round-off;
    the same run without the scale is far from them (the test can tell the scale was applied)."""
    model = _model("qwen2_vl")
    scales = lr_scale_names(model, {"vision_tower": 0.1})
    assert scales and all(".visual." in n and ".merger." not in n for n in scales)
    ref, plain = copy.deepcopy(model), copy.deepcopy(model)
    opt = _groups(ref, scales)
    engine = StreamingEngine(model, EngineConfig(device="cpu", adam_betas=BETAS, weight_decay=WD,
                                                 lr_scale={"vision_tower": 0.1}))
    embed = engine.units[0]
    tower = sum(p.numel for p in embed.params if p.name in scales)
    assert sum(e - s for s, e, c in embed.lr_segments) == tower and {c for *_, c in embed.lr_segments} == {0.1}
    assert all(u.lr_segments == () for u in engine.units[1:])
    batches = [_batch("qwen2_vl", seed=s % 2) for s in range(3)]
    _train_both(engine, ref, opt, batches)
    assert _max_err(engine, ref) <= 1e-5
    unscaled = StreamingEngine(plain, EngineConfig(device="cpu", adam_betas=BETAS, weight_decay=WD))
    for batch in batches:
        unscaled.forward_backward(batch)
        unscaled.optimizer_step(LR)
        unscaled.zero_grad()
    assert _max_err(unscaled, ref) > 1e-3
    engine.close()
    unscaled.close()


def test_a_plain_llm_scaled_by_prefix_matches_torch_param_groups():
    """Llama: the token embedding at lr x 0.1, layer 1 at lr x 3 (its decayed matrices and
    undecayed norms one run, split by AdamW where decay stops), layer 0's attention at lr x 2
    beside its MLP frozen (the frozen tail after the runs): against torch's groups, four steps."""
    model = AutoModelForCausalLM.from_config(family_config("llama", layers=2))
    entries = {"model.embed_tokens": 0.1, "model.layers.1": 3.0, "model.layers.0.self_attn": 2.0}
    scales = lr_scale_names(model, entries)
    ref = copy.deepcopy(model)
    for n, p in ref.named_parameters():
        p.requires_grad_(".layers.0.mlp." not in n)
    opt = _groups(ref, scales)
    engine = StreamingEngine(model, EngineConfig(device="cpu", adam_betas=BETAS, weight_decay=WD, lr_scale=entries,
                                                 frozen=("model.layers.0.mlp",)))
    layer0, layer1 = engine.units[1], engine.units[2]
    assert [(s, e) for s, e, _ in layer1.lr_segments] == [(0, layer1.numel)]
    attn = sum(p.numel for p in layer0.params if ".self_attn." in p.name)
    assert [(e - s, c) for s, e, c in layer0.lr_segments] == [(attn, 2.0)] and layer0.train_numel < layer0.numel
    _train_both(engine, ref, opt, _llm_batches(4))
    assert _max_err(engine, ref) <= 1e-5
    engine.close()


def test_a_checkpoint_resume_keeps_the_scale(tmp_path):
    """Two steps, a checkpoint, a fresh engine with the same lr_scale loads it and takes two
    more: equal to torch's four steps with the groups. Loaded under another lr_scale (or none),
    the moments (ordered by scale) are refused at the first update, by name."""
    model = AutoModelForCausalLM.from_config(family_config("llama", layers=2))
    entries = {"model.embed_tokens": 0.1}
    scales = lr_scale_names(model, entries)
    ref, twin = copy.deepcopy(model), copy.deepcopy(model)
    opt = _groups(ref, scales)
    config = dict(device="cpu", adam_betas=BETAS, weight_decay=WD, lr_scale=entries)
    batches = _llm_batches(4, seed=3)
    a = StreamingEngine(model, EngineConfig(**config))
    _train_both(a, ref, opt, batches[:2])
    a.save_checkpoint(tmp_path / "ck")
    a.close()
    b = StreamingEngine(twin, EngineConfig(**config))
    b.load_checkpoint(tmp_path / "ck")
    _train_both(b, ref, opt, batches[2:])
    assert _max_err(b, ref) <= 1e-5
    b.close()
    for other in ({"model.embed_tokens": 0.5}, None):   # moments laid out for other scales: refused
        c = StreamingEngine(AutoModelForCausalLM.from_config(family_config("llama", layers=2)),
                            EngineConfig(**{**config, "lr_scale": other}))
        c.load_checkpoint(tmp_path / "ck")
        c.forward_backward(batches[0]["input_ids"])
        with pytest.raises(ValueError, match="another EngineConfig.lr_scale"):
            c.optimizer_step(LR)
        c.close()


def test_bad_entries_are_refused_and_compressed_states_take_the_scales():
    model = _model("qwen2_vl")
    with pytest.raises(ValueError, match=r"lr_scale entry 'model.vision'.*vision_tower, projector, language_model"):
        StreamingEngine(copy.deepcopy(model), EngineConfig(device="cpu", lr_scale={"model.vision": 0.1}))
    for bad in ({"vision_tower": 0.0}, {"vision_tower": -1.0}, {"": 0.5}, ["vision_tower"]):
        with pytest.raises(ValueError, match="EngineConfig.lr_scale"):
            EngineConfig(lr_scale=bad)
    for codec in ("int8", "auto"):   # no longer refused: the fused kernel steps each group at its rate
        e = StreamingEngine(copy.deepcopy(model), EngineConfig(device="cpu", optimizer_compression=codec,
                                                               lr_scale={"vision_tower": 0.1}))
        assert {c for *_, c in e.units[0].lr_segments} == {0.1}
        e.close()
