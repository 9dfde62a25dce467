"""Every thread the package starts, by name, in one registry.

A stack dump reads at a glance when each thread says what it is: the engine's are named
``mtnb-*``. Code that starts a thread or a pool takes its name (and its settings) from here
(:func:`executor`, :func:`thread_name`), and ``docs/INTERNALS.md``'s thread table is checked
against this registry and against the threads a training step really starts
(``tests/engine/test_threads.py``).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Dict, Optional


def one_torch_thread() -> None:
    """Run this thread's kernels single-threaded: the worker runs beside the compute and the
    other workers, and more OpenMP teams on a busy 2-core machine mostly wait at barriers.
    (Elementwise kernels and exact max-reductions: results do not depend on it.)"""
    import torch

    torch.set_num_threads(1)


@dataclass(frozen=True)
class ThreadSpec:
    name: str                 # the thread's name (a pool's: the prefix of its threads' names)
    owner: str                # the class that starts it
    count: str                # how many ("1", "2", "1 per session", ...)
    does: str                 # one line: what it does
    initializer: Optional[Callable[[], None]] = None   # per-thread settings
    per_step: bool = False    # a training step with the disk tier and a codec starts it

    @property
    def settings(self) -> str:
        return "one torch thread" if self.initializer is one_torch_thread else "-"


THREADS: Dict[str, ThreadSpec] = {}


def _register(spec: ThreadSpec) -> ThreadSpec:
    THREADS[spec.name] = spec
    return spec


# ---------------------------------------------------------------------- the engine
H2D = _register(ThreadSpec("mtnb-h2d", "Pager", "1", "host->device weight copies", per_step=True))
D2H = _register(ThreadSpec("mtnb-d2h", "Pager", "1", "device->host gradient copies; the gradient intake",
                           per_step=True))
ADAMW = _register(ThreadSpec("mtnb-adamw", "UpdateRunner", "1", "every AdamW update", initializer=None,
                             per_step=True))
DECODE = _register(ThreadSpec("mtnb-decode", "OptimizerStates", "1", "decodes moment chunks ahead of AdamW",
                              initializer=one_torch_thread, per_step=True))
ENCODE = _register(ThreadSpec("mtnb-encode", "OptimizerStates", "1", "encodes moment chunks behind AdamW",
                              initializer=one_torch_thread, per_step=True))
DISK = _register(ThreadSpec("mtnb-disk", "DiskStore", "2 (mtnb-disk_0, mtnb-disk_1) + mtnb-disk_urgent",
                            "file reads and writes in priority order", per_step=True))
CACHE = _register(ThreadSpec("mtnb-cache", "HostCache", "1", "copies resident keys into readers' buffers",
                             per_step=True))
TRANSPORT_IN = _register(ThreadSpec("mtnb-transport-in", "CpuTransport", "1, adversarial mode only (tests)",
                                    "the late copies in (random delays); a sharded engine's gathers on CPU"))
TRANSPORT_OUT = _register(ThreadSpec("mtnb-transport-out", "CpuTransport", "1, adversarial mode only (tests)",
                                     "the late copies out (random delays); a sharded engine's reduce-scatters on CPU"))
# ---------------------------------------------------------------------- outside the engine
MANIFEST = _register(ThreadSpec("mtnb-manifest", "trainer.manifest", "up to 8 (a pool per call)",
                                "hashes checkpoint files"))
SNAPSHOT = _register(ThreadSpec("mtnb-snapshot", "PendingSnapshot", "1 while a snapshot completes",
                                "links, manifest and rename of a snapshot taken without waiting for the step"))
SESSION = _register(ThreadSpec("mtnb-session", "Session", "1 per session (mtnb-session-<name>)",
                               "drives trainer.iter_steps()"))
PUBLISHER = _register(ThreadSpec("mtnb-publisher", "Publisher", "1 per session (mtnb-publisher-<name>)",
                                 "the only writer of widgets and display handles"))
BEACON = _register(ThreadSpec("mtnb-beacon", "SessionBeacon", "1 per session (mtnb-beacon-<id>)",
                              "heartbeat file, command inbox"))
CONTROLLER_WATCH = _register(ThreadSpec("mtnb-controller-watch", "launch_worker", "1 on rank 0",
                                        "stops the run if the launching kernel dies"))


def thread_name(spec: ThreadSpec, suffix: str = "") -> str:
    """A thread's name: the registry's, with ``-<suffix>`` for one per instance."""
    return f"{spec.name}-{suffix}" if suffix else spec.name


def executor(spec: ThreadSpec, workers: int = 1) -> ThreadPoolExecutor:
    """A pool whose threads carry ``spec``'s name and settings."""
    return ThreadPoolExecutor(workers, thread_name_prefix=spec.name, initializer=spec.initializer)
