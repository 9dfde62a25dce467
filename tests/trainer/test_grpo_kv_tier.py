"""mt.GRPOTrainer(generation="auto") follows the planner: under a device budget that holds neither
a resident copy with its KV cache nor the streamed decoder's cache, but the decoder's part of a
cache kept in host RAM, it decodes streamed with the K/V in host RAM, says so (``generation_text``,
``generation_where``: the run header's ``generation:`` line), and trains exactly as the device
cache does (the same completions, logged metrics and weights); where host RAM is short too, it
decodes in sub-batches and, with a random stream per rollout, trains as one batch does."""
import copy

import pytest
import torch

trl = pytest.importorskip("trl")
from transformers import AutoModelForCausalLM  # noqa: E402

import megatrain_nb as mt  # noqa: E402
from megatrain_nb.engine.compute.decode import device_left  # noqa: E402
from megatrain_nb.engine.planning.estimator_grpo import place_kv, streamed_need  # noqa: E402
from megatrain_nb.engine.planning.planner import persistent_device_bytes  # noqa: E402
from megatrain_nb.model_configs import family_config  # noqa: E402

from .test_grpo_parity import config, prompts, reward_short, reward_yes, tokenizer  # noqa: E402

GIB = 1 << 30
LAYERS = 48   # (the cache outweighs the training step's working set: the budget holds that, not the cache)


def _model(tok):
    cfg = family_config("llama", layers=LAYERS, vocab=len(tok), max_position_embeddings=128, bos_token_id=None,
                        eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


def _trainer(tmp_path, name, model, tok, args=None, **options):
    return mt.GRPOTrainer(model=copy.deepcopy(model), reward_funcs=[reward_yes, reward_short],
                          args=config(tmp_path / name, max_steps=2, **(args or {})), train_dataset=prompts(),
                          processing_class=tok, device="cpu", **options)


@pytest.mark.slow
def test_auto_generation_keeps_the_cache_in_host_ram_and_trains_as_the_device_cache(tmp_path):
    tok = tokenizer()
    model = _model(tok)
    rows = 4   # a generation batch
    length = max(len(tok(p["prompt"])["input_ids"]) for p in prompts()) + 6
    probe = _trainer(tmp_path, "probe", model, tok, max_vram_gb=0.001)
    total = persistent_device_bytes(probe.engine.plan)   # (what stays on the device between the steps)
    probe.close()
    host = place_kv(model.config, rows, length, 4, 0, None)
    # a room that holds the host tier's device part, not the device tier's cache
    room = (host.device_bytes + 3 * streamed_need(model.config, rows, length, 4)) // 4
    t = _trainer(tmp_path, "host", model, tok, max_vram_gb=(total + room) / GIB)
    assert abs(device_left(t.engine) - room) <= 2
    said = t.generation_text(length - 6)
    assert "layer-major streamed decoding" in said and "KV cache in host RAM" in said, said
    ref = _trainer(tmp_path, "device", model, tok, generation="streamed")
    assert "KV cache on the device" in ref.generation_text(length - 6)
    got = {}
    for name, tr in (("host", t), ("device", ref)):
        torch.manual_seed(0)
        tr.train()
        got[name] = tr
    assert t._policy.kind == "streamed" and t._policy.last_stats["kv_tier"] == "host"
    assert ref._policy.last_stats["kv_tier"] == "device"
    assert t._policy.last_stats["kv_crossings"] == 2 * LAYERS * t._policy.last_stats["passes"]
    assert "in host RAM" in t.generation_where
    _same_run(t, ref)


def _same_run(t, ref):
    """Two trained runs logged the same metrics (times aside), two steps, and ended on the same
    weights bit for bit; both closed."""
    logs = [[{k: v for k, v in r.items() if not k.endswith("_s") and "time" not in k and "runtime" not in k}
             for r in tr.state.log_history if "loss" in r] for tr in (t, ref)]
    assert logs[0] == logs[1] and len(logs[0]) == 2
    for (n, a), (_, b) in zip(t.engine.named_parameters(), ref.engine.named_parameters()):
        assert torch.equal(a, b), n
    t.close()
    ref.close()


@pytest.mark.slow
def test_a_cache_neither_tier_holds_whole_decodes_in_sub_batches_and_trains_as_one_batch(tmp_path):
    """Host RAM short of the cache too: the rollouts decode in sub-batches the planner sizes (2 of
    2 rows, each within the device room), said, and with a random stream per rollout the run is
    the unbudgeted one's: the same logged metrics and weights."""
    tok = tokenizer()
    model = _model(tok)
    rows = 4   # a generation batch (one group of 4), trained a row a micro-batch: a training step that fits a
    # budget whose room between the steps holds part of the cache (generation runs between the steps)
    one = {"per_device_train_batch_size": 1, "steps_per_generation": 4}
    length = max(len(tok(p["prompt"])["input_ids"]) for p in prompts()) + 6
    probe = _trainer(tmp_path, "probe", model, tok, args=one, max_vram_gb=0.001)
    total, host_total = persistent_device_bytes(probe.engine.plan), probe.engine.plan.host["total"]
    probe.close()
    room = (streamed_need(model.config, 2, length, 4) + streamed_need(model.config, 3, length, 4)) // 2
    t = _trainer(tmp_path, "split", model, tok, args=one, max_vram_gb=(total + room) / GIB,
                 max_host_gb=(host_total + 1024) / GIB, rollout_seeds="per_rollout")
    said = t.generation_text(length - 6)
    assert "layer-major streamed decoding" in said and "on the device in 2 sub-batches" in said, said
    ref = _trainer(tmp_path, "whole", model, tok, args=one, rollout_seeds="per_rollout")
    for tr in (t, ref):
        torch.manual_seed(0)
        tr.train()
    assert t._policy.last_stats["kv_batches"] == 2 and ref._policy.last_stats.get("kv_batches", 1) == 1
    assert t._policy.last_stats["prefill_rows"] == 2   # (the group's prompt, once in each sub-batch)
    _same_run(t, ref)
