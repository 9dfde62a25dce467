"""How a Session shows itself: its dashboard widget, the publisher that keeps the display live,
and the JupyterLab beacon that announces it (``channel/beacon.py``). One per Session."""
from __future__ import annotations

import sys
from typing import Any, Optional

from megatrain_nb.channel.beacon import SessionBeacon


class SessionView:
    """The display side of ``session`` (see the module docstring)."""

    def __init__(self, session: Any):
        self.session = session
        self.live: Any = None        # publisher.Publisher while displayed (``session.publisher``)
        self.widget: Any = None      # dashboard.Dashboard: one per session, every display shows it
        self.beacon: Any = None

    @staticmethod
    def _display():
        """(dashboard, publisher): the display's modules, imported when something is shown."""
        from . import dashboard, publisher   # light: IPython and ipywidgets away from a Session that shows nothing

        return dashboard, publisher

    def dashboard(self):
        """The dashboard widget, made live while the run is."""
        d = self._widget()
        self.live = self._display()[1].make_live(self.session, d, self.live)
        return d

    def show(self, mode: Optional[str]) -> None:
        """Display the run (``mode`` from ``display_mode.resolve_mode``; None: nothing)."""
        if mode is None:
            return
        try:
            publisher = self._display()[1]
            widget = self._widget() if mode in publisher.WIDGET_MODES else None
            self.live = publisher.show_live(self.session, mode, widget)
        except Exception as e:  # noqa: BLE001 - the run matters more than its display
            print(f"megatrain_nb: the dashboard could not be shown ({type(e).__name__}: {e}); "
                  "training goes on (session.dashboard() tries again)", file=sys.stderr)

    def _widget(self):
        if self.widget is None:
            self.widget = self._display()[0].Dashboard(self.session)
        return self.widget

    def announce(self) -> None:
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
