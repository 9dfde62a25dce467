"""Every environment variable the package reads, by name, in one table (as ``threads.py`` is
for threads): its name, what it does, its default and the module that reads it.

``tests/test_layering.py`` checks the table against the code: every ``MEGATRAIN*`` / ``MTNB*``
name written as a string in the package is a row here, and every row is read somewhere.
Variables of other tools the package honours (``HF_HUB_OFFLINE``, ``HF_HOME``, torchrun's
``RANK``/``WORLD_SIZE``/``MASTER_ADDR``...) keep their own documentation and are not listed.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Dict


@dataclass(frozen=True)
class EnvVar:
    name: str
    meaning: str
    default: str
    reader: str   # the module that reads it


#: name | reader | default | meaning
_TABLE = """
MEGATRAIN_NB_CACHE | trainer/default.py | ~/.cache/megatrain_nb | where the built-in corpus's tokenizer and token ids are cached, and mt.measure_machine's rates (engine/measure.py reads it too) and the fused update kernels (engine/updates/fused_update.py)
MEGATRAIN_NB_RUNTIME_DIR | channel/protocol.py | jupyter_runtime_dir()/megatrain_nb | the folder of heartbeats, inboxes and launch folders shared by the kernels and the Jupyter server
MEGATRAIN_NB_DASHBOARD | notebook/display_mode.py | auto | the Session's default display: auto, widgets, html or none
MEGATRAIN_NB_DEBUG | cli/__init__.py | unset | set: the CLI raises the error with its traceback instead of one line and exit status 2
MEGATRAIN_NB_CONTROL | trainer/control.py | on with several ranks or under torchrun | 0 turns a run's control channel (heartbeat, inbox, commands at step boundaries) off, 1 on
MEGATRAIN_NB_RUN_NAME | trainer/control.py | args.run_name, else the output folder's name | the run's name in the sidebar and the Session list
MEGATRAIN_NB_SESSION_ID | trainer/control.py | a new random id | the run's heartbeat id (a launching Session sets it for its ranks)
MEGATRAIN_NB_KERNEL_ID | trainer/control.py | unset | the kernel that launched the ranks (set by the Session), shown with the run
MEGATRAIN_NB_LAUNCHER | trainer/control.py | torchrun | who started the ranks: notebook (set by the Session) or torchrun
MEGATRAIN_NB_SNAPSHOT_STEPS | trainer/control.py | off | a snapshot every N optimizer steps on every rank
MEGATRAIN_NB_KEEP_SNAPSHOTS | trainer/control.py | all | how many of those snapshots to keep (the newest; never one a rewind went back to)
MEGATRAIN_NB_CONTROLLER_PID | notebook/launch_worker.py | unset | the launching kernel's pid: a worker whose controller is gone stops (set by the Session)
MEGATRAIN_DIST_TIMEOUT_S | engine/ranks/dist.py | 600 | seconds a collective waits for the other ranks before the run fails
MEGATRAIN_NB_PLAN_BY | engine/planning/plan_pick.py | auto | rules: every engine plans by the planner's rules even when the machine's rates are known, as EngineOverrides(plan_by='rules') (the test suite sets it: its plans must not follow a cached measurement)
MEGATRAIN_NB_VISION_PLACEMENT | engine/compute/vision_stream.py | the planner's | resident, blocks or streamed: a vision-language model's vision tower placed so whatever the plan says (the tests force each placement with it); unset: the planner picks (planning/vision_plan.place_vision)
MEGATRAIN_NB_FUSED_UPDATE | engine/updates/fused_update.py | 1 | 0: the optimizer-state codecs and the compressed update run on torch ops, never the fused C kernels (built once per machine under MEGATRAIN_NB_CACHE/kernels)
MEGATRAIN_ADVERSARIAL_TRANSPORT | engine/transport/transport.py | 0 | 1: the CPU transport copies late, poisons released buffers and refuses early reuse (tests)
"""


def _parse(table: str) -> Dict[str, EnvVar]:
    out: Dict[str, EnvVar] = {}
    for line in table.strip().splitlines():
        name, reader, default, meaning = (x.strip() for x in line.split("|"))
        out[name] = EnvVar(name=name, meaning=meaning, default=default, reader=reader)
    return out


#: every environment variable the package reads, by name
ENV_VARS: Dict[str, EnvVar] = _parse(_TABLE)


def env_seconds(name: str, default: float, high: float = 7 * 24 * 3600.0) -> float:
    """The variable ``name`` (a row of the table) as seconds, ``default`` when unset or empty;
    text that is not a number, NaN, inf, 0, a negative number or more than ``high`` (a week) is
    refused naming the variable and the range."""
    text = os.environ.get(name, "")
    if not text.strip():
        return float(default)
    try:
        x = float(text)
    except ValueError:
        x = math.nan
    if not (math.isfinite(x) and 0 < x <= high):
        row = ENV_VARS[name]
        raise ValueError(f"the environment variable {name}={text[:40]!r}: must be a number of seconds > 0 and <= "
                         f"{high:g} ({row.meaning}); unset it for the default, {row.default}")
    return x
