"""The live dashboard: header, loss/LR curves with intervention markers, memory tiers,
controls and a layer inspector, as ipywidgets + plotly FigureWidgets.

Threads: the control callbacks run on the kernel's main thread and only call the session's
control methods (which enqueue commands) or leave a note for the publisher; every widget
write happens in :meth:`Dashboard.refresh`, which only the publisher calls. Each panel has
a minimum interval (text ~2/s, figures ~1/s, heatmap ~0.5/s) and is sent only when its data
changed, inside ``hold_sync()`` / ``batch_update()``.

Example::

    d = session.dashboard()      # display it; d.pause_button.click() pauses the run
"""
from __future__ import annotations

import html
import threading
import time
from typing import Any, Callable

import ipywidgets as W

from .figures import fill_heatmap, fill_histogram, fill_training, layers_widget, training_widget
from .inspector import _SCALARS, _fmt
from .probe import RenderProbe
from .run_log import RunView
from .summary_html import fmt_bytes, fmt_num, header_html

#: seconds between two updates of a panel (a panel is also skipped when nothing changed)
INTERVALS = {"header": 0.5, "controls": 0.25, "notice": 0.25, "links": 0.5, "training": 1.0, "layers": 2.0}
_LINKS = (("host_to_device", "host→device"), ("device_to_host", "device→host"),
          ("disk_to_host", "disk→host"), ("host_to_disk", "host→disk"))


def _boxed(fig, width: str) -> W.Box:
    # FigureWidget.layout is the plotly layout, so size the figure through a wrapper Box.
    return W.Box([fig], layout=W.Layout(width=width, min_width="300px"))


class Dashboard(W.VBox):
    """Widgets of one session; refreshed only by the publisher (see module docstring)."""

    def __init__(self, session: Any):
        self.session = session
        self.header = W.HTML()
        self.training_fig = training_widget()
        self.links = W.HTML()
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
        self.layer_stats = W.HTML(layout=W.Layout(width="28%"))
        self.layers_fig = layers_widget()
        self.probe = RenderProbe()
        controls = W.VBox([W.HBox([self.pause_button, self.stop_button, self.checkpoint_button]),
                           W.HBox([self.lr_field, self.lr_apply]), self.notice], layout=W.Layout(width="60%"))
        super().__init__([
            self.header,
            _boxed(self.training_fig, "100%"),
            W.HBox([controls, self.links]),
            W.HTML("<b style='font-family:sans-serif'>Layer inspector</b>"),
            W.HBox([self.layer_select, self.metric]),
            W.HBox([self.layer_stats, _boxed(self.layers_fig, "72%")]),
            self.probe,
        ])
        self._lock = threading.Lock()
        self._showing_lr = False
        self._notice_text = ""
        self._notice_n = 0
        self._due: dict[str, float] = {k: 0.0 for k in INTERVALS}
        self._sent: dict[str, Any] = {k: None for k in INTERVALS}
        self.poke: Callable[[], None] = lambda: None  # set by the publisher: refresh soon
        self.pause_button.on_click(self._on_pause)
        self.stop_button.on_click(self._on_stop)
        self.lr_apply.on_click(lambda _b: self._apply_lr(self.lr_field.value))
        self.lr_field.observe(self._on_lr_field, names="value")
        self.checkpoint_button.on_click(self._on_checkpoint)
        self.layer_select.observe(lambda _ch: self.poke(), names="value")
        self.metric.observe(lambda _ch: self.poke(), names="value")

    def __repr__(self) -> str:  # the text/plain fallback where widgets do not render
        return f"<megatrain_nb dashboard of session {self.session.name!r} (needs a widget frontend)>"

    # ---- controls (main thread): enqueue, leave a note, wake the publisher ----------------------
    def _note(self, text: str) -> None:
        with self._lock:
            self._notice_text = text
            self._notice_n += 1
        self.poke()

    def _guard(self, fn: Callable[[], str]) -> None:
        try:
            self._note(fn())
        except Exception as e:  # noqa: BLE001 - shown to the user, never raised into the frontend
            self._note(f"<span style='color:#b00020'>{html.escape(str(e))}</span>")

    def _on_pause(self, _b=None) -> None:
        s = self.session

        def act():
            if s.state == "paused":
                s.resume(source="widget")
                return "Resume requested."
            s.pause(source="widget")
            return "Pause requested: it takes effect when the current step ends."
        self._guard(act)

    def _on_stop(self, _b=None) -> None:
        def act():
            self.session.stop(wait=False, source="widget")
            return "Stop requested: the run ends after the current step and releases its memory."
        self._guard(act)

    def _on_lr_field(self, change: dict) -> None:
        if not self._showing_lr:  # a value the user entered, not the publisher showing the LR
            self._apply_lr(change["new"])

    def _apply_lr(self, value: Any) -> None:
        s = self.session

        def act():
            v = float(value)
            current = s.requested_lr if s.requested_lr is not None else s.lr
            if current is not None and v == current:
                return f"The learning rate is already {v:.3g}."
            s.set_lr(v, source="widget")
            return f"Learning rate {v:.3g} from the next step."
        self._guard(act)

    def _on_checkpoint(self, _b=None) -> None:
        def act():
            self.session.save_checkpoint(wait=False, source="widget")
            return "Checkpoint requested at the next step boundary (see the events)."
        self._guard(act)

    # ---- refresh (publisher thread only) -------------------------------------------------------
    def refresh(self, now: float | None = None, force: bool = False) -> int:
        """Update the panels that are due and changed; returns how many were sent."""
        now = time.monotonic() if now is None else now
        s, log = self.session, self.session.run_log
        picked = (self.layer_select.value, self.metric.value)
        keys = {
            "header": (log.version, s.state),
            "controls": (s.state, s.requested_lr),
            "notice": (self._notice_n,),
            "links": (log.version,),
            "training": (log.version,),
            "layers": (log.version, *picked),
        }
        due = [p for p, key in keys.items() if self._is_due(p, key, now, force)]
        if not due:
            return 0
        view = log.view(curves=("loss", "lr") if "training" in due else ())
        for panel in due:
            getattr(self, f"_refresh_{panel}")(view)
            self._sent[panel], self._due[panel] = keys[panel], now + INTERVALS[panel]
        return len(due)

    def _is_due(self, panel: str, key: tuple, now: float, force: bool) -> bool:
        sent = self._sent[panel]
        if key == sent:
            return False
        if force or now >= self._due[panel]:
            return True
        # a new choice in the layer inspector shows at once (user actions are rare)
        return panel == "layers" and sent is not None and key[1:] != sent[1:]

    def _refresh_header(self, view: RunView) -> None:
        self.header.value = header_html(self.session, view)

    def _refresh_controls(self, view: RunView) -> None:
        state = self.session.state
        ended = state in ("stopped", "finished", "failed")
        with self.pause_button.hold_sync():
            self.pause_button.description = "Resume" if state == "paused" else "Pause"
            self.pause_button.icon = "play" if state == "paused" else "pause"
            self.pause_button.disabled = ended
        lr = self.session.requested_lr
        if lr is not None and lr != self.lr_field.value:  # set elsewhere (magic, code, sidebar)
            self._showing_lr = True
            try:
                self.lr_field.value = lr
            finally:
                self._showing_lr = False
        can_checkpoint = not ended or (self.session.engine is not None and not self.session._released)
        for w, off in ((self.stop_button, ended), (self.lr_apply, ended), (self.lr_field, ended),
                       (self.checkpoint_button, not can_checkpoint)):
            if w.disabled != off:
                w.disabled = off

    def _refresh_notice(self, view: RunView) -> None:
        with self._lock:
            text = self._notice_text
        self.notice.value = f"<div style='font-size:12px;color:#555'>{text}</div>" if text else ""

    def _refresh_links(self, view: RunView) -> None:
        rows = [f"<td>{label}</td><td>{fmt_bytes(view.links.get(k))}/s</td>" for k, label in _LINKS
                if view.links.get(k) is not None]
        hits = ", ".join(f"{t} {fmt_num(100 * v, '.0f')}%" for t, v in view.prefetch_hit_rate.items()
                         if v is not None)
        # "issued ahead" is about scheduling; whether transfers still made the step wait is the next row
        rows.append(f"<td>loads issued ahead of need</td><td>{hits or '–'}</td>")
        share = view.stall_share
        rows.append(f"<td>step time spent waiting</td><td>{fmt_num(100 * share, '.1f') + '%' if share is not None else '–'}</td>")
        self.links.value = ("<table style='font-size:12px;font-family:sans-serif'>"
                            + "".join(f"<tr>{r}</tr>" for r in rows) + "</table>")

    def _refresh_training(self, view: RunView) -> None:
        fill_training(self.training_fig, view)

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
            rows = "".join(f"<tr><td>{k.replace('_', ' ')}</td><td>{_fmt(stats.get(k))}</td></tr>" for k in _SCALARS)
            self.layer_stats.value = (f"<table style='font-size:12px;font-family:sans-serif'>"
                                      f"<tr><td><b>{html.escape(str(unit))}</b></td><td>step {stats.get('step')}</td>"
                                      f"</tr>{rows}</table>")
        metric = self.metric.value
        units, steps, z = self.session.run_log.heat(metric)
        with self.layers_fig.batch_update():
            fill_histogram(self.layers_fig, stats, unit or "", index=0, axis="xaxis")
            fill_heatmap(self.layers_fig, units, steps, z, metric, index=1)


def warm_up() -> None:
    """Pay plotly's one-off costs now (FigureWidget pulls in nbformat/jsonschema; the first
    figure of each kind builds its validators and template): ~2 s once per process."""
    import plotly.graph_objects as go

    from . import publisher  # noqa: F401

    go.FigureWidget  # noqa: B018 - the attribute access is the lazy import
    training_widget(widget=False)  # static twins: no comm is opened
    layers_widget(widget=False)


def _default_unit(units: list[str]) -> str | None:
    layers = [u for u in units if u not in ("embed", "head")]
    return layers[0] if layers else (units[0] if units else None)
