"""A Session on preference rows (or a DPOConfig) builds an mt.DPOTrainer and trains it in its
background thread; the metrics TRL logs reach the run's log."""
import pytest

pytest.importorskip("trl")

import time  # noqa: E402

import megatrain_nb as mt  # noqa: E402
from megatrain_nb.trainer.dpo import DPOTrainer  # noqa: E402

from tests.trainer.dpo_helpers import dpo_config, pairs, tiny_llama, tokenizer  # noqa: E402


def wait_until(cond, timeout=30.0):
    end = time.time() + timeout
    while time.time() < end:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_a_session_on_preference_rows_trains_a_dpo_trainer(tmp_path):
    tok = tokenizer()
    s = mt.Session(tiny_llama(len(tok)), train_dataset=pairs(8), tokenizer=tok,
                   args=dpo_config(tmp_path, max_steps=2), name="dpo-session", device="cpu")
    try:
        assert isinstance(s.trainer, DPOTrainer)
        s.set_sample_prompt([{"role": "user", "content": "What is two plus three ?"}], every=1, max_new_tokens=3)
        s.train()
        assert s.wait(timeout=120) == "finished"
        assert wait_until(lambda: any(a["step"] == 2 for a in s.sample_watch.answers()))
        logs = [h for h in s.trainer.state.log_history if "rewards/margins" in h]
        assert len(logs) == 2 and all("logps/chosen" in h for h in logs)
        assert s.trainer.reference_seconds["train"] > 0
    finally:
        s.close()


def test_a_fork_shares_the_reference(tmp_path):
    """A fork of a DPO session is a DPOTrainer on the parent's prepared pairs with their reference
    log-probs: no second reference pass (the engine then holds trained weights, not the reference)."""
    tok = tokenizer()
    s = mt.Session(tiny_llama(len(tok)), train_dataset=pairs(8), tokenizer=tok, snapshot_steps=1,
                   args=dpo_config(tmp_path, max_steps=2), name="dpo-parent", device="cpu")
    try:
        s.train()
        assert s.wait(timeout=120) == "finished"
        child = s.fork(step=1, learning_rate=5e-4)
        assert isinstance(child.trainer, DPOTrainer)
        child.train()
        assert child.wait(timeout=120) == "finished"
        assert child.trainer.reference_seconds["train"] == 0.0
        assert [h for h in child.trainer.state.log_history if "rewards/margins" in h]
        child.close()
    finally:
        s.close()
