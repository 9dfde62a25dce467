"""The step-boundary controller (trainer/boundary.py) in one process: one method per command of
the table; a failed command is recorded and never ends the run (a failed stop still stops it);
a pause of a paused run, or a resume of a running one, does nothing."""
import threading
from concurrent.futures import Future

import pytest

from megatrain_nb.commands import COMMANDS
from megatrain_nb.trainer.boundary import BoundaryControl, Order
from tests.distributed.boundary_parts import Host, Trainer


def test_one_method_per_command_of_the_table():
    control = BoundaryControl(Trainer(), Host())
    assert set(control.appliers) == set(COMMANDS)
    with pytest.raises(ValueError, match="unknown command 'reboot'"):
        Order("reboot")


def test_a_failed_command_is_recorded_and_the_run_goes_on():
    trainer, host = Trainer(), Host()

    def broken(path=None):
        raise OSError("disk full")

    trainer.save_checkpoint = broken
    control = BoundaryControl(trainer, host)
    waiting = Order("checkpoint", "ckpt", "notebook", future=Future())
    assert control.apply(waiting) is False and not control.stopped
    assert host.events[-1]["kind"] == "checkpoint_failed" and "OSError: disk full" in host.events[-1]["error"]
    with pytest.raises(OSError, match="disk full"):
        waiting.future.result(timeout=1)
    assert control.apply(Order("stop", True)) is True and control.stopped   # its checkpoint failed: still stops
    assert host.events[-1]["kind"] == "stop_failed" and trainer.calls[-1] == ["request_stop"]


def test_pause_and_resume_move_the_state_once_and_a_paused_run_waits_for_the_next_command():
    trainer, host = Trainer(), Host()
    control = BoundaryControl(trainer, host)
    control.request("pause")
    control.request("pause")   # already paused: nothing to do, no event
    feeder = threading.Timer(0.2, lambda: (control.request("lr", "5e-4"), control.request("resume")))
    feeder.start()
    assert control.run_queued() is False   # paused: it waited for the resume
    feeder.join()
    assert [e["kind"] for e in host.events] == ["pause", "lr", "resume"] and host.state == "running"
    assert trainer.calls == [["set_lr", 5e-4]] and host.events[1]["previous"] == 1e-3
