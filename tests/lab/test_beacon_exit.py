"""Ended sessions' heartbeat files do not pile up in the runtime folder (issue 44 item 10): an
ended run's last heartbeat stays while its process lives (the sidebar shows its final loss until
dismissed) and goes when the process exits; a beacon starting tidies the files of sessions whose
process is gone, without waiting for a Jupyter server to list them."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from megatrain_nb.channel.beacon import SessionBeacon
from megatrain_nb.channel.registry import list_sessions

from .fakes import FakeSession

REPO = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent("""
    import sys, json
    sys.path.insert(0, {repo!r})
    from megatrain_nb.channel.beacon import SessionBeacon
    from tests.lab.fakes import FakeSession
    files = []
    for i in range(3):
        s = FakeSession(f"run-{{i}}")
        b = SessionBeacon(s, interval=0.05, poll=0.05).start()
        s.state = "finished"
        b.stop()
        files.append(str(b.heartbeat_file))
    import os
    print(json.dumps([os.path.exists(f) for f in files]))
    {end}
""")


def _child(root: Path, end: str = "") -> list:
    env = dict(os.environ, MEGATRAIN_NB_RUNTIME_DIR=str(root), PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", CHILD.format(repo=str(REPO), end=end)], env=env, check=True,
                         capture_output=True, text=True, timeout=120).stdout
    return json.loads(out.strip().splitlines()[-1])


def _heartbeats(root: Path) -> list:
    return sorted(p.name for p in (root / "sessions").glob("*.json")) if (root / "sessions").is_dir() else []


def test_ended_sessions_files_go_when_their_process_exits(runtime_root):
    assert _child(runtime_root) == [True, True, True]   # kept while the process lives: the sidebar's cards
    assert _heartbeats(runtime_root) == []               # gone with it, no Jupyter server needed
    assert not list((runtime_root / "sessions").glob("*.inbox"))


def test_a_starting_beacon_tidies_the_files_of_processes_that_are_gone(runtime_root):
    _child(runtime_root, end="os._exit(0)")   # (no exit handlers: as a kill -9)
    assert len(_heartbeats(runtime_root)) == 3   # ended, their process gone: kept a while for the sidebar
    for f in (runtime_root / "sessions").glob("*.json"):   # ... until DEAD_ENDED_KEPT has passed
        data = json.loads(f.read_text())
        data["ended"] = data["updated"] = data["ended"] - 3600
        f.write_text(json.dumps(data))
    s = FakeSession("new")
    b = SessionBeacon(s, interval=0.05, poll=0.05).start()
    try:
        assert _heartbeats(runtime_root) == [f"{b.id}.json"]
        assert [x["id"] for x in list_sessions()] == [b.id]
    finally:
        b.stop()
    assert _heartbeats(runtime_root) == []   # a run that did not end: removed at stop, as before
