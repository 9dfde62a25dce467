"""Sequence tiling of a layer's MLP (engine/compute/tiling.py): exact against Hugging Face autograd and
against the untiled engine; modules that cannot be tiled are said, not guessed."""
import copy

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from megatrain_nb.engine import EngineConfig, StreamingEngine
from megatrain_nb.engine.compute import tiling
from megatrain_nb.engine.compute.tiling import LayerTiling, auto_tile_tokens

from .families import FAMILIES, VOCAB, family_config, packed_rows, tiny_model, worst_rel


_model = tiny_model


def _ids(seq: int, batch: int = 1):
    return torch.randint(1, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(3))


def _hf(model, ids):
    ref = copy.deepcopy(model)
    out = ref(input_ids=ids, labels=ids)
    out.loss.backward()
    return float(out.loss.detach()), {n: p.grad for n, p in ref.named_parameters()}


def _engine_grads(model, ids, **cfg):
    engine = StreamingEngine(copy.deepcopy(model), EngineConfig(device="cpu", **cfg))
    out = engine.forward_backward(ids)
    grads = {n: g.clone() for n, g in engine.named_gradients()}
    report = engine.runner.tiling.report()
    calls = engine.runner.tiling.tiled_calls
    engine.close()
    return out.loss, grads, calls, report


_worst = worst_rel


@pytest.mark.parametrize("family,seq,k", [pytest.param("llama", 2048, 1, marks=pytest.mark.slow),
                                          ("llama", 512, 1), ("mixtral", 512, 2), ("qwen2_moe", 384, 1),
                                          ("mistral", 512, 1), ("gemma2", 384, 0)])
def test_tiled_layers_match_hf(family, seq, k):
    """Dense, mixture-of-experts and sliding-window families, tiles forced small (not dividing
    the sequence): the loss and every gradient are Hugging Face's, and the MLP did run tiled."""
    model = _model(family, seq)
    ids = _ids(seq)
    ref_loss, ref_grads = _hf(model, ids)
    loss, grads, calls, _ = _engine_grads(model, ids, checkpoint_interval=k, overrides={"tile_tokens": 100})
    assert calls > 0
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert _worst(grads, ref_grads) <= 1e-4


def test_tiled_gradients_equal_untiled_and_the_check_fails_on_a_wrong_tile(monkeypatch):
    """Per tensor, the tiled engine's gradients are the untiled engine's; a tiling that got one
    tile's weight gradient wrong is caught by the same comparison."""
    model = _model("llama", 300)
    ids = _ids(150, batch=2)   # two rows: tiles run over the flattened tokens
    _, untiled, calls0, _ = _engine_grads(model, ids, overrides={"tile_tokens": 0})
    _, tiled, calls, _ = _engine_grads(model, ids, overrides={"tile_tokens": 64})
    assert calls0 == 0 and calls > 0
    assert _worst(tiled, untiled) <= 1e-4

    real = tiling._Tiled.backward

    def dropping_last_tile(ctx, g):
        g = g.clone()
        g.reshape(-1, g.shape[-1])[64:65] = 0   # the second tile's first token's gradient lost
        return real(ctx, g)
    monkeypatch.setattr(tiling._Tiled, "backward", staticmethod(dropping_last_tile))
    _, broken, _, _ = _engine_grads(model, ids, overrides={"tile_tokens": 64})
    assert _worst(broken, untiled) > 1e-4


def test_tiled_function_against_autograd_directly():
    """The autograd Function alone: a [batch, seq, hidden] MLP input, weights as leaves."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(16, 48), nn.GELU(), nn.Linear(48, 16))
    x = torch.randn(2, 37, 16, requires_grad=True)
    g = torch.randn(2, 37, 16)
    ref = torch.autograd.grad(mlp(x), [x, *mlp.parameters()], g)
    params = list(mlp.parameters())
    out = tiling._Tiled.apply(mlp.forward, tiling._rebinder(mlp), 10, x, *params)
    assert torch.allclose(out, mlp(x), atol=1e-6)
    got = torch.autograd.grad(out, [x, *params], g)
    for a, b in zip(got, ref):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


class _SequenceCentred(nn.Module):
    """An MLP whose output for a token depends on the others (the sequence mean taken out)."""

    def __init__(self, mlp):
        super().__init__()
        self.inner = mlp

    def forward(self, x):
        return self.inner(x - x.mean(dim=-2, keepdim=True))


def test_a_module_that_mixes_tokens_is_said_untiled_and_stays_exact():
    model = _model("llama", 256)
    for layer in model.model.layers:
        layer.mlp = _SequenceCentred(layer.mlp)
    ids = _ids(256)
    ref_loss, ref_grads = _hf(model, ids)
    engine = StreamingEngine(copy.deepcopy(model), EngineConfig(device="cpu", overrides={"tile_tokens": 50}))
    out = engine.forward_backward(ids)
    report = engine.runner.tiling.report()
    assert out.loss == pytest.approx(ref_loss, rel=1e-5)
    assert _worst(dict(engine.named_gradients()), ref_grads) <= 1e-4
    assert report["tiled"] == []
    assert any("depends on other tokens" in r for r in report["untiled"].values()), report
    engine.close()


def test_dropout_while_training_and_router_logits_are_not_tiled():
    cfg = family_config("gpt2", layers=1)
    cfg.resid_pdrop = 0.1
    model = AutoModelForCausalLM.from_config(cfg).train()
    t = LayerTiling(model, list(model.transformer.h), tile_tokens=4)
    layer = model.transformer.h[0]
    with t.active(layer, torch.zeros(1, 16, cfg.n_embd)):
        assert "forward" not in layer.mlp.__dict__
    assert "dropout" in next(iter(t.report()["untiled"].values()))
    moe = _model("mixtral", 64, output_router_logits=True)
    t = LayerTiling(moe, list(moe.model.layers), tile_tokens=4)
    with t.active(moe.model.layers[0], torch.zeros(1, 16, 32)):
        pass
    assert "router logits" in next(iter(t.report()["untiled"].values()))


def test_short_sequences_run_untiled_and_the_tile_follows_the_budget():
    cfg = family_config("llama")
    cfg.intermediate_size = 4096
    assert auto_tile_tokens(cfg, 4) == 1024                       # 64 MiB of fp32 intermediates
    assert auto_tile_tokens(cfg, 2) == 2048
    assert auto_tile_tokens(cfg, 4, budget_bytes=1 << 30) == 512   # a 32nd of 1 GiB
    model = _model("llama", 64)
    t = LayerTiling(model, list(model.model.layers), tile_tokens=64)
    layer = model.model.layers[0]
    with t.active(layer, torch.zeros(1, 64, 32)):
        assert "forward" not in layer.mlp.__dict__
    with t.active(layer, torch.zeros(1, 65, 32)):
        assert "forward" in layer.mlp.__dict__
    assert "forward" not in layer.mlp.__dict__


def test_tile_tokens_override_is_validated():
    with pytest.raises(ValueError, match="tile_tokens"):
        EngineConfig(device="cpu", overrides={"tile_tokens": -1})
    assert EngineConfig.from_options(device="cpu", tile_tokens=0).overrides.tile_tokens == 0


def test_eager_attention_at_a_long_length_is_switched_to_sdpa_with_a_note(monkeypatch):
    from megatrain_nb.engine.compute import long_attention
    monkeypatch.setattr(long_attention, "EAGER_TOKENS", 64)
    cfg = family_config("llama", layers=2)
    cfg.max_position_embeddings = 96
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    ids = _ids(96)
    ref_loss, ref_grads = _hf(model, ids)   # eager, as configured
    engine = StreamingEngine(model, EngineConfig(device="cpu"))
    with pytest.warns(UserWarning, match="switched the model to attn_implementation='sdpa'"):
        out = engine.forward_backward(ids)
    assert model.config._attn_implementation == "sdpa"
    assert out.loss == pytest.approx(ref_loss, rel=1e-5)
    assert _worst(dict(engine.named_gradients()), ref_grads) <= 1e-4
    engine.close()


def test_soft_capped_eager_attention_is_left_eager_with_the_bytes_said(monkeypatch):
    from megatrain_nb.engine.compute import long_attention
    monkeypatch.setattr(long_attention, "EAGER_TOKENS", 64)
    model = _model("gemma2", 96)
    model.config._attn_implementation = "eager"
    with pytest.warns(UserWarning, match=r"left eager because its attention logits are soft-capped"):
        note = long_attention.long_attention(model, 1, 96)
    assert "GiB of attention scores per layer" in note
    assert model.config._attn_implementation == "eager"
    assert long_attention.long_attention(model, 1, 96) is None   # said once


def test_run_header_names_the_tile():
    import io
    from types import SimpleNamespace

    from megatrain_nb.cli.report import print_header
    engine = StreamingEngine(_model("llama", 64), EngineConfig(device="cpu", overrides={"tile_tokens": 512}))
    trainer = SimpleNamespace(engine=engine, args=SimpleNamespace(output_dir="out", max_steps=3, num_train_epochs=1),
                              total_steps=3, metrics_log=SimpleNamespace(path="m.jsonl"))
    buf = io.StringIO()
    print_header(trainer, model="tiny", data="ids", out=buf)
    engine.close()
    assert "tiles:  a layer's MLP runs rows longer than 512 tokens in tiles of 512 tokens" in buf.getvalue()


@pytest.mark.parametrize("family", FAMILIES)
def test_every_tested_family_tiles_exactly_with_tiny_tiles(family):
    """The engine's test families, two padded rows of 40 tokens, tiles of 7 tokens: Hugging
    Face's loss and gradients; every family's MLP is tiled (none said untileable)."""
    model = _model(family, 64)
    ids = _ids(40, batch=2)
    am = torch.ones_like(ids)
    am[1, 30:] = 0
    ref = copy.deepcopy(model)
    out = ref(input_ids=ids, attention_mask=am, labels=ids.masked_fill(am == 0, -100))
    out.loss.backward()
    engine = StreamingEngine(copy.deepcopy(model), EngineConfig(device="cpu", overrides={"tile_tokens": 7}))
    got = engine.forward_backward(ids, attention_mask=am)
    report = engine.runner.tiling.report()
    assert got.loss == pytest.approx(float(out.loss.detach()), rel=1e-5)
    assert _worst(dict(engine.named_gradients()), {n: p.grad for n, p in ref.named_parameters()}) <= 1e-4
    assert report["tiled"] and not report["untiled"], report
    engine.close()


def test_planner_counts_one_tile_of_the_mlp():
    from megatrain_nb.engine.planning.planner import activation_bytes
    from megatrain_nb.engine.compute.tiling import tile_for
    kw = dict(hidden_size=64, intermediate_size=4096, num_layers=2, vocab_size=256, batch=1, seq=16384,
              checkpoint_interval=1, compute_bytes=4)
    whole, tiled = activation_bytes(**kw), activation_bytes(**kw, tile_tokens=1024)
    # the MLP's 4 saved intermediates and the 2 gradients in flight (LayerDims.work_bytes), for a tile
    assert whole - tiled == (16384 - 1024) * (4 + 2) * 4096 * 4
    assert activation_bytes(**kw, tile_tokens=0) == whole
    assert tile_for(4096, 4) == 1024 and tile_for(4096, 4, pinned=0) == 0


def test_estimate_llama3_8b_shape_at_131072_tokens_fits_an_80_gb_device():
    """On paper (issue 35): bf16 compute, the MLP counted for one tile."""
    import megatrain_nb as mt
    cfg = AutoConfig.for_model("llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                               num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                               max_position_embeddings=131072)
    est = mt.estimate(cfg, seq=131072, vram_gb=80, ram_gb=1024, precision="bf16").to_dict()
    assert est["feasible"]
    assert est["tiers"]["device"]["total"] < 80 * 2**30


def test_tile_width_from_per_layer_or_missing_sizes():
    from types import SimpleNamespace
    assert tiling._width(SimpleNamespace(hidden_size=64, intermediate_size=[128, 4096])) == 4096
    assert tiling._width(SimpleNamespace(hidden_size=64)) == 256
    assert tiling._width(SimpleNamespace(hidden_size=64, intermediate_size=128, moe_intermediate_size=96,
                                         num_experts_per_tok=2, shared_expert_intermediate_size=64)) == 256


def test_packed_rows_with_per_document_positions_tile_exactly():
    """SFT packing: three documents in one row, positions restarting per document, no mask."""
    model = _model("llama", 256)
    ids, pos, labels, loss, ref = packed_rows(model, [(90, 70, 96)], 256)
    engine = StreamingEngine(copy.deepcopy(model), EngineConfig(device="cpu", overrides={"tile_tokens": 40}))
    got = engine.forward_backward(ids, labels=labels, position_ids=pos)
    assert engine.runner.tiling.tiled_calls > 0
    assert got.loss == pytest.approx(loss, rel=1e-5)
    assert worst_rel(dict(engine.named_gradients()), ref) <= 1e-4
    engine.close()


def test_a_functional_dropout_rate_while_training_is_not_tiled():
    model = _model("llama", 64).train()
    layer = model.model.layers[0]
    layer.mlp.hidden_dropout = 0.1   # as MLPs that call F.dropout(x, p=self.hidden_dropout) keep it
    t = LayerTiling(model, list(model.model.layers), tile_tokens=4)
    with t.active(layer, torch.zeros(1, 16, 32)):
        assert "forward" not in layer.mlp.__dict__
    assert "hidden_dropout=0.1" in t.report()["untiled"]["LlamaDecoderLayer.mlp (LlamaMLP)"]


def test_packed_attention_finds_the_documents_once_per_batch_not_per_layer_call(monkeypatch):
    """Issue 45 item 5: per-document attention reads the position ids on the host once per batch
    (a host sync on a GPU), not in every layer's call: counted with a mock, over a model of four
    layers, checkpoint interval 1 (every layer called again in the backward); gradients as HF's."""
    from megatrain_nb.engine.compute import packed_attention as pa

    monkeypatch.setattr(pa, "PACKED_TOKENS", 64)
    model = _model("llama", 256)
    model.config._attn_implementation = "sdpa"
    ids, pos, labels, loss, ref = packed_rows(model, [(90, 70, 96)], 256)
    calls, real = [], pa._documents
    monkeypatch.setattr(pa, "_documents", lambda p: calls.append(tuple(p.shape)) or real(p))
    layer_calls, real_fwd = [], pa.docs_attention_forward

    def counting(*a, **kw):
        layer_calls.append(1)
        return real_fwd(*a, **kw)
    monkeypatch.setattr(pa, "docs_attention_forward", counting)
    monkeypatch.setattr(pa, "_registered", False)
    engine = StreamingEngine(copy.deepcopy(model), EngineConfig(device="cpu", checkpoint_interval=1,
                                                                overrides={"tile_tokens": 0}))
    got = engine.forward_backward(ids, labels=labels, position_ids=pos)
    assert engine.model_config._attn_implementation == pa.NAME
    assert len(layer_calls) >= 2 * model.config.num_hidden_layers and calls == [(1, 256)]
    assert got.loss == pytest.approx(loss, rel=1e-5)
    assert worst_rel(dict(engine.named_gradients()), ref) <= 1e-4
    engine.close()
    from transformers import AttentionInterface

    AttentionInterface.register(pa.NAME, real_fwd)   # the real function back for later tests


def test_tiles_only_where_the_layer_does_not_fit_the_device(monkeypatch):
    """Issue 45 item 3: an automatic tile only where the call's untiled MLP intermediates exceed a
    quarter of the device budget; on CUDA without a budget, of the device's memory (a 32B's MLP
    at 64K tokens fits an 80 GiB GPU untiled, at 128K it does not); a pinned tile always tiles."""
    from types import SimpleNamespace

    qwen32 = SimpleNamespace(hidden_size=5120, intermediate_size=27648)
    gib = 2 ** 30
    assert not tiling.needs_tiles(27648, 65536, 2, 80 * gib) and tiling.needs_tiles(27648, 131072, 2, 80 * gib)
    assert tiling.tile_tokens_for(27648, 65536, 2, 80 * gib) == 0
    assert tiling.tile_tokens_for(27648, 131072, 2, 80 * gib) == auto_tile_tokens(qwen32, 2, 80 * gib)
    assert tiling.tile_tokens_for(27648, 4096, 2, 80 * gib, pinned=256) == 256
    assert tiling.needs_tiles(64, 10, 4, None)   # a CPU device without a budget: as before
    model = _model("llama", 64)
    layer = model.model.layers[0]
    width = tiling._width(model.config)
    monkeypatch.setattr(tiling, "_cuda_memory", lambda: 4 * (4 * width * 4 * 300))   # a quarter: 300 tokens
    monkeypatch.setattr(tiling, "auto_tile_tokens", lambda *a: 64)
    t = LayerTiling(model, list(model.model.layers), tile_tokens=None, elem_bytes=4)
    assert t.budget == 16 * width * 4 * 300 and t.tile == 64
    with t.active(layer, torch.zeros(1, 300, 32)):
        assert "forward" not in layer.mlp.__dict__   # fits: untiled, though longer than a tile
    with t.active(layer, torch.zeros(1, 301, 32)):
        assert "forward" in layer.mlp.__dict__
    pinned = LayerTiling(model, list(model.model.layers), tile_tokens=64)
    with pinned.active(layer, torch.zeros(1, 65, 32)):
        assert "forward" in layer.mlp.__dict__


@pytest.mark.parametrize("precision,straight", [("fp32", True), ("bf16", False)])
def test_tiles_add_straight_into_the_fp32_gradient_sum(monkeypatch, precision, straight):
    """fp32 compute: each tile's weight gradients go straight into the unit's fp32 sum (the bound
    parameters' .grad views); bf16: summed in fp32, rounded once. Either way the untiled engine's
    gradients (fp32: <= 1e-4; bf16: its own round-off)."""
    used = []
    real = tiling._sink
    monkeypatch.setattr(tiling, "_sink", lambda o: used.append(real(o) is not None) or real(o))
    model = _model("llama", 300)
    ids = _ids(150, batch=2)
    _, untiled, _, _ = _engine_grads(model, ids, precision=precision, overrides={"tile_tokens": 0})
    _, tiled, calls, _ = _engine_grads(model, ids, precision=precision, overrides={"tile_tokens": 64})
    assert calls > 0 and used and all(u == straight for u in used)
    assert _worst(tiled, untiled) <= (1e-4 if precision == "fp32" else 2e-2)


def test_a_frozen_weights_tiles_are_not_added_straight_in():
    """A frozen weight (requires_grad=False in the model: its bound tensor's hook makes its
    gradient zero) keeps a zero gradient when its MLP runs in tiles, though the other weights'
    tiles go straight into the fp32 sum."""
    model = _model("llama", 300)
    frozen = "model.layers.0.mlp.up_proj.weight"
    model.get_parameter(frozen).requires_grad_(False)
    ids = _ids(150, batch=2)
    _, untiled, _, _ = _engine_grads(model, ids, overrides={"tile_tokens": 0})
    _, tiled, calls, _ = _engine_grads(model, ids, overrides={"tile_tokens": 64})
    assert calls > 0 and _worst(tiled, untiled) <= 1e-4
    assert not tiled[frozen].any() and not untiled[frozen].any()
    assert tiled["model.layers.0.mlp.down_proj.weight"].abs().sum() > 0
