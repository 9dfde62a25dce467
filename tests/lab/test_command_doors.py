"""Every command of the table through every door, in one process (issue 34): the Python call,
``%megatrain``, the run's inbox and the Jupyter server's HTTP route reach one step-boundary
controller (``trainer/boundary.py``) and see the same effect, or the same refusal words.

One real Session (a micro model, CPU) per door, paused at a step boundary: each command is
applied there at once, and recorded in the run log. The HTTP route takes what the sidebar
sends (pause, resume, lr, stop); the inbox takes what a run's inbox carries (all but fork,
whose changes JSON cannot hold as the table's tuple); each refuses the others with the table's
words, and a bad value with the value table's rule.
"""
from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import pytest
import torch

pytest.importorskip("pytest_jupyter")
from pytest_jupyter.jupyter_server import *  # noqa: E402,F403 - fixtures for this module

from megatrain_nb.commands import COMMANDS, RANKS, SIDEBAR, check_command  # noqa: E402
from megatrain_nb.values import rule  # noqa: E402

from .conftest import wait_for  # noqa: E402

DOORS = ("python", "magic", "inbox", "http")
#: what each door carries; the rest it refuses with the table's words (the inbox: a fork's value,
#: ``(step, name, changes)``, is no JSON; the HTTP route: only the sidebar's rows)
CARRIES = {"python": tuple(COMMANDS), "magic": tuple(COMMANDS), "inbox": RANKS, "http": SIDEBAR}


@pytest.fixture
def jp_server_config(runtime_root):
    return {"ServerApp": {"jpserver_extensions": {"megatrain_nb.lab": True}}}


@pytest.fixture
def post(jp_fetch, jp_asyncio_loop):
    def do(session_id, body):
        r = jp_asyncio_loop.run_until_complete(jp_fetch("megatrain-nb", "sessions", session_id, "command",
                                                        method="POST", body=json.dumps(body), raise_error=False))
        return r.code, json.loads(r.body)
    return do


@pytest.fixture
def session(tmp_path, runtime_root):
    import datasets
    from transformers import AutoModelForCausalLM, TrainingArguments

    from megatrain_nb.notebook import Session
    from megatrain_nb.model_configs import preset_config

    torch.manual_seed(0)
    rows = np.random.default_rng(0).integers(0, 512, size=(64, 16)).tolist()
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=40, per_device_train_batch_size=2,
                             learning_rate=3e-3, lr_scheduler_type="constant", logging_steps=1, report_to="none",
                             save_strategy="no", disable_tqdm=True, use_cpu=True)
    s = Session(AutoModelForCausalLM.from_config(preset_config("micro")),
                train_dataset=datasets.Dataset.from_dict({"input_ids": rows}), args=args, name="doors")
    made = [s]
    yield s, made
    for m in made:
        with contextlib.suppress(Exception):
            m.stop(wait=True, timeout=30)
            m.close()


def _send(door, s, post, name, value=None):
    """``name`` (with ``value``) through ``door``: (what it returned, the refusal's words or None)."""
    if door == "python":
        method = getattr(s, COMMANDS[name].method)
        try:
            if name == "fork":
                return method(**value), None
            return (method(value) if value is not None else method()), None
        except ValueError as e:
            return None, str(e)
    if door == "magic":
        from megatrain_nb.notebook.magics import megatrain

        arg = " ".join(f"{k}={v}" for k, v in value.items()) if name == "fork" else "" if value is None else value
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            got = megatrain(f"-s {s.name} {name} {arg}".strip())
        text = out.getvalue()
        return got, (text if text.startswith("megatrain:") else None)
    if door == "inbox":   # the inbox's one writer, as a controller Session or the server writes it
        from megatrain_nb.channel.protocol import write_command

        msg = write_command(s.id, name, value)
        beat = wait_for(lambda: _last_command(s.id, msg["id"]), timeout=10)[0]
        return None, (None if beat["ok"] else beat["error"])
    code, data = post(s.id, {"command": name, "value": value})
    if code != 202:
        return None, data["message"]
    beat = wait_for(lambda: _last_command(s.id, data["id"]), timeout=10)[0]
    return None, (None if beat["ok"] else beat["error"])


def _last_command(session_id, command_id):
    from megatrain_nb.channel.registry import get_session

    last = get_session(session_id).get("last_command") or {}
    return last if last.get("id") == command_id else None


def _kinds(s):
    return [e["kind"] for e in s.run_log.events()]


@pytest.mark.parametrize("door", DOORS)
def test_every_command_through_every_door(session, post, door):
    s, made = session
    s.train(dashboard=False)
    s.wait(until_step=2, timeout=60)
    value = {"lr": "2e-3", "checkpoint": None, "rewind": None, "fork": {"learning_rate": 1e-3}}
    bad = {"lr": "-1", "rewind": "-2"}
    for name in ("pause", "lr", "checkpoint", "snapshot", "rewind", "fork", "resume", "stop"):
        if name == "rewind":
            value["rewind"] = s.step   # the snapshot just taken
        v = value.get(name)
        before = len(_kinds(s))
        if name not in CARRIES[door]:   # refused with the table's words, nothing applied
            _, refused = _send(door, s, post, name, v)
            table_words = _refusal(name, v, door)
            assert refused is not None and table_words in refused, (door, name, refused)
            assert len(_kinds(s)) == before
            continue
        if name in bad:   # a bad value: the value table's rule, through this door as through every other
            _, refused = _send(door, s, post, name, bad[name])
            assert refused is not None and rule("learning_rate" if name == "lr" else "step") in refused, refused
            assert len(_kinds(s)) == before
        got, refused = _send(door, s, post, name, v)
        assert refused is None, (door, name, refused)
        if name == "fork" and got is not None:
            made.append(got)
        wait_for(lambda: name in _kinds(s)[before:], timeout=20)
        _same_effect(s, name)
    assert s.wait(timeout=30) == "stopped"


def _refusal(name, value, door):
    """The table's words for ``name`` refused at ``door``."""
    try:
        check_command(name, value, sidebar=door == "http")
    except ValueError as e:
        return str(e).split(":")[0]
    if name == "fork":   # JSON has no tuple: the table's shape of a fork's value
        return "command 'fork' takes (step or None, name or None, changes)"
    raise AssertionError(f"{door} should refuse {name}")


def _same_effect(s, name):
    """What each command does, whichever door it came through."""
    ev = [e for e in s.run_log.events() if e["kind"] == name][-1]
    if name == "pause":
        assert s.state == "paused"
    elif name == "resume":
        assert s.state in ("running", "stopped")
    elif name == "lr":
        assert ev["value"] == 2e-3 and s.trainer.schedule.current() == pytest.approx(2e-3)
    elif name in ("checkpoint", "snapshot"):
        assert ev["path"] and (s.trainer.args.output_dir in ev["path"])
    elif name == "rewind":
        assert ev["step"] == s.step and s.state == "paused"
    elif name == "fork":
        assert ev["changes"]
