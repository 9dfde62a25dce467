"""The Jupyter server extension: listing, commands, and refusing unauthenticated requests.

pytest-jupyter's fixtures are imported into this module only (not registered as a global
plugin), so their autouse fixtures do not reach the rest of the test suite; requests are run
on the fixture's event loop explicitly.
"""

from __future__ import annotations

import json
import time
from http.cookies import SimpleCookie

import pytest

pytest.importorskip("pytest_jupyter")
from pytest_jupyter.jupyter_server import *  # noqa: E402,F403 - fixtures for this module

from megatrain_nb.channel.beacon import SessionBeacon  # noqa: E402

from .conftest import wait_for  # noqa: E402
from .fakes import FakeSession  # noqa: E402


@pytest.fixture
def jp_server_config(runtime_root):
    return {"ServerApp": {"jpserver_extensions": {"megatrain_nb.lab": True}}}


@pytest.fixture
def fetch(jp_fetch, jp_asyncio_loop):
    """Synchronous jp_fetch returning (status, parsed JSON body or None)."""

    def do(*parts, method="GET", body=None, headers=None, **kw):
        if body is not None and not isinstance(body, (str, bytes)):
            body = json.dumps(body)
        r = jp_asyncio_loop.run_until_complete(
            jp_fetch(*parts, method=method, body=body, headers=headers, raise_error=False, **kw)
        )
        try:
            data = json.loads(r.body) if r.body else None
        except ValueError:
            data = None
        return r.code, data, r

    return do


@pytest.fixture
def running(runtime_root, monkeypatch):
    monkeypatch.setenv("JPY_SESSION_NAME", "from-env.ipynb")
    s = FakeSession("handler-run", total_steps=10)
    s.advance(3)
    b = SessionBeacon(s).start()
    yield s
    b.stop()


def test_list_empty(fetch):
    code, data, _ = fetch("megatrain-nb", "sessions")
    assert code == 200 and data["sessions"] == [] and abs(data["time"] - time.time()) < 5


def test_list_running_session(fetch, running):
    code, data, r = fetch("megatrain-nb", "sessions")
    assert code == 200 and r.headers["Content-Type"].startswith("application/json")
    [s] = data["sessions"]
    assert s["id"] == running.id and s["name"] == "handler-run"
    assert (s["state"], s["step"], s["total_steps"]) == ("running", 3, 10)
    assert s["notebook"] == "from-env.ipynb" and s["kernel_known"] is False
    assert len(s["loss_tail"]) == 3 and s["memory"]["device"]["used_bytes"] == 2**30


def test_the_listing_carries_each_runs_branches(fetch, running):
    class Tree:
        def sidebar_rows(self):
            return [{"run_id": "r1", "name": "handler-run", "state": "running", "step": 3, "loss": 2.0, "current": True},
                    {"run_id": "r2", "name": "fork", "parent_run_id": "r1", "forked_at_step": 2, "state": "idle"}]

    code, data, _ = fetch("megatrain-nb", "sessions")
    assert data["sessions"][0]["branches"] == []          # no branches yet
    running.explorer = Tree()
    wait_for(lambda: len(fetch("megatrain-nb", "sessions")[1]["sessions"][0]["branches"]) == 2, timeout=3.0)
    rows = fetch("megatrain-nb", "sessions")[1]["sessions"][0]["branches"]
    assert [(r["name"], r["parent_run_id"], r["forked_at_step"], r["state"]) for r in rows] == [
        ("handler-run", None, None, "running"), ("fork", "r1", 2, "idle")]


def test_notebook_path_comes_from_the_session_manager(fetch, running, jp_serverapp,
                                                      monkeypatch, runtime_root):
    hb = runtime_root / "sessions" / f"{running.id}.json"
    data = json.loads(hb.read_text())
    data["kernel_id"] = "k-123"
    hb.write_text(json.dumps(data))  # as if written from inside kernel k-123

    async def list_sessions():
        return [{"path": "notebooks/01-quickstart.ipynb", "kernel": {"id": "k-123"}}]

    monkeypatch.setattr(jp_serverapp.session_manager, "list_sessions", list_sessions)
    monkeypatch.setattr(jp_serverapp.kernel_manager, "list_kernel_ids", lambda: ["k-123"])
    _, out, _ = fetch("megatrain-nb", "sessions")
    [s] = out["sessions"]
    assert s["notebook"] == "notebooks/01-quickstart.ipynb" and s["kernel_known"] is True


@pytest.mark.parametrize(
    ("body", "kind", "check"),
    [({"command": "pause"}, "pause", lambda s: s.state == "paused"),
     ({"command": "stop", "value": None}, "stop", lambda s: s.state == "stopped"),
     ({"command": "lr", "value": 3e-4}, "lr", lambda s: s.lr == 3e-4)],
)
def test_command_reaches_the_session_within_a_second(fetch, running, body, kind, check):
    t0 = time.monotonic()
    code, data, _ = fetch("megatrain-nb", "sessions", running.id, "command",
                          method="POST", body=body)
    assert code == 202, data
    assert data["session_id"] == running.id and data["command"] == kind
    wait_for(lambda: check(running), timeout=2.0)
    assert time.monotonic() - t0 < 1.0
    assert running.events[-1]["kind"] == kind and running.events[-1]["source"] == "lab"


@pytest.mark.parametrize(
    ("body", "message"),
    [({"command": "explode"}, "unknown command 'explode'"),
     ({"command": "lr"}, "must be a finite number > 0"),
     ({"command": "lr", "value": -1}, "> 0"),
     ({"command": "pause", "value": 1}, "takes no value"),
     ("not json", "must be JSON"),
     ([1, 2], "JSON object")],
)
def test_bad_command_is_400_with_a_message(fetch, running, body, message):
    code, data, _ = fetch("megatrain-nb", "sessions", running.id, "command",
                          method="POST", body=body)
    assert code == 400 and message in data["message"]
    assert running.events == []


def test_unknown_session_is_404(fetch, running):
    code, data, _ = fetch("megatrain-nb", "sessions", "nosuchsession", "command",
                          method="POST", body={"command": "pause"})
    assert code == 404 and "nosuchsession" in data["message"]
    code, _, _ = fetch("megatrain-nb", "sessions", "bad.id", "command",
                       method="POST", body={"command": "pause"})
    assert code == 404


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_unauthenticated_request_is_refused(fetch, running, method):
    parts = (("megatrain-nb", "sessions") if method == "GET"
             else ("megatrain-nb", "sessions", running.id, "command"))
    body = {"command": "pause"} if method == "POST" else None
    for auth in ["", "token wrong-token"]:
        code, data, _ = fetch(*parts, method=method, body=body, headers={"Authorization": auth})
        assert code == 403, (auth, code, data)
        assert data is None or "sessions" not in data
    time.sleep(0.5)
    assert running.events == [] and running.state == "running"


def test_cookie_authenticated_post_needs_xsrf(fetch, running):
    # The browser's cookies: the login page sets _xsrf, a token-authenticated request logs in.
    jar = SimpleCookie()
    for parts, headers in [(("login",), {"Authorization": ""}), (("megatrain-nb", "sessions"), None)]:
        _, _, r = fetch(*parts, headers=headers, follow_redirects=False)
        for h in r.headers.get_list("Set-Cookie"):
            jar.load(h)
    assert "_xsrf" in jar and any(k.startswith("username-") for k in jar)
    cookie = "; ".join(f"{k}={m.value}" for k, m in jar.items())
    url = ("megatrain-nb", "sessions", running.id, "command")
    # A cookie-only POST without the XSRF token, as a forged cross-site form would be,
    code, _, _ = fetch(*url, method="POST", body={"command": "pause"},
                       headers={"Authorization": "", "Cookie": cookie})
    assert code == 403 and running.events == []
    # while JupyterLab's own request (cookie + X-XSRFToken header) goes through.
    code, _, _ = fetch(*url, method="POST", body={"command": "pause"},
                       headers={"Authorization": "", "Cookie": cookie,
                                "X-XSRFToken": jar["_xsrf"].value})
    assert code == 202
    wait_for(lambda: running.state == "paused")


@pytest.mark.parametrize(("body", "message"), [
    ("[" * 100_000 + "]" * 100_000, "at most 4096 bytes"),
    ("[" * 1000 + "]" * 1000, "nests 1000 levels"),
    ('{"command": "pause", "value": [[[[[[1]]]]]]}', "nests"),
])
def test_deeply_nested_or_huge_bodies_are_400_and_logged(fetch, running, body, message, caplog):
    import logging

    caplog.set_level(logging.WARNING)
    code, data, _ = fetch("megatrain-nb", "sessions", running.id, "command", method="POST", body=body)
    assert code == 400 and message in data["message"], (code, data)
    assert running.events == []
    assert any("refused a command" in r.getMessage() for r in caplog.records)

def test_dismiss_removes_an_ended_run_and_refuses_a_running_one(fetch, runtime_root):
    s = FakeSession("dismiss-run", total_steps=3)
    s.advance(3, loss=0.5)
    b = SessionBeacon(s).start()
    code, data, _ = fetch("megatrain-nb", "sessions", b.id, method="DELETE")
    assert code == 409 and "stop it" in data["message"]
    s.state = "finished"
    b.stop()
    _, listed, _ = fetch("megatrain-nb", "sessions")
    assert [(x["state"], x["loss"]) for x in listed["sessions"]] == [("finished", s.history[-1]["loss"])]
    code, _, _ = fetch("megatrain-nb", "sessions", b.id, method="DELETE")
    assert code == 204
    _, listed, _ = fetch("megatrain-nb", "sessions")
    assert listed["sessions"] == []
    code, _, _ = fetch("megatrain-nb", "sessions", b.id, method="DELETE")
    assert code == 404


@pytest.mark.parametrize("raw", ["1" + "0" * 400, "-1", "0", "11", '"x"', "[1]", "true", "NaN", "Infinity", "1e400"])
def test_a_bad_value_from_the_table_is_400_never_500(fetch, running, raw):
    """Issue 33: a 400-digit integer was a 500 (OverflowError); every refusal has the table's words."""
    from megatrain_nb.values import rule

    body = '{"command": "lr", "value": ' + raw + "}"
    code, data, _ = fetch("megatrain-nb", "sessions", running.id, "command", method="POST", body=body)
    assert code == 400, (raw, code, data)
    assert rule("learning_rate") in data["message"] or "JSON" in data["message"], data
    assert running.events == []


def test_runs_from_elsewhere_say_where_they_come_from_and_age_out(fetch, running, jp_serverapp, monkeypatch):
    """Issue 46 item 1: a run not in this server's kernels is marked so, with its origin in words
    (the beacon writes pid, parent pid, connection file and command); once ended, it is listed for
    ELSEWHERE_ENDED_KEPT seconds only. A kernel this server had stays "here" after it is gone."""
    from megatrain_nb.lab.handlers import ELSEWHERE_ENDED_KEPT, origin_text, place_sessions

    [s] = fetch("megatrain-nb", "sessions")[1]["sessions"]
    assert s["here"] is False and s["origin"]["kind"] == "process" and s["origin"]["pid"] == s["pid"]
    assert s["origin_text"] == f"{s['origin']['command']} ({'pid'} {s['pid']})" and s["origin"]["command"]
    now = 1000.0
    script = {"id": "a", "pid": 42, "kernel_id": None,
              "origin": {"kind": "process", "pid": 42, "command": "python train.py --steps 200"}}
    other_kernel = {"id": "b", "pid": 43, "kernel_id": "k-other", "origin": {"kind": "kernel", "pid": 43}}
    old_test = {"id": "c", "pid": 44, "kernel_id": None, "ended": now - ELSEWHERE_ENDED_KEPT - 1,
                "origin": {"kind": "process", "pid": 44, "command": "pytest tests/x.py"}}
    recent_test = dict(old_test, id="d", ended=now - 10)
    mine = {"id": "e", "pid": 45, "kernel_id": "k-1", "ended": now - 5000}   # this server's: kept until dismissed
    gone = {"id": "f", "pid": 46, "kernel_id": "k-0"}   # a kernel this server had, shut down since
    seen = {"k-0"}
    out = place_sessions([script, other_kernel, old_test, recent_test, mine, gone], {"k-1"}, seen, now)
    assert [x["id"] for x in out] == ["a", "b", "d", "e", "f"]
    assert [x["here"] for x in out] == [False, False, False, True, True]
    assert [x.get("origin_text") for x in out[:3]] == [
        "python train.py --steps 200 (pid 42)", "a kernel of another Jupyter server (pid 43)", "pytest tests/x.py (pid 44)"]
    assert seen == {"k-0", "k-1"}   # remembered for the polls to come
    assert origin_text({"pid": 7, "kernel_id": None}) == "a process (pid 7)"   # an older heartbeat
