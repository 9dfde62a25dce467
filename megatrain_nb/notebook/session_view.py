"""How a Session shows itself: its dashboard widget, the publisher that keeps the display live,
and the JupyterLab beacon that announces it (``channel/beacon.py``). One per Session."""
from __future__ import annotations

import sys
from typing import Any, Optional


class SessionView:
    """The display side of ``session`` (see the module docstring)."""

    def __init__(self, session: Any):
        self.session = session
        self.live: Any = None        # publisher.Publisher while displayed (``session.publisher``)
        self.widget: Any = None      # dashboard.Dashboard: one per session, every display shows it
        self.beacon: Any = None

    def dashboard(self):
        """The dashboard widget, made live while the run is."""
        from .publisher import make_live

        d = self._widget()
        self.live = make_live(self.session, d, self.live)
        return d

    def show(self, mode: Optional[str]) -> None:
        """Display the run (``mode`` from ``display_mode.resolve_mode``; None: nothing)."""
        if mode is None:
            return
        try:
            from .publisher import WIDGET_MODES, show_live

            self.live = show_live(self.session, mode, self._widget() if mode in WIDGET_MODES else None)
        except Exception as e:  # noqa: BLE001 - the run matters more than its display
            print(f"megatrain_nb: the dashboard could not be shown ({type(e).__name__}: {e}); "
                  "training goes on (session.dashboard() tries again)", file=sys.stderr)

    def _widget(self):
        if self.widget is None:
            from .dashboard import Dashboard

            self.widget = Dashboard(self.session)
        return self.widget

    def announce(self) -> None:
        from megatrain_nb.channel.beacon import SessionBeacon

        try:
            self.beacon = SessionBeacon(self.session).start()
        except Exception as e:  # noqa: BLE001 - the sidebar is optional; training is not
            print(f"megatrain_nb: the JupyterLab beacon did not start ({e})", file=sys.stderr)
            self.beacon = None

    def run_ended(self) -> None:
        """The run ended (background thread): the beacon writes its last heartbeat, the
        publisher its last update."""
        if self.beacon is not None:
            try:
                self.beacon.stop()
            except Exception:  # noqa: BLE001
                pass
            self.beacon = None
        if self.live is not None:
            self.live.run_ended()

    def final_from_caller(self) -> None:
        """``wait()`` saw the end: the last update again from the caller's thread (nbclient)."""
        if self.live is not None:
            self.live.final_from_caller()
