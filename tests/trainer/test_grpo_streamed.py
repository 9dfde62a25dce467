"""mt.GRPOTrainer with generation streamed on the engine (``generation="streamed"``, an engine
option keyword): the completions come from the layer-major decoder (each unit loaded once per
decoded token for the whole generation batch), and with no completion ending early (the end of
sequence suppressed) its sampling draws are generate's, so the run is the resident run's: the
same completions, every logged value and the final weights. ``"auto"`` streams when the resident
copy does not fit the device budget."""
import copy

import pytest
import torch

trl = pytest.importorskip("trl")

import megatrain_nb as mt  # noqa: E402
import megatrain_nb.trainer.grpo_rollout as rollout  # noqa: E402
from megatrain_nb.engine.planning.planner import persistent_device_bytes  # noqa: E402

from .test_grpo_parity import (NOT_COMPARED, config, prompts, reward_short, reward_yes, tiny_model,  # noqa: E402
                               tokenizer)


def _run(tmp_path, model, tok, generation, **kw):
    calls = []
    t = mt.GRPOTrainer(model=copy.deepcopy(model), reward_funcs=[reward_yes, reward_short],
                       args=config(tmp_path / generation, **kw), train_dataset=prompts(), processing_class=tok,
                       device="cpu", generation=generation)
    orig = t.make_rollouts

    def make_rollouts(examples, mode="train"):
        before = dict(t.engine.counters.loads_per_unit)
        out = orig(examples, mode)
        calls.append((t._policy.kind, {k: v - before.get(k, 0) for k, v in t.engine.counters.loads_per_unit.items()},
                      out["completion_ids"].tolist(), getattr(t._policy, "last_stats", {})))
        return out

    t.make_rollouts = make_rollouts
    t.train()
    weights = {n: w.clone() for n, w in t.engine.named_parameters()}
    logs = [r for r in t.state.log_history if "loss" in r]
    t.close()
    return calls, logs, weights


@pytest.mark.slow
def test_streamed_generation_trains_as_the_resident_one(tmp_path):
    tok = tokenizer()
    model = tiny_model(tok)
    kw = dict(max_steps=2, generation_kwargs={"suppress_tokens": [tok.eos_token_id]})
    streamed = _run(tmp_path, model, tok, "streamed", **kw)
    resident = _run(tmp_path, model, tok, "resident", **kw)
    assert {c[0] for c in streamed[0]} == {"streamed"} and {c[0] for c in resident[0]} == {"resident"}
    for (_, loads, ids, stats), (_, _, ids_r, _) in zip(streamed[0], resident[0], strict=True):
        assert ids == ids_r   # the same completions (6 tokens each: the end of sequence suppressed)
        # the generation batch (4 rows of one prompt) decoded 6 tokens: 6 loads per unit for them all,
        # beside what the step's own forward-only passes loaded (as many in the resident run)
        assert stats["passes"] == 6 and stats["prefill_rows"] == 1 and stats["rows_in"] == 4
    gen_loads = [c[1] for c in streamed[0]]
    res_loads = [c[1] for c in resident[0]]
    assert all(g[k] - r.get(k, 0) == 6 for g, r in zip(gen_loads, res_loads) for k in g)
    assert len(streamed[1]) == len(resident[1]) == 2
    for a, b in zip(resident[1], streamed[1]):
        for k in (k for k in a if k not in NOT_COMPARED):
            assert (b[k] is None) if a[k] is None else b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7), k
    w_r, w_s = resident[2], streamed[2]
    assert max(float((w_r[n] - w_s[n]).abs().max()) for n in w_r) <= 1e-6


def test_auto_streams_when_the_resident_copy_does_not_fit(tmp_path):
    tok = tokenizer()
    t = mt.GRPOTrainer(model=tiny_model(tok), reward_funcs=reward_yes, args=config(tmp_path), train_dataset=prompts(),
                       processing_class=tok, device="cpu", max_vram_gb=0.000165)
    assert t.generation == "auto"
    left = t.engine.plan.capacity["device"] - persistent_device_bytes(t.engine.plan)   # (between the steps)
    assert t.engine.num_parameters() * 4 > left   # (the premise: a resident fp32 copy does not fit)
    assert isinstance(rollout.make_policy(t.engine, "auto", 4, 12), rollout.StreamedPolicy)
    assert isinstance(rollout.make_policy(t.engine, "resident", 4, 12), rollout.ResidentPolicy)
    t.close()
    t = mt.GRPOTrainer(model=tiny_model(tok), reward_funcs=reward_yes, args=config(tmp_path), train_dataset=prompts(),
                       processing_class=tok, device="cpu")
    assert isinstance(rollout.make_policy(t.engine, "auto", 4, 12), rollout.ResidentPolicy)   # no budget: it fits
    t.close()


def test_an_unknown_generation_mode_is_refused_with_the_choices(tmp_path):
    tok = tokenizer()
    with pytest.raises(ValueError, match="generation='vllm'.*'auto', 'resident', 'streamed'"):
        mt.GRPOTrainer(model=tiny_model(tok), reward_funcs=reward_yes, args=config(tmp_path), train_dataset=prompts(),
                       processing_class=tok, device="cpu", generation="vllm")
