"""RenderProbe: an invisible anywidget whose frontend view says "widgets render here".

A kernel cannot ask its frontend whether it has a widget manager; a view that renders can
tell it. The dashboard carries one probe; the publisher keeps the HTML fallback alive until
the probe reports (see ``publisher.py``).
"""
from __future__ import annotations

from typing import Callable, Optional

import anywidget


class RenderProbe(anywidget.AnyWidget):
    _esm = """
    export default {
      render({ model, el }) {
        el.style.display = "none";
        model.send({ event: "rendered" });
      }
    };
    """

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
