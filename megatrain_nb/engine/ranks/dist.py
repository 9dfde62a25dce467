"""The process group of a run spread over several ranks: who we are, which device we drive,
how each unit's flat buffer is cut into per-rank shards, and the three collectives the sharded
engine needs (gather a unit, reduce-scatter its gradient, all-reduce a few numbers).

One object, :class:`Dist`, owns all of it (as picotron's process-group manager does), so the
engine, the trainer and the tests never call ``torch.distributed`` themselves. A run in one
process gets ``Dist.single()``: world 1, every collective a copy, no torch.distributed at all.

Shards: a unit's ``numel`` elements are cut into ``world`` contiguous shards of ``shard``
elements each (the last ones may be short, or empty for a tiny unit); ``shard`` is a multiple of
:data:`SHARD_ALIGN`, the largest codec block, so a compressed Adam state's blocks never straddle
a shard boundary and a shard's blocks are the same blocks whatever the world size (a checkpoint
written by N ranks can be re-cut for M without re-encoding). On the wire every shard is padded
to ``shard`` elements, as the collectives need equal pieces.

Traffic: every collective adds to :attr:`Dist.traffic` the bytes this rank sends with the
algorithm the backend uses (``sent``) and the floor for the operation on the unpadded data
(``minimum``: (N-1)/N of the unit for a gather or a reduce-scatter, 2(N-1)/N for an all-reduce,
the ring algorithms NCCL uses). Where a backend lacks a collective we fall back to one it has
(gloo before torch 2.6 had no reduce-scatter: all-reduce and keep our slice), and ``sent``
says what that costs.
"""
from __future__ import annotations

import atexit
import datetime
import json
import logging
import os
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from megatrain_nb.env_vars import env_seconds
from megatrain_nb.loopback import is_loopback, loopback_env, loopback_store

from ..updates.codecs import INT4_BLOCK, INT8_BLOCK
from ..transport.issuer import Issuer

#: Shard sizes are multiples of this: every codec block size divides it.
SHARD_ALIGN = max(INT8_BLOCK, INT4_BLOCK)
assert SHARD_ALIGN % INT8_BLOCK == 0 and SHARD_ALIGN % INT4_BLOCK == 0

#: Bound on every wait of a collective (init included), unless the caller passes another.
def default_timeout_s() -> float:
    """MEGATRAIN_DIST_TIMEOUT_S (default 600), read when a group is made: a bad value is refused
    naming the variable and its range (env_vars.env_seconds)."""
    return env_seconds("MEGATRAIN_DIST_TIMEOUT_S", 600.0)



_DDP_HINT = "parallel_mode != ParallelMode.DISTRIBUTED"


class _NoDdpHint(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return _DDP_HINT not in record.getMessage()


def quiet_transformers_ddp_hint() -> None:
    """transformers.TrainingArguments warns, each time a rank sets up its device under an
    initialized process group, "torch.distributed process group is initialized, but
    parallel_mode != ParallelMode.DISTRIBUTED ... launch with torch.distributed.launch" (its
    accelerate state sees no DDP). Here that is by design: the ranks shard the training state
    themselves (engine/ranks/sharded.py) and never wrap the model in DDP, so the advice does not
    apply; this one message is filtered, every other transformers warning stays."""
    log = logging.getLogger("transformers.training_args")
    if not any(isinstance(f, _NoDdpHint) for f in log.filters):
        log.addFilter(_NoDdpHint())

class DistError(RuntimeError):
    """The ranks cannot work together (they disagree, or the process group is missing)."""


@dataclass(frozen=True)
class ShardLayout:
    """How one flat buffer of ``numel`` elements is cut over ``world`` ranks."""

    numel: int
    world: int
    shard: int          # elements per rank on the wire (padded); a multiple of the alignment

    @classmethod
    def make(cls, numel: int, world: int, align: int = SHARD_ALIGN) -> "ShardLayout":
        if numel < 0 or world < 1 or align < 1:
            raise ValueError(f"ShardLayout: numel={numel}, world={world}, align={align}; need numel >= 0, "
                             "world >= 1, align >= 1")
        per_rank = -(-numel // world)
        return cls(numel=numel, world=world, shard=max(align, -(-per_rank // align) * align))

    @property
    def padded(self) -> int:
        return self.shard * self.world

    def bounds(self, rank: int) -> tuple[int, int]:
        """[start, end) of rank's real elements in the full buffer (start == end: it owns none)."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside world size {self.world}")
        start = min(rank * self.shard, self.numel)
        return start, min(start + self.shard, self.numel)

    def numel_of(self, rank: int) -> int:
        s, e = self.bounds(rank)
        return e - s

    def local_range(self, rank: int, lo: int, hi: int) -> tuple[int, int]:
        """The part of the full buffer's [lo, hi) that rank owns, in its shard's coordinates
        (e.g. the weight-decayed prefix of a unit, for the update of a shard)."""
        s, e = self.bounds(rank)
        a, b = max(lo, s), min(hi, e)
        return (a - s, b - s) if a < b else (0, 0)

    def shard_of(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank's slice of a full flat buffer (a view)."""
        if full.numel() < self.numel:
            raise ValueError(f"buffer of {full.numel()} elements is shorter than the layout's {self.numel}")
        s, e = self.bounds(rank)
        return full.view(-1)[s:e]


@dataclass
class Traffic:
    """Bytes this rank sent, per kind of collective: what the backend's algorithm sends and the
    floor for the same operation on the unpadded data."""

    sent: dict = field(default_factory=dict)
    minimum: dict = field(default_factory=dict)
    calls: dict = field(default_factory=dict)

    def __post_init__(self):
        self._lock = threading.Lock()   # the pager's and the gradients' threads both count

    def add(self, kind: str, sent: float, minimum: float) -> None:
        with self._lock:
            self.sent[kind] = self.sent.get(kind, 0) + int(sent)
            self.minimum[kind] = self.minimum.get(kind, 0) + int(minimum)
            self.calls[kind] = self.calls.get(kind, 0) + 1

    def total(self) -> tuple[int, int]:
        return sum(self.sent.values()), sum(self.minimum.values())

    def reset(self) -> None:
        self.sent.clear()
        self.minimum.clear()
        self.calls.clear()


class Pending:
    """A collective in flight; :meth:`wait` returns its result (bounded by the group's timeout)."""

    def __init__(self, work, finish: Callable[[], torch.Tensor]):
        self._work, self._finish, self._result = work, finish, None

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._result is None:
            self._result = self._finish()
        return self._result


def _done(t: torch.Tensor) -> Pending:
    return Pending(None, lambda: t)


def _env_int(name: str, default: int) -> int:
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    try:
        return int(v)
    except ValueError:
        raise DistError(f"environment variable {name}={v!r} is not an integer (torchrun sets it)") from None


class Dist:
    """Rank, world size, device and collectives of one run. Build it with :meth:`single`,
    :meth:`from_env` (torchrun) or ``Dist(group)`` for a group the caller made."""

    def __init__(self, group=None, *, device: Optional[torch.device | str] = None,
                 local_rank: Optional[int] = None, timeout_s: Optional[float] = None,
                 _single: bool = False):
        import torch.distributed as tdist

        self.traffic = Traffic()
        self._lock = threading.Lock()
        self.timeout_s = default_timeout_s() if timeout_s is None else float(timeout_s)
        self.owns_group = False
        self.store = None   # a rendezvous store this rank hosts on loopback (see loopback_rendezvous)
        # every collective of this group and of its channels, one at a time in the program's order
        self.issuer = Issuer(self.timeout_s, DistError)
        self.host_stream = None   # CUDA: the stream a host value's all-reduce runs on (None: a side stream)
        if _single:
            self.group, self.rank, self.world, self.backend = None, 0, 1, None
        else:
            if not (tdist.is_available() and tdist.is_initialized()):
                raise DistError("Dist(group): torch.distributed is not initialised; use Dist.from_env() "
                                "under torchrun, or Dist.single() for one process")
            self.group = group
            self.rank = tdist.get_rank(group)
            self.world = tdist.get_world_size(group)
            self.backend = str(tdist.get_backend(group)).lower()
        self.local_rank = _env_int("LOCAL_RANK", self.rank if self.world > 1 else 0) \
            if local_rank is None else int(local_rank)
        self.device = torch.device(device) if device is not None else self._default_device()
        if self.device.type == "cuda" and self.device.index is None:   # "cuda": this rank's GPU
            self.device = torch.device("cuda", self.local_rank)
        if self.backend == "nccl" and self.device.type != "cuda":
            raise DistError(f"the NCCL backend needs a CUDA device, got {self.device}; use gloo on the CPU")
        self._native = self._probe_collectives()

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def single(cls, device: Optional[torch.device | str] = None) -> "Dist":
        """One process: world 1, no torch.distributed."""
        return cls(_single=True, device=device if device is not None else "cpu")

    @classmethod
    def from_env(cls, *, backend: Optional[str] = None, device: Optional[torch.device | str] = None,
                 timeout_s: Optional[float] = None) -> "Dist":
        """The run's group: the default group if one exists, else one built from torchrun's
        environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), else :meth:`single`.
        NCCL when this rank drives a CUDA device, gloo otherwise; every wait is bounded by
        ``timeout_s``."""
        import torch.distributed as tdist

        timeout_s = default_timeout_s() if timeout_s is None else float(timeout_s)
        if tdist.is_available() and tdist.is_initialized():
            quiet_transformers_ddp_hint()
            return _ended_at_exit(cls(None, device=device, timeout_s=timeout_s))
        world = _env_int("WORLD_SIZE", 1)
        if world <= 1:
            return cls.single(device=device)
        if not tdist.is_available():
            raise DistError(f"WORLD_SIZE={world} but this torch build has no torch.distributed")
        local_rank = _env_int("LOCAL_RANK", 0)
        if device is None:
            device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:   # "cuda": this rank's GPU (set_device needs an index)
            device = torch.device("cuda", local_rank)
        if backend is None:
            backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        kwargs = {}
        if backend == "nccl":
            kwargs["device_id"] = device  # eager NCCL init: a missing peer fails within the timeout
        store = loopback_rendezvous(timeout_s)
        tdist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
        quiet_transformers_ddp_hint()
        d = cls(None, device=device, local_rank=local_rank, timeout_s=timeout_s)
        d.owns_group = True
        d.store = store
        return _ended_at_exit(d)

    def _default_device(self) -> torch.device:
        if self.backend == "nccl":
            return torch.device(f"cuda:{self.local_rank}")
        return torch.device("cpu")

    def channel(self, name: str) -> "Dist":
        """A Dist over a process group of its own, for collectives issued from one worker thread
        (the pager's gathers, the gradients' reduce-scatters). The channels share this object's
        :attr:`issuer`: every collective of every channel is issued in one order, the program's
        (engine/transport/issuer.py). Every rank must ask for its channels in the same order (the engine
        does, at construction). The channel counts its bytes into this object's :attr:`traffic`."""
        if self.world == 1:
            return self
        with self._lock:
            chans = self.__dict__.setdefault("_channels", {})
            if name not in chans:
                import torch.distributed as tdist

                ranks = tdist.get_process_group_ranks(self.group) if self.group is not None else None
                g = tdist.new_group(ranks=ranks, backend=self.backend,
                                    timeout=datetime.timedelta(seconds=self.timeout_s))
                c = Dist(g, device=self.device, local_rank=self.local_rank, timeout_s=self.timeout_s)
                c.traffic = self.traffic
                c.issuer = self.issuer   # one order over every channel (engine/transport/issuer.py)
                chans[name] = c
            return chans[name]

    def close(self) -> None:
        """Tear down the group if this object made it, in order: every collective of every
        channel finished on every rank (a barrier on each: every rank calls close at the end
        of a run), then :meth:`teardown`."""
        import torch.distributed as tdist

        if self.owns_group and tdist.is_initialized():
            for c in list(self.__dict__.get("_channels", {}).values()):
                c.barrier()
            self.barrier()
        self.teardown()

    def teardown(self, *, at_exit: bool = False) -> None:
        """Destroy the groups this object made and drop its references to them now, so their
        worker threads end here. A gloo group's worker threads live as long as its Python
        object (``destroy_process_group`` does not stop them): left to the interpreter's exit,
        a worker releasing a finished collective's tensors asks for the GIL of an interpreter
        being torn down, and the rank aborts ("terminate called without an active exception",
        seen in tests/distributed/test_zero3_flow.py). ``at_exit``: run by the exit hook for
        every Dist :meth:`from_env` returned, whoever made the group (a script that never calls
        close(), a group transformers' TrainingArguments made); no barrier there: a peer may
        be gone."""
        import gc
        import time

        import torch.distributed as tdist

        if not (self.owns_group or at_exit):
            return
        self.owns_group = False
        time.sleep(0.05)   # the GIL released: workers finish releasing their last works
        if tdist.is_initialized():
            tdist.destroy_process_group()
        chans = self.__dict__.get("_channels", {})
        for c in chans.values():
            c.group = None
        chans.clear()
        gc.collect()   # the groups' objects (and their threads) go now, not at the interpreter's exit

    # -- facts --------------------------------------------------------------------------------
    @property
    def is_main(self) -> bool:
        """Rank 0: the one that logs, reports and writes shared files."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def layout(self, numel: int) -> ShardLayout:
        return ShardLayout.make(int(numel), self.world)

    def __repr__(self) -> str:
        return f"Dist(rank={self.rank}, world={self.world}, backend={self.backend}, device={self.device})"

    # -- collectives ---------------------------------------------------------------------------
    def gather(self, shard: torch.Tensor, layout: ShardLayout, out: Optional[torch.Tensor] = None,
               async_op: bool = False, key=None):
        """Every rank's shard -> the whole flat buffer on this rank's device.

        ``shard``: this rank's real elements (``layout.numel_of(rank)``, any device);
        ``out``: an optional device buffer of ``layout.padded`` elements to fill. Returns the
        ``[numel]`` tensor, or a :class:`Pending` with ``async_op=True`` (a prefetch).
        ``key``: the announcement this gather answers (a worker's; see engine/transport/issuer.py)."""
        self._check_layout(layout)
        n_own = layout.numel_of(self.rank)
        if shard.numel() != n_own:
            raise ValueError(f"gather: rank {self.rank} holds {n_own} elements of this unit, got a shard of "
                             f"{shard.numel()}")
        if out is None:
            out = torch.empty(layout.padded, dtype=shard.dtype, device=self.device)
        elif out.numel() < layout.padded or out.device != self.device:
            raise ValueError(f"gather: out must hold {layout.padded} elements on {self.device}, got "
                             f"{out.numel()} on {out.device}")
        out = out.view(-1)[:layout.padded]
        if self.world == 1:
            out[:n_own].copy_(shard.view(-1), non_blocking=True)
            return _done(out[:layout.numel]) if async_op else out[:layout.numel]
        return self.issuer.issue("gather", key, lambda: self._gather(shard, layout, out, n_own, async_op))

    def _gather(self, shard, layout: ShardLayout, out: torch.Tensor, n_own: int, async_op: bool):
        import torch.distributed as tdist

        mine = out[self.rank * layout.shard:(self.rank + 1) * layout.shard]
        mine[:n_own].copy_(shard.view(-1), non_blocking=True)
        if n_own < layout.shard:
            mine[n_own:].zero_()  # padding travels; keep it deterministic
        esize, n = out.element_size(), self.world
        self.traffic.add("gather", (n - 1) * layout.shard * esize, (n - 1) * layout.numel * esize / n)
        if self._native["gather"]:
            work = _all_gather_single(out, mine, self.group, async_op)
        else:
            # Inputs must not alias outputs for the list form: send a copy of our piece.
            pieces = list(out.split(layout.shard))
            work = tdist.all_gather(pieces, mine.clone(), group=self.group, async_op=async_op)
        full = out[:layout.numel]
        return Pending(work, lambda: full) if async_op else full

    def reduce_scatter(self, full: torch.Tensor, layout: ShardLayout, async_op: bool = False, key=None):
        """Sum a full flat buffer (a gradient) over ranks and return this rank's shard of the sum
        (``layout.numel_of(rank)`` elements, on ``full``'s device).

        ``full`` holds ``numel`` or ``padded`` elements; with ``padded`` (tail zero) no copy is
        made. The result is a fresh tensor (or a :class:`Pending` with ``async_op=True``).
        ``key``: the announcement this reduce-scatter answers (engine/transport/issuer.py)."""
        self._check_layout(layout)
        flat = full.view(-1)
        n_own = layout.numel_of(self.rank)
        if self.world == 1:
            if flat.numel() < layout.numel:
                raise ValueError(f"reduce_scatter: got {flat.numel()} elements, the unit has {layout.numel}")
            res = flat[:layout.numel].clone()
            return _done(res) if async_op else res
        return self.issuer.issue("reduce_scatter", key, lambda: self._reduce_scatter(flat, layout, n_own, async_op))

    def _reduce_scatter(self, flat: torch.Tensor, layout: ShardLayout, n_own: int, async_op: bool):
        import torch.distributed as tdist

        if flat.numel() == layout.padded:
            src = flat
        elif flat.numel() == layout.numel:
            src = torch.zeros(layout.padded, dtype=flat.dtype, device=flat.device)
            src[:layout.numel].copy_(flat)
        else:
            raise ValueError(f"reduce_scatter: got {flat.numel()} elements; expected {layout.numel} or the "
                             f"padded {layout.padded}")
        esize, n = flat.element_size(), self.world
        minimum = (n - 1) * layout.numel * esize / n
        if self._native["reduce_scatter"]:
            out = torch.empty(layout.shard, dtype=flat.dtype, device=flat.device)
            work = _reduce_scatter_single(out, src, self.group, async_op)
            self.traffic.add("reduce_scatter", (n - 1) * layout.shard * esize, minimum)
            return Pending(work, lambda: out[:n_own]) if async_op else out[:n_own]
        # Fallback (gloo without reduce-scatter): all-reduce the whole buffer, keep our slice.
        # A ring all-reduce sends twice what a reduce-scatter would.
        buf = src.clone() if src is flat else src
        work = tdist.all_reduce(buf, group=self.group, async_op=async_op)
        self.traffic.add("reduce_scatter", 2 * (n - 1) * layout.shard * esize, minimum)
        s = self.rank * layout.shard

        def finish():
            return buf[s:s + n_own].clone()

        return Pending(work, finish) if async_op else finish()

    def all_reduce_(self, t: torch.Tensor, *, kind: str = "all_reduce", key=None) -> torch.Tensor:
        """Sum ``t`` over ranks in place (e.g. per-shard squared gradient norms). Returns ``t``.
        ``kind``/``key``: the announcement this answers (a worker's vote; engine/transport/issuer.py)."""
        if self.world == 1:
            return t
        n, b = self.world, t.numel() * t.element_size()
        self.traffic.add("all_reduce", 2 * (n - 1) * b / n, 2 * (n - 1) * b / n)
        dev = self.device if (self.backend == "nccl") else torch.device("cpu")
        if t.device != dev and dev.type == "cuda":
            host, ev, _tmp = self.issuer.issue(kind, key, lambda: self._host_all_reduce(t, dev))
            ev.synchronize()   # outside the turn: the next collective is issued meanwhile
            t.copy_(host)
            return t
        return self.issuer.issue(kind, key, lambda: self._all_reduce(t, dev))

    def _all_reduce(self, t: torch.Tensor, dev: torch.device) -> torch.Tensor:
        import torch.distributed as tdist

        if t.device != dev:  # gloo works on the CPU
            tmp = t.to(dev)
            tdist.all_reduce(tmp, group=self.group)
            t.copy_(tmp)
        else:
            tdist.all_reduce(t, group=self.group)
        return t

    def _host_all_reduce(self, t: torch.Tensor, dev: torch.device):
        """A host value (a finiteness vote, a token count) over NCCL, enqueued without waiting:
        on :attr:`host_stream` (the reduce channel's: the d2h stream, whose gradient copies the
        vote follows) or a side stream of this group's own -- never the calling thread's
        default stream, where it would queue behind the whole compute backlog. Through a pinned
        buffer both ways, so neither copy blocks the host. Returns (pinned result, event after
        it, device temporary: kept alive until the event)."""
        import torch.distributed as tdist

        stream = self.host_stream if self.host_stream is not None else self._side_stream(dev)
        with torch.cuda.device(dev), torch.cuda.stream(stream):
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t)
            tmp = host.to(dev, non_blocking=True)
            tdist.all_reduce(tmp, group=self.group)
            host.copy_(tmp, non_blocking=True)   # (after the H2D above: one stream)
            ev = torch.cuda.Event(blocking=True)   # the host waits on it: sleep, not spin
            ev.record(stream)
        return host, ev, tmp

    def _side_stream(self, dev: torch.device):
        """This group's stream for host values' collectives (made once)."""
        with self._lock:
            stream = self.__dict__.get("_side")
            if stream is None:
                stream = self.__dict__["_side"] = torch.cuda.Stream(dev)
            return stream

    def sum(self, value: float | int) -> float | int:
        """A number summed over ranks (token counts, loss sums); exact for integers below 2**53."""
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        self.all_reduce_(t)
        out = t.item()
        return int(round(out)) if isinstance(value, int) else out

    def all_gather_json(self, obj: Any) -> list:
        """Every rank's ``obj`` (a control message: commands, memory figures, a path, a run id),
        in rank order. It travels as JSON text in a byte tensor, never pickled: what a peer sends
        is parsed as data, so no rank runs code another sent (``all_gather_object`` unpickles).
        Tuples come back as lists, as JSON has them; a value JSON cannot hold is a TypeError."""
        text = json.dumps(obj, separators=(",", ":"))
        if self.world == 1:
            return [json.loads(text)]
        return self.issuer.issue("json", None, lambda: self._exchange_json(text))

    def _exchange_json(self, text: str) -> list:
        dev = self.device if self.backend == "nccl" else torch.device("cpu")
        data = torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8) if text else \
            torch.empty(0, dtype=torch.uint8)
        sizes = torch.zeros(self.world, dtype=torch.int64, device=dev)
        mine = torch.tensor([data.numel()], dtype=torch.int64, device=dev)
        self._gather_flat(sizes, mine)
        longest = int(sizes.max())
        buf = torch.zeros(longest, dtype=torch.uint8, device=dev)
        buf[:data.numel()] = data.to(dev)
        out = torch.empty(longest * self.world, dtype=torch.uint8, device=dev)
        self._gather_flat(out, buf)
        raw = out.cpu().numpy().tobytes()
        return [json.loads(raw[r * longest:r * longest + int(sizes[r])].decode("utf-8")) for r in range(self.world)]

    def _gather_flat(self, out: torch.Tensor, mine: torch.Tensor) -> None:
        """``out`` = every rank's ``mine`` end to end (not counted in :attr:`traffic`: the
        control messages are a few hundred bytes a step, the traffic figures are the model's)."""
        import torch.distributed as tdist

        if self._native["gather"]:
            _all_gather_single(out, mine, self.group, False)
        else:
            tdist.all_gather(list(out.split(mine.numel())), mine.clone(), group=self.group)

    def check_same(self, what: str, value: Any) -> None:
        """Refuse to start when the ranks disagree on ``value`` (model, codec, seed, data...):
        raise on every rank, naming the ranks and their values."""
        values = self.all_gather_json(value)
        if any(v != values[0] for v in values):
            detail = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            raise DistError(f"the ranks disagree on {what} ({detail}); every rank must start the run with "
                            "the same settings")

    def barrier(self) -> None:
        if self.world > 1:
            self.issuer.issue("barrier", None, self._barrier)

    def _barrier(self) -> None:
        import torch.distributed as tdist

        if self.backend == "nccl":
            tdist.barrier(group=self.group, device_ids=[self.device.index or 0])
        else:
            tdist.barrier(group=self.group)

    def _probe_collectives(self) -> dict:
        """Which single-tensor collectives the backend has. NCCL has both; gloo gained them in
        later torch releases. Every rank runs the same probe at the same point, so a collective
        that is missing fails on all of them before any data moves (an unsupported op raises at
        the call, before it is enqueued)."""
        native = {"gather": True, "reduce_scatter": True}
        if self.world == 1 or self.backend == "nccl":
            return native
        dev = self.device
        for name, run in (("gather", lambda: _all_gather_single(
                                torch.zeros(self.world, device=dev), torch.zeros(1, device=dev), self.group, False)),
                          ("reduce_scatter", lambda: _reduce_scatter_single(
                                torch.zeros(1, device=dev), torch.zeros(self.world, device=dev), self.group, False))):
            try:
                run()
            except (NotImplementedError, RuntimeError) as e:
                if "support" not in str(e).lower() and not isinstance(e, NotImplementedError):
                    raise  # a real failure (a peer died, a timeout): not a missing feature
                native[name] = False
        return native

    def _check_layout(self, layout: ShardLayout) -> None:
        if layout.world != self.world:
            raise ValueError(f"layout cut for world size {layout.world}, this group has {self.world} ranks")


_MADE: "weakref.WeakSet[Dist]" = weakref.WeakSet()   # the Dists from_env returned (their channels)
_EXIT_HOOK: list = []


def _ended_at_exit(d: "Dist") -> "Dist":
    """``d``, torn down by the exit hook (registered once) if still up when the interpreter exits."""
    _MADE.add(d)
    if not _EXIT_HOOK:
        atexit.register(_teardown_at_exit)
        _EXIT_HOOK.append(True)
    return d


def _teardown_at_exit() -> None:
    """At exit, while the interpreter is whole: every group's worker threads end (see
    :meth:`Dist.teardown`), the default group's too when no Dist is left to do it."""
    import torch.distributed as tdist

    for d in list(_MADE):
        d.teardown(at_exit=True)
    if tdist.is_available() and tdist.is_initialized():
        tdist.destroy_process_group()


def loopback_rendezvous(timeout_s: float):
    """A run whose rendezvous is on this machine (MASTER_ADDR a loopback address) keeps every
    socket on loopback: the collectives' (gloo, NCCL's bootstrap) on the ``lo`` interface, and,
    when rank 0 hosts the store itself (torchrun's c10d rendezvous with its store not shared),
    that store bound to 127.0.0.1, where torch's own would listen on every interface. Returns
    that store (kept alive with the group) or None."""
    if not is_loopback(os.environ.get("MASTER_ADDR")):
        return None
    os.environ.update(loopback_env())
    if _env_int("RANK", 0) != 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        return None   # a client of the agent's store (or of rank 0's)
    try:
        return loopback_store(_env_int("MASTER_PORT", 0), world_size=_env_int("WORLD_SIZE", 1), timeout_s=timeout_s)
    except OSError:
        return None   # the port is taken (a store already there): torch's own connects to it


def _all_gather_single(out, inp, group, async_op):
    import torch.distributed as tdist

    fn = getattr(tdist, "all_gather_single", None) or tdist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)


def _reduce_scatter_single(out, inp, group, async_op):
    import torch.distributed as tdist

    fn = getattr(tdist, "reduce_scatter_single", None) or tdist.reduce_scatter_tensor
    return fn(out, inp, group=group, async_op=async_op)


def resolve_dist(dist, config) -> Dist:
    """The engine's process group: a Dist as given; a torch ProcessGroup wrapped; else the
    initialised default group; else, under torchrun (WORLD_SIZE > 1), the group built from the
    environment; else one process."""
    if isinstance(dist, Dist):
        return dist
    import torch.distributed as tdist

    want = None
    if config.device is not None and torch.device(config.device).type == "cpu":
        want = "cpu"
    if dist is not None:
        return Dist(dist, device=want)
    if tdist.is_available() and tdist.is_initialized():
        return Dist(None, device=want)
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:   # under torchrun: join the run's group
        return Dist.from_env(device=want)
    return Dist.single()
