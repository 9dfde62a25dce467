"""The session beacon and the registry: heartbeat files, permissions, commands, liveness."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time

import pytest

from megatrain_nb.channel.beacon import SessionBeacon
from megatrain_nb.commands import check_command
from megatrain_nb.channel.protocol import CommandError
from megatrain_nb.channel.registry import (
    UnknownSession,
    enqueue_command,
    get_session,
    list_sessions,
)

from .conftest import wait_for
from .fakes import FakeSession, MinimalSession


def _drop(path, text: str) -> None:
    """A command file put in the inbox as its writers do (atomic_write_json): written under a
    temporary name and renamed, so the beacon's poll never reads it half written."""
    tmp = path.with_name(path.name + ".tmp-test")
    tmp.write_text(text)
    os.replace(tmp, path)


def mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def beacon_for(runtime_root):
    started = []

    def make(session, **kw):
        b = SessionBeacon(session, **kw).start()
        started.append(b)
        return b

    yield make
    for b in started:
        b.stop()


def test_heartbeat_content_and_permissions(runtime_root, beacon_for, monkeypatch):
    monkeypatch.setenv("JPY_SESSION_NAME", "notebooks/01-quickstart.ipynb")
    old = os.umask(0o022)  # a permissive umask must not leak into the files
    try:
        s = FakeSession("tiny-gpt", total_steps=40)
        s.advance(4, loss=3.5)
        b = beacon_for(s)
    finally:
        os.umask(old)

    hb = runtime_root / "sessions" / f"{s.id}.json"
    assert mode(runtime_root) == 0o700
    assert mode(runtime_root / "sessions") == 0o700
    assert mode(b.inbox) == 0o700
    assert mode(hb) == 0o600
    data = json.loads(hb.read_text())  # strict JSON
    assert data["id"] == s.id and data["name"] == "tiny-gpt"
    assert data["pid"] == os.getpid() and data["kernel_id"] is None
    assert data["notebook"] == "notebooks/01-quickstart.ipynb"
    assert (data["state"], data["step"], data["total_steps"]) == ("running", 4, 40)
    assert data["loss"] == pytest.approx(3.5 * 0.99**3)
    assert data["lr"] == 1e-3 and data["tokens_per_s"] == 1000.0
    assert data["loss_tail"] == pytest.approx([3.5 * 0.99**i for i in range(4)])
    assert data["memory"]["device"]["used_bytes"] == 2**30
    assert data["memory"]["device"]["capacity_bytes"] == 2**34
    assert data["memory"]["device"]["breakdown"] == {"weights": 2**29}
    assert data["memory"]["host"]["peak_bytes"] is None
    assert abs(data["updated"] - time.time()) < 2
    assert not list((runtime_root / "sessions").glob(".*.tmp"))


def test_loose_existing_folders_are_tightened(runtime_root, beacon_for):
    (runtime_root / "sessions").mkdir(parents=True, mode=0o755)
    os.chmod(runtime_root, 0o755)
    os.chmod(runtime_root / "sessions", 0o755)
    beacon_for(FakeSession())
    assert mode(runtime_root) == 0o700 and mode(runtime_root / "sessions") == 0o700


def test_a_folder_writable_by_others_is_refused(runtime_root, beacon_for):
    from megatrain_nb.channel.protocol import UnsafeFolderError

    (runtime_root / "sessions").mkdir(parents=True, mode=0o700)
    os.chmod(runtime_root / "sessions", 0o777)  # others could have planted files in it
    with pytest.raises(UnsafeFolderError, match="writable by group or others.*chmod 700"):
        beacon_for(FakeSession())


def test_heartbeat_follows_the_session(runtime_root, beacon_for):
    s = FakeSession()
    beacon_for(s, interval=0.2)
    s.advance(150)
    data, waited = wait_for(lambda: (d := get_session(s.id)) and d["step"] == 150 and d)
    assert waited < 1.0
    assert len(data["loss_tail"]) == 100  # bounded


def test_minimal_session_without_optional_attributes(runtime_root, beacon_for):
    s = MinimalSession()
    b = beacon_for(s)
    data = json.loads(b.heartbeat_file.read_text())
    assert data["id"] == b.id and len(b.id) >= 8  # generated fallback id
    assert data["total_steps"] is None
    assert data["loss"] is None and data["loss_tail"] == [None]  # NaN is not JSON
    assert data["memory"] is None
    enqueue_command(b.id, "lr", 5e-5)
    enqueue_command(b.id, "pause")
    wait_for(lambda: s.calls == [("lr", 5e-5), ("pause",)])


def test_unsafe_session_id_is_digested(runtime_root, beacon_for):
    s = FakeSession(sid="../../etc/passwd")
    b = beacon_for(s)
    assert b.heartbeat_file.parent == runtime_root / "sessions"
    assert len(b.id) == 16 and b.id.isalnum()


@pytest.mark.parametrize(
    ("command", "value", "event"),
    [("pause", None, "pause"), ("stop", None, "stop"), ("lr", 2.5e-4, "lr")],
)
def test_command_takes_effect_within_one_second(runtime_root, beacon_for, command, value, event):
    s = FakeSession()
    b = beacon_for(s)
    t0 = time.monotonic()
    rec = enqueue_command(s.id, command, value)
    _, waited = wait_for(lambda: s.events, timeout=2.0)
    assert time.monotonic() - t0 < 1.0, f"applied after {waited:.2f} s"
    ev = s.events[0]
    assert ev["kind"] == event and ev["source"] == "lab"
    if command == "lr":
        assert ev["value"] == value and s.lr == value
    # the heartbeat reports the outcome so the sidebar can show it
    hb, _ = wait_for(lambda: (d := get_session(s.id)).get("last_command") and d)
    assert hb["last_command"]["id"] == rec["id"] and hb["last_command"]["ok"] is True
    assert list(b.inbox.iterdir()) == []  # consumed


def test_pause_then_resume_in_order(runtime_root, beacon_for):
    s = FakeSession()
    beacon_for(s)
    enqueue_command(s.id, "pause")
    enqueue_command(s.id, "resume")
    wait_for(lambda: len(s.events) == 2)
    assert [e["kind"] for e in s.events] == ["pause", "resume"] and s.state == "running"


def test_invalid_commands_are_refused(runtime_root, beacon_for):
    s = FakeSession()
    b = beacon_for(s)
    for command, value in [("explode", None), ("lr", None), ("lr", -1), ("lr", "nan"),
                           ("pause", 3)]:
        with pytest.raises(CommandError):
            enqueue_command(s.id, command, value)
    assert not list(b.inbox.iterdir())
    with pytest.raises(UnknownSession):
        enqueue_command("nosuchsession", "pause")
    with pytest.raises(UnknownSession):
        enqueue_command("../x", "pause")


def test_a_bad_command_file_is_reported_not_fatal(runtime_root, beacon_for):
    s = FakeSession()
    b = beacon_for(s)
    _drop(b.inbox / "1-bad.json", '{"command": "lr", "value": "fast"}')
    _drop(b.inbox / "2-junk.json", "not json")
    _drop(b.inbox / "3-ok.json", '{"command": "pause", "value": null}')
    wait_for(lambda: s.state == "paused")
    assert [e["kind"] for e in s.events] == ["pause"]
    hb, _ = wait_for(lambda: (get_session(s.id).get("last_command") or {}).get("id") == "3-ok"
                     and get_session(s.id))
    assert hb["last_command"]["ok"] is True
    assert b.running


def test_failing_session_method_is_reported(runtime_root, beacon_for):
    s = FakeSession()

    def broken(source="notebook"):
        raise RuntimeError("cannot pause a finished run")

    s.pause = broken
    b = beacon_for(s)
    enqueue_command(s.id, "pause")
    hb, _ = wait_for(lambda: get_session(s.id).get("last_command"))
    assert hb["ok"] is False and "cannot pause a finished run" in hb["error"]
    assert b.running


def test_stop_removes_files(runtime_root, beacon_for):
    s = FakeSession()
    b = beacon_for(s)
    assert [x["id"] for x in list_sessions()] == [s.id]
    b.stop()
    assert not b.heartbeat_file.exists() and not b.inbox.exists()
    assert list_sessions() == []
    b.stop()  # idempotent


def _write_heartbeat(root, sid, **fields):
    d = root / "sessions"
    d.mkdir(parents=True, exist_ok=True)
    data = {"id": sid, "name": sid, "pid": os.getpid(), "state": "running",
            "updated": time.time(), "started": time.time(), **fields}
    (d / f"{sid}.json").write_text(json.dumps(data))
    (d / f"{sid}.inbox").mkdir(exist_ok=True)
    return d / f"{sid}.json"


def test_stale_and_dead_sessions_are_dropped(runtime_root):
    fresh = _write_heartbeat(runtime_root, "fresh")
    silent = _write_heartbeat(runtime_root, "silent", updated=time.time() - 10)
    abandoned = _write_heartbeat(runtime_root, "abandoned", updated=time.time() - 600)
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    dead = _write_heartbeat(runtime_root, "dead", pid=p.pid)
    other_host = _write_heartbeat(runtime_root, "elsewhere", pid=p.pid, host="not-this-host")

    assert {s["id"] for s in list_sessions()} == {"fresh", "elsewhere"}
    assert fresh.exists() and silent.exists() and other_host.exists()  # hidden, kept
    assert not abandoned.exists() and not dead.exists()  # cleaned, inbox too
    assert not (runtime_root / "sessions" / "dead.inbox").exists()


BEACON_CHILD = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {tests!r})
    from lab.fakes import FakeSession
    from megatrain_nb.channel.beacon import SessionBeacon
    s = FakeSession("child", sid="childsession")
    SessionBeacon(s, interval=0.2).start()
    print("ready", flush=True)
    while True:
        s.advance(); time.sleep(0.05)
    """
)


def test_killed_kernel_disappears_within_seconds(runtime_root):
    tests_dir = os.path.dirname(os.path.dirname(__file__))
    code = BEACON_CHILD.format(tests=tests_dir)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), tests_dir])}
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=env)
    try:
        assert p.stdout.readline().strip() == b"ready"
        wait_for(lambda: [s["id"] for s in list_sessions()] == ["childsession"])
        os.kill(p.pid, signal.SIGKILL)  # no clean-up code runs; not reaped yet (a zombie)
        _, waited = wait_for(lambda: list_sessions() == [], timeout=6.0)
        assert waited < 3.0
        assert not (runtime_root / "sessions" / "childsession.json").exists()
    finally:
        p.kill()
        p.wait()


@pytest.mark.parametrize(
    ("command", "value", "expected"),
    [("pause", None, ("pause", None)), ("resume", None, ("resume", None)),
     ("stop", None, ("stop", None)), ("lr", 1e-4, ("lr", 1e-4)), ("lr", "3e-4", ("lr", 3e-4))],
)
def test_the_sidebars_check_accepts(command, value, expected):
    assert check_command(command, value, sidebar=True) == expected


@pytest.mark.parametrize(
    ("command", "value", "message"),
    [("Pause", None, "unknown command"), (None, None, "unknown command"),
     ("stop", 1, "takes no value"), ("lr", None, "must be a finite number > 0"),
     ("lr", True, "must be a finite number > 0"), ("lr", "abc", "must be a finite number > 0"),
     ("lr", 0, "> 0"), ("lr", float("inf"), "finite"), ("lr", 100, "implausibly large")],
)
def test_the_sidebars_check_refuses(command, value, message):
    with pytest.raises(CommandError, match=message):
        check_command(command, value, sidebar=True)


def test_enum_state_deque_history_and_sparse_memory(runtime_root, beacon_for):
    import collections
    import enum

    class State(str, enum.Enum):
        RUNNING = "running"

    s = FakeSession()
    s.advance(2)  # record 2 carries memory
    s.history.extend({"step": i, "loss": 1.0, "lr": 1e-3} for i in range(3, 300))
    s.history = collections.deque(s.history)
    s.state = State.RUNNING
    b = beacon_for(s)
    data = b.snapshot()
    assert data["state"] == "running" and len(data["loss_tail"]) == 100
    assert data["memory"] is None  # the memory record is far behind the tail: not seen
    s.history.append({"step": 300, "loss": 1.0, "memory": {"host": {"used_bytes": 5}}})
    b.snapshot()
    s.history.append({"step": 301, "loss": 1.0})
    for _ in range(150):
        s.history.append({"step": 302, "loss": 1.0})
    # ... and once seen, the latest memory report stays until a newer one comes
    assert b.snapshot()["memory"] == {"host": {"used_bytes": 5}}


def _refused(s):
    return get_session(s.id).get("refused_commands") or []


def test_an_oversized_command_file_is_refused_unread(runtime_root, beacon_for):
    import resource

    s = FakeSession()
    b = beacon_for(s, poll=0.05)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    big = b.inbox / "1-big.json"
    # a sparse 300 MB file: cheap to make, expensive to read; put in place by a rename, as every
    # writer of the inbox does (atomic_write_json) -- the beacon never sees it half made
    tmp = b.inbox / "1-big.json.tmp-test"
    with open(tmp, "wb") as f:
        f.truncate(300 << 20)
    os.replace(tmp, big)
    _drop(b.inbox / "2-ok.json", '{"command": "pause", "value": null}')
    wait_for(lambda: s.state == "paused")
    refused, _ = wait_for(lambda: _refused(s))
    assert refused[0]["id"] == "1-big" and "over the 4096-byte limit; not read" in refused[0]["error"]
    assert not big.exists()
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 100 << 10   # KiB: never read whole


def test_a_command_file_that_grows_while_it_is_opened_is_refused_alike(tmp_path, monkeypatch):
    """A writer that grows the file after the size check (no rename): one read of at most the
    limit + 1 bytes, refused with the same words as a file refused from its size."""
    from megatrain_nb.channel import protocol

    path = tmp_path / "1-grows.json"
    path.write_bytes(b" " * (protocol.MAX_COMMAND_BYTES + 10))
    real = os.fstat

    def small(fd):   # what the check saw before the writer grew it
        st = real(fd)
        return os.stat_result((st.st_mode, st.st_ino, st.st_dev, st.st_nlink, st.st_uid, st.st_gid, 2,
                               st.st_atime, st.st_mtime, st.st_ctime))
    monkeypatch.setattr(protocol.os, "fstat", small)
    with pytest.raises(protocol.CommandError, match="over the 4096-byte limit; not read"):
        protocol.read_command_file(path)


def test_a_folder_named_like_a_command_is_moved_aside_and_reported_once(runtime_root, beacon_for, caplog):
    import logging

    s = FakeSession()
    caplog.set_level(logging.WARNING, logger="megatrain_nb.channel.beacon")
    b = beacon_for(s, poll=0.02)
    (b.inbox / "1-dir.json").mkdir()
    os.mkfifo(b.inbox / "2-fifo.json")
    wait_for(lambda: len(_refused(s)) == 2)
    time.sleep(0.5)   # some 25 polls
    assert sorted(p.name for p in b.inbox.iterdir()) == [".refused-1-dir.json", ".refused-2-fifo.json"]
    assert [r["id"] for r in _refused(s)] == ["1-dir", "2-fifo"]
    assert "not a regular file" in _refused(s)[0]["error"]
    warned = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(warned) == 2, [r.getMessage() for r in warned]
    enqueue_command(s.id, "pause")   # the inbox goes on working
    wait_for(lambda: s.state == "paused")
    assert b.running


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, '{"command": {"a": {"b": {"c": {"d": 1}}}}}',
                                  "not json"])
def test_bad_or_deeply_nested_json_is_refused_and_recorded(runtime_root, beacon_for, text):
    s = FakeSession()
    b = beacon_for(s, poll=0.05)
    _drop(b.inbox / "1-deep.json", text[:4000] if len(text) > 4000 and text[0] == "{" else text)
    refused, _ = wait_for(lambda: _refused(s))
    assert refused[0]["id"] == "1-deep" and "CommandError" in refused[0]["error"]
    assert get_session(s.id)["last_command"]["ok"] is False
    assert s.events == [] and b.running


def test_command_json_limits():
    from megatrain_nb.channel.protocol import MAX_COMMAND_BYTES, parse_command_json

    assert parse_command_json(b'{"command": "lr", "value": "[[[[[["}') == {"command": "lr", "value": "[[[[[["}
    assert parse_command_json('{"command": "x", "value": "\\\\\\"[[[[[["}')["value"] == '\\"[[[[[['
    for bad, why in [(b"[" * 3000, "nests"), (b" " * (MAX_COMMAND_BYTES + 1), "at most"), (b"{", "not valid JSON")]:
        with pytest.raises(CommandError, match=why):
            parse_command_json(bad)

def test_a_finished_run_stays_listed_with_its_final_loss_until_dismissed(runtime_root):
    from megatrain_nb.channel.registry import StillRunning, dismiss_session

    s = FakeSession("done-run", total_steps=5)
    s.advance(5, loss=1.25)
    b = SessionBeacon(s).start()
    with pytest.raises(StillRunning):
        dismiss_session(b.id)  # a live run is stopped first, not dismissed
    s.state = "finished"
    b.stop()
    [info] = list_sessions()
    assert info["state"] == "finished" and info["loss"] == s.history[-1]["loss"] and info["step"] == 5
    assert isinstance(info["ended"], float)
    assert not b.inbox.exists()
    # its process gone and silent for minutes: still listed (over, not lost)
    later = list_sessions(now=time.time() + 600)
    assert [x["id"] for x in later] == [b.id]
    with pytest.raises(UnknownSession):
        enqueue_command(b.id, "pause")  # nothing reads its commands any more
    dismiss_session(b.id)
    assert list_sessions() == [] and not b.heartbeat_file.exists()


def test_a_beacon_stopped_while_running_leaves_nothing(runtime_root):
    s = FakeSession("interrupted", total_steps=5)
    b = SessionBeacon(s).start()
    b.stop()
    assert list_sessions() == [] and not b.heartbeat_file.exists()


def test_the_heartbeat_carries_a_requested_learning_rate(runtime_root):
    s = FakeSession("lr-run", total_steps=5)
    s.requested_lr = 5e-4
    b = SessionBeacon(s).start()
    try:
        assert list_sessions()[0]["requested_lr"] == 5e-4
    finally:
        b.stop()


class _Explorer:
    def __init__(self, rows):
        self.rows = rows

    def sidebar_rows(self):
        return self.rows


def test_the_heartbeat_lists_the_runs_branches_cleaned(runtime_root):
    s = FakeSession("tree-run", total_steps=5)
    s.explorer = _Explorer([
        {"run_id": "aaa", "name": "tree-run", "parent_run_id": None, "forked_at_step": None, "state": "running",
         "step": 9, "loss": 2.5, "changes": "", "current": True, "records": [{"step": 1}] * 500},
        {"run_id": "bbb", "name": "low-lr", "parent_run_id": "aaa", "forked_at_step": 4, "state": "paused",
         "step": 6, "loss": float("nan"), "changes": "learning_rate=0.0001", "current": False},
        "not a row",
    ])
    b = SessionBeacon(s).start()
    try:
        got = list_sessions()[0]["branches"]
        # only the listed fields travel (not the records), NaN as null, non-rows dropped
        assert got == [
            {"run_id": "aaa", "name": "tree-run", "parent_run_id": None, "forked_at_step": None, "state": "running",
             "step": 9, "loss": 2.5, "changes": "", "current": True},
            {"run_id": "bbb", "name": "low-lr", "parent_run_id": "aaa", "forked_at_step": 4, "state": "paused",
             "step": 6, "loss": None, "changes": "learning_rate=0.0001", "current": False}]
        s.explorer = _Explorer(None)            # a failing or odd explorer: no branches, heartbeat goes on
        b.write_heartbeat()
        assert list_sessions()[0]["branches"] == []
    finally:
        b.stop()
    plain = FakeSession("no-tree")
    b = SessionBeacon(plain).start()
    try:
        assert list_sessions()[0]["branches"] == []
    finally:
        b.stop()


def test_a_finished_run_whose_process_exited_goes_after_a_while(runtime_root):
    """Issue 36: cards of exited kernels' runs stayed "finished" for a day (44 in an afternoon)."""
    from megatrain_nb.channel.registry import DEAD_ENDED_KEPT

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    t = time.time()
    _write_heartbeat(runtime_root, "exited", pid=p.pid, state="finished", ended=t, updated=t)
    _write_heartbeat(runtime_root, "alive", state="finished", ended=t, updated=t)   # this process
    assert {s["id"] for s in list_sessions(now=t + 60)} == {"exited", "alive"}   # its final loss, a while
    later = list_sessions(now=t + DEAD_ENDED_KEPT + 1)
    assert [s["id"] for s in later] == ["alive"]   # a kernel that still holds its run keeps the card
    assert not (runtime_root / "sessions" / "exited.json").exists()
