"""A trainer and a host for the step-boundary controller (``trainer/boundary.py``) that record
what they are asked, and the script of commands the one-process and two-rank tests drive."""
from megatrain_nb.commands import CommandError

#: the commands rank 0 takes before each phase: step 1's boundary, the pause after it, step 2's
SCRIPT = {"step 1": [("pause", None), ("lr", "2e-3")],
          "paused": [("checkpoint", "ckpt-a"), ("snapshot", None), ("rewind", 2), ("resume", None)],
          "step 2": [("stop", True)]}


class Trainer:
    def __init__(self):
        self.calls, self.step = [], 0

    def set_lr(self, lr):
        self.calls.append(["set_lr", lr])

    def save_checkpoint(self, path=None):
        self.calls.append(["save_checkpoint", path])
        return f"/out/{path or 'checkpoint-%d' % self.step}"

    def request_stop(self):
        self.calls.append(["request_stop"])


class Host:
    def __init__(self):
        self.state, self.events, self.step = "running", [], 0

    def set_state(self, state):
        self.state = state

    def current_step(self):
        return self.step

    def lr_before(self):
        return 1e-3

    def record(self, kind, step, fields):
        self.events.append(dict(fields, kind=kind, step=step))

    def explore(self, order):
        return order.kind, {"path": f"/out/{order.kind}-{order.value}"}


def drive(control, host, main: bool) -> list:
    """Steps 1 and 2 and the pause between, every rank the same calls (each exchange is a
    collective); rank 0 (``main``) takes each phase's commands first. Returns rank 0's refusals
    of a fork (never applied by the ranks) and of a bad value, by their words."""
    refused = []
    if main:
        for name, value in (("fork", None), ("lr", "-1")):
            try:
                control.request(name, value)
            except CommandError as e:
                refused.append(str(e))
    for phase in ("step 1", "paused", "step 2"):
        if main:
            for name, value in SCRIPT[phase]:
                control.request(name, value, source="test")
        if phase == "paused":
            while host.state == "paused" and not control.stopped:
                control.exchange({}, wait=0.05)
        else:
            host.step += 1
            control.exchange({})
    return refused
