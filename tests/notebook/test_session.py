"""Session lifecycle and controls against the fake trainer (the real one: test_session_real.py)."""
import os
import threading
import time

import pytest

from megatrain_nb.notebook import Session, registry
from nb_fakes import wait_until


def test_train_returns_at_once_and_runs_in_background(fake_session):
    s = fake_session(total_steps=40, step_time=0.01)
    t0 = time.perf_counter()
    s.train()
    assert time.perf_counter() - t0 < 0.3
    assert s.state == "running"
    assert wait_until(lambda: s.step >= 3)
    assert s.wait(timeout=20) == "finished"
    assert s.step == 40 and len(s.history) == 40
    assert s.trainer.threads_seen == {f"mtnb-session-{s.name}"}
    assert not s.engine.closed  # a finished run keeps its weights for generate()/inspect()
    s.close()
    assert s.engine.closed


def test_pause_holds_the_step_count_and_resume_continues(fake_session):
    s = fake_session(total_steps=200, step_time=0.005)
    s.train()
    assert wait_until(lambda: s.step >= 5)
    s.pause()
    assert wait_until(lambda: s.state == "paused")
    held = s.step
    time.sleep(0.2)
    assert s.step == held
    s.pause()          # paused already: nothing to do, no event (not a "pause_failed")
    s.resume()
    assert wait_until(lambda: s.step > held + 3)
    s.resume()         # running already: the same
    s.wait(timeout=20)
    kinds = [(e["kind"], e["step"]) for e in s.events]
    assert kinds == [("pause", held), ("resume", held)]
    assert s.events[0]["source"] == "notebook"


def test_set_lr_applies_from_the_next_step_under_a_constant_schedule(fake_session):
    s = fake_session(total_steps=60, step_time=0.003, lr=1e-3)
    s.train()
    assert wait_until(lambda: s.step >= 10)
    s.set_lr(5e-4)
    s.wait(timeout=20)
    (event,) = [e for e in s.events if e["kind"] == "lr"]
    assert event["value"] == 5e-4 and event["previous"] == 1e-3
    for rec in s.history:
        assert rec["lr"] == (1e-3 if rec["step"] <= event["step"] else 5e-4), rec


def test_controls_enqueued_before_train_apply_before_the_first_step(fake_session):
    s = fake_session(total_steps=10)
    s.set_lr(2e-3)
    s.train(block=True)
    assert s.events[0]["kind"] == "lr" and s.events[0]["step"] == 0
    assert {lr for _, lr in s.trainer.lrs_used} == {2e-3}


def test_set_lr_rejects_nonsense(fake_session):
    s = fake_session()
    for bad in ("abc", float("nan"), -1.0, None):
        with pytest.raises(ValueError):
            s.set_lr(bad)


def test_stop_ends_within_one_step_and_releases_everything(fake_session, tmp_path):
    s = fake_session(total_steps=10_000, step_time=0.02)
    s.train()
    assert wait_until(lambda: s.step >= 2)
    t0 = time.perf_counter()
    s.stop(checkpoint=str(tmp_path / "kept"))
    assert time.perf_counter() - t0 < 1.0
    assert s.state == "stopped"
    assert s.engine.closed and s.trainer.closed_generator
    assert not [t.name for t in threading.enumerate()
                if t.name == f"mtnb-session-{s.name}" or s.id in t.name]  # training thread, beacon
    assert os.path.isfile(tmp_path / "kept" / "state.json")
    kinds = [e["kind"] for e in s.events]
    assert kinds == ["checkpoint", "stop"]
    with pytest.raises(RuntimeError, match="stopped"):
        s.pause()
    with pytest.raises(RuntimeError, match="stopped"):
        s.train()
    with pytest.raises(RuntimeError, match="released"):
        s.generate("x")


def test_stop_while_paused_and_stop_before_train(fake_session):
    s = fake_session(total_steps=1000, step_time=0.005)
    s.train()
    s.pause()
    assert wait_until(lambda: s.state == "paused")
    s.stop()
    assert s.state == "stopped" and s.engine.closed
    idle = fake_session()
    idle.stop()
    assert idle.state == "stopped" and idle.engine.closed and idle.events[-1]["kind"] == "stop"


def test_a_loss_that_raises_at_step_5_fails_the_session_and_wait_reraises(fake_session):
    def loss_fn(step):
        if step == 5:
            raise ValueError("loss exploded at step 5")
        return 1.0

    s = fake_session(total_steps=50, loss_fn=loss_fn)
    s.train()
    with pytest.raises(ValueError, match="exploded") as info:
        s.wait(timeout=20)
    assert s.state == "failed" and s.step == 4
    assert "loss_fn" in "".join(__import__("traceback").format_tb(info.value.__traceback__))
    err = s.events[-1]
    assert err["kind"] == "error" and err["step"] == 4 and "loss_fn" in err["traceback"]
    assert s.engine.closed
    with pytest.raises(ValueError):  # every wait() says it again
        s.wait()
    assert "failed" in s._repr_html_() and "exploded" in s._repr_html_()


def test_save_checkpoint_while_running_and_after_finishing(fake_session, tmp_path):
    s = fake_session(total_steps=100, step_time=0.005)
    s.train()
    assert wait_until(lambda: s.step >= 3)
    path = s.save_checkpoint(str(tmp_path / "mid"))
    assert os.path.isfile(os.path.join(path, "state.json"))
    s.wait(timeout=20)
    end = s.save_checkpoint()
    assert end.endswith("checkpoint-100")
    assert [e["kind"] for e in s.events] == ["checkpoint", "checkpoint"]


def test_resume_from_a_checkpoint(fake_session, tmp_path):
    s = fake_session(total_steps=20)
    s.train(block=True)
    ckpt = s.save_checkpoint(str(tmp_path / "c20"))
    s2 = fake_session(total_steps=30, resume_from_checkpoint=ckpt)
    s2.train(block=True)
    assert s2.history[0]["step"] == 21 and s2.step == 30


def test_inspect_returns_the_engine_layer_stats(fake_session):
    s = fake_session(total_steps=8)
    with pytest.raises(LookupError, match="train at least one step"):
        s.inspect(0)
    s.train(block=True)
    r = s.inspect(1)
    assert r["unit"] == "model.layers.1" and r["step"] == 8
    assert {"weight_norm", "grad_norm", "update_norm", "update_ratio", "hist_counts", "hist_edges"} <= set(r)
    assert s.inspect(-1)["unit"] == "model.layers.2"
    assert s.inspect("head")["unit"] == "head"
    assert s.inspect("layers.0")["unit"] == "model.layers.0"
    assert len(r["history"]["grad_norm"]["step"]) == 8
    assert "<img alt='weight histogram' src='data:image/svg+xml;base64," in r._repr_html_()   # sanitizer-safe
    with pytest.raises(IndexError, match="3 decoder layers"):
        s.inspect(7)
    with pytest.raises(LookupError, match="no unit"):
        s.inspect("nope")


def test_generate_while_running_and_paused(fake_session):
    s = fake_session(total_steps=500, step_time=0.005)
    s.train()
    assert wait_until(lambda: s.step >= 2)
    text = s.generate("ab", max_new_tokens=3, temperature=0)
    assert text == "abcde"
    s.pause()
    assert wait_until(lambda: s.state == "paused")
    assert s.generate("x", max_new_tokens=2, seed=0).startswith("x")
    assert [x["prompt"] for x in s.samples] == ["ab", "x"]
    s.stop()


def test_registry_tracks_current_and_named_sessions(fake_session):
    a = fake_session(name="alpha")
    b = fake_session()
    assert registry.get() is b and registry.get("alpha") is a
    assert b.name.startswith("session-")
    a.train(block=True)
    assert registry.get() is a  # training makes it current


def test_from_trainer_rejects_objects_that_cannot_be_driven():
    with pytest.raises(TypeError, match="lacks"):
        Session.from_trainer(object())


def test_wait_until_a_step(fake_session):
    s = fake_session(total_steps=300, step_time=0.003)
    s.train()
    assert s.wait(until_step=20, timeout=10) == "running"
    assert 20 <= s.step < 300
    assert s.wait(until_step=10_000, timeout=20) == "finished"


def test_help_shows_a_docstring_for_every_public_member():
    """help(mt.Session) / help(mt.Trainer): no member without its own docstring (pydoc would
    otherwise show the section comment above it)."""
    import inspect

    import megatrain_nb as mt

    for cls in (mt.Session, mt.Trainer):
        for name, member in vars(cls).items():
            if name.startswith("_") or not (callable(member) or isinstance(member, (property, classmethod))):
                continue
            target = member if isinstance(member, property) else getattr(member, "__func__", member)
            doc = inspect.getdoc(target)
            assert doc and "----" not in doc, f"{cls.__name__}.{name}"


def test_one_session_class_with_a_run_controller_chosen_at_construction(fake_session):
    """Composed, not subclassed (issue 22): in-kernel and worker-process runs are the same class;
    what only a run of ranks has comes from its controller, what it cannot do is refused."""
    from megatrain_nb.notebook.session import Session

    s = fake_session(total_steps=2)
    assert type(s) is Session and not Session.__subclasses__()
    members = [v for v in vars(Session).values() if callable(v) or isinstance(v, (property, classmethod))]
    assert len(members) <= 40
    with pytest.raises(AttributeError, match="no attribute 'ranks'"):
        s.ranks
    r = Session("micro", nproc_per_node=2)   # the launch folder is written; workers start at train()
    try:
        assert type(r) is Session and r.nproc_per_node == 2 and r.run_dir.is_dir()
        assert r.engine is None and r.trainer is None and r.state == "idle"
        for refused in (lambda: r.inspect(0), lambda: r.generate("x")):
            with pytest.raises(RuntimeError, match="weights are not in this kernel"):
                refused()
        with pytest.raises(RuntimeError, match="no running workers to snapshot"):
            r.snapshot()   # the ranks take it at a step boundary (forwarded); before train(), nothing to take
        with pytest.raises(RuntimeError, match=r"no running workers to snapshot now \(idle\): fork\(step=...\)"):
            r.fork()       # a fork launches new ranks from a snapshot: none yet
        with pytest.raises(LookupError, match="the steps that have one: none"):
            r.fork(3)
        assert r.snapshots == []
        assert [k for k, _ in r.launch_info()][:2] == ["ranks (nproc_per_node)", "output_dir"]
    finally:
        r.close()
    assert not r.run_dir.exists()
