"""A GRPO step's record carries what the dashboard's panel draws (issue 48 item 5): each reward
function's mean beside the weighted reward, the step's KL to the reference when beta != 0 (the
value TRL logs for that step), generation seconds beside training seconds."""
import pytest

pytest.importorskip("trl")

import megatrain_nb as mt  # noqa: E402

from .test_grpo_parity import config, prompts, reward_short, reward_yes, tiny_model, tokenizer  # noqa: E402


@pytest.mark.slow
def test_the_record_has_rewards_per_function_kl_and_the_time_split(tmp_path):
    tok = tokenizer()
    t = mt.GRPOTrainer(model=tiny_model(tok), reward_funcs=[reward_yes, reward_short],
                       args=config(tmp_path, max_steps=2, beta=0.04, loss_type="grpo", reward_weights=[1.0, 0.5]),
                       train_dataset=prompts(), processing_class=tok, device="cpu")
    recs = list(t.iter_steps())
    logged = [h for h in t.state.log_history if "kl" in h]
    for r, h in zip(recs, logged):
        assert r["rewards/reward_yes/mean"] == h["rewards/reward_yes/mean"]
        assert r["rewards/reward_short/mean"] == h["rewards/reward_short/mean"]
        assert r["reward"] == pytest.approx(r["rewards/reward_yes/mean"] + 0.5 * r["rewards/reward_short/mean"])
        assert r["kl"] == pytest.approx(h["kl"], rel=1e-6, abs=1e-12)
        assert r["generation_s"] > 0 and r["step_time_s"] > 0
    assert len(logged) == 2 and recs[1]["kl"] > 0   # the policy moved away from the reference
    t.close()
    t0 = mt.GRPOTrainer(model=tiny_model(tok), reward_funcs=reward_yes, args=config(tmp_path / "b0", max_steps=1),
                        train_dataset=prompts(), processing_class=tok, device="cpu")
    assert "kl" not in next(iter(t0.iter_steps()))   # beta 0: no reference, no KL
    t0.close()
