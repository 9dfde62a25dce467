"""The resident generation copy of mt.GRPOTrainer in the engine's compute dtype: under
``precision="bf16"`` it holds bf16 weights (and generate's KV cache is bf16 with them), refreshed
from the compute-dtype copies the update writes where the engine keeps them (no cast), and it
samples the completions a bf16 copy of the model (``from_pretrained(dtype=torch.bfloat16)`` with
the engine's current weights) samples with ``generate``, at every generation of a run.
``resident_fits`` counts its bytes by the compute dtype (2 a value in bf16, 4 in fp32), so it
flips at half the fp32 budget. fp32 runs are unchanged (tests/trainer/test_grpo_parity.py)."""
import copy
from types import SimpleNamespace

import pytest
import torch

trl = pytest.importorskip("trl")
from transformers import AutoModelForCausalLM, GenerationConfig  # noqa: E402

import megatrain_nb as mt  # noqa: E402
import megatrain_nb.trainer.grpo_rollout as rollout  # noqa: E402
from megatrain_nb.engine.tiers import host_store  # noqa: E402

from .test_grpo_parity import config, prompts, reward_short, reward_yes, tiny_model, tokenizer  # noqa: E402


def _trainer(tmp_path, model, tok, precision, generation="resident", **kw):
    return mt.GRPOTrainer(model=copy.deepcopy(model), reward_funcs=[reward_yes, reward_short],
                          args=config(tmp_path / precision, **kw), train_dataset=prompts(), processing_class=tok,
                          device="cpu", precision=precision, generation=generation)


def _bf16_copy(folder, engine):
    """A bf16 model as transformers loads one, holding the engine's current weights."""
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    params = dict(ref.named_parameters())
    with torch.no_grad():
        for name, w in engine.named_parameters():
            params[name].copy_(w)
    ref.tie_weights()
    return ref


@pytest.mark.slow
def test_bf16_run_samples_what_a_bf16_copy_samples(tmp_path):
    tok = tokenizer()
    model = tiny_model(tok)
    folder = tmp_path / "policy"
    model.save_pretrained(folder)
    t = _trainer(tmp_path, model, tok, "bf16", max_steps=2)
    seen = []

    def wrap(policy):
        orig = policy.generate

        def generate(prompt_ids, gc, pad, eos):
            state = torch.get_rng_state()
            ref = _bf16_copy(folder, t.engine)   # the weights of this step, cast as transformers casts them
            want = rollout.ResidentPolicy.generate(SimpleNamespace(model=ref), prompt_ids, gc, pad, eos)
            torch.set_rng_state(state)
            got = orig(prompt_ids, gc, pad, eos)
            seen.append((got, want, t.state.global_step))
            return got
        policy.generate = generate
        return policy

    make = rollout.make_policy
    t._policy = wrap(make(t.engine, "resident", 4, 12))
    t.train()
    policy = t._policy
    assert policy.kind == "resident" and policy.dtype == torch.bfloat16
    assert {p.dtype for p in policy.model.parameters()} == {torch.bfloat16}
    n = t.engine.num_parameters()
    assert policy.nbytes() == 2 * n   # (an fp32 copy: 4 x n)
    # released after each generation: the training steps ran beside none of it (resident_fits' room)
    assert policy.released and all(p.numel() == 0 for p in policy.model.parameters())
    assert [s[2] for s in seen] == [0, 1]   # one generation per step (steps_per_generation 1), new weights each
    for got, want, _ in seen:
        assert got == want
    assert sum(len(c) for got, _, _ in seen for c in got) > 0
    t.close()


def test_bf16_copy_holds_the_engine_weights_and_gives_their_greedy_tokens(tmp_path):
    """Parameter by parameter, the resident copy is the bf16 model's (bit for bit); its greedy
    tokens are that model's; an fp32 engine's copy stays fp32."""
    tok = tokenizer()
    model = tiny_model(tok)
    folder = tmp_path / "policy"
    model.save_pretrained(folder)
    t = _trainer(tmp_path, model, tok, "bf16")
    policy = rollout.make_policy(t.engine, "resident", 4, 12)
    policy.refresh(t.engine, 0)
    ref = _bf16_copy(folder, t.engine)
    for (name, p), (_, q) in zip(policy.model.named_parameters(), ref.named_parameters(), strict=True):
        assert p.dtype == torch.bfloat16 and torch.equal(p, q), name
    t32 = _trainer(tmp_path, model, tok, "fp32")
    fp32 = rollout.make_policy(t32.engine, "resident", 4, 12)
    t32.close()
    assert fp32.dtype == torch.float32 and {p.dtype for p in fp32.model.parameters()} == {torch.float32}
    gc = GenerationConfig(max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id,
                          eos_token_id=[tok.eos_token_id])
    ids = [tok(r)["input_ids"] for r in prompts()["prompt"]]
    got = policy.generate(ids, gc, tok.pad_token_id, [tok.eos_token_id])
    want = rollout.ResidentPolicy.generate(SimpleNamespace(model=ref), ids, gc, tok.pad_token_id,
                                           [tok.eos_token_id])
    assert got == want and sum(map(len, got)) > 0
    t.close()


@pytest.mark.parametrize("shadows", [True, False])
def test_refresh_copies_the_compute_dtype_copies_the_update_writes(tmp_path, monkeypatch, shadows):
    """Where the engine keeps compute-dtype copies (CUDA's path; on the CPU when
    host_store.SHADOWS_ON_CPU asks) the refresh copies them, no cast; else it casts the masters."""
    monkeypatch.setattr(host_store, "SHADOWS_ON_CPU", shadows)
    tok = tokenizer()
    t = _trainer(tmp_path, tiny_model(tok), tok, "bf16")
    views = rollout.shadow_views(t.engine)
    assert (len(views) == len(dict(t.engine.named_parameters()))) if shadows else views == {}
    policy = rollout.make_policy(t.engine, "resident", 4, 12)
    policy.refresh(t.engine, 0)
    assert policy.cast_refreshes == (0 if shadows else 1)
    params = dict(policy.model.named_parameters())
    if shadows:   # the copy's source is the shadow itself: a mark put in it shows up in the copy
        name = next(iter(views))
        views[name].view(-1)[0] = 1232.0   # (a bf16 value)
        policy.refresh(t.engine, 1)
        assert float(params[name].detach().view(-1)[0]) == 1232.0 and policy.cast_refreshes == 0
    t.close()


def test_the_copy_is_released_after_generating_and_copied_in_whole_by_the_next_refresh(tmp_path):
    """GRPOTrainer releases the copy's parameters once a generation batch is made (training runs
    between generations beside the engine's slots alone: generation's room is counted between the
    engine's steps, decode.device_left); the next refresh, even on the same weights, allocates and
    copies them again: the same parameters bit for bit, the same greedy tokens."""
    tok = tokenizer()
    t = _trainer(tmp_path, tiny_model(tok), tok, "bf16")
    policy = rollout.make_policy(t.engine, "resident", 4, 12)
    policy.release()   # (nothing held yet: nothing to release)
    assert not policy.released
    policy.refresh(t.engine, 0)
    gc = GenerationConfig(max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id,
                          eos_token_id=[tok.eos_token_id])
    ids = [tok(r)["input_ids"] for r in prompts()["prompt"]]
    want = policy.generate(ids, gc, tok.pad_token_id, [tok.eos_token_id])
    held = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    n = policy.nbytes()
    policy.release()
    assert policy.released and all(p.numel() == 0 for p in policy.model.parameters()) and policy.nbytes() == n
    policy.refresh(t.engine, 0)   # (the same step's weights: copied in again)
    assert not policy.released
    for name, p in policy.model.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p, held[name]), name
    assert policy.generate(ids, gc, tok.pad_token_id, [tok.eos_token_id]) == want and sum(map(len, want)) > 0
    t.close()


def test_resident_fits_counts_bytes_by_the_compute_dtype(tmp_path, monkeypatch):
    tok = tokenizer()
    model = tiny_model(tok)
    engines = {p: _trainer(tmp_path, model, tok, p) for p in ("bf16", "fp32")}
    rows, length = 4, 12
    cfg = model.config
    n = engines["fp32"].engine.num_parameters()
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * rows * length   # values in the cache
    need = {"bf16": 2 * (n + kv), "fp32": 4 * (n + kv)}
    for p, t in engines.items():
        assert rollout.resident_bytes(t.engine, rows, length) == need[p]
    for budget, fits in ((need["bf16"] - 1, {"bf16": False, "fp32": False}),
                         (need["bf16"], {"bf16": True, "fp32": False}),
                         (need["fp32"] - 1, {"bf16": True, "fp32": False}),
                         (need["fp32"], {"bf16": True, "fp32": True})):
        monkeypatch.setattr(rollout, "device_left", lambda engine, b=budget: b)
        for p, t in engines.items():
            assert rollout.resident_fits(t.engine, rows, length) is fits[p], (budget, p)
            kind = rollout.make_policy(t.engine, "auto", rows, length).kind
            assert kind == ("resident" if fits[p] else "streamed"), (budget, p)
    for t in engines.values():
        t.close()


def test_the_estimate_counts_the_engines_resident_bytes(tmp_path):
    """engine/planning/estimator_grpo (torch-free) plans the resident copy and its cache with the
    bytes ``resident_bytes`` counts on the engine, per compute dtype."""
    tok = tokenizer()
    model = tiny_model(tok)
    for precision in ("bf16", "fp32"):
        t = _trainer(tmp_path, model, tok, precision)
        gp = mt.estimate(model.config, vram_gb=8, ram_gb=8, disk_gb=8, batch=4, seq=12, rollouts=4,
                         completion_length=6, precision=precision).grpo
        assert gp.mode == "resident"
        assert gp.weights_bytes + gp.kv_bytes == rollout.resident_bytes(t.engine, 4, 12), precision
        assert gp.weights_bytes == (2 if precision == "bf16" else 4) * t.engine.num_parameters()
        t.close()
