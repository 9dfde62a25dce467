"""``%load_ext megatrain_nb`` registers ``%megatrain``, acting on the current session (the one
most recently created or trained) or a named one (``-s NAME`` / ``--session NAME``)::

    %megatrain status
    %megatrain pause | resume | stop
    %megatrain lr 5e-4
    %megatrain checkpoint [folder]
    %megatrain dashboard
    %megatrain report run.html
    %megatrain estimate llama-100b --vram 80 --ram 512 --disk 4096
    %megatrain sessions
    %megatrain snapshot | rewind 200 | fork learning_rate=1e-4 name=low | branches
"""
from __future__ import annotations

import shlex
import time
from typing import Any, Optional

from megatrain_nb.commands import CommandError, usage_lines
from megatrain_nb.estimate_words import estimate_from_words   # the CLI's flags (--vram/--ram/...)
from megatrain_nb.formatting import fmt_bytes, fmt_num, fmt_seconds

from . import registry
from .figures import event_label
from .lifecycle import ENDED
from .prediction_view import session_report, status_lines
from .grpo_view import grpo_parts
from .preference_view import reward_parts
from .summary_html import eta_seconds

USAGE = "\n".join(["Usage: %megatrain <command> [-s SESSION]",
                   "  status              the run at a glance",
                   *usage_lines(["pause", "resume", "stop", "lr"]),   # the run commands' table
                   """  dashboard           show the live dashboard
  report <path>       write a report (.html or .ipynb)
  trained-on [index]  one training example, the tokens that count toward the loss highlighted
  estimate <model dir | config.json | preset> [--vram GB] [--ram GB] [--disk GB] [--nodes M] [--gpus-per-node N]
  sessions            list the sessions of this kernel""",
                   *usage_lines(["checkpoint", "snapshot", "rewind"]),
                   """  fork key=value ...  a branch from now (step=N: from that snapshot; name=...), e.g. learning_rate=1e-4
  branches            the run tree: branches, fork points, what changed, snapshots"""])

_NO_SESSION = ("No megatrain session here yet. Create one and start it:\n"
               "    import megatrain_nb as mt\n"
               "    session = mt.Session('tiny')   # or a model / local folder with train_dataset=...\n"
               "    session.train()")


class MagicError(Exception):
    """Shown to the user as one line (no traceback)."""


def megatrain(line: str) -> Any:
    """The ``%megatrain`` line magic (see module docstring)."""
    try:
        return _dispatch(line)
    except MagicError as e:
        print(str(e))
    except (ValueError, RuntimeError, LookupError, FileNotFoundError, TypeError) as e:
        print(f"megatrain: {e}")
    return None


def _dispatch(line: str) -> Any:
    try:
        words = shlex.split(line)
    except ValueError as e:
        raise MagicError(f"megatrain: cannot parse {line!r}: {e}") from None
    name = _pop_option(words, ("-s", "--session"))
    if not words or words[0] in ("help", "-h", "--help"):
        print(USAGE)
        return None
    cmd, rest = words[0], words[1:]
    if cmd == "estimate":
        return _estimate(rest)
    if cmd == "sessions":
        return _sessions()
    handler = {"status": _status, "pause": _pause, "resume": _resume, "stop": _stop, "lr": _lr,
               "dashboard": _dashboard, "report": _report, "trained-on": _trained_on, "checkpoint": _checkpoint, "snapshot": _snapshot,
               "rewind": _rewind, "fork": _fork, "branches": _branches}.get(cmd)
    if handler is None:
        raise MagicError(f"megatrain: unknown command {cmd!r}\n{USAGE}")
    return handler(_session(name), rest)


def _pop_option(words: list[str], flags: tuple[str, ...]) -> Optional[str]:
    for i, w in enumerate(words):
        if w in flags:
            if i + 1 >= len(words):
                raise MagicError(f"megatrain: {w} needs a value")
            value = words[i + 1]
            del words[i:i + 2]
            return value
        for f in flags:
            if f.startswith("--") and w.startswith(f + "="):
                del words[i]
                return w.split("=", 1)[1]
    return None


def _session(name: Optional[str]):
    s = registry.get(name)
    if s is not None:
        return s
    if name is None:
        others = [x.name for x in registry.all_sessions()]
        if others:   # the current one was closed; others are open: name one, never "no session here"
            raise MagicError(f"megatrain: no current session (the last one started here was closed); open here: "
                             f"{', '.join(others)}. Name one: %megatrain status -s {others[-1]} (or start one: "
                             "session.train() makes it the current one)")
        raise MagicError(_NO_SESSION)
    known = ", ".join(x.name for x in registry.all_sessions()) or "none"
    raise MagicError(f"megatrain: no session named {name!r} (sessions: {known})")


def _wait_state(session, states: tuple[str, ...], seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if session.state in states:
            return True
        time.sleep(0.02)
    return session.state in states


def status_line(session) -> str:
    view = session.run_log.view(max_points=2)
    total = session.total_steps
    last = view.last
    eta = eta_seconds(session, view)  # None unless running: a paused run has no ETA
    parts = [f"{session.name}: {session.state}", f"step {view.step}{'/' + str(total) if total else ''}",
             f"loss {fmt_num(last.get('loss'))}", f"lr {fmt_num(last.get('lr'), '.3g')}",
             f"{fmt_num(view.tokens_per_s, ',.0f')} tok/s", *([f"ETA {fmt_seconds(eta)}"] if eta is not None else [])]
    parts += reward_parts(last)   # a DPO run: reward margin and accuracy
    parts += grpo_parts(last)     # a GRPO run: reward, KL, completion length, generation's share
    line = ", ".join(parts)
    if view.events:
        e = view.events[-1]
        n = len(view.events)
        line += f"; {n} event{'s' if n != 1 else ''} (last: {event_label(e)} at step {e['step']})"
    for e in (e for e in view.events if e.get("kind") == "recovery"):   # (on_nonfinite="rewind")
        line += (f"\nrecovery {e.get('attempt')}/{e.get('max_recoveries')}: {e.get('reason')} -> back to step "
                 f"{e.get('to_step')}, lr x{fmt_num(e.get('lr_factor'), '.3g')}")
    if session.error is not None:
        line += f"\nerror: {type(session.error).__name__}: {session.error} (session.wait() re-raises it)"

    for text in status_lines(session_report(session)):   # with rates: predicted vs measured per phase
        line += "\n" + text
    return line


def _status(session, rest):
    print(status_line(session))


def _pause(session, rest):
    session.pause(source="magic")
    if _wait_state(session, ("paused",) + ENDED, 2.0):
        print(f"{session.name}: paused at step {session.step}." if session.state == "paused"
              else f"{session.name}: {session.state}.")
    else:
        print(f"{session.name}: pause requested; it takes effect when step {session.step + 1} ends.")


def _resume(session, rest):
    was = session.state
    session.resume(source="magic")
    if was != "paused":
        print(f"{session.name}: not paused ({was}); nothing to resume.")
    elif _wait_state(session, ("running",) + ENDED, 2.0):
        print(f"{session.name}: resumed at step {session.step}.")
    else:
        print(f"{session.name}: resume requested.")


def _stop(session, rest):
    if session.state in ENDED:
        session.stop(source="magic")
        print(f"{session.name}: already {session.state}; its memory is released.")
        return
    session.stop(wait=False, source="magic")
    if _wait_state(session, ENDED, 10.0):
        print(f"{session.name}: stopped at step {session.step}; memory, threads and files released.")
    else:
        print(f"{session.name}: stop requested; the run ends when step {session.step + 1} ends.")


def _lr(session, rest):
    if len(rest) != 1:
        raise MagicError("megatrain: lr needs one value, e.g. %megatrain lr 5e-4")
    try:
        session.command("lr", rest[0], source="magic", where="%megatrain lr")
    except ValueError as e:
        raise MagicError(f"megatrain: {e}") from None
    print(f"{session.name}: learning rate {float(rest[0]):g} from the next step (after step {session.step}).")


def _dashboard(session, rest):
    from IPython.display import display

    display(session.dashboard())


def _trained_on(session, rest):
    if len(rest) > 1 or (rest and not rest[0].isdigit()):
        raise MagicError("megatrain: trained-on takes an example index, e.g. %megatrain trained-on 3")
    return session.trained_on(int(rest[0]) if rest else 0)


def _report(session, rest):
    if len(rest) != 1:
        raise MagicError("megatrain: report needs a path ending in .html or .ipynb, e.g. %megatrain report run.html")
    print(f"{session.name}: report written to {session.export_report(rest[0])}")


def _snapshot(session, rest):
    info = session.snapshot(source="magic")
    print(f"{session.name}: snapshot at step {info.step} ({fmt_bytes(info.bytes_unique)} written, "
          f"{fmt_bytes(info.bytes_shared)} shared by hard links): {info.path}")


def _checkpoint(session, rest):
    if len(rest) > 1:
        raise MagicError("megatrain: checkpoint takes one folder or none, e.g. %megatrain checkpoint ckpt-a")
    path = session.command("checkpoint", rest[0] if rest else None, source="magic", where="%megatrain checkpoint",
                           wait=True)
    print(f"{session.name}: checkpoint at step {session.step}: {path}")


def _rewind(session, rest):
    if len(rest) != 1:
        raise MagicError("megatrain: rewind needs one step, e.g. %megatrain rewind 200")
    try:
        info = session.command("rewind", rest[0], source="magic", where="%megatrain rewind", wait=True)
    except CommandError as e:
        raise MagicError(f"megatrain: {e}") from None
    print(f"{session.name}: back at step {info.step} ({session.state}); "
          f"{'resume' if session.state == 'paused' else 'train'} to continue from there.")


def _fork(session, rest):
    import ast

    changes = {}
    for w in rest:
        if "=" not in w:
            raise MagicError(f"megatrain: fork takes key=value pairs, got {w!r} (e.g. %megatrain fork learning_rate=1e-4)")
        k, v = w.split("=", 1)
        try:
            changes[k] = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            changes[k] = v   # a plain word (a scheduler type, a name)
    step, name = changes.pop("step", None), changes.pop("name", None)
    branch = session.fork(step=step, name=name, **changes)
    print(f"{session.name}: branch {branch.name!r} forked at step {branch.explorer.origin[1]}; "
          f"`{branch.name} = _` keeps it, then .train() starts it (pausing {session.name}); "
          f"or %megatrain -s {branch.name} ...")
    return branch


def _branches(session, rest):
    ex = session.explorer
    for run in ex.tree():
        steps = [r.get("step") for r in run["records"]]
        span = f"steps {min(steps)}-{max(steps)}" if steps else "no steps yet"
        at = f", from step {run['forked_at_step']}" if run["forked_at_step"] is not None else ""
        print(f"  {run['name']} [{run['run_id']}]{at}: {span}{'; ' + run['changes'] if run['changes'] else ''}")
    snaps = ex.all_snapshots()
    if snaps:
        print("snapshots: " + ", ".join(f"{i.step} ({i.branch or i.run_id}, {fmt_bytes(i.bytes_unique)})"
                                        for i in snaps))


def _estimate(rest):
    from IPython.display import display   # IPython: present in a kernel, not needed to import this module

    if not rest:
        raise MagicError("megatrain: estimate needs one model: a folder, a config.json or a preset, e.g.\n"
                         "    %megatrain estimate llama-100b --vram 80 --ram 512 --disk 4096")
    try:
        est = estimate_from_words(list(rest))
    except ValueError as e:
        raise MagicError(f"megatrain: estimate: {e}") from None
    display(est)  # messages name --vram/--ram/--disk


def _sessions():
    sessions = registry.all_sessions()
    if not sessions:
        print(_NO_SESSION)
        return
    current = registry.get()
    for s in sessions:
        print(("* " if s is current else "  ") + status_line(s).splitlines()[0])


def load_ipython_extension(ipython) -> None:
    """``%load_ext megatrain_nb``."""
    ipython.register_magic_function(megatrain, magic_kind="line", magic_name="megatrain")


def unload_ipython_extension(ipython) -> None:
    ipython.magics_manager.magics["line"].pop("megatrain", None)
