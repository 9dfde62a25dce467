"""RenderProbe: an invisible anywidget whose frontend view says "widgets render here".

A kernel cannot ask its frontend whether it has a widget manager; a view that renders can
tell it. The dashboard carries one probe; the publisher keeps the HTML fallback alive until
the probe reports (see ``publisher.py``).
"""
from __future__ import annotations

from typing import Callable, Optional

import anywidget
import traitlets


class RenderProbe(anywidget.AnyWidget):
    """``key`` (a run's): where this view renders, the run's static snapshot (the HTML its run
    leaves for a saved notebook, class ``mtnb-final-<key>``) is hidden on the page, so a run
    shows once: its live dashboard here, its snapshot where widgets do not render."""

    _esm = """
    export default {
      render({ model, el }) {
        el.style.display = "none";
        const key = model.get("key");
        if (key && !document.getElementById(`mtnb-final-style-${key}`)) {
          const s = document.createElement("style");
          s.id = `mtnb-final-style-${key}`;
          s.textContent = `.mtnb-final-${key} { display: none !important; }`;
          document.head.appendChild(s);
        }
        model.send({ event: "rendered" });
      }
    };
    """
    key = traitlets.Unicode("").tag(sync=True)

    def __init__(self, **kw):
        super().__init__(**kw)
        self.rendered = False
        self.on_render: Optional[Callable[[], None]] = None
        self.on_msg(self._got)

    def _got(self, _widget, content, _buffers) -> None:
        if isinstance(content, dict) and content.get("event") == "rendered":
            self.rendered = True
            if self.on_render is not None:
                self.on_render()
