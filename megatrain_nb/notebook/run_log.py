"""RunLog: everything a run has produced, in one lock-protected place.

The training thread appends (records, events, layer statistics); readers (the dashboard
publisher, the beacon, reports, ``session.history``) take consistent copies. Nothing here
touches widgets or the engine.

Example::

    log = RunLog()
    log.add_record({"step": 1, "loss": 2.3, "lr": 1e-3, "time": time.time()})
    log.add_event("lr", step=1, value=5e-4)
    view = log.view(max_points=400)     # downsampled curves for a figure
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from megatrain_nb.formatting import fmt_bytes

#: record keys copied into the curves (others stay in ``history`` only)
_CURVES = ("loss", "lr", "grad_norm", "tokens_per_s", "step_time_s")
#: layer-statistic metrics kept as a layers x steps matrix
HEAT_METRICS = ("grad_norm", "update_ratio", "weight_norm")
_TIERS = ("device", "host", "disk")


def downsample(x: np.ndarray, y: np.ndarray, max_points: int) -> tuple[np.ndarray, np.ndarray]:
    """At most ``max_points`` points: per bucket the min and the max of ``y`` (in x order),
    so spikes survive. NaNs are dropped first. Vectorised: it runs about once a second on
    the publisher thread, which shares the GIL with training."""
    ok = np.isfinite(y)
    if not ok.all():
        x, y = x[ok], y[ok]
    n = len(x)
    if n <= max_points:
        return x, y
    buckets = max(1, max_points // 2)
    size = -(-n // buckets)
    rows = -(-n // size)
    padded = np.concatenate([y, np.full(rows * size - n, y[-1])]).reshape(rows, size)
    base = np.arange(rows) * size
    lo = np.minimum(base + padded.argmin(axis=1), n - 1)
    hi = np.minimum(base + padded.argmax(axis=1), n - 1)
    idx = np.unique(np.concatenate([lo, hi]))
    return x[idx], y[idx]


class _HeatColumns:
    """A layers x steps matrix with a bounded number of columns: when it reaches twice the
    capacity, neighbouring columns are averaged in pairs (older steps get coarser)."""

    def __init__(self, capacity: int = 256):
        self.capacity = capacity
        self.steps: list[int] = []
        self.cols: list[np.ndarray] = []

    def append(self, step: int, values: np.ndarray) -> None:
        self.steps.append(step)
        self.cols.append(values)
        if len(self.cols) >= 2 * self.capacity:
            merged = []
            for k in range(0, len(self.cols) - 1, 2):
                a, b = self.cols[k], self.cols[k + 1]
                with np.errstate(invalid="ignore"):
                    merged.append(np.nanmean(np.vstack([a, b]), axis=0))
            self.steps = self.steps[1::2]
            self.cols = merged

    def matrix(self) -> tuple[list[int], np.ndarray]:
        if not self.cols:
            return [], np.zeros((0, 0))
        return list(self.steps), np.vstack(self.cols).T  # units x steps


@dataclass
class RunView:
    """A consistent, downsampled copy of a RunLog for one refresh of a display."""

    version: int
    step: int
    records: int
    curves: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    eval: tuple[np.ndarray, np.ndarray] = (np.zeros(0), np.zeros(0))
    events: list[dict] = field(default_factory=list)
    last: dict = field(default_factory=dict)
    memory: dict | None = None
    rank_memory: list | None = None     # several ranks: each rank's memory report, by rank
    links: dict[str, float | None] = field(default_factory=dict)
    prefetch_hit_rate: dict[str, float | None] = field(default_factory=dict)
    stall_share: float | None = None
    tokens_per_s: float | None = None
    step_time_s: float | None = None
    elapsed_s: float = 0.0
    units: list[str] = field(default_factory=list)
    layers: dict[str, dict] = field(default_factory=dict)
    heat: dict[str, tuple] = field(default_factory=dict)  # metric -> (units, steps, z), if asked for


class RunLog:
    """History, events and layer statistics of one run (thread-safe)."""

    def __init__(self, heat_capacity: int = 256):
        self._lock = threading.Lock()
        self._records: list[dict] = []
        self._events: list[dict] = []
        self._curves: dict[str, list[float]] = {k: [] for k in _CURVES}
        self._steps: list[float] = []
        self._eval: tuple[list[float], list[float]] = ([], [])
        self._memory: dict | None = None
        self._rank_memory: list | None = None
        self._telemetry: list[tuple[float, dict]] = []  # (time, snapshot), last two kept
        self._units: list[str] = []
        self._layers: dict[str, dict] = {}
        self._heat = {m: _HeatColumns(heat_capacity) for m in HEAT_METRICS}
        self._started = time.time()
        self._paused_s = 0.0
        self._version = 0

    # ---- writers (training thread) -------------------------------------------------------
    def add_record(self, record: dict, layer_stats: list[dict] | None = None) -> None:
        """One step's record, with its layer statistics (``layer_stats``) if it has any: both
        under one lock, so no view sees a step's statistics beside the previous step's record."""
        rec = dict(record)
        rec.setdefault("time", time.time())
        with self._lock:
            if layer_stats:
                self._put_layer_stats(int(rec.get("step", 0) or 0), layer_stats)
            self._records.append(rec)
            step = rec.get("step", len(self._records))
            self._steps.append(float(step))
            for k in _CURVES:
                self._curves[k].append(_num(rec.get(k)))
            if rec.get("eval_loss") is not None:
                self._eval[0].append(float(step))
                self._eval[1].append(_num(rec.get("eval_loss")))
            if isinstance(rec.get("memory"), dict):
                self._memory = rec["memory"]
            if isinstance(rec.get("rank_memory"), list):
                self._rank_memory = rec["rank_memory"]
            if isinstance(rec.get("telemetry"), dict):
                self._telemetry = (self._telemetry + [(rec["time"], rec["telemetry"])])[-2:]
            self._version += 1

    def _put_layer_stats(self, step: int, stats: list[dict]) -> None:
        """(under the lock)"""
        names = [str(s.get("unit", i)) for i, s in enumerate(stats)]
        if names != self._units:
            self._units = names
            for m in HEAT_METRICS:  # a different unit list starts a new matrix
                self._heat[m] = _HeatColumns(self._heat[m].capacity)
        for name, s in zip(names, stats):
            self._layers[name] = dict(s, step=step)
        for m in HEAT_METRICS:
            self._heat[m].append(step, np.array([_num(s.get(m)) for s in stats], dtype=float))

    def add_event(self, kind: str, step: int, **fields: Any) -> dict:
        event = {"kind": kind, "step": int(step), "time": time.time(), **fields}
        with self._lock:
            self._events.append(event)
            self._version += 1
        return event

    def truncate_after(self, step: int) -> list[dict]:
        """Remove and return the records of steps after ``step`` (a rewind: they become a branch of
        their own, see branches.py); the curves follow. Events and layer statistics stay."""
        with self._lock:
            keep = [r for r in self._records if int(r.get("step", 0) or 0) <= step]
            gone = [r for r in self._records if int(r.get("step", 0) or 0) > step]
            self._records = keep
            self._steps = [float(r.get("step", i + 1)) for i, r in enumerate(keep)]
            self._curves = {k: [_num(r.get(k)) for r in keep] for k in _CURVES}
            ev = [(float(r.get("step", 0)), _num(r.get("eval_loss"))) for r in keep if r.get("eval_loss") is not None]
            self._eval = ([e[0] for e in ev], [e[1] for e in ev])
            self._version += 1
        return gone

    def add_paused_time(self, seconds: float) -> None:
        with self._lock:
            self._paused_s += seconds

    def touch(self) -> None:
        """Mark a change that is not a record (state, error) so displays refresh."""
        with self._lock:
            self._version += 1

    # ---- readers -------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    def records(self) -> list[dict]:
        with self._lock:
            return list(self._records)

    def events(self) -> list[dict]:
        with self._lock:
            return [dict(e) for e in self._events]

    def last_record(self) -> dict:
        with self._lock:
            return dict(self._records[-1]) if self._records else {}

    def units(self) -> list[str]:
        with self._lock:
            return list(self._units)

    def layer(self, unit: str) -> dict | None:
        with self._lock:
            s = self._layers.get(unit)
            return dict(s) if s is not None else None

    def heat(self, metric: str) -> tuple[list[str], list[int], np.ndarray]:
        if metric not in self._heat:
            raise ValueError(f"metric {metric!r}: choose one of {', '.join(HEAT_METRICS)}")
        with self._lock:
            steps, z = self._heat[metric].matrix()
            return list(self._units), steps, z

    def unit_series(self, unit: str, metric: str) -> tuple[list[int], list[float]]:
        """One unit's row of the layers x steps matrix (coarser for older steps)."""
        units, steps, z = self.heat(metric)
        if unit not in units or z.size == 0:
            return [], []
        return steps, z[units.index(unit)].tolist()

    def view(self, max_points: int = 400, curves: tuple[str, ...] = _CURVES,
             heat: tuple[str, ...] = ()) -> RunView:
        """A consistent copy for one display refresh; ``curves`` picks which curves to
        downsample (the costly part), e.g. ``()`` for a header only; ``heat``, which layers x
        steps matrices to copy (``view.heat[metric] = (units, steps, z)``)."""
        for m in heat:
            if m not in self._heat:
                raise ValueError(f"metric {m!r}: choose one of {', '.join(HEAT_METRICS)}")
        with self._lock:
            matrices = {m: (list(self._units), *self._heat[m].matrix()) for m in heat}
            x = np.asarray(self._steps, dtype=float) if curves else None
            raw = {k: np.asarray(self._curves[k], dtype=float) for k in curves}
            ev = (np.asarray(self._eval[0], dtype=float), np.asarray(self._eval[1], dtype=float))
            last = dict(self._records[-1]) if self._records else {}
            recent = self._records[-20:]
            telemetry = list(self._telemetry)
            view = RunView(
                version=self._version,
                step=int(last.get("step", 0) or 0),
                records=len(self._records),
                eval=ev,
                events=[dict(e) for e in self._events],
                last=last,
                memory=self._memory,
                rank_memory=self._rank_memory,
                units=list(self._units),
                layers={k: dict(v) for k, v in self._layers.items()},
                heat=matrices,
            )
            paused = self._paused_s
        view.curves = {k: downsample(x, y, max_points) for k, y in raw.items()}  # outside the lock
        view.elapsed_s = max(0.0, time.time() - self._started - paused)
        times = [r.get("step_time_s") for r in recent if _finite(r.get("step_time_s"))]
        view.step_time_s = float(np.median(times)) if times else None
        view.tokens_per_s = _num(last.get("tokens_per_s")) if _finite(last.get("tokens_per_s")) else None
        _link_rates(view, telemetry)
        return view


def _link_rates(view: RunView, telemetry: list[tuple[float, dict]]) -> None:
    """Bytes per second per link over the last telemetry interval, prefetch hit rate and the
    share of step time spent stalled (waiting for a transfer or the optimizer)."""
    if not telemetry:
        return
    t1, cur = telemetry[-1]
    for tier, pf in (cur.get("prefetch") or {}).items():
        if isinstance(pf, dict):
            view.prefetch_hit_rate[tier] = pf.get("hit_rate")
    if len(telemetry) < 2:
        for link, v in (cur.get("bytes_per_second") or {}).items():
            view.links[link] = v
        return
    t0, prev = telemetry[0]
    dt = t1 - t0
    for link, b in (cur.get("bytes") or {}).items():
        b0 = (prev.get("bytes") or {}).get(link, 0)
        view.links[link] = (b - b0) / dt if dt > 0 else None
    stall = sum((cur.get("stall_seconds") or {}).values()) - sum((prev.get("stall_seconds") or {}).values())
    busy = (cur.get("step_seconds") or 0.0) - (prev.get("step_seconds") or 0.0)
    if busy > 0:
        view.stall_share = max(0.0, min(1.0, stall / busy))


def tier_summary(memory: dict | None) -> dict[str, dict]:
    """Per tier: used/peak/capacity bytes and the bytes by kind, from ``engine.memory_report()``
    (kinds as flat numeric keys such as ``weights``/``grads``/``optimizer_states``, or nested
    under ``by_kind``/``breakdown``)."""
    out: dict[str, dict] = {}
    for tier in _TIERS:
        t = (memory or {}).get(tier)
        if not isinstance(t, dict):
            continue
        kinds: dict[str, float] = {}
        nested = t.get("by_kind") or t.get("breakdown") or t.get("kinds")
        if isinstance(nested, dict):
            kinds = {k: float(v) for k, v in nested.items() if _finite(v)}
        else:
            for k, v in t.items():
                if not any(w in k for w in ("used", "peak", "capacity")) and _finite(v):
                    kinds[k[: -len("_bytes")] if k.endswith("_bytes") else k] = float(v)
        out[tier] = {
            "used": _num(t.get("used_bytes")),
            "peak": _num(t.get("peak_bytes")),
            "capacity": _num(t.get("capacity_bytes")) if t.get("capacity_bytes") is not None else None,
            "kinds": kinds,
        }
    return out


def disk_cache_line(tier: dict | None) -> str:
    """"disk cache 1.2 GiB / 4 GiB, 310 hits, 9.8 GiB saved" from a host tier's
    ``disk_cache_stats`` (engine.memory_report()), or "" without a cache."""
    st = (tier or {}).get("disk_cache_stats") if isinstance(tier, dict) else None
    if not isinstance(st, dict) or not st.get("capacity_bytes"):
        return ""
    held = st.get("ram_bytes", tier.get("disk_cache") or 0)   # all it holds (each kind is counted as itself)
    return (f"disk cache {fmt_bytes(held)} / {fmt_bytes(st['capacity_bytes'])}, "
            f"{st.get('hits', 0)} hits, {fmt_bytes(st.get('bytes_saved', 0))} saved")


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _num(v: Any) -> float:
    return float(v) if _finite(v) else float("nan")
