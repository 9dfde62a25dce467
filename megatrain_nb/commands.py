"""The one table of run commands: their names, what value each takes, who applies them, in
which states the sidebar offers them, and their help line.

Read by every place that takes a command: the Session's controls and its run controllers
(``notebook/session.py``, ``thread_run.py``, ``remote.py``), the ranks' run control
(``trainer/control.py``), the beacon and the Jupyter server (``channel/protocol.py``,
``channel/beacon.py``), ``%megatrain``'s help, and the JupyterLab sidebar, whose TypeScript
(``extension/src/commands.ts``) a test checks against :data:`COMMANDS`. Standard library
only: the server side imports it cheaply.

Values: ``none`` (no value); ``learning_rate`` and ``step``: the rows of that name in the table of
values (:mod:`megatrain_nb.values`, whose check every door shares); ``path`` (a checkpoint
folder, or None for the default one); ``stop`` (nothing, or a checkpoint to write first: True
for the default folder, or a path); ``fork`` (``(step or None, name or None, changes)``, what
``Session.fork`` queues; the changes checked by the table).

Who applies a command: every Session (its run controller: in-kernel thread or worker
processes); ``ranks`` marks those the ranks' run control applies too, so a Session whose ranks
train in worker processes forwards them (the others it refuses, saying so). ``sidebar`` marks
what the sidebar sends, ``states`` the run states in which it offers it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatrain_nb.values import ValueRefused, check

_MAX_PATH = 4096

LIVE_STATES = ("running", "paused")


@dataclass(frozen=True)
class Command:
    name: str
    value: str       # "none" | "learning_rate" | "path" | "stop" | "step" | "fork"
    help: str        # one line, as %megatrain's usage prints it
    method: str      # the Session method (and the announced run's) that takes it
    ranks: bool      # the ranks' run control applies it (trainer/control.py); else only an in-kernel Session
    sidebar: bool    # the JupyterLab sidebar offers it (the server accepts it from there)
    states: tuple = ()   # the run states in which the sidebar offers it


COMMANDS: dict[str, Command] = {c.name: c for c in (
    Command("pause", "none", "pause after the current step", "pause", True, True, ("running",)),
    Command("resume", "none", "carry on from the step it paused at", "resume", True, True, ("paused",)),
    Command("stop", "stop", "end the run after the current step (a checkpoint first, if given)", "stop",
            True, True, LIVE_STATES + ("idle",)),
    Command("lr", "learning_rate", "learning rate from the next step (e.g. 5e-4)", "set_lr", True, True,
            LIVE_STATES),
    Command("checkpoint", "path", "write a checkpoint at the next step boundary", "save_checkpoint", True, False),
    # exploration (notebook/branches.py): a Session that trains in this kernel applies them; the ranks'
    # run control applies snapshot and rewind (ranks=True: a run in worker processes forwards them);
    # a fork is never applied by running ranks: a run in worker processes launches new ones (rank_fork.py)
    Command("snapshot", "none", "take a snapshot at the next step boundary", "snapshot",
            ranks=True, sidebar=False),
    Command("rewind", "step", "go back to the snapshot at that step (train()/resume continues)", "rewind",
            ranks=True, sidebar=False),
    Command("fork", "fork", "a new branch from a snapshot, with changed settings", "fork",
            ranks=False, sidebar=False),
)}

#: What the sidebar sends (and the Jupyter server accepts from it).
SIDEBAR = tuple(n for n, c in COMMANDS.items() if c.sidebar)
#: What the ranks' run control applies (and a run's beacon accepts from its inbox).
RANKS = tuple(n for n, c in COMMANDS.items() if c.ranks)


class CommandError(ValueError):
    """A command that is not in :data:`COMMANDS`, or a bad value for it."""


def check_command(name: Any, value: Any = None, *, sidebar: bool = False, ranks: bool = False,
                  where: str = "") -> tuple[str, Any]:
    """``(name, value)`` checked against the table (``sidebar``: only what the sidebar may
    send, and ``stop`` without a checkpoint; ``ranks``: only what the ranks apply);
    :class:`CommandError` saying what is wrong (``where``: how to name the value; default
    ``command 'lr'``). A value's rule is the table of values' (:func:`megatrain_nb.values.check`).

    >>> check_command("lr", "3e-4")
    ('lr', 0.0003)
    """
    allowed = SIDEBAR if sidebar else RANKS if ranks else tuple(COMMANDS)
    if not isinstance(name, str) or name not in allowed:
        raise CommandError(f"unknown command {name!r}: expected one of {', '.join(sorted(allowed))}")
    kind = COMMANDS[name].value
    if kind == "none" or (kind == "stop" and sidebar):
        if value is not None:
            raise CommandError(f"command {name!r} takes no value (got {value!r})")
        return name, None
    if kind in ("learning_rate", "step"):
        try:
            return name, check(kind, value, where or f"command {name!r}")
        except ValueRefused as e:
            raise CommandError(str(e)) from None
    if kind == "fork":
        if not (isinstance(value, tuple) and len(value) == 3 and isinstance(value[2], dict)):
            raise CommandError(f"command 'fork' takes (step or None, name or None, changes), got {value!r}")
        return name, value
    # a checkpoint path (or None: the default folder); stop also takes True/False
    if value is None or (kind == "stop" and isinstance(value, bool)) or (
            isinstance(value, str) and 0 < len(value) < _MAX_PATH and "\0" not in value):
        return name, value
    raise CommandError(f"command {name!r} takes a path string (or nothing), got {value!r}")


def state_after(kind: str, state: str) -> Any:
    """The run state ``pause`` or ``resume`` leads to from ``state``, or None when it has nothing
    to do (a pause of a run that is not running, a resume of one that is not paused: no event).
    One rule for the in-kernel thread (``notebook/thread_run.py``) and the ranks (``trainer/control.py``).

    >>> state_after("pause", "running"), state_after("pause", "paused"), state_after("resume", "paused")
    ('paused', None, 'running')
    """
    return {("pause", "running"): "paused", ("resume", "paused"): "running"}.get((kind, state))


def as_step(value: Any, what: str) -> int:
    """``value`` (an int, or its text) as an optimizer step >= 0 (the table's ``step`` rule);
    ValueError naming ``what``."""
    return check("step", value, what)


def usage_lines(names=None) -> list[str]:
    """``name <value>   help`` lines for ``%megatrain``'s usage."""
    arg = {"none": "", "learning_rate": " <value>", "path": " [path]", "stop": "", "step": " <step>",
           "fork": " [step]"}
    names = list(COMMANDS) if names is None else list(names)
    return [f"  {(n + arg[COMMANDS[n].value]):<20}{COMMANDS[n].help}" for n in names]
