"""Whether another process is still there: used to tell a live writer's temporary files (a
checkpoint being written, a session's heartbeat) from those a crashed process left behind."""
from __future__ import annotations

import os
import socket
from typing import Any, Optional


def pid_alive(pid: Any, host: Any = None) -> Optional[bool]:
    """True/False for process ``pid`` on this host; None when it cannot be told (``host``
    names another machine, or the system would not say). A zombie counts as gone: a killed
    kernel can linger as one until its parent reaps it."""
    if host is not None and host != socket.gethostname():
        return None
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    except OSError:
        return None
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:  # it went away just now
        return False
    except psutil.Error:  # e.g. access denied: it exists
        return True
