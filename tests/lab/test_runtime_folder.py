"""The runtime folder is refused when another user could control it: owned by someone else,
writable by others, or a symlink; heartbeat and command files are never followed through a
symlink. Run as another uid by dropping privileges in a forked child."""
import json
import os
import shutil
import time
from pathlib import Path

import pytest

from megatrain_nb.channel import protocol, registry
from megatrain_nb.channel.beacon import SessionBeacon

from ..privileges import as_user, needs_root, shared_dir
from .fakes import FakeSession


@pytest.fixture
def base(tmp_path_factory):
    needs_root()
    d = Path(shared_dir(tmp_path_factory, "rt"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _start(root, poll=0.05):
    b = SessionBeacon(FakeSession(), root=root, interval=0.2, poll=poll)
    return b.start()


def test_a_runtime_folder_owned_by_another_user_is_refused(base):
    root = base / "rt"
    ok, _ = as_user(lambda: (os.mkdir(root, 0o755), os.mkdir(root / "sessions", 0o755)) and None)
    assert ok
    with pytest.raises(protocol.UnsafeFolderError, match=f"{root}.*owned by uid 65534"):
        _start(root)
    assert registry.list_sessions(root) == []


def test_a_symlinked_runtime_folder_is_refused(base):
    target = base / "elsewhere"
    root = base / "rt"
    ok, _ = as_user(lambda: (os.mkdir(target, 0o700), os.symlink(target, root)) and None)
    assert ok
    with pytest.raises(protocol.UnsafeFolderError, match="symbolic link"):
        _start(root)


def test_another_user_is_refused_a_folder_root_created_for_itself(base):
    root = base / "rt"
    protocol.ensure_sessions_dir(root)  # root's, 0700
    os.chmod(root, 0o755)
    os.chmod(root / "sessions", 0o755)

    def as_nobody():
        try:
            protocol.ensure_sessions_dir(root)
        except protocol.UnsafeFolderError as e:
            return str(e)
        return "accepted"
    ok, msg = as_user(as_nobody)
    assert ok and "owned by uid 0" in msg, msg


def test_symlinked_heartbeats_and_commands_are_not_followed(base):
    root = base / "rt"
    b = _start(root, poll=30)  # the test polls the inbox itself
    try:
        real = json.loads(b.heartbeat_file.read_text())
        decoy = base / "decoy.json"  # a valid heartbeat of ours, outside the folder
        decoy.write_text(json.dumps({**real, "name": "fake", "updated": time.time()}))
        os.symlink(decoy, protocol.sessions_dir(root) / "fakeid.json")
        ids = [s["id"] for s in registry.list_sessions(root, clean=False)]
        assert ids == [b.id]  # the planted symlink is not listed as a session
        cmd = base / "stop.json"
        cmd.write_text(json.dumps({"command": "stop"}))
        os.symlink(cmd, b.inbox / "0-1-1.json")
        b.poll_inbox()
        assert b.session.state != "stopped"
        assert b.last_command["ok"] is False
    finally:
        b.stop()
