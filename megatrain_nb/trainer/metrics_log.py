"""The JSONL metrics log: one JSON object per line in ``output_dir/metrics.jsonl`` (step records,
evaluations, checkpoints, the end of training). Appends, so a resumed run continues the file.

Every run starts with an ``{"event": "run_start", "run_id": ...}`` line and, once the run has an
id, every line carries its ``run_id``: runs that share an output_dir can be told apart
(``MetricsLog.read(run_id=...)``)."""
from __future__ import annotations

import json
import math
import threading
from pathlib import Path


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


class MetricsLog:
    """``enabled=False`` (a data-parallel rank other than 0) writes nothing: one run, one log."""

    def __init__(self, path, enabled: bool = True):
        self.path = Path(path)
        self.enabled = enabled
        self._lock = threading.Lock()
        self.run_id = None  # set by the Trainer when a run starts
        self.lineage: dict = {}  # parent_run_id, forked_at_step of a branch (None for a root run)

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        if self.run_id is not None:
            record = {**record, "parent_run_id": self.lineage.get("parent_run_id"),
                      "forked_at_step": self.lineage.get("forked_at_step"), "run_id": self.run_id}
        line = json.dumps(_clean(record), default=str)
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line + "\n")

    def read(self, run_id=None) -> list[dict]:
        """The lines of the file (with ``run_id``: that run's only)."""
        if not self.path.is_file():
            return []
        lines = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
        return lines if run_id is None else [x for x in lines if x.get("run_id") == run_id]
