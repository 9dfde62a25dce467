"""Every thread the package starts, by name, in one registry.

A stack dump reads at a glance when each thread says what it is: the engine's are named
``mtnb-*``. Code that starts a thread or a pool takes its name (and its settings) from here
(:func:`executor`, :func:`thread_name`), and ``docs/INTERNALS.md``'s thread table is checked
against this registry and against the threads a training step really starts
(``tests/engine/test_threads.py``).
"""
from __future__ import annotations

import contextlib
import functools
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Dict, Optional


def torch_threads_here(n: int) -> None:
    """This thread's torch kernels on ``n`` threads (its OpenMP team), the other threads' and
    the ones started later left as they are. ``torch.set_num_threads`` would also set the
    process-wide count every thread starts from (torch sets a thread's count from it on the
    thread's first parallel op): a worker that calls it makes a compute thread started later
    (a notebook session's) run on ``n``; measured: after an int8 engine's first step a new
    thread ran on 1 of the 2 cores. So torch's own per-thread start runs first, then the
    OpenMP runtime's per-thread setting (``torch.set_num_threads`` where none is found)."""
    import torch

    torch.get_num_threads()   # torch's per-thread start, from the process-wide count, done now
    lib = _openmp_runtime()
    if lib is None:
        torch.set_num_threads(n)
    else:
        lib.omp_set_num_threads(int(n))


@functools.lru_cache(maxsize=None)
def _openmp_runtime():
    """The OpenMP runtime torch runs its parallel regions on (libgomp, libiomp5 or libomp, as
    loaded in this process), or None (looked up once)."""
    try:
        import ctypes

        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if line.rstrip().endswith(".so") or ".so." in line}
        for path in sorted(paths):
            if path.rsplit("/", 1)[-1].startswith(("libgomp", "libiomp5", "libomp")):
                lib = ctypes.CDLL(path)
                lib.omp_set_num_threads.argtypes = [ctypes.c_int]
                return lib
    except (OSError, AttributeError):
        pass
    return None


def one_torch_thread() -> None:
    """Run this thread's kernels single-threaded: the worker runs beside the compute and the
    other workers, and more OpenMP teams on a busy 2-core machine mostly wait at barriers.
    (Elementwise kernels and exact max-reductions: results do not depend on it.)"""
    torch_threads_here(1)


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


#: The registry as one table: name | owner | count | settings ("one torch thread" or "-") |
#: "step" when a training step with the disk tier and a codec starts it (else "-") | what it does.
_TABLE = """
mtnb-h2d | Pager | 1 | - | step | host->device weight copies
mtnb-d2h | Pager | 1 | - | step | device->host gradient copies; the gradient intake
mtnb-adamw | UpdateRunner | 1 | - | step | every AdamW update
mtnb-update | UpdateTeam | EngineConfig.optimizer_threads - 1 (none at 1, a CPU device's default) | one torch thread | - | pieces of each fused compressed chunk beside mtnb-adamw
mtnb-decode | OptimizerStates | 1 | one torch thread | step | decodes moment chunks ahead of AdamW
mtnb-encode | OptimizerStates | 1 | one torch thread | step | encodes moment chunks after AdamW
mtnb-disk | DiskStore | 2 (mtnb-disk_0, mtnb-disk_1) + mtnb-disk_urgent | - | step | reads and writes, by priority
mtnb-cache | HostCache | 1 | - | step | copies resident keys into readers' buffers
mtnb-pin | PinnedPool | 1 per CUDA transport, from its first size-class buffer | - | - | registers pinned host blocks per size class ahead of need (cudaHostRegister off the compute thread)
mtnb-transport-in | CpuTransport | 1, adversarial mode (tests) | - | - | delayed copies in; sharded gathers on CPU
mtnb-transport-out | CpuTransport | 1, adversarial mode (tests) | - | - | delayed copies out; sharded reduce-scatters on CPU
mtnb-manifest | manifest | up to 8 (a pool per call) | - | - | hashes checkpoint files
mtnb-snapshot | PendingSnapshot | 1 while a snapshot completes | - | - | links, manifest and rename of a snapshot taken without waiting for the step
mtnb-session | Session | 1 per session (mtnb-session-<name>) | - | - | drives trainer.iter_steps()
mtnb-publisher | Publisher | 1 per session (mtnb-publisher-<name>) | - | - | the only writer of widgets and displays
mtnb-beacon | SessionBeacon | 1 per session (mtnb-beacon-<id>) | - | - | heartbeat file, command inbox
mtnb-samples | SampleWatch | 1 per session with a sample prompt (mtnb-samples-<name>) | - | - | draws the answers to the sample prompt (a caller of the engine, as generate())
mtnb-controller-watch | launch_worker | 1 on rank 0 | - | - | stops the run if the launching kernel dies
mtnb-measure | measure_machine | 1 while it measures a CPU device's update rates | - | - | one-thread matmuls beside the AdamW and codec measurements
"""
_SETTINGS = {"-": None, "one torch thread": one_torch_thread}


def _parse(table: str) -> Dict[str, ThreadSpec]:
    specs = {}
    for line in table.strip().splitlines():
        name, owner, count, settings, when, does = (c.strip() for c in line.split("|"))
        specs[name] = ThreadSpec(name, owner, count, does, initializer=_SETTINGS[settings], per_step=when == "step")
    return specs


THREADS: Dict[str, ThreadSpec] = _parse(_TABLE)
# the engine's
H2D, D2H, ADAMW = THREADS["mtnb-h2d"], THREADS["mtnb-d2h"], THREADS["mtnb-adamw"]
DECODE, ENCODE, UPDATE = THREADS["mtnb-decode"], THREADS["mtnb-encode"], THREADS["mtnb-update"]
DISK, CACHE, PIN = THREADS["mtnb-disk"], THREADS["mtnb-cache"], THREADS["mtnb-pin"]
TRANSPORT_IN, TRANSPORT_OUT = THREADS["mtnb-transport-in"], THREADS["mtnb-transport-out"]
# outside the engine
MANIFEST, SNAPSHOT, SESSION = THREADS["mtnb-manifest"], THREADS["mtnb-snapshot"], THREADS["mtnb-session"]
PUBLISHER, BEACON = THREADS["mtnb-publisher"], THREADS["mtnb-beacon"]
SAMPLES = THREADS["mtnb-samples"]
CONTROLLER_WATCH = THREADS["mtnb-controller-watch"]
MEASURE = THREADS["mtnb-measure"]


def thread_name(spec: ThreadSpec, suffix: str = "") -> str:
    """A thread's name: the registry's, with ``-<suffix>`` for one per instance."""
    return f"{spec.name}-{suffix}" if suffix else spec.name


_local = threading.local()


def set_thread_device(device) -> None:
    """Make ``device`` this thread's current CUDA device (nothing for another device type).

    A fresh thread's current device is cuda:0: the first ``torch.cuda.stream(...)`` or
    ``current_stream()`` without a device in it creates a context on GPU 0, so every rank with
    ``local_rank > 0`` (and ``device="cuda:1"``) would hold a second context there. Every engine
    thread and pool sets its device here when it starts."""
    import torch

    if device is None:
        return
    device = with_index(torch.device(device))
    if device.type == "cuda":
        torch.cuda.set_device(device)


def with_index(device):
    """``device`` with its index where it is a GPU's: ``cuda`` is the current one, ``cuda:0`` on a
    fresh thread (``torch.cuda.set_device`` refuses a device without an index)."""
    import torch

    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


@contextlib.contextmanager
def thread_device(device):
    """Pools created in this thread inside the block start their threads on ``device`` (the
    engine builds its parts inside one); the calling thread runs on it inside the block
    (``torch.cuda.device``: switching back makes no context on the device it leaves)."""
    import torch

    prev = getattr(_local, "device", None)
    _local.device = device
    cuda = device is not None and torch.device(device).type == "cuda"
    try:
        with torch.cuda.device(torch.device(device)) if cuda else contextlib.nullcontext():
            yield
    finally:
        _local.device = prev


def current_thread_device():
    """The device pools created now start on (None: none set)."""
    return getattr(_local, "device", None)


def executor(spec: ThreadSpec, workers: int = 1, device=None) -> ThreadPoolExecutor:
    """A pool whose threads carry ``spec``'s name and settings, each set to ``device`` (default:
    :func:`thread_device`'s, where one is in force) when it starts."""
    device = current_thread_device() if device is None else device

    def start():
        set_thread_device(device)   # (looked up at call time: tests may replace it)
        if spec.initializer is not None:
            spec.initializer()
    return ThreadPoolExecutor(workers, thread_name_prefix=spec.name, initializer=start)
