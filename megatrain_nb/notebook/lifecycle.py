"""The states of a Session's run, defined once: the session, its displays, the magics and the
registry all read them from here.

    idle ──train()──> running <──pause()/resume()──> paused
                         │                              │
                         └──> finished | stopped | failed <┘
"""
from __future__ import annotations

STATES = ("idle", "running", "paused", "stopped", "finished", "failed")
#: a training thread is alive and takes commands
LIVE = ("running", "paused")
#: the run is over; it cannot be restarted
ENDED = ("stopped", "finished", "failed")
