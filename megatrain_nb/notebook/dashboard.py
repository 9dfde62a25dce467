"""The live dashboard: loss first and large, loss/LR curves with intervention markers,
memory tiers, controls and a layer inspector, as ipywidgets + two light chart widgets
(``chart.py``: our own few-kilobyte module, not plotly's 5 MB bundle per figure).

Threads: the control callbacks run on the kernel's main thread and only call the session's
control methods (which enqueue commands) or leave a note for the publisher; every widget
write happens in :meth:`Dashboard.refresh`, which only the publisher calls.

One snapshot per refresh: every panel that shows the run (``data=True``: header, curves,
memory, links, inspector, extra figures) is filled from the same :class:`RunView`, at the
same moment, so they never show different steps; they refresh at most once a second and
only when the run changed. Controls and notes are quicker (0.25 s).

Adding a panel: build its widgets in ``Dashboard.__init__`` and decorate the method that fills
them with ``@panel(name, interval, key=...)``; the registration (:data:`PANELS`) is all
``refresh`` needs to know about it. A figure from elsewhere (any widget) goes in with
:meth:`Dashboard.add_figure`, with a function that fills it from each snapshot.

Example::

    d = session.dashboard()      # display it; d.pause_button.click() pauses the run
"""
from __future__ import annotations

import html
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import ipywidgets as W

from megatrain_nb.formatting import fmt_bytes, fmt_num

from . import chart, publisher
from .chart import Chart, layers_spec, training_spec
from .inspector import stats_rows_html
from .lifecycle import ENDED
from .prediction_view import prediction_html, session_report
from .grpo_view import attach_grpo_panel
from .preference_view import attach_reward_panel
from .probe import RenderProbe
from .run_log import RunView
from .run_tree import BranchesPanel
from .sample_watch import answers_html
from .summary_html import FG2, final_key, header_html, memory_tiers_html, rank_memory_table


@dataclass(frozen=True)
class Panel:
    """A part of the dashboard the publisher refreshes on its own schedule."""

    name: str
    interval: float  # seconds between two updates of the panel
    key: Callable[["Dashboard"], tuple]  # what it shows depends on: an unchanged key is not resent
    refresh: Callable[["Dashboard", RunView], None]  # writes its widgets (publisher thread only)
    curves: tuple[str, ...] = ()  # the RunView curves it draws (downsampling them is the costly part)
    at_once: Callable[[tuple, tuple], bool] = lambda sent, key: False  # (sent, key) -> skip the interval
    data: bool = False  # shows the run: refreshed together with the other data panels, from one view
    heat: bool = False  # needs the layers x steps matrix of the selected metric


#: the dashboard's panels in refresh order; :func:`panel` adds one
PANELS: list[Panel] = []


def panel(name: str, interval: float, key: Callable[["Dashboard"], tuple], **options: Any):
    """Register the decorated ``Dashboard`` method as the refresh of a panel (see :class:`Panel`)."""
    def register(refresh: Callable[["Dashboard", RunView], None]):
        PANELS.append(Panel(name, interval, key, refresh, **options))
        return refresh
    return register


def _control(act: Callable[..., str]) -> Callable[..., None]:
    """A control callback: ``act`` asks the session for something and returns the note to
    show; an error is shown as the note instead, never raised into the frontend."""
    def handler(self: "Dashboard", *args: Any) -> None:
        try:
            note = act(self, *args)
        except Exception as e:  # noqa: BLE001 - shown to the user
            note = f"<span style='color:#b00020'>{html.escape(str(e))}</span>"
        self._note(note)
    return handler


def _shown_lr(session: Any) -> float | None:
    """What the LR field shows: a rate asked for and not applied yet, else the latest step's
    (scheduled) rate, to the 3 digits the header shows, so a decaying schedule does not rewrite
    the field every step."""
    lr = session.lr   # learning_rate.shown: a pending request, else the latest step's
    return float(f"{lr:.3g}") if lr is not None else None


_LINKS = (("host_to_device", "host→device"), ("device_to_host", "device→host"),
          ("disk_to_host", "disk→host"), ("host_to_disk", "host→disk"))


@dataclass
class ExtraFigure:
    widget: Any
    fill: Callable[[RunView], None] | None


DATA_INTERVAL = 1.0  # seconds between two snapshots shown


class Dashboard(W.VBox):
    """Widgets of one session; refreshed only by the publisher (see module docstring)."""

    def __init__(self, session: Any):
        self.session = session
        self.header = W.HTML(layout=W.Layout(width="auto"))
        self.training_fig = Chart(layout=W.Layout(width="auto", min_width="280px"))
        self.memory = W.HTML(layout=W.Layout(flex="1 1 340px", min_width="260px"))
        self.links = W.HTML(layout=W.Layout(flex="0 1 auto"))
        self.ranks = W.HTML()   # several ranks: each rank's memory tiers
        self.samples = W.HTML()   # answers to the sample prompt, once one is set
        self.pause_button = W.Button(description="Pause", icon="pause", tooltip="Pause after the current step")
        self.stop_button = W.Button(description="Stop", icon="stop", button_style="danger",
                                    tooltip="End the run after the current step and release memory")
        self.lr_field = W.FloatText(value=session.lr or 0.0, description="LR", step=None,
                                    layout=W.Layout(width="180px"))
        self.lr_apply = W.Button(description="Apply LR", tooltip="Use this learning rate from the next step")
        self.checkpoint_button = W.Button(description="Checkpoint", icon="save",
                                          tooltip="Write a checkpoint at the next step boundary")
        self.notice = W.HTML()
        units = session.unit_names()
        self.layer_select = W.Dropdown(options=units, value=_default_unit(units), description="Layer",
                                       layout=W.Layout(width="260px"))
        self.metric = W.ToggleButtons(options=[("grad norm", "grad_norm"), ("update ratio", "update_ratio")],
                                      value="grad_norm", description="Heatmap")
        self.layer_stats = W.HTML(layout=W.Layout(flex="0 1 260px", min_width="200px"))
        self.layers_fig = Chart(layout=W.Layout(flex="1 1 420px", min_width="280px"))
        self.extras = W.VBox([])   # add_figure() puts figures from elsewhere here
        self._extra: list[ExtraFigure] = []
        self.probe = RenderProbe(key=final_key(session))
        self.branches = BranchesPanel(session)   # the run tree, shown once the run has branches
        wrap = W.Layout(display="flex", flex_flow="row wrap", align_items="flex-start", width="auto",
                        grid_gap="8px 24px")
        controls = W.VBox([W.HBox([self.pause_button, self.stop_button, self.checkpoint_button],
                                  layout=W.Layout(flex_flow="row wrap")),
                           W.HBox([self.lr_field, self.lr_apply]), self.notice, self.links],
                          layout=W.Layout(flex="1 1 360px", min_width="300px"))
        super().__init__([
            self.header,
            self.training_fig,
            W.Box([self.memory, controls], layout=wrap),
            self.samples,
            self.ranks,
            W.HTML(f"<b style='font-family:sans-serif;color:{FG2}'>Layer inspector</b>"),
            W.Box([self.layer_select, self.metric], layout=W.Layout(display="flex", flex_flow="row wrap")),
            W.Box([self.layer_stats, self.layers_fig], layout=wrap),
            self.branches.box,
            self.extras,
            self.probe,
        ], layout=W.Layout(width="100%"))
        self.add_class("mtnb-dashboard")
        self._lock = threading.Lock()
        self._showing_lr = False
        self._notice_text = ""
        self._notice_n = 0
        self._due: dict[str, float] = {p.name: 0.0 for p in PANELS}
        self._sent: dict[str, Any] = {p.name: None for p in PANELS}
        self._shown_version: int | None = None  # the run log version the data panels show
        self.poke: Callable[[], None] = lambda: None  # set by the publisher: refresh soon

        attach_reward_panel(self)   # a DPO run: reward margin and accuracy over steps
        attach_grpo_panel(self)     # a GRPO run: reward, KL, completion length, generation vs training
        self.pause_button.on_click(self._on_pause)
        self.stop_button.on_click(self._on_stop)
        self.lr_apply.on_click(lambda _b: self._apply_lr(self.lr_field.value))
        self.lr_field.observe(self._on_lr_field, names="value")
        self.checkpoint_button.on_click(self._on_checkpoint)
        self.layer_select.observe(lambda _ch: self.poke(), names="value")
        self.metric.observe(lambda _ch: self.poke(), names="value")

    def __repr__(self) -> str:
        return f"<megatrain_nb dashboard of session {self.session.name!r} (needs a widget frontend)>"

    def _repr_mimebundle_(self, **kwargs: Any) -> dict:
        """No text fallback: where widgets do not render (an untrusted notebook, a page without
        the widget manager) the run's static snapshot, displayed beside the dashboard, shows
        it; a "needs a widget frontend" line next to that only confused."""
        data = super()._repr_mimebundle_(**kwargs)
        data["text/plain"] = ""
        return data

    # ---- controls (main thread): enqueue, leave a note, wake the publisher ----------------------
    def _note(self, text: str) -> None:
        with self._lock:
            self._notice_text = text
            self._notice_n += 1
        self.poke()

    @_control
    def _on_pause(self, _b=None) -> str:
        s = self.session
        if s.state == "paused":
            s.resume(source="widget")
            return "Resume requested."
        s.pause(source="widget")
        return "Pause requested: it takes effect when the current step ends."

    @_control
    def _on_stop(self, _b=None) -> str:
        self.session.stop(wait=False, source="widget")
        return "Stop requested: the run ends after the current step and releases its memory."

    def _on_lr_field(self, change: dict) -> None:
        if not self._showing_lr:  # a value the user entered, not the publisher showing the LR
            self._apply_lr(change["new"])

    @_control
    def _apply_lr(self, value: Any) -> str:
        s = self.session
        v = float(value)
        current = s.lr
        if current is not None and v == current:
            return f"The learning rate is already {v:.3g}."
        s.set_lr(v, source="widget")
        return f"Learning rate {v:.3g} from the next step."

    @_control
    def _on_checkpoint(self, _b=None) -> str:
        self.session.save_checkpoint(wait=False, source="widget")
        return "Checkpoint requested at the next step boundary (see the events)."

    # ---- figures from elsewhere ------------------------------------------------------------------
    def add_figure(self, widget: Any, fill: Callable[[RunView], None] | None = None) -> Any:
        """Show ``widget`` (any ipywidget, e.g. a :class:`Chart`) below the layer inspector;
        ``fill(view)``, if given, updates it from each snapshot the other panels show (on the
        publisher thread, at most once a second, only when the run changed). Returns ``widget``."""
        self._extra.append(ExtraFigure(widget, fill))
        self.extras.children = tuple(e.widget for e in self._extra)
        if fill is not None:
            self._sent["extra"] = None  # fill it at the next refresh
            self.poke()
        return widget

    def resend_state(self) -> None:
        """Send the run's panels again from the calling thread (``session.wait()``, once the
        publisher is done): a notebook runner saves the widget state it sees in the executing
        cell's messages, so the saved notebook keeps the final dashboard, not its first frame."""
        for w in (self.header, self.training_fig, self.memory, self.links, self.ranks, self.samples, self.layer_stats,
                  self.layers_fig, self.branches.chart, *(e.widget for e in self._extra)):
            w.send_state()

    # ---- refresh (publisher thread only) -------------------------------------------------------
    def refresh(self, now: float | None = None, force: bool = False, view: RunView | None = None) -> int:
        """Update the panels that are due and changed; returns how many were sent. When any
        panel that shows the run is due, every one of them whose data changed is refreshed,
        all from one snapshot (``view``, or one taken here)."""
        now = time.monotonic() if now is None else now
        keyed = [(p, p.key(self)) for p in PANELS]
        due = [(p, key) for p, key in keyed if self._is_due(p, key, now, force)]
        if not due:
            return 0
        if any(p.data for p, _ in due):  # one snapshot for all: never two steps on screen
            if view is None:  # the run may have moved on since the keys were read: take what any may need
                view = self.snapshot([(p, key) for p, key in keyed if p.data or (p, key) in due])
            due = [(p, key) for p, key in keyed if (p, key) in due
                   or (p.data and (key != self._sent[p.name] or self._shown_version != view.version))]
        elif view is None:
            view = self.snapshot(due)
        for p, key in due:
            p.refresh(self, view)
            self._sent[p.name], self._due[p.name] = key, now + p.interval
        if any(p.data for p, _ in due):
            self._shown_version = view.version   # every data panel shows it now
        return len(due)

    def snapshot(self, panels=None) -> RunView:
        """One consistent copy of the run for the given (or all) panels."""
        panels = [p for p, _ in panels] if panels is not None else PANELS
        curves = tuple(dict.fromkeys(c for p in panels for c in p.curves))
        heat = (self.metric.value,) if any(p.heat for p in panels) else ()
        return self.session.run_log.view(curves=curves, heat=heat)

    def _is_due(self, p: Panel, key: tuple, now: float, force: bool) -> bool:
        sent = self._sent[p.name]
        if key == sent:
            return False
        return force or now >= self._due[p.name] or (sent is not None and p.at_once(sent, key))

    @panel("header", DATA_INTERVAL, key=lambda d: (d.session.run_log.version, d.session.state,
                                                   d.session.requested_lr), data=True)
    def _refresh_header(self, view: RunView) -> None:
        self.header.value = header_html(self.session, view)

    @panel("controls", 0.25, key=lambda d: (d.session.state, _shown_lr(d.session)))
    def _refresh_controls(self, view: RunView) -> None:
        state = self.session.state
        ended = state in ENDED
        with self.pause_button.hold_sync():
            self.pause_button.description = "Resume" if state == "paused" else "Pause"
            self.pause_button.icon = "play" if state == "paused" else "pause"
            self.pause_button.disabled = ended
        lr = _shown_lr(self.session)   # the scheduled rate, as the header shows it, or one set elsewhere
        if lr is not None and lr != self.lr_field.value:
            self._showing_lr = True
            try:
                self.lr_field.value = lr
            finally:
                self._showing_lr = False
        can_checkpoint = not ended or (self.session.engine is not None and not self.session.released)
        for w, off in ((self.stop_button, ended), (self.lr_apply, ended), (self.lr_field, ended),
                       (self.checkpoint_button, not can_checkpoint)):
            if w.disabled != off:
                w.disabled = off

    @panel("notice", 0.25, key=lambda d: (d._notice_n,))
    def _refresh_notice(self, view: RunView) -> None:
        with self._lock:
            text = self._notice_text
        self.notice.value = (f"<div style='font-size:12px;font-family:sans-serif;color:{FG2}'>{text}</div>"
                             if text else "")

    @panel("links", DATA_INTERVAL, key=lambda d: (d.session.run_log.version,), data=True)
    def _refresh_links(self, view: RunView) -> None:
        rows = [f"<td>{label}</td><td>{fmt_bytes(view.links.get(k))}/s</td>" for k, label in _LINKS
                if view.links.get(k) is not None]
        hits = ", ".join(f"{t} {fmt_num(100 * v, '.0f')}%" for t, v in view.prefetch_hit_rate.items()
                         if v is not None)
        # "issued ahead" is about scheduling; whether transfers still made the step wait is the next row
        rows.append(f"<td>loads issued ahead of need</td><td>{hits or '–'}</td>")
        share = view.stall_share
        rows.append(f"<td>step time spent waiting</td><td>{fmt_num(100 * share, '.1f') + '%' if share is not None else '–'}</td>")
        self.links.value = (f"<table style='font-size:12px;font-family:sans-serif;color:{FG2}'>"
                            + "".join(f"<tr>{r}</tr>" for r in rows) + "</table>"
                            + prediction_html(session_report(self.session), FG2))

    @panel("memory", DATA_INTERVAL, key=lambda d: (d.session.run_log.version,), data=True)
    def _refresh_memory(self, view: RunView) -> None:
        self.memory.value = memory_tiers_html(view)

    @panel("ranks", DATA_INTERVAL, key=lambda d: (d.session.run_log.version,), data=True)
    def _refresh_ranks(self, view: RunView) -> None:
        self.ranks.value = rank_memory_table(view)

    @panel("training", DATA_INTERVAL, key=lambda d: (d.session.run_log.version,), curves=("loss", "lr"), data=True)
    def _refresh_training(self, view: RunView) -> None:
        self.training_fig.spec = training_spec(view, total=self.session.total_steps)

    # drawn on the sample watch's thread; shown here (publisher thread) when one is added
    @panel("samples", DATA_INTERVAL, key=lambda d: (d.session.sample_watch.version,))
    def _refresh_samples(self, view: RunView) -> None:
        self.samples.value = answers_html(self.session.sample_watch)

    @panel("branches", DATA_INTERVAL, key=lambda d: d.branches.key(), data=True)
    def _refresh_branches(self, view: RunView) -> None:
        self.branches.update()

    # a new choice in the layer inspector shows at once (user actions are rare)
    @panel("layers", DATA_INTERVAL, key=lambda d: (d.session.run_log.version, d.layer_select.value, d.metric.value),
           at_once=lambda sent, key: key[1:] != sent[1:], data=True, heat=True)
    def _refresh_layers(self, view: RunView) -> None:
        if not self.layer_select.options and view.units:
            with self.layer_select.hold_sync():
                self.layer_select.options = view.units
                self.layer_select.value = _default_unit(view.units)
        unit = self.layer_select.value
        stats = view.layers.get(unit) if unit else None
        if stats is None:
            self.layer_stats.value = "<i>no statistics yet (gathered at each optimizer step)</i>"
        else:
            rows = stats_rows_html(stats)
            self.layer_stats.value = (f"<table style='font-size:12px;font-family:sans-serif'>"
                                      f"<tr><td><b>{html.escape(str(unit))}</b></td><td>step {stats.get('step')}</td>"
                                      f"</tr>{rows}</table>")
        metric = self.metric.value
        heat = view.heat.get(metric) or self.session.run_log.heat(metric)
        self.layers_fig.spec = layers_spec(view, unit, metric, heat)

    @panel("extra", DATA_INTERVAL, key=lambda d: (d.session.run_log.version, len(d._extra)), data=True)
    def _refresh_extra(self, view: RunView) -> None:
        for e in self._extra:
            if e.fill is not None:
                e.fill(view)


def warm_up() -> None:
    """Import the display stack now rather than in ``train()`` (ipywidgets, anywidget)."""

def _default_unit(units: list[str]) -> str | None:
    layers = [u for u in units if u not in ("embed", "head")]
    return layers[0] if layers else (units[0] if units else None)
