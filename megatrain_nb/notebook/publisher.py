"""The one thread that pushes a run to the notebook display.

Why a dedicated thread (not an asyncio task on the kernel's loop): a cell that blocks
(``session.wait()``, ``train(block=True)``) blocks the kernel's main loop, and the dashboard
must keep moving exactly then. ipykernel (>= 7.1) makes sending from any thread safe: comm and
display messages go through its IOPub thread (one event pipe per sending thread), and a
thread without a parent header falls back to the shell's (ipykernel#1451, the fix of the 7.0
regression ipykernel#1450). We start the thread inside a copy of the caller's context, so its
messages carry the parent of the cell that displayed the dashboard.

Rates: the publisher wakes every ``TICK`` seconds (or when a control pokes it); each
dashboard panel has its own minimum interval (see ``dashboard.PANELS``) and is only sent
when its data changed; the HTML summary is rewritten at most once per ``HTML_INTERVAL``.

Where widgets cannot render: the dashboard carries a tiny anywidget probe whose frontend
view sends one message when it renders. Until that message arrives (never, under nbclient
or a viewer without widget support) the publisher keeps a display-updated HTML summary
alive. When the run ends the same display slot receives a static snapshot, so a saved
notebook still shows the run.
"""
from __future__ import annotations

import contextvars
import logging
import threading
import time
from typing import Any, Optional

from megatrain_nb.threads import PUBLISHER, thread_name
from .lifecycle import ENDED, LIVE
from .summary_html import summary_html

log = logging.getLogger(__name__)

TICK = 0.1
HTML_INTERVAL = 1.0


class Publisher:
    """Pushes a session's RunLog to its dashboard and/or HTML summary at a bounded rate."""

    def __init__(self, session: Any, *, dashboard: Any = None, html_live: bool = False):
        self.session = session
        self.dashboard = dashboard
        self.html_live = html_live  # keep the HTML summary updated (no widget frontend seen)
        self.html_handle = None  # IPython DisplayHandle of the summary / final snapshot slot
        self.refreshes = 0
        self.failures = 0
        self.busy_s = 0.0
        self._wake = threading.Event()
        self._ended = threading.Event()
        self._final_html: Optional[str] = None
        self._html_due = 0.0
        self._html_version = None
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self.enabled = True  # the benchmark switches publishing off and on
        self._clear_html = False
        if dashboard is not None:
            self.attach(dashboard)

    def attach(self, dashboard: Any) -> None:
        """Publish to ``dashboard`` from now on."""
        self.dashboard = dashboard
        dashboard.poke = self.poke
        dashboard.probe.on_render = self.widgets_rendered
        if dashboard.probe.rendered:
            self.widgets_rendered()

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> "Publisher":
        ctx = contextvars.copy_context()  # the displaying cell's parent header goes along
        self._thread = threading.Thread(target=ctx.run, args=(self._loop,), daemon=True,
                                        name=thread_name(PUBLISHER, self.session.name))
        self._thread.start()
        return self

    def poke(self) -> None:
        self._wake.set()

    def run_ended(self) -> None:
        self._ended.set()
        self._wake.set()

    @property
    def running(self) -> bool:
        t = self._thread
        return t is not None and t.is_alive()

    def join(self, timeout: Optional[float] = None) -> None:
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)

    def widgets_rendered(self) -> None:
        """The probe saw a widget frontend: the live HTML summary is not needed any more."""
        if self.html_live:
            self.html_live = False
            self._clear_html = True
            self.poke()

    def _loop(self) -> None:
        while True:
            # the state check covers a run that ended before this publisher was attached
            ended = self._ended.is_set() or self.session.state in ENDED
            if self.enabled or ended:
                self.tick(force=ended)
            if ended:
                break
            self._wake.wait(TICK)
            self._wake.clear()
        self._emit_final()

    # ---- one refresh --------------------------------------------------------------------------
    def tick(self, force: bool = False) -> int:
        t0 = time.perf_counter()
        sent = 0
        try:
            now = time.monotonic()
            html_key = (self.session.run_log.version, self.session.state)
            html_due = (self.html_live and self.html_handle is not None and not force
                        and html_key != self._html_version and now >= self._html_due)
            # one snapshot for the dashboard and the summary of this tick: both show one step
            view = self._snapshot() if html_due else None
            if self.dashboard is not None:
                sent += self.dashboard.refresh(now, force=force, view=view)
            if self._clear_html and self.html_handle is not None and not force:
                self._clear_html = False
                self.html_handle.update({"text/html": ""}, raw=True)
                sent += 1
            if html_due and self.html_live:
                self.html_handle.update({"text/html": summary_html(self.session, view),
                                         "text/plain": repr(self.session)}, raw=True)
                self._html_version, self._html_due = html_key, now + HTML_INTERVAL
                sent += 1
        except Exception:  # noqa: BLE001 - a display glitch must never reach the run
            self.failures += 1
            log.log(logging.WARNING if self.failures == 1 else logging.DEBUG,
                    "megatrain_nb: refreshing the dashboard failed (training goes on)", exc_info=True)
        self.refreshes += sent
        self.busy_s += time.perf_counter() - t0
        return sent

    def _snapshot(self):
        d = self.dashboard
        return d.snapshot() if d is not None else self.session.run_log.view()

    def _emit_final(self) -> None:
        with self._lock:
            if self._final_html is None:
                self._final_html = summary_html(self.session, self.session.run_log.view(), final=True)
        self._update_final()

    def _update_final(self) -> None:
        if self.html_handle is None or self._final_html is None:
            return
        try:
            self.html_handle.update({"text/html": self._final_html, "text/plain": repr(self.session)}, raw=True)
        except Exception:  # noqa: BLE001
            log.debug("megatrain_nb final snapshot failed", exc_info=True)

    def final_from_caller(self) -> None:
        """Send the static snapshot again from the calling thread (``session.wait()``): nbclient
        only accepts display updates whose parent is the cell executing now."""
        self.join(5.0)
        if self._final_html is None:
            self._emit_final()
        else:
            self._update_final()
        d = self.dashboard
        if d is not None and not self.running:  # the publisher is done: no other writer
            try:
                d.resend_state()
            except Exception:  # noqa: BLE001
                log.debug("megatrain_nb: resending the dashboard's state failed", exc_info=True)


# ---- what Session.train() / Session.dashboard() call; the session keeps what they return --------------
#: display modes that show the widget dashboard (the others only the HTML summary)
WIDGET_MODES = ("auto", "widgets")


def show_live(session: Any, mode: str, dashboard: Any = None) -> Publisher:
    """Display the run (``mode`` from ``display_mode.resolve_mode``; ``dashboard``, the
    session's widget, for the modes in WIDGET_MODES) and start its publisher."""
    from IPython.display import HTML, display

    _check_ipykernel()

    pub = Publisher(session, dashboard=dashboard, html_live=mode in ("auto", "html"))
    if dashboard is not None:
        display(dashboard)
    pub.html_handle = display(HTML(summary_html(session, session.run_log.view()) if pub.html_live else ""),
                              display_id=True)
    return pub.start()


def _check_ipykernel() -> None:
    import sys
    import warnings

    version = getattr(sys.modules.get("ipykernel"), "__version__", "")
    if version.startswith("7.0."):
        warnings.warn(f"ipykernel {version} drops display and widget messages sent from threads "
                      "(ipykernel#1450): the dashboard may stay blank; megatrain_nb needs ipykernel>=7.1",
                      stacklevel=3)


def make_live(session: Any, dashboard: Any, pub: Optional[Publisher]) -> Optional[Publisher]:
    """Make the session's ``dashboard`` live: while the run is, a publisher (``pub``, the one
    already running, or a new one) pushes to it; otherwise it is refreshed once. Returns the
    publisher the session keeps."""
    if session.state not in LIVE:
        dashboard.refresh(force=True)
        return pub
    if pub is None:
        return Publisher(session, dashboard=dashboard).start()
    if pub.dashboard is None:
        pub.attach(dashboard)
        pub.poke()
    return pub
