"""A run's prediction against what it measures: the prediction taken once as the run starts
(``Trainer.prediction``) and the engine telemetry each step's ``EngineOutput`` carries up (the
first step's, a warm-up left out, and the latest), so the CLI, ``%megatrain status`` and the
dashboard compare them without calling into the engine while it trains
(``Trainer.measured_vs_predicted``; the table: ``engine.prediction_check.comparison_rows``)."""
from __future__ import annotations

import threading
from typing import Optional

from megatrain_nb.engine.planning.prediction_check import comparison_rows, difference_line, measured_phases


class PredictionWatch:
    """The prediction of one run and the telemetry of its first and latest steps (thread-safe:
    the training thread writes, any thread reads :meth:`report`)."""

    def __init__(self, prediction=None):
        self.prediction = prediction
        self._lock = threading.Lock()
        self._first: Optional[dict] = None
        self._last: Optional[dict] = None

    def on_step(self, telemetry: Optional[dict]) -> None:
        """A step ended with this ``engine.telemetry()`` snapshot (None: the engine sent none)."""
        if not isinstance(telemetry, dict) or "steps" not in telemetry:
            return
        with self._lock:
            if self._first is None:
                self._first = telemetry
            else:
                self._last = telemetry

    def report(self) -> Optional[dict]:
        """None without a prediction; else ``{"prediction", "measured"`` (measured_phases' dict per
        step since the first, None until a second step ran), ``"steps"`` (how many it covers),
        ``"rows"`` (comparison_rows), ``"difference"`` (the >25% line or None)``}``."""
        pred = self.prediction
        if pred is None:
            return None
        with self._lock:
            first, last = self._first, self._last
        steps = last["steps"] - first["steps"] if first is not None and last is not None else 0
        measured = measured_phases(first, last) if steps > 0 else None
        return {"prediction": pred, "measured": measured, "steps": steps,
                "rows": comparison_rows(pred, measured),
                "difference": difference_line(pred, measured) if measured else None}
