"""The layer-major streamed decoder (engine/compute/decode.py) against transformers' ``generate``
on the same weights: the same greedy tokens and per-token log-probs within 1e-4 of the model's
own forward (llama, qwen2, gemma2 with a sliding window, gemma3 with a sliding window and tied
embeddings, a tied llama), the same sampled tokens while every row decodes; the transport loads
each unit exactly once per decoded token for 2, 8 and 32 rows; finished rows leave the batch;
a group's shared prompt is prefilled once."""
import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, GenerationConfig

import megatrain_nb.engine.compute.decode as decode
from megatrain_nb.engine import StreamingEngine
from megatrain_nb.engine.compute.kv_offload import DeviceKVCache, DeviceKVLayer
from megatrain_nb.engine.compute.decode import StreamedDecoder, decode_bytes, device_left, kv_place
from megatrain_nb.model_configs import family_config, tiny

EOS_FREE = 0   # the pad id: never an end of sequence unless a test says so


def _config(name: str):
    if name in ("gemma3_text", "qwen3_next"):
        # gemma3: sliding (window 4) and full attention, tied embeddings; qwen3_next: linear attention
        # layers (convolution and recurrent states in the cache) beside full attention
        return tiny(name)
    tie = name.endswith("_tied")
    return family_config(name.removesuffix("_tied"), layers=3, tie=tie, max_position_embeddings=128)


def _pair(name: str, **engine_options):
    """(the engine, a plain copy of the same weights for generate, the vocabulary size)."""
    cfg = _config(name)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    ref = copy.deepcopy(model)
    return StreamingEngine(model, device="cpu", **engine_options), ref, cfg.get_text_config().vocab_size


def _prompts(vocab: int, lengths, copies: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    distinct = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
    return [p for p in distinct for _ in range(copies)]


def _generate(ref, rows, gc):
    n = max(map(len, rows))
    ids = torch.tensor([[0] * (n - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (n - len(r)) + [1] * len(r) for r in rows])
    with torch.no_grad():
        out = ref.generate(input_ids=ids, attention_mask=mask, generation_config=gc)
    return out[:, n:].tolist()


def _cut(c, eos):
    return c[:c.index(eos) + 1] if eos in c else c


def _base_rows(engine):
    """The rows of every call of the model's base forward (a decoding pass each), recorded."""
    seen = []
    engine.runner.base.register_forward_pre_hook(lambda m, a, k: seen.append(k["input_ids"].shape[0]),
                                                 with_kwargs=True)
    return seen


def _copies_in(engine):
    """Per unit name, the transport's copies into a device slot, counted at the transport."""
    counts: dict = {}
    orig = engine.transport.copy_in

    def copy_in(unit, src, dst):
        if unit is not None:
            counts[unit.name] = counts.get(unit.name, 0) + 1
        return orig(unit, src, dst)

    engine.transport.copy_in = copy_in
    return counts


@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma2", "gemma3_text", "llama_tied", "qwen3_next"])
def test_greedy_tokens_and_logps_are_generates(name):
    engine, ref, vocab = _pair(name)
    rows = _prompts(vocab, (5, 3, 7), copies=2)
    free = GenerationConfig(max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    plain = _generate(ref, rows, free)
    # an end-of-sequence id that rows reach at different steps (some never): rows finish apart
    eos = plain[0][3]
    gc = GenerationConfig(max_new_tokens=10, do_sample=False, eos_token_id=eos, pad_token_id=0)
    seen = _base_rows(engine)
    out = StreamedDecoder(engine).generate(rows, gc)
    assert out.completions == [_cut(c, eos) for c in _generate(ref, rows, gc)]
    lengths = [len(c) for c in out.completions]
    assert min(lengths) < max(lengths)   # (the test's premise: rows finished apart)
    for r, c, lp in zip(rows, out.completions, out.logps):
        with torch.no_grad():
            logits = ref(torch.tensor([r + c])).logits[0].float()
        want = logits.log_softmax(-1)[len(r) - 1:len(r) - 1 + len(c)].gather(1, torch.tensor(c)[:, None])[:, 0]
        assert torch.allclose(lp, want, atol=1e-4, rtol=0), (lp - want).abs().max()
    # three distinct prompts prefilled once; then each pass runs the rows still decoding
    assert seen[0] == 3
    assert seen[1:] == [sum(n > k for n in lengths) for k in range(1, max(lengths))]
    assert out.stats["rows"] == sum(seen[1:]) == sum(n - 1 for n in lengths) < len(rows) * (max(lengths) - 1)
    engine.close()


def test_sampled_tokens_are_generates_while_every_row_decodes():
    """Temperature, top-k, top-p, min-p and the repetition penalty through transformers' own
    processors, in generate's order: with no row finishing, the same draws give the same tokens."""
    engine, ref, vocab = _pair("llama")
    rows = _prompts(vocab, (4, 6), copies=4)
    gc = GenerationConfig(max_new_tokens=8, do_sample=True, temperature=0.7, top_k=20, top_p=0.9, min_p=0.02,
                          repetition_penalty=1.3, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(11)
    want = _generate(ref, rows, gc)
    torch.manual_seed(11)
    assert StreamedDecoder(engine).generate(rows, gc).completions == want
    torch.manual_seed(12)
    assert StreamedDecoder(engine).generate(rows, gc).completions != want   # (another seed: other tokens)
    engine.close()


@pytest.mark.parametrize("rollouts", [2, 8, 32])
def test_each_unit_is_loaded_once_per_decoded_token_whatever_the_rows(rollouts):
    engine, _, vocab = _pair("llama")
    counts = _copies_in(engine)
    rows = _prompts(vocab, (5,) * max(1, rollouts // 4), copies=min(4, rollouts))
    gc = GenerationConfig(max_new_tokens=6, do_sample=True, eos_token_id=None, pad_token_id=0)
    out = StreamedDecoder(engine).generate(rows, gc)
    assert len(out.completions) == rollouts and {len(c) for c in out.completions} == {6}
    engine.pager.reset()   # (no fetch left in flight)
    assert counts == {u.name: 6 for u in engine.units} == dict(engine.counters.loads_per_unit)
    assert out.stats["passes"] == 6
    engine.close()


def test_a_kv_cache_over_the_device_budget_decodes_in_sub_batches_with_the_same_tokens():
    """64 rollouts whose cache exceeds the device room beside the plan decode in sub-batches the
    planner sizes (whole groups, each fitting the room), one after another: the same greedy tokens
    and log-probs as one batch on an engine without a budget, rows finishing apart; sampled with a
    random stream per row, the same draws; each sub-batch's passes load every unit once."""
    engine, _, vocab = _pair("llama", max_vram_gb=0.001)
    free, _, _ = _pair("llama")
    rows = _prompts(vocab, (8, 5, 6, 7) * 4, copies=4)
    place = kv_place(engine, 64, 8 + 64, group=4)
    assert place.tier == "device" and place.batches >= 2 and place.batch_rows % 4 == 0
    assert decode_bytes(engine, 64, 72) > device_left(engine) >= decode_bytes(engine, place.batch_rows, 72)
    plain = StreamedDecoder(free).generate(rows, GenerationConfig(max_new_tokens=64, do_sample=False,
                                                                  eos_token_id=None, pad_token_id=0))
    eos = plain.completions[0][5]
    gc = GenerationConfig(max_new_tokens=64, do_sample=False, eos_token_id=eos, pad_token_id=0)
    whole = StreamedDecoder(free).generate(rows, gc)
    seen, counts = _base_rows(engine), _copies_in(engine)
    out = StreamedDecoder(engine).generate(rows, gc)
    assert out.completions == whole.completions and len({len(c) for c in out.completions}) > 1
    assert all(torch.allclose(a, b, atol=1e-5, rtol=0) for a, b in zip(out.logps, whole.logps))
    assert out.stats["kv_batches"] == place.batches and max(seen) <= place.batch_rows
    assert out.stats["prefill_rows"] == 16 and out.stats["passes"] == len(seen) > whole.stats["passes"]
    engine.pager.reset()
    assert set(counts.values()) == {out.stats["passes"]}   # each unit once per pass of every sub-batch
    gens = lambda: [torch.Generator().manual_seed(100 + i) for i in range(64)]   # noqa: E731
    sampled = GenerationConfig(max_new_tokens=12, do_sample=True, top_k=20, eos_token_id=None, pad_token_id=0)
    assert StreamedDecoder(engine).generate(rows, sampled, generator=gens()).completions == \
        StreamedDecoder(free).generate(rows, sampled, generator=gens()).completions
    engine.close()
    free.close()


def test_a_kv_cache_not_even_one_row_of_which_fits_is_refused_with_the_numbers():
    engine, _, vocab = _pair("llama", max_vram_gb=0.001)
    rows = _prompts(vocab, (8,), copies=64)
    room = device_left(engine)
    gc = GenerationConfig(max_new_tokens=64, eos_token_id=2, pad_token_id=0)
    StreamedDecoder(engine).generate(rows, gc)   # (in sub-batches: refused only when one row does not fit)
    engine.plan.capacity["device"] -= room - decode_bytes(engine, 1, 72) + 1   # room: one row's need less a byte
    assert kv_place(engine, 64, 72).tier == "none"
    with pytest.raises(ValueError, match=r"64 rollouts x 72 tokens .* GiB .*max_vram_gb=0.001.*generation_batch_size"):
        StreamedDecoder(engine).generate(rows, gc)
    engine.close()


@pytest.mark.parametrize("field,value", [("no_repeat_ngram_size", 2), ("cache_implementation", "static"),
                                         ("num_beams", 2)])
def test_generation_fields_it_does_not_apply_are_refused_by_name(field, value):
    engine, _, vocab = _pair("llama")
    with pytest.raises(ValueError, match=f"{field}.*generation='resident'"):
        StreamedDecoder(engine).generate(_prompts(vocab, (3,), 1), GenerationConfig(max_new_tokens=4, **{field: value}))
    engine.close()


def test_bf16_decodes_on_the_bf16_copy_the_engine_loads():
    """precision="bf16": the layers run on the slots' bf16 weights, the KV cache is bf16; the
    tokens are those of generate on the model cast to bf16."""
    engine, ref, vocab = _pair("qwen2", precision="bf16")
    assert engine.pager.dtype == torch.bfloat16
    rows = _prompts(vocab, (5, 4), copies=2)
    gc = GenerationConfig(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    dtypes = []
    layer = engine.runner.layers[0].module
    layer.register_forward_hook(lambda m, a, k, o: dtypes.append(k["cache"].layers[0].keys.dtype), with_kwargs=True)
    out = StreamedDecoder(engine).generate(rows, gc)
    assert set(dtypes) == {torch.bfloat16}
    assert out.completions == _generate(ref.to(torch.bfloat16), rows, gc)
    engine.close()


class _WindowOnly:
    """An engine that gives only ``forward_logits``: sample_text re-runs the window per token."""

    def __init__(self, engine):
        self.engine, self.model_config, self.lock = engine, engine.model_config, engine.lock

    def forward_logits(self, *a, **k):
        return self.engine.forward_logits(*a, **k)


@pytest.mark.parametrize("options", [dict(temperature=0), dict(temperature=0.8, top_k=20, seed=3),
                                     dict(temperature=1.0, top_k=None, seed=5)])
def test_sample_text_decodes_with_the_cache_as_the_window_path_did(options):
    from megatrain_nb.assets import chat_tokenizer
    from megatrain_nb.engine.compute.sampling import sample_text

    tok = chat_tokenizer()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config("llama", layers=2, vocab=len(tok),
                                                           max_position_embeddings=64)).eval()
    engine = StreamingEngine(model, device="cpu")
    seen = []
    engine.runner.base.register_forward_pre_hook(lambda m, a, k: seen.append(tuple(k["input_ids"].shape)),
                                                 with_kwargs=True)
    text = sample_text(engine, tok, "hello there", max_new_tokens=8, **options)
    decoded = list(seen)
    assert decoded[0][1] > 1 and set(decoded[1:]) <= {(1, 1)}   # a prefill, then one token a pass (the cache)
    assert text == sample_text(_WindowOnly(engine), tok, "hello there", max_new_tokens=8, **options)
    assert seen[len(decoded)][1] == decoded[0][1]   # (the window path: the whole window each token)
    engine.close()


def test_weights_on_the_disk_tier_decode_as_in_ram(tmp_path):
    """Master weights on the disk tier (no host cache): each pass reads every unit from its file
    through the engine's read-ahead; the same tokens as generate, one load per unit per token."""
    engine, ref, vocab = _pair("qwen2", offload_dir=str(tmp_path), offload_params=True, host_cache_gb=0)
    assert engine.params_on_disk
    rows = _prompts(vocab, (5, 3), copies=3)
    gc = GenerationConfig(max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0)
    out = StreamedDecoder(engine).generate(rows, gc)
    assert out.completions == _generate(ref, rows, gc)
    engine.pager.reset()
    assert dict(engine.counters.loads_per_unit) == {u.name: 5 for u in engine.units}
    engine.close()


def test_the_device_cache_writes_in_place_and_decodes_as_a_dynamic_cache(monkeypatch):
    """The full-attention layers' K/V preallocated (kv_offload.DeviceKVLayer): every pass's keys
    are a view of one buffer per layer (no copy of the past per token), and the tokens and
    log-probs are bit for bit those of transformers' DynamicCache, with rows finishing apart and
    a group's cache replicated; a sliding-window layer stays transformers' own."""
    engine, ref, vocab = _pair("gemma2")   # (sliding and full attention layers alternate)
    rows = _prompts(vocab, (5, 3, 7), copies=2)
    free = GenerationConfig(max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0)
    eos = _generate(ref, rows, free)[0][3]
    gc = GenerationConfig(max_new_tokens=10, do_sample=False, eos_token_id=eos, pad_token_id=0)
    storages, made = [], []

    class Spied(DeviceKVCache):
        def __init__(self, *a):
            super().__init__(*a)
            made.append(self)
            layer = next(x for x in self.layers if isinstance(x, DeviceKVLayer))
            update = layer.update
            layer.update = lambda *u, **k: storages.append(update(*u, **k)[0].untyped_storage().data_ptr()) \
                or (layer.keys, layer.values)

    monkeypatch.setattr(decode, "DeviceKVCache", Spied)
    out = StreamedDecoder(engine).generate(rows, gc)
    kinds = [type(x).__name__ for x in made[0].layers]
    assert "DeviceKVLayer" in kinds and any(k != "DeviceKVLayer" for k in kinds)   # the sliding ones kept
    assert len(storages) == out.stats["passes"] > 2 and len(set(storages)) == 1
    monkeypatch.setattr(decode, "DeviceKVCache", lambda cfg, rows, tokens: DynamicCache(config=cfg))
    plain = StreamedDecoder(engine).generate(rows, gc)
    assert out.completions == plain.completions
    assert len({len(c) for c in out.completions}) > 1   # (rows finished apart)
    assert all(torch.equal(a, b) for a, b in zip(out.logps, plain.logps))
    engine.close()


def test_the_device_cache_moves_only_the_rows_after_the_first_that_changes():
    """DeviceKVLayer.reorder_cache: dropping finished rows copies only the rows after the first
    one dropped (rows_moved), and every kept row's K/V is the one it had (against a plain gather);
    a group's replication copies every row after the first."""
    layer = DeviceKVLayer(rows=6, tokens=8)
    k, v = torch.randn(4, 2, 3, 5), torch.randn(4, 2, 3, 5)
    layer.update(k, v)
    for idx, moved, want in (([0, 1, 2], 0, [0, 1, 2]),        # the last row dropped: nothing moves
                             ([0, 2], 1, [0, 2]),              # row 1 dropped: row 2 moves up
                             ([0, 0, 1, 1], 3, [0, 0, 2, 2])):  # replicated: all but the first
        before = layer.rows_moved
        layer.reorder_cache(torch.tensor(idx))
        assert layer.rows_moved - before == moved
        assert torch.equal(layer.keys, k[want]) and torch.equal(layer.values, v[want])
