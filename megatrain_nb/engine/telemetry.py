"""Plain counters the engine keeps; anything (dashboard, CLI, report) reads them as a dict."""
from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import Dict, Optional


class Telemetry:
    """Thread-safe counters: bytes per link, loads per unit, prefetch hits, stall seconds."""

    LINKS = ("host_to_device", "device_to_host", "disk_to_host", "host_to_disk")

    def __init__(self):
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.bytes = {k: 0 for k in self.LINKS}
            self.link_seconds = {k: 0.0 for k in self.LINKS}
            self._in_flight = {k: 0 for k in self.LINKS}     # asynchronous transfers under way
            self._busy_since = {k: 0.0 for k in self.LINKS}
            self.loads_per_unit: Dict[str, int] = defaultdict(int)
            self.prefetch = {"device": {"ahead": 0, "late": 0}, "disk": {"ahead": 0, "late": 0}}
            # what the waiting thread waited for: a tier ("device", "disk", "host_cache": a copy out
            # of the disk tier's RAM cache), "decode" (optimizer states still decoding), ...
            self.stall_seconds = {"device": 0.0, "disk": 0.0, "host_cache": 0.0, "decode": 0.0, "optimizer": 0.0,
                                  "grad_return": 0.0}
            self.steps = 0
            self.micro_batches = 0
            self.step_seconds = 0.0
            self.optimizer_seconds = 0.0
            self.optimizer_exposed_seconds = 0.0
            self.optimizer_exposed_disk_seconds = 0.0   # of it, the updates waiting for the disk tier
            self.weight_reads_saved = 0   # disk reads of master weights served by a kept buffer
            self.skipped_steps = 0        # non-finite steps dropped (on_nonfinite="skip")
            # Per optimizer step (the last one closed): see close_step().
            self.last_step: dict = {}
            self._mark = ({}, 0)          # loads per unit and host->device bytes at the last close
            self._step_tokens = 0
            self._step_micro_batches = 0

    def add_bytes(self, link: str, n: int, seconds: float = 0.0) -> None:
        with self._lock:
            self.bytes[link] += int(n)
            self.link_seconds[link] += seconds

    def busy_while(self, link: str, fut) -> None:
        """An asynchronous transfer on ``link`` (a disk read or write in the I/O threads) runs
        until ``fut`` is done: the time at least one is under way counts as the link's seconds,
        so ``bytes_per_second`` says how fast the disk moved while it was busy (overlapping
        transfers are not counted twice)."""
        with self._lock:
            if self._in_flight[link] == 0:
                self._busy_since[link] = time.perf_counter()
            self._in_flight[link] += 1

        def ended(_f) -> None:
            with self._lock:
                if self._in_flight[link] == 0:
                    return   # (the counters were reset while it ran)
                self._in_flight[link] -= 1
                if self._in_flight[link] == 0:
                    self.link_seconds[link] += time.perf_counter() - self._busy_since[link]
        fut.add_done_callback(ended)

    def load(self, unit_name: str) -> None:
        with self._lock:
            self.loads_per_unit[unit_name] += 1

    def prefetch_result(self, tier: str, ahead: bool) -> None:
        with self._lock:
            self.prefetch[tier]["ahead" if ahead else "late"] += 1

    def stall(self, what: str, seconds: float) -> None:
        with self._lock:
            self.stall_seconds[what] = self.stall_seconds.get(what, 0.0) + seconds

    def wait(self, fut, default: str = "disk"):
        """``fut.result()``, the time waited counted against the tier that caused it: the
        future's ``stall_kind`` (set by the disk tier's host cache), else ``default``."""
        t0 = time.perf_counter()
        try:
            return fut.result()
        finally:
            self.stall(getattr(fut, "stall_kind", default), time.perf_counter() - t0)

    def add(self, field: str, value) -> None:
        with self._lock:
            setattr(self, field, getattr(self, field) + value)

    def add_tokens(self, tokens: int, micro_batches: int = 1) -> None:
        """Tokens (and micro-batches) trained in the optimizer step that is running."""
        with self._lock:
            self._step_tokens += int(tokens)
            self._step_micro_batches += int(micro_batches)

    def close_step(self, layer_names, **extra) -> dict:
        """An optimizer step ended: its loads per unit, host->device bytes, tokens and tokens per
        weight fetch (tokens ÷ loads per layer) become ``last_step``; ``extra`` (groups, boundary
        bytes per tier, ...) is recorded with them."""
        with self._lock:
            loads0, h2d0 = self._mark
            loads = {k: v - loads0.get(k, 0) for k, v in self.loads_per_unit.items() if v - loads0.get(k, 0)}
            layer_loads = [loads.get(n, 0) for n in layer_names]
            per_layer = sum(layer_loads) / len(layer_loads) if layer_loads else 0.0
            self.last_step = {
                "loads_per_unit": loads,
                "loads_per_layer": per_layer,
                "host_to_device_bytes": self.bytes["host_to_device"] - h2d0,
                "tokens": self._step_tokens,
                "micro_batches": self._step_micro_batches,
                "tokens_per_weight_fetch": (self._step_tokens / per_layer) if per_layer else None,
                **extra,
            }
            self._mark = (dict(self.loads_per_unit), self.bytes["host_to_device"])
            self._step_tokens = 0
            self._step_micro_batches = 0
            return dict(self.last_step)

    def snapshot(self) -> dict:
        with self._lock:
            pf = {t: dict(v) for t, v in self.prefetch.items()}
            for v in pf.values():
                total = v["ahead"] + v["late"]
                v["hit_rate"] = (v["ahead"] / total) if total else None
            rate = {k: (self.bytes[k] / self.link_seconds[k]) if self.link_seconds[k] > 0 else None
                    for k in self.LINKS}
            return {
                "bytes": dict(self.bytes),
                "bytes_per_second": rate,
                "link_seconds": dict(self.link_seconds),
                "loads_per_unit": dict(self.loads_per_unit),
                "prefetch": pf,
                "stall_seconds": dict(self.stall_seconds),
                "steps": self.steps,
                "micro_batches": self.micro_batches,
                "step_seconds": self.step_seconds,
                "optimizer_seconds": self.optimizer_seconds,
                "optimizer_exposed_seconds": self.optimizer_exposed_seconds,
                "optimizer_exposed_disk_seconds": self.optimizer_exposed_disk_seconds,
                "weight_reads_saved": self.weight_reads_saved,
                "skipped_steps": self.skipped_steps,
                "last_step": dict(self.last_step),
            }


def waits_by_cause(tel: dict, since: Optional[dict] = None) -> Dict[str, float]:
    """The seconds the training thread waited, by cause, in a :meth:`Telemetry.snapshot` (less
    ``since``'s, an earlier one): ``stall_seconds``' causes, except that a forward waiting for a
    unit's pending update, which waits on that unit's weights, is taken out of the "device" wait
    and split into ``optimizer_exposed`` (the updates' own time) and ``optimizer_exposed_disk``
    (the updates waiting for the disk tier)."""
    def diff(key: str, sub: Optional[str] = None) -> float:
        now, then = (t.get(key) or ({} if sub else 0.0) for t in (tel, since or {}))
        return (now.get(sub, 0.0) - then.get(sub, 0.0)) if sub else now - then

    waits = {k: diff("stall_seconds", k) for k in tel.get("stall_seconds") or {}}
    exposed, on_disk = diff("optimizer_exposed_seconds"), diff("optimizer_exposed_disk_seconds")
    waits["optimizer_exposed"], waits["optimizer_exposed_disk"] = exposed - on_disk, on_disk
    waits["device"] = max(waits.get("device", 0.0) - exposed, 0.0)
    return waits
