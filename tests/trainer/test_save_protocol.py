"""The checkpoint save protocol survives a kill -9 or an exception at every one of its steps:
afterwards (once the next start has run its recovery) the folder holds a complete checkpoint
under the name -- the previous one or the new one, never none and never a mixture -- for a new
name and for one that already exists."""
import os
import shutil
import signal

import pytest

from megatrain_nb.trainer import checkpoint as ckpt

# Every filesystem step of the protocol goes through one of these; the fault is injected just
# before or just after the n-th call.
_OPS = ("replace", "rename", "fsync", "mkdir", "rmdir", "unlink")


def _writer(version: str, die_halfway=None):
    def write(folder):
        (folder / "model.safetensors").write_text(f"weights {version}" * 100)
        if die_halfway:
            die_halfway()
        (folder / "trainer_state.json").write_text("{}")
        (folder / ckpt.STATE_FILE).write_text(f'{{"version": "{version}"}}')
    return write


def _version(folder):
    import json
    return json.loads((folder / ckpt.STATE_FILE).read_text())["version"]


def _inject(monkeypatch, n: int, when: str, fault):
    """Make the n-th filesystem call (before or after it runs) call ``fault``."""
    count = [0]

    def wrap(real):
        def op(*a, **k):
            count[0] += 1
            hit = count[0] == n
            if hit and when == "before":
                fault()
            out = real(*a, **k)
            if hit and when == "after":
                fault()
            return out
        return op
    for name in _OPS:
        monkeypatch.setattr(os, name, wrap(getattr(os, name)))
    monkeypatch.setattr(shutil, "rmtree", wrap(shutil.rmtree))
    return count


def _setup(tmp_path, existing: bool):
    out = tmp_path / "run"
    ckpt.write_checkpoint(out / "checkpoint-1", _writer("v1"))
    if existing:
        ckpt.write_checkpoint(out / "checkpoint-2", _writer("v2-old"))
    return out


def _check(out, existing: bool):
    names = [c.name for c in ckpt.list_checkpoints(out)]  # runs the recovery of a dead writer
    assert not [c for c in os.listdir(out) if ".tmp-" in c or ".old-" in c], os.listdir(out)
    assert _version(out / "checkpoint-1") == "v1"
    if existing:
        assert names == ["checkpoint-1", "checkpoint-2"]
        assert _version(out / "checkpoint-2") in ("v2-old", "v2-new")
    else:
        assert names in (["checkpoint-1"], ["checkpoint-1", "checkpoint-2"])
        if len(names) == 2:
            assert _version(out / "checkpoint-2") == "v2-new"
    for c in ckpt.list_checkpoints(out):
        assert ckpt.verify_manifest(c)  # complete, not a mixture of old and new files


def _count_ops(tmp_path, monkeypatch) -> int:
    out = _setup(tmp_path / "count", existing=True)
    with monkeypatch.context() as m:
        count = _inject(m, -1, "before", lambda: None)
        ckpt.write_checkpoint(out / "checkpoint-2", _writer("v2-new"))
    return count[0]


def _points(tmp_path, monkeypatch):
    n = _count_ops(tmp_path, monkeypatch)
    assert n >= 6
    return [(i, w) for i in range(1, n + 1) for w in ("before", "after")]


@pytest.mark.parametrize("existing", [False, True], ids=["new-name", "existing-name"])
def test_kill_at_every_step_of_a_save_keeps_a_complete_checkpoint(tmp_path, monkeypatch, existing):
    cases = _points(tmp_path, monkeypatch) + [("halfway", None)]
    for k, (n, when) in enumerate(cases):
        out = _setup(tmp_path / f"k{k}", existing)
        pid = os.fork()
        if pid == 0:  # the child saves and is killed at that point
            try:
                die = lambda: os.kill(os.getpid(), signal.SIGKILL)  # noqa: E731
                if n == "halfway":
                    ckpt.write_checkpoint(out / "checkpoint-2", _writer("v2-new", die_halfway=die))
                else:
                    _inject(monkeypatch, n, when, die)
                    ckpt.write_checkpoint(out / "checkpoint-2", _writer("v2-new"))
            finally:
                os._exit(0)  # reached only when the save outran the injected point
        _, status = os.waitpid(pid, 0)
        monkeypatch.undo()
        assert os.WIFSIGNALED(status) or os.WEXITSTATUS(status) == 0, (n, when, status)
        _check(out, existing)


@pytest.mark.parametrize("existing", [False, True], ids=["new-name", "existing-name"])
def test_exception_at_every_step_of_a_save_keeps_a_complete_checkpoint(tmp_path, monkeypatch, existing):
    def fail():
        raise OSError(28, "No space left on device (injected)")

    for k, (n, when) in enumerate(_points(tmp_path, monkeypatch)):
        out = _setup(tmp_path / f"e{k}", existing)
        with monkeypatch.context() as m:
            _inject(m, n, when, fail)
            try:
                ckpt.write_checkpoint(out / "checkpoint-2", _writer("v2-new"))
            except OSError:
                pass
        # even before any recovery, the exception path left no side folders and a complete checkpoint
        assert (out / "checkpoint-2").exists() or not existing, (n, when, os.listdir(out))
        _check(out, existing)
