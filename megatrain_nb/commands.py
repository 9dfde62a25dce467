"""The one table of run commands: their names, what value each takes, and their help line.

Read by every place that takes a command: the Session's controls, the ranks' run control
(``trainer/control.py``), the beacon and the Jupyter server (``lab/protocol.py``,
``lab/beacon.py``), ``%megatrain``'s help, and the JupyterLab sidebar, whose TypeScript
(``extension/src/commands.ts``) a test checks against :data:`COMMANDS`. Standard library
only: the server side imports it cheaply.

Values: ``none`` (no value); ``learning_rate`` (:func:`~megatrain_nb.learning_rate.check_learning_rate`);
``path`` (a checkpoint folder, or None for the default one); ``stop`` (nothing, or a
checkpoint to write first: True for the default folder, or a path); ``step`` (an optimizer step,
an int >= 0: the snapshot to go back to).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_MAX_PATH = 4096


@dataclass(frozen=True)
class Command:
    name: str
    value: str       # "none" | "learning_rate" | "path" | "stop" | "step"
    help: str        # one line, as %megatrain's usage prints it
    sidebar: bool    # the JupyterLab sidebar offers it (the server accepts it from there)


COMMANDS: dict[str, Command] = {c.name: c for c in (
    Command("pause", "none", "pause after the current step", True),
    Command("resume", "none", "carry on from the step it paused at", True),
    Command("stop", "stop", "end the run after the current step (a checkpoint first, if given)", True),
    Command("lr", "learning_rate", "learning rate from the next step (e.g. 5e-4)", True),
    Command("checkpoint", "path", "write a checkpoint at the next step boundary", False),
    Command("snapshot", "none", "take a snapshot at the next step boundary (every rank its shard)", False),
    Command("rewind", "step", "go back to the snapshot at step N (every rank; a paused run stays paused)", False),
)}

#: What the sidebar sends (and the Jupyter server accepts from it).
SIDEBAR = tuple(n for n, c in COMMANDS.items() if c.sidebar)


class CommandError(ValueError):
    """A command that is not in :data:`COMMANDS`, or a bad value for it."""


def check_command(name: Any, value: Any = None, *, sidebar: bool = False) -> tuple[str, Any]:
    """``(name, value)`` checked against the table (``sidebar``: only what the sidebar may
    send, and ``stop`` without a checkpoint); :class:`CommandError` saying what is wrong.

    >>> check_command("lr", "3e-4")
    ('lr', 0.0003)
    """
    allowed = SIDEBAR if sidebar else tuple(COMMANDS)
    if not isinstance(name, str) or name not in allowed:
        raise CommandError(f"unknown command {name!r}: expected one of {', '.join(sorted(allowed))}")
    kind = COMMANDS[name].value
    if kind == "none" or (kind == "stop" and sidebar):
        if value is not None:
            raise CommandError(f"command {name!r} takes no value (got {value!r})")
        return name, None
    if kind == "learning_rate":
        from megatrain_nb.learning_rate import check_learning_rate

        try:
            return name, check_learning_rate(value)
        except ValueError as e:
            raise CommandError(f"command 'lr': {e}") from None
    if kind == "step":
        try:
            return name, as_step(value, f"command {name!r}")
        except ValueError as e:
            raise CommandError(str(e)) from None
    # a checkpoint path (or None: the default folder); stop also takes True/False
    if value is None or (kind == "stop" and isinstance(value, bool)) or (
            isinstance(value, str) and 0 < len(value) < _MAX_PATH and "\0" not in value):
        return name, value
    raise CommandError(f"command {name!r} takes a path string (or nothing), got {value!r}")


def as_step(value: Any, what: str) -> int:
    """``value`` (an int, or its text) as an optimizer step >= 0; ValueError naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{what} takes a step number, got {value!r}")
    try:
        step = int(value)
    except ValueError:
        raise ValueError(f"{what} takes a step number, got {value!r}") from None
    if step < 0:
        raise ValueError(f"{what} takes a step number >= 0, got {step}")
    return step


def usage_lines(names=None) -> list[str]:
    """``name <value>   help`` lines for ``%megatrain``'s usage."""
    arg = {"none": "", "learning_rate": " <value>", "path": " [path]", "stop": "", "step": " <step>"}
    names = list(COMMANDS) if names is None else list(names)
    return [f"  {(n + arg[COMMANDS[n].value]):<20}{COMMANDS[n].help}" for n in names]
