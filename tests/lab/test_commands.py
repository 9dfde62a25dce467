"""One command table (megatrain_nb/commands.py): the Session, the ranks' run control, the
beacon and the server read it, and the sidebar's TypeScript agrees with it."""
import re
from pathlib import Path

import pytest

from megatrain_nb.commands import COMMANDS, RANKS, SIDEBAR, CommandError, check_command

TS = Path(__file__).resolve().parents[2] / "extension" / "src" / "commands.ts"


def test_every_place_reads_the_one_table():
    from megatrain_nb.channel.protocol import COMMANDS as server
    from megatrain_nb.notebook.magics import USAGE
    from megatrain_nb.notebook.session import Order
    from megatrain_nb.trainer.control import KINDS

    assert set(KINDS) == set(RANKS) == {n for n, c in COMMANDS.items() if c.ranks}
    assert {"pause", "resume", "lr", "checkpoint", "stop"} <= set(KINDS) and "fork" not in KINDS
    assert set(server) == set(SIDEBAR) and server["lr"] is True and server["pause"] is False
    for name in SIDEBAR:
        assert COMMANDS[name].help in USAGE
    for name in COMMANDS:
        Order(name)
    with pytest.raises(ValueError, match="unknown command 'reboot'"):
        Order("reboot")


def test_the_session_has_a_method_for_every_command_and_no_second_list():
    """Session-only commands (snapshot, rewind, fork) are rows of the same table, marked as
    not applied by the ranks; the beacon calls the method the table names."""
    import megatrain_nb.notebook.session as session_module
    from megatrain_nb.notebook.session import Session
    from megatrain_nb.trainer.control import RunControl

    for name, c in COMMANDS.items():
        assert callable(getattr(Session, c.method)), name
    assert not hasattr(session_module, "SESSION_COMMANDS")
    assert {n for n, c in COMMANDS.items() if not c.ranks} >= {"fork"}
    # the beacon hands every command to one door, on a Session and on the ranks' run control
    assert callable(Session.command) and callable(RunControl.command)
    # and one controller applies every command of the table, one method each
    from megatrain_nb.trainer.boundary import BoundaryControl

    assert set(BoundaryControl(None, None).appliers) == set(COMMANDS)


def test_a_run_of_ranks_refuses_what_the_ranks_do_not_apply(tmp_path):
    """A ProcessRun forwards only the table's ``ranks`` commands; the others are refused with a
    reason (no file ever reaches rank 0's inbox)."""
    from megatrain_nb.notebook.remote import ProcessRun
    from megatrain_nb.notebook.run_state import Order, RunState

    run = ProcessRun(RunState("r"), "abc", nproc=2, root=tmp_path)
    for name, c in COMMANDS.items():
        if c.ranks:
            run.deliver(Order(name, None if c.value != "learning_rate" else 1e-4))
        else:
            with pytest.raises(RuntimeError, match=f"the ranks do not apply '{name}'"):
                run.deliver(Order(name))
    assert run.status.commands.qsize() == len(RANKS)
    with pytest.raises(RuntimeError, match="weights are not in this kernel"):
        run.check("inspect")


def test_the_ranks_run_control_takes_only_what_the_ranks_apply():
    from megatrain_nb.trainer.boundary import BoundaryControl

    control = BoundaryControl(None, None)
    assert control.request("checkpoint", "/x").value == "/x"
    for name, c in COMMANDS.items():
        if not c.ranks:
            with pytest.raises(CommandError, match="unknown command"):
                control.request(name, None)


def test_the_sidebar_typescript_matches_the_table():
    ts = TS.read_text()
    union = re.search(r"export type CommandName\s*=\s*([^;]+);", ts).group(1)
    assert sorted(re.findall(r"'(\w+)'", union)) == sorted(SIDEBAR)
    labels = re.search(r"PENDING_LABELS[^{]*\{([^}]*)\}", ts).group(1)
    assert sorted(re.findall(r"^\s*(\w+):", labels, re.M)) == sorted(SIDEBAR)
    plain = re.search(r"if \(!\[([^\]]*)\]\.includes\(command\)\)", ts).group(1)
    assert sorted(re.findall(r"'(\w+)'", plain)) == sorted(n for n in SIDEBAR if COMMANDS[n].value != "learning_rate")
    controls = re.search(r"export interface IControls \{([^}]*)\}", ts).group(1)
    assert sorted(re.findall(r"(\w+): boolean", controls)) == sorted(SIDEBAR)
    # the states in which each control is offered: the table's, not a second list
    offered = re.search(r"export const OFFERED_IN[^=]*=\s*\{([^}]*)\}", ts).group(1)
    got = {m[0]: tuple(re.findall(r"'(\w+)'", m[1])) for m in re.findall(r"(\w+):\s*\[([^\]]*)\]", offered)}
    assert got == {n: COMMANDS[n].states for n in SIDEBAR}
    for n in SIDEBAR:
        assert f"{n}: OFFERED_IN.{n}.includes(state)" in ts


@pytest.mark.parametrize("name,value,sidebar,want", [
    ("pause", None, True, ("pause", None)), ("lr", "1e-4", True, ("lr", 1e-4)),
    ("stop", True, False, ("stop", True)), ("stop", "/tmp/ck", False, ("stop", "/tmp/ck")),
    ("checkpoint", None, False, ("checkpoint", None)), ("checkpoint", "/x", False, ("checkpoint", "/x")),
    ("snapshot", None, False, ("snapshot", None)), ("rewind", 0, False, ("rewind", 0)),
    ("fork", (None, None, {}), False, ("fork", (None, None, {}))),
])
def test_checks_accept(name, value, sidebar, want):
    assert check_command(name, value, sidebar=sidebar) == want


@pytest.mark.parametrize("name,value,sidebar,why", [
    ("checkpoint", None, True, "unknown command"), ("stop", True, True, "takes no value"),
    ("lr", 11, False, "implausibly large"), ("pause", 1, False, "takes no value"),
    ("checkpoint", 3, False, "path string"), ("checkpoint", "a\0b", False, "path string"), ("x", None, False, "unknown"),
    ("rewind", -1, False, "must be a whole number >= 0"), ("rewind", True, False, "must be a whole number >= 0"),
    ("rewind", 3, True, "unknown command"), ("fork", {"lr": 1}, False, "takes \\(step"),
    ("snapshot", 1, False, "takes no value"),
])
def test_checks_refuse(name, value, sidebar, why):
    with pytest.raises(CommandError, match=why):
        check_command(name, value, sidebar=sidebar)
