"""The JSONL metrics log: one JSON object per line in ``output_dir/metrics.jsonl`` (step records,
evaluations, checkpoints, the end of training). Appends, so a resumed run continues the file."""
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

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        line = json.dumps(_clean(record), default=str)
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line + "\n")

    def read(self) -> list[dict]:
        if not self.path.is_file():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
