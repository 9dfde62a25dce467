"""One command table (megatrain_nb/commands.py): the Session, the ranks' run control, the
beacon and the server read it, and the sidebar's TypeScript agrees with it."""
import re
from pathlib import Path

import pytest

from megatrain_nb.commands import COMMANDS, SIDEBAR, CommandError, check_command

TS = Path(__file__).resolve().parents[2] / "extension" / "src" / "commands.ts"


def test_every_place_reads_the_one_table():
    from megatrain_nb.lab.protocol import COMMANDS as server
    from megatrain_nb.notebook.magics import USAGE
    from megatrain_nb.notebook.session import QueuedCommand
    from megatrain_nb.trainer.control import KINDS

    assert set(KINDS) == set(COMMANDS)
    assert set(server) == set(SIDEBAR) and server["lr"] is True and server["pause"] is False
    for name in SIDEBAR:
        assert COMMANDS[name].help in USAGE
    for name in COMMANDS:
        QueuedCommand(name)
    with pytest.raises(ValueError, match="unknown command 'reboot'"):
        QueuedCommand("reboot")


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


@pytest.mark.parametrize("name,value,sidebar,want", [
    ("pause", None, True, ("pause", None)), ("lr", "1e-4", True, ("lr", 1e-4)),
    ("stop", True, False, ("stop", True)), ("stop", "/tmp/ck", False, ("stop", "/tmp/ck")),
    ("checkpoint", None, False, ("checkpoint", None)), ("checkpoint", "/x", False, ("checkpoint", "/x")),
])
def test_checks_accept(name, value, sidebar, want):
    assert check_command(name, value, sidebar=sidebar) == want


@pytest.mark.parametrize("name,value,sidebar,why", [
    ("checkpoint", None, True, "unknown command"), ("stop", True, True, "takes no value"),
    ("lr", 11, False, "implausibly large"), ("pause", 1, False, "takes no value"),
    ("checkpoint", 3, False, "path string"), ("checkpoint", "a\0b", False, "path string"), ("x", None, False, "unknown"),
])
def test_checks_refuse(name, value, sidebar, why):
    with pytest.raises(CommandError, match=why):
        check_command(name, value, sidebar=sidebar)
