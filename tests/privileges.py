"""Run a piece of a test as another (unprivileged) user: tests run as root in CI, where
permission checks would pass vacuously. ``as_user(fn)`` forks, drops to ``uid`` (nobody by
default) in the child, runs ``fn()`` and hands back its JSON-able result or its exception
(type name and message). The child only touches files: no exec, no threads."""
import json
import os
import traceback

import pytest

NOBODY = 65534


def needs_root():
    if os.geteuid() != 0:
        pytest.skip("switching to another user needs root (CI runs as root)")


def as_user(fn, uid: int = NOBODY, timeout: float = 60.0):
    """(True, value) or (False, "ExcType: message")."""
    needs_root()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        code = 0
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            try:
                out = {"ok": True, "value": fn()}
            except BaseException as e:  # noqa: BLE001 - reported to the parent
                out = {"ok": False, "value": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()}
            os.write(w, json.dumps(out, default=str).encode())
        except BaseException:  # noqa: BLE001
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    import select
    chunks = []
    while True:
        ready, _, _ = select.select([r], [], [], timeout)
        if not ready:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            raise TimeoutError(f"as_user({fn}) did not finish in {timeout} s")
        b = os.read(r, 65536)
        if not b:
            break
        chunks.append(b)
    os.close(r)
    os.waitpid(pid, 0)
    out = json.loads(b"".join(chunks) or b'{"ok": false, "value": "child died"}')
    return out["ok"], out["value"]


def shared_dir(tmp_path_factory, name="shared"):
    """A folder both root and the other user can reach (pytest's own is 0700)."""
    import tempfile
    d = tempfile.mkdtemp(prefix=f"mtnb-{name}-")
    os.chmod(d, 0o777)
    return d
