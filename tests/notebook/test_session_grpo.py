"""A Session with a GRPOConfig and reward_funcs builds an mt.GRPOTrainer (issue 48 item 5) and shows
its rewards (status, dashboard, report); a fork changes temperature, beta and learning_rate from
its step (its rollouts made anew with them), and bad changes are refused before anything is built."""
import pytest

pytest.importorskip("trl")

import megatrain_nb as mt  # noqa: E402
from megatrain_nb.notebook.branches import check_changes  # noqa: E402
from megatrain_nb.trainer.grpo import GRPOTrainer  # noqa: E402

from tests.trainer.test_grpo_parity import config, prompts, reward_yes, tiny_model, tokenizer  # noqa: E402

pytestmark = pytest.mark.slow


def _folder(tmp_path):
    tok = tokenizer()
    folder = tmp_path / "policy"
    tiny_model(tok).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def test_a_session_with_a_grpo_config_trains_and_shows_its_rewards(tmp_path):
    from megatrain_nb.notebook.dashboard import Dashboard
    from megatrain_nb.notebook.magics import status_line

    s = mt.Session(_folder(tmp_path), train_dataset=prompts(), args=config(tmp_path / "run", max_steps=2),
                   reward_funcs=reward_yes, name="grpo-session", device="cpu")
    try:
        assert isinstance(s.trainer, GRPOTrainer)
        s.train()
        assert s.wait(timeout=300) == "finished"
        last = s.run_log.last_record()
        assert "rewards/reward_yes/mean" in last and last["generation_s"] >= 0
        assert f"reward {last['reward']:.4g}" in status_line(s)
        d = Dashboard(s)
        d.refresh(force=True)
        assert len(d.extras.children) == 1   # the GRPO panel
        page = open(s.export_report(str(tmp_path / "grpo.html")), encoding="utf-8").read()
        assert "Learning from rewards" in page
    finally:
        s.close()


def test_a_fork_changes_temperature_beta_and_learning_rate_from_its_step(tmp_path):
    s = mt.Session(_folder(tmp_path), train_dataset=prompts(), args=config(tmp_path / "run", max_steps=3),
                   reward_funcs=reward_yes, name="grpo-parent", snapshot_steps=1, device="cpu")
    try:
        s.train()
        assert s.wait(timeout=300) == "finished"
        with pytest.raises(ValueError, match=r"fork\(temperature\)=0(\.0)?: must be a finite number > 0"):
            s.fork(step=1, temperature=0)
        with pytest.raises(ValueError, match="only in a GRPO run"):
            check_changes({"temperature": 0.5}, object())
        child = s.fork(step=1, temperature=0.5, beta=0.04, learning_rate=5e-3)
        t = child.trainer
        assert isinstance(t, GRPOTrainer) and t.reward_funcs == s.trainer.reward_funcs
        assert (t.settings.temperature, t.settings.beta, t.generation_config.temperature) == (0.5, 0.04, 0.5)
        assert t.args.learning_rate == 5e-3 and s.trainer.args.temperature == 1.0 and s.trainer.args.beta == 0.0
        child.train()
        assert child.wait(timeout=300) == "finished"
        recs = [r for r in child.run_log.records() if "reward" in r]
        assert [r["step"] for r in recs] == [2, 3]
        assert all(r["kl"] >= 0 for r in recs)   # the reference's KL from the fork's step
        assert recs[0]["lr"] == pytest.approx(5e-3 * 2 / 3)   # the linear schedule rebuilt at the fork's step
        assert all("kl" not in r for r in s.run_log.records())
        assert child.explorer.changes["temperature"] == "0.5"
        child.close()
    finally:
        s.close()


def test_a_fork_that_changes_only_max_steps_repeats_the_parents_steps(tmp_path):
    """From the snapshot's data position and random state: the same prompts, the same sampled
    completions, the same losses as the parent's steps after it."""
    s = mt.Session(_folder(tmp_path), train_dataset=prompts(), args=config(tmp_path / "run", max_steps=3),
                   reward_funcs=reward_yes, name="grpo-same", snapshot_steps=1, device="cpu")
    try:
        s.train()
        assert s.wait(timeout=300) == "finished"
        child = s.fork(step=1, max_steps=3)
        child.train()
        assert child.wait(timeout=300) == "finished"
        keys = ("reward", "completion_length", "loss")
        mine = [r[k] for r in child.run_log.records() if "reward" in r for k in keys]
        parent = [r[k] for r in s.run_log.records() if "reward" in r and r["step"] > 1 for k in keys]
        assert len(mine) == 6 and mine == pytest.approx(parent, rel=1e-5, abs=1e-7)
        child.close()
    finally:
        s.close()


def test_beta_needs_the_starting_weights(tmp_path):
    tok = tokenizer()
    s = mt.Session(tiny_model(tok), train_dataset=prompts(), tokenizer=tok, args=config(tmp_path, max_steps=1),
                   reward_funcs=reward_yes, name="grpo-module", snapshot_steps=1, device="cpu")
    try:
        s.train()
        assert s.wait(timeout=300) == "finished"
        with pytest.raises(ValueError, match="kept no starting weights"):
            s.fork(step=1, beta=0.04)
    finally:
        s.close()
