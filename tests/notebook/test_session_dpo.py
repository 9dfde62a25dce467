"""A Session on preference rows (or a DPOConfig) builds an mt.DPOTrainer and trains it in its
background thread; the metrics TRL logs reach the run's log."""
import pytest

pytest.importorskip("trl")

import time  # noqa: E402

import megatrain_nb as mt  # noqa: E402
from megatrain_nb.notebook.branches import check_changes  # noqa: E402
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
        _shows_the_rewards(s, tmp_path)
    finally:
        s.close()


def _shows_the_rewards(s, tmp_path):
    """%megatrain status, the dashboard, the report and the sidebar's card show a DPO run's reward
    margin and accuracy (the last step's, as the run's records hold them)."""
    from megatrain_nb.channel.beacon import SessionBeacon
    from megatrain_nb.notebook.dashboard import Dashboard
    from megatrain_nb.notebook.magics import status_line

    last = s.run_log.last_record()
    margin, accuracy = last["rewards/margins"], last["rewards/accuracies"]
    assert f"reward margin {margin:.4g}, accuracy {accuracy:.3g}" in status_line(s)
    d = Dashboard(s)
    d.refresh(force=True)
    margins, accuracies = (p["series"][0] for p in d.reward_chart.spec["panels"])
    assert margins["x"] == [1, 2] and margins["y"] == [h["rewards/margins"] for h in s.run_log.records()]
    assert accuracies["y"][-1] == accuracy and margins["name"] == "reward margin"
    page = open(s.export_report(str(tmp_path / "dpo.html")), encoding="utf-8").read()
    assert "Preference training" in page and f"<td>{margin:.4g}</td>" in page and "reward margin and accuracy" in page
    card = SessionBeacon(s, root=tmp_path / "beacons").snapshot()
    assert (card["reward_margin"], card["reward_accuracy"]) == (margin, accuracy)
    assert "reward margin" not in status_line(_NotDPO())   # another run shows nothing new


class _NotDPO:
    name, state, total_steps, error = "plain", "finished", 1, None

    class run_log:   # noqa: N801 - a stand-in for the run log
        @staticmethod
        def view(max_points=2):
            from megatrain_nb.notebook.run_log import RunLog

            log = RunLog()
            log.add_record({"step": 1, "loss": 2.0, "lr": 1e-3})
            return log.view(max_points=max_points)


def test_a_fork_shares_the_reference(tmp_path):
    """A fork of a DPO session is a DPOTrainer on the parent's prepared pairs with their reference
    log-probs: no second reference pass (the engine then holds trained weights, not the reference).
    It may change beta and loss_type (the step it repeats then has another loss); bad values and
    DPO fields on a run that is not DPO are refused before anything is built."""
    tok = tokenizer()
    s = mt.Session(tiny_llama(len(tok)), train_dataset=pairs(8), tokenizer=tok, snapshot_steps=1,
                   args=dpo_config(tmp_path, max_steps=2), name="dpo-parent", device="cpu")
    try:
        s.train()
        assert s.wait(timeout=120) == "finished"
        with pytest.raises(ValueError, match=r"fork\(loss_type\)='nope': must be one or a non-empty list of"):
            s.fork(step=1, loss_type="nope")
        with pytest.raises(ValueError, match=r"fork\(beta\)=0: must be a finite number > 0"):
            s.fork(step=1, beta=0)
        with pytest.raises(ValueError, match="only in a preference"):
            check_changes({"beta": 0.5}, object())
        child = s.fork(step=1, learning_rate=5e-4, beta=0.5, loss_type="ipo")
        assert isinstance(child.trainer, DPOTrainer)
        assert (child.trainer.settings.beta, child.trainer.settings.loss_type) == (0.5, ["ipo"])
        assert (s.trainer.settings.beta, s.trainer.settings.loss_type) == (0.1, ["sigmoid"])
        child.train()
        assert child.wait(timeout=120) == "finished"
        assert child.trainer.reference_seconds["train"] == 0.0
        logs = [h for h in child.trainer.state.log_history if "rewards/margins" in h]
        parent = [h for h in s.trainer.state.log_history if "rewards/margins" in h]
        assert logs and abs(logs[-1]["loss"] - parent[-1]["loss"]) > 1e-3   # ipo's loss, not sigmoid's
        assert child.explorer.changes["loss_type"] == "['ipo']"
        child.close()
    finally:
        s.close()


def _on_first_reference_batch(s, act):
    """``act(s)`` from the training thread as the reference pass's first batch runs (so the
    command is queued while the pass is under way, deterministically)."""
    engine, calls = s.trainer.engine, []
    real = engine.evaluate

    def evaluate(*a, **kw):
        if not calls:
            act(s)
        calls.append(1)
        return real(*a, **kw)

    engine.evaluate = evaluate
    return calls


def test_the_reference_pass_pauses_resumes_and_stops_from_the_session(tmp_path):
    tok = tokenizer()
    s = mt.Session(tiny_llama(len(tok)), train_dataset=pairs(8), tokenizer=tok,
                   args=dpo_config(tmp_path / "a", max_steps=2), name="dpo-pause", device="cpu")
    try:
        calls = _on_first_reference_batch(s, lambda s: s.pause())
        s.train()
        assert wait_until(lambda: s.state == "paused")
        time.sleep(0.3)
        assert len(calls) == 1 and s.step == 0 and "train" not in s.trainer.reference_seconds   # held mid-pass
        s.resume()
        assert s.wait(timeout=120) == "finished" and s.step == 2
        assert len(calls) >= 4 and s.trainer.reference_seconds["train"] > 0
    finally:
        s.close()
    s = mt.Session(tiny_llama(len(tok)), train_dataset=pairs(8), tokenizer=tok,
                   args=dpo_config(tmp_path / "b", max_steps=2), name="dpo-stop", device="cpu")
    try:
        calls = _on_first_reference_batch(s, lambda s: s.stop(wait=False))
        s.train()
        assert s.wait(timeout=120) == "stopped" and s.step == 0 and len(calls) == 1
        assert not list((tmp_path / "b" / "reference_logps").glob("*.safetensors"))   # nothing half-computed is cached
    finally:
        s.close()
