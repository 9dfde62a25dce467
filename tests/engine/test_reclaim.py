"""Offload folders of killed processes are reclaimed when the next store opens -- safely:
never a live process's, another host's, another user's, or a symlink."""
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from megatrain_nb.engine.tiers import reclaim as rc
from megatrain_nb.engine.tiers.disk_store import DiskStore

_JOB = textwrap.dedent("""
    import os, signal, sys, time, torch
    from megatrain_nb.engine.tiers.disk_store import DiskStore
    s = DiskStore(sys.argv[1])
    s.write("k", {"x": torch.ones(1 << 20)}).result()
    print(s.path, flush=True)
    if sys.argv[2] == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)
""")


def _spawn(root, mode):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.Popen([sys.executable, "-c", _JOB, str(root), mode], stdout=subprocess.PIPE, text=True, env=env)
    path = p.stdout.readline().strip()
    assert path, "the job did not start"
    return p, path


def test_a_killed_process_folder_is_reclaimed_and_a_live_one_kept(tmp_path):
    live, live_path = _spawn(tmp_path, "live")
    try:
        dead, dead_path = _spawn(tmp_path, "die")
        assert dead.wait(timeout=60) == -signal.SIGKILL
        assert os.path.isdir(dead_path) and os.path.isdir(live_path)
        with pytest.warns(UserWarning, match=rf"reclaimed 1 offload folder.*{os.path.basename(dead_path)}"):
            s = DiskStore(tmp_path)
        assert [p for p, _ in s.reclaimed] == [dead_path] and s.reclaimed[0][1] >= 4 << 20
        assert not os.path.exists(dead_path) and os.path.isdir(live_path)
        s.close()
    finally:
        live.kill()
        live.wait(timeout=30)


def test_uncertain_folders_are_left_alone(tmp_path):
    tag = rc._host_tag()
    dead_pid = 4_000_000  # above pid_max: no such process
    reused = tmp_path / f"megatrain-1-{tag}-1-aaaaaaaa"          # pid 1 runs, but started at another time
    other_host = tmp_path / f"megatrain-{dead_pid}-ffffff-1-bbbbbbbb"
    link = tmp_path / f"megatrain-{dead_pid}-{tag}-1-cccccccc"
    legacy = tmp_path / f"megatrain-{dead_pid}-dddddddd"          # named by an older version
    for d in (reused, other_host, tmp_path / "target", legacy):
        d.mkdir()
    os.symlink(tmp_path / "target", link)
    with pytest.warns(UserWarning):
        s = DiskStore(tmp_path)
    s.close()
    assert not reused.exists() and not legacy.exists()
    assert other_host.exists() and link.is_symlink() and (tmp_path / "target").exists()


def test_another_users_folder_is_never_touched(tmp_path_factory):
    from ..privileges import as_user, shared_dir

    root = shared_dir(tmp_path_factory, "reclaim")
    theirs = os.path.join(root, f"megatrain-4000000-{rc._host_tag()}-1-eeeeeeee")
    ok, msg = as_user(lambda: os.mkdir(theirs, 0o700))
    assert ok, msg
    DiskStore(root).close()
    assert os.path.isdir(theirs)
