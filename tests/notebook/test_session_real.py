"""Session over the real Trainer and StreamingEngine (a micro Llama on CPU, random tokens)."""
import os

import numpy as np
import pytest

from nb_fakes import close_sessions, wait_until


@pytest.fixture
def real_session(tmp_path):
    import datasets
    from transformers import AutoModelForCausalLM, TrainingArguments

    from megatrain_nb.notebook import Session
    from megatrain_nb.model_configs import preset_config

    made = []

    def make(max_steps=40, lr=1e-3, name=None, **kw):
        rng = np.random.default_rng(0)
        ds = datasets.Dataset.from_dict({"input_ids": rng.integers(0, 512, size=(256, 16)).tolist()})
        args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=max_steps, per_device_train_batch_size=2,
                                 learning_rate=lr, lr_scheduler_type="constant", logging_steps=5, report_to="none",
                                 save_strategy="no", disable_tqdm=True, use_cpu=True)
        s = Session(AutoModelForCausalLM.from_config(preset_config("micro")), train_dataset=ds, args=args,
                    name=name, **kw)
        made.append(s)
        return s

    yield make
    close_sessions(made, timeout=30)


def test_real_run_with_controls_inspect_and_generate(real_session, tmp_path):
    s = real_session(max_steps=400)
    assert s.total_steps == 400 and s.unit_names()[0] == "embed"
    s.train()
    assert s.wait(until_step=5, timeout=60) == "running"
    s.pause()
    assert wait_until(lambda: s.state == "paused", timeout=30)
    held = s.step
    s.set_lr(5e-4)
    stats = s.inspect(0)
    assert stats["unit"] == "model.layers.0" and stats["grad_norm"] > 0 and stats["update_ratio"] > 0
    assert sum(stats["hist_counts"]) > 0
    # generate() while paused: from the engine's current weights (the tokenizer is a stand-in)
    from nb_fakes import CharTokenizer

    s.tokenizer = CharTokenizer()
    assert s.generate("ab", max_new_tokens=3, seed=0).startswith("ab")
    ckpt = s.save_checkpoint(str(tmp_path / "mid"))
    assert os.path.isfile(os.path.join(ckpt, "config.json"))
    s.resume()
    assert s.wait(until_step=held + 10, timeout=60) == "running"
    s.stop()
    assert s.state == "stopped"
    assert [e["kind"] for e in s.events] == ["pause", "lr", "checkpoint", "resume", "stop"]
    for r in s.history:
        assert r["lr"] == (1e-3 if r["step"] <= held else 5e-4)
    assert s.engine.closed


def test_resume_from_a_session_checkpoint(real_session, tmp_path):
    from megatrain_nb.notebook import Session

    a = real_session(max_steps=12)
    a.pause()  # applied before the first step...
    a.train()
    assert wait_until(lambda: a.state == "paused", timeout=30)
    a.resume()
    a.wait(until_step=6, timeout=60)
    a.pause()
    assert wait_until(lambda: a.state == "paused", timeout=30)
    path = a.save_checkpoint(str(tmp_path / "ckpt"))
    at = a.step
    a.stop()
    b = Session.from_checkpoint(path, train_dataset=a.trainer.train_dataset, args=a.trainer.args)
    try:
        b.train(block=True)
        assert b.history[0]["step"] == at + 1 and b.step == 12
    finally:
        b.close()


def test_an_engine_error_at_step_5_fails_the_session(real_session, monkeypatch):
    s = real_session(max_steps=50)
    real = s.engine.forward_backward
    calls = {"n": 0}

    def failing(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 5:
            raise FloatingPointError("loss is nan at step 5")
        return real(*a, **kw)

    monkeypatch.setattr(s.engine, "forward_backward", failing)
    s.train()
    with pytest.raises(FloatingPointError, match="step 5"):
        s.wait(timeout=60)
    assert s.state == "failed" and s.step == 4 and s.engine.closed
    assert s.events[-1]["kind"] == "error"


def test_a_custom_loss_function_that_raises(real_session):
    from megatrain_nb.trainer import Trainer
    import inspect

    params = inspect.signature(Trainer.__init__).parameters
    if "loss_fn" not in params and "compute_loss_func" not in params:
        with pytest.raises(TypeError, match="custom loss"):
            real_session(loss_fn=lambda logits, labels: 0)
        pytest.skip("mt.Trainer takes no custom loss function yet")
    steps = {"n": 0}

    def loss_fn(logits, labels):
        import torch.nn.functional as F

        steps["n"] += 1
        if steps["n"] >= 5:
            raise ArithmeticError("custom loss failed")
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")

    s = real_session(max_steps=50, loss_fn=loss_fn)
    s.train()
    with pytest.raises(ArithmeticError):
        s.wait(timeout=60)
    assert s.state == "failed"


def test_commands_from_jupyterlab_reach_the_run(real_session):
    from megatrain_nb.channel.registry import enqueue_command, get_session

    s = real_session(max_steps=100_000, name="from-lab")
    s.train()
    assert wait_until(lambda: _beat(get_session, s.id), timeout=30)
    enqueue_command(s.id, "pause")
    assert wait_until(lambda: s.state == "paused", timeout=30)
    enqueue_command(s.id, "lr", 2e-4)
    assert wait_until(lambda: any(e["kind"] == "lr" for e in s.events), timeout=30)
    enqueue_command(s.id, "stop")
    assert wait_until(lambda: s.state == "stopped", timeout=30)
    assert [(e["kind"], e["source"]) for e in s.events] == [("pause", "lab"), ("lr", "lab"), ("stop", "lab")]


def _beat(get_session, sid):
    try:
        return get_session(sid)
    except Exception:
        return None
