"""The streamed decoder's KV cache in host RAM (engine/compute/kv_offload.py): placed there by the
planner's rule (estimator_grpo.place_kv) when the device budget beside the engine's plan does not
hold it and host RAM does; the same completions as the device cache and as transformers'
``generate`` (greedy with rows finishing apart, sampled with the same random stream); each
full-attention layer's K/V crosses twice per pass, the bytes counted exactly; a budget that holds
it nowhere is refused with the numbers; the estimate says where the cache is and prices it."""
import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

import megatrain_nb as mt
from megatrain_nb.assets import chat_tokenizer
from megatrain_nb.engine import StreamingEngine
from megatrain_nb.engine.compute.decode import StreamedDecoder, device_left, kv_place
from megatrain_nb.engine.compute.kv_offload import HostKVCache
from megatrain_nb.engine.compute.sampling import sample_text
from megatrain_nb.engine.planning.estimator_grpo import host_kv_bytes, place_kv
from megatrain_nb.engine.planning.planner import persistent_device_bytes
from megatrain_nb.engine.planning.rates import rates_for
from megatrain_nb.model_configs import family_config, tiny

GIB = 1 << 30
LAYERS = 6
ROWS, PROMPTS, NEW = 8, (6, 4), 10   # 8 rollouts: two prompts of 6 and 4 tokens x 4, 10 new tokens
LENGTH = max(PROMPTS) + NEW


def _config():
    return family_config("llama", layers=LAYERS, max_position_embeddings=128)


def _model():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(_config()).eval()


def _engine(room=None, **options):
    """An engine whose device budget leaves ``room`` bytes beside its plan (None: no budget)."""
    if room is None:
        return StreamingEngine(_model(), device="cpu", **options)
    probe = StreamingEngine(_model(), device="cpu", max_vram_gb=0.001, **options)
    total = persistent_device_bytes(probe.plan)   # (the slots and buffers a budget's plan keeps between steps)
    probe.close()
    engine = StreamingEngine(_model(), device="cpu", max_vram_gb=(total + room) / GIB, **options)
    assert device_left(engine) == pytest.approx(room, abs=2)
    return engine


def _host_room():
    """A device room between the host tier's need and the device tier's (the test's premise)."""
    place = place_kv(_config(), ROWS, LENGTH, 4, 0, None)
    device_need = place.kv_bytes + 3 * ROWS * _config().vocab_size * 4   # the device tier's
    assert place.device_bytes < device_need
    return (place.device_bytes + device_need) // 2


def _rows():
    g = torch.Generator().manual_seed(1)
    distinct = [torch.randint(3, 96, (n,), generator=g).tolist() for n in PROMPTS]
    return [p for p in distinct for _ in range(ROWS // len(PROMPTS))]   # (a group's prompt, prefilled once)


def _generate(ref, rows, gc):
    n = max(map(len, rows))
    ids = torch.tensor([[0] * (n - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (n - len(r)) + [1] * len(r) for r in rows])
    with torch.no_grad():
        return ref.generate(input_ids=ids, attention_mask=mask, generation_config=gc)[:, n:].tolist()


def _cut(c, eos):
    return c[:c.index(eos) + 1] if eos in c else c


def test_the_planner_puts_the_cache_in_host_ram_when_only_host_ram_holds_it():
    cfg = _config()
    kv = place_kv(cfg, ROWS, LENGTH, 4, None, None).kv_bytes
    room = _host_room()
    assert place_kv(cfg, ROWS, LENGTH, 4, 10 ** 9, None).tier == "device"
    host = place_kv(cfg, ROWS, LENGTH, 4, room, 10 ** 9)
    assert host.tier == "host" and host.host_bytes == kv == host_kv_bytes(cfg, ROWS, LENGTH, 4)
    # on the device: the logits and two layers' K/V in flight
    assert host.device_bytes == 3 * ROWS * cfg.vocab_size * 4 + 2 * kv // LAYERS
    assert "in host RAM" in host.why
    none = place_kv(cfg, ROWS, LENGTH, 4, room, kv - 1, split=False)   # host RAM short by a byte
    assert none.tier == "none" and "neither fits" in none.why
    assert place_kv(cfg, ROWS, LENGTH, 4, host.device_bytes - 1, None, split=False).tier == "none"   # the device short
    # with sub-batches: host RAM short, the rows decode in sub-batches that fit the device room
    sub = place_kv(cfg, ROWS, LENGTH, 4, room, kv - 1, group=4)
    assert (sub.tier, sub.batch_rows, sub.batches) == ("device", 4, 2) and "2 sub-batches of <= 4 rows" in sub.why
    assert sub.device_bytes == place_kv(cfg, 4, LENGTH, 4, None, None).device_bytes <= room
    # both fit: the host tier where it moves fewer bytes per token than streaming the weights once per sub-batch
    weights = host.host_bytes // 2   # (the host tier moves the weights and at least half its cache)
    assert place_kv(cfg, ROWS, LENGTH, 4, room, None, weights_bytes=weights + 1, group=4).tier == "host"
    assert place_kv(cfg, ROWS, LENGTH, 4, room, None, weights_bytes=weights, group=4).batches == 2
    small = place_kv(cfg, ROWS, LENGTH, 4, sub.device_bytes - 1, kv - 1, group=4)   # no room for a whole group
    assert (small.tier, small.batch_rows, small.batches) == ("device", 3, 3)
    # a sliding-window layer's K/V stay on the device (gemma2: every other layer slides)
    g = tiny("gemma3_text")
    assert 0 < host_kv_bytes(g, ROWS, LENGTH, 4) < place_kv(g, ROWS, LENGTH, 4, None, None).kv_bytes


@pytest.mark.slow
def test_greedy_tokens_are_the_device_caches_and_generates_with_rows_finishing_apart():
    ref = _model()
    engine, plain = _engine(_host_room()), _engine()
    assert kv_place(engine, ROWS, LENGTH).tier == "host" and kv_place(plain, ROWS, LENGTH).tier == "device"
    rows = _rows()
    free = GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    eos = _generate(ref, rows, free)[0][3]   # an end of sequence that rows reach at different steps
    gc = GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=eos, pad_token_id=0)
    want = [_cut(c, eos) for c in _generate(ref, rows, gc)]
    host = StreamedDecoder(engine).generate(rows, gc)
    device = StreamedDecoder(plain).generate(rows, gc)
    assert host.completions == device.completions == want
    assert len({len(c) for c in want}) > 1   # (the premise: rows left the batch, the host rows reordered)
    assert host.stats["kv_tier"] == "host" and device.stats["kv_tier"] == "device"
    for a, b in zip(host.logps, device.logps):
        assert torch.equal(a, b)
    engine.close()
    plain.close()


def test_sampled_tokens_with_the_same_stream_and_the_bytes_each_pass_moves():
    """Sampling with one generator: the host cache's tokens are the device cache's, and while
    every row decodes, generate's; each pass moves each layer's K/V twice: its cached entries in
    (rows x tokens so far), the new token's entries back (rows x 1; the prefill: the prompts)."""
    ref = _model()
    engine, plain = _engine(_host_room()), _engine()
    rows = _rows()
    gc = GenerationConfig(max_new_tokens=NEW, do_sample=True, temperature=0.8, top_k=20, eos_token_id=None,
                          pad_token_id=0)
    torch.manual_seed(5)
    want = _generate(ref, rows, gc)
    torch.manual_seed(5)
    host = StreamedDecoder(engine).generate(rows, gc)
    dev = StreamedDecoder(plain).generate(rows, gc, generator=torch.Generator().manual_seed(9))
    again = StreamedDecoder(engine).generate(rows, gc, generator=torch.Generator().manual_seed(9))
    assert host.completions == want and again.completions == dev.completions != want
    s, cfg = host.stats, _config()
    per = 2 * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4   # a token's K+V, a layer
    prompt = max(PROMPTS)
    assert s["passes"] == NEW and s["kv_host_layers"] == LAYERS and s["prefill_rows"] == len(PROMPTS)
    assert s["kv_crossings"] == LAYERS * 2 * s["passes"]
    assert s["kv_d2h_bytes"] == LAYERS * per * (len(PROMPTS) * prompt + ROWS * (NEW - 1))
    assert s["kv_h2d_bytes"] == LAYERS * per * ROWS * sum(prompt + t for t in range(NEW - 1))
    engine.close()
    plain.close()


def test_a_cache_neither_tier_holds_whole_decodes_in_sub_batches_else_is_refused_with_the_numbers():
    probe = _engine(None)
    host_total = probe.plan.host["total"]
    probe.close()
    engine = _engine(_host_room(), max_host_gb=(host_total + 1024) / GIB)
    assert kv_place(engine, ROWS, LENGTH, split=False).tier == "none"
    gc = GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = StreamedDecoder(engine).generate(_rows(), gc)
    assert out.stats["kv_tier"] == "device" and out.stats["kv_batches"] == 2
    assert out.completions == StreamedDecoder(_engine(None)).generate(_rows(), gc).completions
    # lockstep ranks (``more``) decode their rows as one batch: refused there
    with pytest.raises(ValueError, match=r"8 rollouts x 16 tokens .* GiB .*max_vram_gb=.*in host RAM the cache would "
                                         r"take .* GiB .*max_host_gb"):
        StreamedDecoder(engine).generate(_rows(), gc, more=lambda going: going)
    engine.close()


def test_forced_host_tier_on_a_sliding_window_family_keeps_the_windows_on_the_device():
    """gemma3 (sliding and full attention layers): only the full layers' K/V go to host RAM."""
    cfg = tiny("gemma3_text")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    ref = copy.deepcopy(model)
    engine = StreamingEngine(model, device="cpu")
    rows = _rows()
    gc = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = StreamedDecoder(engine, kv_tier="host").generate(rows, gc)
    assert out.completions == _generate(ref, rows, gc)
    full = cfg.layer_types.count("full_attention")
    assert 0 < out.stats["kv_host_layers"] == full < cfg.num_hidden_layers
    assert out.stats["kv_crossings"] == 2 * full * 6
    assert sum(type(x).__name__ == "HostKVLayer" for x in HostKVCache(cfg, 2, 8).layers) == full
    engine.close()


@pytest.mark.slow
def test_the_estimate_places_the_cache_where_it_moves_fewest_bytes_and_prices_it():
    """A cache over the device room: narrow layers, many rollouts: sub-batches that fit the device
    stream the weights once each a token, fewer bytes than the host tier's cache crossings (the
    host tier's own pricing: the test below)."""
    cfg = family_config("llama", layers=4, vocab=64, max_position_embeddings=2048, intermediate_size=256)
    # (micro-batches of one row: a training step that fits beside the slots in less than the cache takes)
    base = dict(ram_gb=8, disk_gb=8, batch=1, seq=1088, rollouts=64, completion_length=1024, precision="bf16",
                rates=rates_for("h100-pcie5-gen4nvme"))
    est = mt.estimate(cfg, vram_gb=8, **base)
    kv = est.grpo.kv_bytes
    # a room between the steps short of the cache (the copy's too): the budget less what the plan it gets keeps
    # between its steps (a tighter budget: fewer slots)
    for _ in range(4):
        keep = persistent_device_bytes(est.plan)
        budget = keep + kv // 3
        est = mt.estimate(cfg, vram_gb=budget / GIB, **base)
        if persistent_device_bytes(est.plan) == keep:
            break
    assert est.plan.feasible and est.plan.device["total"] <= budget   # (the training step fits the budget)
    gp = est.grpo
    k = gp.kv_batches
    assert gp.mode == "streamed" and gp.kv_tier == "device" and k >= 2 and gp.kv_host_bytes == 0
    host = host_kv_bytes(cfg, 64, 1088, 2)
    assert gp.link_bytes_per_token == k * gp.weights_bytes < gp.weights_bytes + host // 2
    text = str(est)
    assert "GRPO KV cache tier: device" in text and f"decoded in {k} sub-batches" in text
    assert gp.room_bytes >= place_kv(cfg, 64 // k, 1088, 2, None, None).device_bytes > 0


def test_a_host_tier_token_prices_the_caches_two_crossings_beside_the_weights():
    """estimator_grpo.price (torch-free): with the cache in host RAM a decoded token moves the
    weights and each full layer's K/V at the average length in (h2d), the new token's entries back
    (d2h); the prefill sends the prompts' K/V to the host."""
    from megatrain_nb.engine.planning.estimator_grpo import GenerationPlan, price
    from megatrain_nb.engine.planning.planner import ModelShape, unit_specs_from_config

    cfg, r = _config(), rates_for("h100-pcie5-gen4nvme")
    units = unit_specs_from_config(cfg)
    P, C, R = 64, 192, 32
    kv = place_kv(cfg, R, P + C, 2, None, None).kv_bytes
    plans = {tier: GenerationPlan(R, P, C, "bf16", 2 * sum(u.numel for u in units), kv, tier, "streamed", 0,
                                  kv_host_bytes=kv if tier == "host" else 0) for tier in ("device", "host")}
    for gp in plans.values():
        price(gp, cfg, units, ModelShape.of(cfg), r, training_s=1.0, cuda=True)
    dev, host = plans["device"], plans["host"]
    assert (dev.kv_in_bytes_per_token, dev.kv_out_bytes_per_token) == (0, 0)
    assert host.kv_in_bytes_per_token == int(kv * (P + C / 2) / (P + C)) and host.kv_out_bytes_per_token == kv // (P + C)
    assert host.link_bytes_per_token == host.weights_bytes + host.kv_in_bytes_per_token + host.kv_out_bytes_per_token
    link = (host.weights_bytes + host.kv_in_bytes_per_token) / r.h2d_pinned + host.kv_out_bytes_per_token / r.d2h_pinned
    assert host.token_s == pytest.approx(max(link, dev.token_s if dev.token_bound == "compute" else 0.0))
    assert host.prefill_s == pytest.approx(dev.prefill_s + kv * P / (P + C) / r.d2h_pinned)
    assert any("over the link per decoded token" in line for line in host.lines())


def test_sample_text_decodes_with_the_cache_in_host_ram_where_only_host_ram_holds_it():
    """sample_text's check is the planner's place (decode.kv_place), not the device alone: one row
    whose cache the device room does not hold but host RAM does decodes with the cache (a prefill,
    then a token a pass), the same text as with no budget."""
    tok = chat_tokenizer()
    cfg = family_config("llama", layers=LAYERS, vocab=len(tok), max_position_embeddings=128)

    def engine(room=None):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg).eval()
        if room is None:
            return StreamingEngine(model, device="cpu")
        probe = StreamingEngine(copy.deepcopy(model), device="cpu", max_vram_gb=0.001)
        total = persistent_device_bytes(probe.plan)
        probe.close()
        return StreamingEngine(model, device="cpu", max_vram_gb=(total + room) / GIB)

    n = len(tok("hello there", add_special_tokens=False)["input_ids"]) + 8
    host = place_kv(cfg, 1, n, 4, 0, None)
    whole = place_kv(cfg, 1, n, 4, None, None).device_bytes
    budgeted = engine((host.device_bytes + whole) // 2)
    assert kv_place(budgeted, 1, n).tier == "host"
    seen = []
    budgeted.runner.base.register_forward_pre_hook(lambda m, a, k: seen.append(tuple(k["input_ids"].shape)),
                                                   with_kwargs=True)
    text = sample_text(budgeted, tok, "hello there", max_new_tokens=8, temperature=0)
    assert seen[0][1] > 1 and set(seen[1:]) == {(1, 1)}   # the cache's decoding, not the window's re-runs
    free = engine()
    assert text == sample_text(free, tok, "hello there", max_new_tokens=8, temperature=0)
    budgeted.close()
    free.close()
