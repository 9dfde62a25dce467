"""Resuming a GRPO run (docs/GRPO.md, "Resuming"): a run stopped at a checkpoint and resumed
gives bitwise the uninterrupted run's completions, logged losses and metrics, and final weights,
at a generation boundary and in the middle of one (the stored rollouts come back from the
checkpoint); without them the continuation differs (the control)."""
import copy
import json
import math

import pytest
import torch

trl = pytest.importorskip("trl")

import megatrain_nb as mt  # noqa: E402
import megatrain_nb.trainer.grpo_rollout as rollout  # noqa: E402
from megatrain_nb.trainer import checkpoint as ckpt  # noqa: E402
from megatrain_nb.trainer.grpo_data import decode_tensors, encode_tensors  # noqa: E402

from .test_grpo_parity import config, prompts, reward_short, reward_yes, tiny_model, tokenizer  # noqa: E402

# steps_per_generation x num_iterations optimizer steps per generation batch: 1, and 4 (step 2 is
# in the middle of the first generation batch, step 4 at its end) with a reference (beta > 0: the
# stored rollouts hold old and reference log-probs), logged every 3 steps (the metrics of step 2
# are not yet logged when its checkpoint is written: they come back from it); and 2, the
# completions sampled by the engine's streamed decoder; and 1 with 2 prompts per generation, so
# an epoch of the 8 prompts is 4 steps (step 2 mid-epoch, step 4 at an epoch's end, the run into a second)
CASES = {"one_step_per_generation": dict(),
         "four_steps_per_generation": dict(steps_per_generation=2, num_iterations=2, per_device_train_batch_size=2,
                                           logging_steps=3, beta=0.04),
         "two_steps_per_generation_streamed": dict(num_iterations=2, generation="streamed"),
         "two_epochs": dict(per_device_train_batch_size=8)}


def _run(out, model, tok, resume=None, generation="resident", **kw):
    """(completions per generation with the step they were made at, logged entries, final weights)."""
    gens: list = []
    policy = rollout.StreamedPolicy if generation == "streamed" else rollout.ResidentPolicy
    orig = policy.generate
    t = mt.GRPOTrainer(model=copy.deepcopy(model), reward_funcs=[reward_yes, reward_short], processing_class=tok,
                       args=config(out, max_steps=6, save_strategy="steps", save_steps=2, **kw),
                       train_dataset=prompts(), device="cpu", generation=generation)

    def generate(self, *a, **k):
        ids = orig(self, *a, **k)
        gens.append((t.state.global_step, ids))
        return ids

    policy.generate = generate
    try:
        t.train(resume_from_checkpoint=resume)
    finally:
        policy.generate = orig
    weights = {n: w.clone() for n, w in t.engine.named_parameters()}
    logs = [r for r in t.state.log_history if "loss" in r]
    t.close()
    return gens, logs, weights


def _same_logs(a, b):
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:   # bitwise: equal floats, or both NaN
            assert x[k] == y[k] or (isinstance(x[k], float) and math.isnan(x[k]) and math.isnan(y[k])), (x["step"], k)


@pytest.fixture(scope="module")
def start():
    tok = tokenizer()
    return tok, tiny_model(tok)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_a_resumed_run_is_the_uninterrupted_run(tmp_path, start, case):
    tok, model = start
    kw = CASES[case]
    whole = _run(tmp_path / "whole", model, tok, **kw)
    moved = sum(float((whole[2][n] - p.detach()).norm()) for n, p in model.named_parameters())
    assert moved > 0
    assert (whole[1][-1]["epoch"] > 1) == (case == "two_epochs")
    for k in (2, 4):
        ck = tmp_path / "whole" / f"checkpoint-{k}"
        data = ckpt.read_json(ck / ckpt.STATE_FILE)["data"]
        mid = (data["buffer"] is not None)
        assert mid == (case == "four_steps_per_generation" and k == 2)   # the stored rollouts only mid-batch
        gens, logs, weights = _run(tmp_path / f"from{k}", model, tok, resume=str(ck), **kw)
        assert gens == [g for g in whole[0] if g[0] >= k] and gens   # the same completions from step k on
        _same_logs(whole[1], logs)                                    # every logged loss and metric, bitwise
        assert all(torch.equal(whole[2][n], w) for n, w in weights.items())


@pytest.mark.slow
def test_without_the_stored_rollouts_the_continuation_differs(tmp_path, start):
    """The control (what TRL's resume does: the generation batch made anew mid-way): the
    checkpoint's stored rollouts removed (resealed), the completions and the weights differ."""
    tok, model = start
    kw = CASES["four_steps_per_generation"]
    whole = _run(tmp_path / "whole", model, tok, **kw)
    ck = tmp_path / "whole" / "checkpoint-2"
    meta = ckpt.read_json(ck / ckpt.STATE_FILE)
    assert meta["data"]["buffer"] is not None
    meta["data"]["buffer"] = None
    (ck / ckpt.STATE_FILE).write_text(json.dumps(meta))
    ckpt.seal(ck, reseal=True)
    gens, logs, weights = _run(tmp_path / "from2", model, tok, resume=str(ck), **kw)
    assert gens[0][0] == 2 and gens != [g for g in whole[0] if g[0] >= 2]   # a generation made anew at step 3
    assert not all(torch.equal(whole[2][n], w) for n, w in weights.items())


@pytest.mark.slow
def test_a_checkpoint_without_grpo_state_is_refused(tmp_path, start):
    tok, model = start
    _run(tmp_path / "whole", model, tok)
    ck = tmp_path / "whole" / "checkpoint-2"
    meta = ckpt.read_json(ck / ckpt.STATE_FILE)
    meta["data"] = {"epoch": 0, "consumed": 2}   # a plain run's data position
    (ck / ckpt.STATE_FILE).write_text(json.dumps(meta))
    ckpt.seal(ck, reseal=True)
    with pytest.raises(ValueError, match="no GRPO rollout state"):
        _run(tmp_path / "again", model, tok, resume=str(ck))


@pytest.mark.parametrize("t", [torch.arange(6, dtype=torch.int64).reshape(2, 3), torch.randn(2, 5),
                               torch.randn(3).to(torch.bfloat16), torch.tensor(7.0), torch.zeros(0, 4)])
def test_stored_tensors_read_back_bitwise(t):
    back = decode_tensors(json.loads(json.dumps(encode_tensors({"x": t, "none": None}))))
    assert back["none"] is None and back["x"].dtype == t.dtype and torch.equal(back["x"], t)
