"""The planner and the estimator know the sequence (issue 35 item 3): the device working set as a
function of the row's length and the MLP's tile, a long row's boundary activations placed on the
device, in host RAM or on the disk tier by the plan, impossible lengths refused with the numbers."""
import copy
import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from megatrain_nb.engine import EngineConfig, StreamingEngine
from megatrain_nb.engine.planning.planner import GiB, LayerDims, ModelShape, UnitSpec, Workload, make_plan

from .families import VOCAB, family_config, packed_rows, tiny_model, worst_rel

H, I, N = 256, 1024, 8   # hidden, intermediate, layers of the paper model below
UNITS = ([UnitSpec("embed", 1000 * H, "embed")] + [UnitSpec(f"layers.{i}", 12 * H * H, "layer") for i in range(N)]
         + [UnitSpec("head", 1000 * H, "head")])
SHAPE = ModelShape(hidden_size=H, num_layers=N, intermediate_size=I, vocab_size=1000)


def _plan(seq, vram_gb=1.0, host_gb=None, disk=False, **overrides):
    cfg = EngineConfig(max_vram_gb=vram_gb, max_host_gb=host_gb, checkpoint_interval=1,
                       offload_dir="/nonexistent" if disk else None, overrides=overrides)
    return make_plan(UNITS, SHAPE, cfg, cuda=False, workload=Workload(seq=seq))


def test_a_long_rows_boundary_activations_go_to_host_then_disk_by_the_plan():
    short, long_ = _plan(1024), _plan(65536)
    assert short.feasible and "activations" not in short.placement
    boundary = N * 65536 * H * 4   # every layer's input (checkpoint interval 1), fp32
    assert long_.feasible and long_.placement["activations"] == "host"
    assert long_.host["activations"] == boundary and long_.device["total"] <= 1.0 * GiB
    # the device figures are the same plan's less the boundaries
    on_device, off = _plan(65536, vram_gb=None, tile_tokens=512), _plan(65536, tile_tokens=512)
    assert on_device.device["activations"] - off.device["activations"] == boundary
    # a host budget that cannot hold them: the disk tier
    tight = _plan(65536, host_gb=0.5, disk=True)
    assert tight.placement["activations"] == "disk" and tight.disk["activations"] == boundary
    assert "activations" not in tight.host
    # nowhere: the host check refuses with the host's numbers
    none = _plan(65536, host_gb=0.5)
    assert not none.feasible and none.limiting_tier == "host"


def test_an_impossible_length_is_refused_with_the_numbers_and_the_longest_that_fits():
    plan = _plan(1 << 20)
    assert not plan.feasible and plan.limiting_tier == "device"
    z = plan.longest_seq
    assert 0 < z < 1 << 20
    assert _plan(z).feasible and not _plan(z + 1).feasible          # computed, not guessed
    assert f"{1 << 20:,} tokens need" in plan.reason and f"tiles of {plan.tile_tokens:,} tokens" in plan.reason
    assert "max_vram_gb allows 1.00 GiB" in plan.reason and f"the longest sequence that fits is {z:,}" in plan.reason
    # the figure in the message is the device working set without the boundaries that may leave it
    need = float(plan.reason.split(" tokens need ")[1].split(" GiB")[0])
    assert need == pytest.approx((plan.device["total"] - N * (1 << 20) * H * 4) / GiB, abs=0.01)


def test_the_tile_follows_the_budget_and_the_override_pins_it():
    roomy, wider, tight = _plan(65536, vram_gb=64), _plan(65536, vram_gb=3), _plan(65536)
    # tiles only where the row's MLP does not fit (tiling.tile_tokens_for, as the engine runs it):
    # its untiled intermediates (1 GiB here) fit a quarter of 64 GiB, not of 3 GiB nor of 1 GiB
    assert roomy.tile_tokens == 0 and wider.tile_tokens > tight.tile_tokens > 0
    assert _plan(65536, tile_tokens=128).tile_tokens == 128
    untiled = _plan(65536, tile_tokens=0)
    assert untiled.tile_tokens == 0
    assert untiled.longest_seq < tight.longest_seq   # the MLP's intermediates for the whole row
    grows = [_plan(s, vram_gb=None).device["activations"] for s in (16384, 32768, 65536)]
    # linear in the row once it is tiled (and the row's hidden-wide gradients outgrow a tile's MLP ones)
    assert grows[2] - grows[1] == 2 * (grows[1] - grows[0])


def test_estimate_gives_per_tier_bytes_and_the_tile_at_131072_tokens():
    import megatrain_nb as mt
    cfg = AutoConfig.for_model("llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                               num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)
    est = mt.estimate(cfg, seq=131072, vram_gb=80, ram_gb=1024, disk_gb=4096, precision="fp32")
    d = est.to_dict()
    assert d["feasible"] and d["placement"]["activations"] == "host"
    assert d["tiers"]["host"]["activations"] == 32 * 131072 * 4096 * 4
    assert d["tiers"]["device"]["total"] <= 80 * GiB and d["tile_tokens"] > 0
    assert d["longest_seq"] > 131072
    text = str(est)
    assert f"tiles of {d['tile_tokens']:,} tokens" in text and "wait in host RAM" in text
    small = AutoConfig.for_model("llama", hidden_size=1024, intermediate_size=4096, num_hidden_layers=4,
                                 num_attention_heads=8, vocab_size=32000)
    too_long = mt.estimate(small, seq=4 << 20, vram_gb=8, ram_gb=None, disk_gb=None, precision="bf16")
    assert not too_long.feasible and f"the longest sequence that fits is {too_long.plan.longest_seq:,}" in str(too_long)


def test_engine_puts_a_long_packed_rows_boundaries_in_host_ram_and_matches_hf():
    """SFT packing at a moderate length with small tiles, under a device budget that holds the
    layer's work but not the boundary activations: they wait in host RAM (the planner's
    boundary_tier), and the loss and every gradient equal Hugging Face autograd's."""
    cfg = family_config("llama", layers=4, hidden=64)
    cfg.max_position_embeddings = 1024
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    seq = 1024
    ids, pos, labels, loss, ref = packed_rows(model, [(300, 212, 400, 112)], seq)
    probe = StreamingEngine(copy.deepcopy(model), EngineConfig(device="cpu", overrides={"tile_tokens": 64}))
    plan = probe.plan
    probe.close()
    inter = cfg.intermediate_size
    work = seq * 12 * 64 * 4 + 64 * 4 * inter * 4
    boundary = math.ceil(4 / plan.checkpoint_interval) * seq * 64 * 4
    vram = plan.device["weights"] + plan.device["grads"] + work + boundary // 2
    engine = StreamingEngine(copy.deepcopy(model), EngineConfig(device="cpu", max_vram_gb=vram / GiB,
                                                                 overrides={"tile_tokens": 64}))
    got = engine.forward_backward(ids, labels=labels, position_ids=pos)
    assert engine.last_window_plan.tier == "host" and engine.steps.boundary_peak["host"] > 0
    assert engine.runner.tiling.tiled_calls > 0
    assert got.loss == pytest.approx(loss, rel=1e-5)
    assert worst_rel(dict(engine.named_gradients()), ref) <= 1e-4
    engine.close()


def test_the_step_record_and_the_dashboard_header_name_the_tile():
    """A step whose rows ran in tiles records the tile; the dashboard's header shows it beside tok/s."""
    from types import SimpleNamespace

    from megatrain_nb.notebook.run_log import RunLog
    from megatrain_nb.notebook.summary_html import header_html
    from megatrain_nb.trainer.run import tiled_this_step

    cfg = family_config("llama", layers=2)
    cfg.max_position_embeddings = 128
    engine = StreamingEngine(AutoModelForCausalLM.from_config(cfg), EngineConfig(device="cpu",
                                                                                 overrides={"tile_tokens": 32}))
    engine.forward_backward(torch.randint(1, VOCAB, (1, 16)))       # shorter than a tile: untiled
    tile, calls = tiled_this_step(engine, 0)
    assert tile == 0
    engine.forward_backward(torch.randint(1, VOCAB, (1, 96)))
    assert tiled_this_step(engine, calls)[0] == 32
    engine.close()
    log = RunLog()
    session = SimpleNamespace(state="running", total_steps=4, name="long", requested_lr=None, error_traceback=None,
                              run_log=log)
    log.add_record({"step": 1, "loss": 2.0, "lr": 1e-3, "tokens_per_s": 1234.0, "step_time_s": 1.0,
                    "tile_tokens": 0})
    assert "tiles" not in header_html(session, log.view()) and "1,234 tok/s" in header_html(session, log.view())
    log.add_record({"step": 2, "loss": 2.0, "lr": 1e-3, "tokens_per_s": 1234.0, "step_time_s": 1.0,
                    "tile_tokens": 32})
    assert "MLP tiles of 32 tokens" in header_html(session, log.view())


@pytest.mark.parametrize("family", ["llama", "qwen2_moe"])
def test_long_packed_rows_attend_per_document_without_a_mask_and_match_hf(family, monkeypatch):
    """Packed rows above PACKED_TOKENS: SDPA per document (no [seq, seq] mask), in small tiles,
    two rows of different document layouts; the loss and every gradient equal HF's masked SDPA."""
    from transformers import masking_utils

    from megatrain_nb.engine.compute import packed_attention

    monkeypatch.setattr(packed_attention, "PACKED_TOKENS", 128)
    model = tiny_model(family, 512)
    assert model.config._attn_implementation == "sdpa"
    ids, pos, labels, loss, ref = packed_rows(model, [(90, 70, 96), (200, 56)], 256)
    built, split = [], []
    real, find = masking_utils.sdpa_mask, packed_attention._documents
    monkeypatch.setattr(masking_utils, "sdpa_mask", lambda *a, **k: built.append(1) or real(*a, **k))
    monkeypatch.setattr(packed_attention, "_documents", lambda p: split.append(find(p)) or split[-1])
    engine = StreamingEngine(copy.deepcopy(model), EngineConfig(device="cpu", overrides={"tile_tokens": 32}))
    got = engine.forward_backward(ids, labels=labels, position_ids=pos)
    assert engine.model.config._attn_implementation == packed_attention.NAME and not built
    assert split and split[0] == [[(0, 90), (90, 160), (160, 256)], [(0, 200), (200, 256)]]
    assert engine.runner.tiling.tiled_calls > 0
    assert got.loss == pytest.approx(loss, rel=1e-5)
    assert worst_rel(dict(engine.named_gradients()), ref) <= 1e-4
    engine.close()
    fresh = StreamingEngine(copy.deepcopy(model), EngineConfig(device="cpu"))   # evaluation switches too
    assert fresh.evaluate(ids, labels=labels, position_ids=pos).loss == pytest.approx(loss, rel=1e-5)
    assert fresh.model.config._attn_implementation == packed_attention.NAME
    fresh.close()


def test_sliding_window_models_keep_their_masks_with_packed_rows(monkeypatch):
    from megatrain_nb.engine.compute import packed_attention
    from megatrain_nb.engine.inputs import PackedRows

    monkeypatch.setattr(packed_attention, "PACKED_TOKENS", 8)
    cfg = family_config("mistral", layers=2)
    cfg.sliding_window = 16
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    ids = torch.ones(1, 32, dtype=torch.long)
    assert packed_attention.packed_attention(model, [(ids, PackedRows(torch.arange(32)[None]), ids)]) is None
    assert model.config._attn_implementation == "sdpa"
    llama = AutoModelForCausalLM.from_config(family_config("llama", layers=2), attn_implementation="sdpa")
    assert packed_attention.packed_attention(llama, [(ids, None, ids)]) is None    # not packed: as it is
    assert packed_attention.packed_attention(llama, [(ids, PackedRows(torch.arange(32)[None]), ids)])
    assert llama.config._attn_implementation == packed_attention.NAME
    q = torch.zeros(1, 4, 32, 8)
    with pytest.raises(RuntimeError, match="does not hand position_ids"):   # documents unknown: said, not guessed
        packed_attention.docs_attention_forward(llama.model.layers[0].self_attn, q, q, q, None)


def test_the_engine_refuses_a_row_longer_than_its_device_budget_holds():
    cfg = family_config("llama", layers=2)
    cfg.max_position_embeddings = 1024
    model = AutoModelForCausalLM.from_config(cfg)
    probe = StreamingEngine(copy.deepcopy(model), EngineConfig(device="cpu"))
    fixed = probe.plan.device["weights"] + probe.plan.device["grads"]
    probe.close()
    engine = StreamingEngine(model, EngineConfig(device="cpu", max_vram_gb=(fixed + (1 << 20)) / GiB,
                                                 overrides={"tile_tokens": 32}))
    z = engine.plan.longest_seq
    assert 32 < z < 1024
    with pytest.raises(ValueError, match=f"a micro-batch of {z + 1:,} tokens does not fit .* longest that fits is "
                                         f"{z:,} tokens") as refused:
        engine.forward_backward(torch.randint(1, VOCAB, (1, z + 1)))
    # the working set a token it quotes is the planner's layer count (planner.LayerDims), not a rule of thumb
    per_token = LayerDims.of(cfg).work_bytes(z + 1, 32, 4) / (z + 1) / 1024
    assert f"about {per_token:.1f} KiB per token (its MLP in tiles of 32 tokens" in str(refused.value)
    assert engine.forward_backward(torch.randint(1, VOCAB, (1, z))).num_tokens == z - 1
    engine.close()
