"""The learning rate is one value (issue 43): set through every door (the Python call, the
magic, the run's inbox, the server's HTTP route, a fork) on a linear schedule, every view -- the
dashboard's header and field, the heartbeat the sidebar lists, the summary HTML, the report --
agrees with the rate the engine's AdamW was given at every step, and nothing stays pending once a
step has used the request."""
from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest
import torch

pytest.importorskip("pytest_jupyter")
from pytest_jupyter.jupyter_server import *  # noqa: E402,F403 - fixtures for this module

from .conftest import wait_for  # noqa: E402
from .test_command_doors import _send, jp_server_config, post  # noqa: E402,F401 - fixtures

BASE, TOTAL, ASKED = 3e-3, 12, 1e-3


def _linear(step_done: int) -> float:
    """transformers' linear schedule without warm-up: the rate of the step after ``step_done``."""
    return BASE * (TOTAL - step_done) / TOTAL


@pytest.fixture
def lr_session(tmp_path, runtime_root):
    import datasets
    from transformers import AutoModelForCausalLM, TrainingArguments

    from megatrain_nb.model_configs import preset_config
    from megatrain_nb.notebook import Session

    torch.manual_seed(0)
    rows = np.random.default_rng(0).integers(0, 512, size=(64, 16)).tolist()
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=TOTAL, per_device_train_batch_size=2,
                             learning_rate=BASE, lr_scheduler_type="linear", logging_steps=1, report_to="none",
                             save_strategy="no", disable_tqdm=True, use_cpu=True)
    s = Session(AutoModelForCausalLM.from_config(preset_config("micro")),
                train_dataset=datasets.Dataset.from_dict({"input_ids": rows}), args=args, name="lr-doors")
    given: list[float] = []   # the rate each optimizer step handed the engine's AdamW
    engine = s.trainer.engine
    inner = engine.forward_backward

    def spy(*a, **kw):
        given.append(float(kw["step_lr"]))
        return inner(*a, **kw)

    engine.forward_backward = spy
    made = [s]
    yield s, given, made
    for m in made:
        with contextlib.suppress(Exception):
            m.stop(wait=True, timeout=30)
            m.close()


def _views(s) -> dict:
    """What each view shows of the learning rate now."""
    from megatrain_nb.channel.registry import get_session
    from megatrain_nb.notebook.summary_html import header_html

    beat = wait_for(lambda: (lambda b: b if b.get("step") == s.step else None)(get_session(s.id)), timeout=10)[0]
    d = s.dashboard()
    d.refresh(force=True)
    return {"beat": beat, "header": header_html(s, s.run_log.view()), "field": d.lr_field.value,
            "learning_rate": s.learning_rate}


@pytest.mark.parametrize("door", ("python", "magic", "inbox", "http", "fork"))
def test_the_learning_rate_is_one_value_through_every_door(lr_session, post, door, tmp_path):
    from megatrain_nb.notebook.report import build_notebook

    s, given, made = lr_session
    s.train(dashboard=False)
    s.wait(until_step=3, timeout=60)
    s.pause()
    wait_for(lambda: s.state == "paused", timeout=20)
    paused_at = s.step
    if door == "fork":
        child = s.fork(learning_rate=ASKED, name="lr-fork")
        made.append(child)
        s.stop(wait=True, timeout=30)
        s = child
        s.train(dashboard=False)
    else:
        _, refused = _send(door, s, post, "lr", str(ASKED))
        assert refused is None, refused
        wait_for(lambda: any(e["kind"] == "lr" for e in s.run_log.events()), timeout=20)
        lr = s.learning_rate   # taken at the boundary, used by no step yet: pending, and every view says so
        assert lr.requested == ASKED and lr.applies_at == paused_at + 1 and lr.last == pytest.approx(
            _linear(paused_at - 1))
        v = _views(s)
        assert v["beat"]["requested_lr"] == ASKED and v["field"] == pytest.approx(float(f"{ASKED:.3g}"))
        assert "mtnb-dash-lr-pending" in v["header"]
        s.resume()
    assert s.wait(timeout=120) == "finished"
    records = s.history
    assert [r["step"] for r in records][-1] == TOTAL
    if door == "fork":   # the child: the same linear schedule with the asked base rate, from the fork's step
        child = [r for r in records if r["step"] > paused_at]
        assert child and given[-len(child):] == pytest.approx([r["lr"] for r in child], rel=1e-6)
        for r in child:
            assert r["lr"] == pytest.approx(ASKED / BASE * _linear(r["step"] - 1), rel=1e-6), r
    else:
        for r, lr in zip(records, given):
            k = r["step"]
            want = _linear(k - 1) if k <= paused_at else ASKED * _linear(k - 1) / _linear(paused_at)
            assert r["lr"] == pytest.approx(want, rel=1e-6) and lr == pytest.approx(want, rel=1e-6), (k, r["lr"], lr)
        assert len(given) == TOTAL
    # after it applied: nothing pending anywhere, and every view shows the latest step's rate
    last = records[-1]["lr"]
    v = _views(s)
    assert not v["learning_rate"].pending and v["learning_rate"].last == pytest.approx(last)
    assert s.requested_lr is None and v["beat"]["requested_lr"] is None
    assert v["beat"]["lr"] == pytest.approx(last)
    assert "mtnb-dash-lr-pending" not in v["header"] and f"mtnb-dash-lr'>{last:.3g}<" in v["header"]
    assert v["field"] == pytest.approx(float(f"{last:.3g}"))
    report = json.dumps(build_notebook(s))
    assert f"{last:.3g}" in report
