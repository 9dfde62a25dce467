"""The dashboard's charts outside a live widget: in an exported report and in any HTML output.

``chart_html(spec, fallback_svg)`` is one output that reads well everywhere:

- where scripts run (the HTML report in a browser, a trusted notebook), the dashboard's own
  ``chart.js`` draws ``spec`` in place, hover values and all (the module is inlined, a few tens
  of kilobytes, so the page needs nothing from the network: no plotly.js, ~5 MB a report);
- where they do not (an untrusted notebook: JupyterLab's sanitizer drops scripts, inline SVG
  and ``data-`` attributes), what stays is an ``<img>`` of a static SVG drawn here, which the
  sanitizer keeps (an image of an SVG runs nothing).

Example::

    html = chart_html(runs_spec(session.explorer.tree()), panels_svg(spec))
"""
from __future__ import annotations

import base64
import html
import json
import math
from pathlib import Path

from megatrain_nb.formatting import fmt_bytes

_CHART_JS = Path(__file__).with_name("chart.js")
FG2 = "#757575"      # readable on light and dark backgrounds (an <img> sees no theme variables)
GRID = "#d9d9d9"


def _runner() -> str:
    """chart.js as a classic script that defines ``window.mtnbChart`` once and draws every
    ``.mtnb-static-chart`` not drawn yet (its fallback image replaced by the live chart)."""
    src = _CHART_JS.read_text(encoding="utf-8").replace("export default", "window.mtnbChart =", 1)
    return ("(function () {\nif (!window.mtnbChart) {\n" + src + "\n}\n"
            "document.querySelectorAll('.mtnb-static-chart:not([data-drawn])').forEach(function (el) {\n"
            "  el.setAttribute('data-drawn', '1');\n"
            "  var spec = JSON.parse(el.getAttribute('data-spec'));\n"
            "  el.replaceChildren();\n"
            "  window.mtnbChart.render({ model: { get: function () { return spec; }, on: function () {},"
            " off: function () {} }, el: el });\n"
            "});\n})();")


def img(svg: str, alt: str) -> str:
    """``svg`` as an ``<img>`` (a data URI): what survives a notebook's HTML sanitizer."""
    if not svg:
        return ""
    data = base64.b64encode(svg.encode("utf-8")).decode("ascii")
    return f"<img alt='{html.escape(alt, quote=True)}' src='data:image/svg+xml;base64,{data}' style='max-width:100%'>"


def chart_html(spec: dict, fallback: str, alt: str = "chart") -> str:
    """One HTML output: the live chart where scripts run, ``fallback`` (HTML: an image, a note)
    where they do not."""
    data = html.escape(json.dumps(spec, separators=(",", ":"), allow_nan=False, ensure_ascii=False), quote=True)
    return (f"<div class='mtnb-static-chart' data-spec=\"{data}\" style='width:100%'>{fallback}</div>"
            f"<script>{_runner()}</script>")


def _fmt(v: float) -> str:
    a = abs(v)
    if a and (a < 1e-3 or a >= 1e5):
        return f"{v:.2e}"
    return f"{v:.4g}"


def _bytes(v: float) -> str:
    return fmt_bytes(v)


def panels_svg(spec: dict, width: int = 760) -> str:
    """A static picture of a ``panels`` spec (chart.js draws the same, with hover)."""
    panels = spec.get("panels") or []
    if not panels:
        return ""
    cols = max(1, spec.get("columns") or 2)
    pw, ph = (width - 16 * (cols - 1)) // cols, int(spec.get("height") or 190)
    xs = [x for p in panels for s in p.get("series", []) for x in s["x"] if x is not None]
    x0, x1 = (min(xs), max(xs)) if xs else (0, 1)
    x1 = max(x1, x0 + 1)
    legend = spec.get("legend") or []
    top0 = 16 * len(legend) + 4
    rows = math.ceil(len(panels) / cols)
    height = top0 + rows * (ph + 20)
    out = [f"<text x='4' y='{12 + 16 * i}' font-size='11' fill='{item['color']}'>■ "
           f"<tspan fill='{FG2}'>{html.escape(item['name'])}</tspan></text>" for i, item in enumerate(legend)]
    for k, p in enumerate(panels):
        ox, oy = (k % cols) * (pw + 16), top0 + (k // cols) * (ph + 20)
        out.append(f"<text x='{ox + 4}' y='{oy + 12}' font-size='11' font-weight='600' fill='{FG2}'>"
                   f"{html.escape(p.get('title') or '')}</text>")
        out.append(_panel(p, ox, oy + 16, pw, ph, x0, x1))
    return (f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
            f"font-family='sans-serif'>{''.join(out)}</svg>")


def _panel(p: dict, ox: float, oy: float, pw: int, ph: int, x0: float, x1: float) -> str:
    series = [s for s in p.get("series", []) if any(v is not None for v in s["y"])]
    if not series:
        return (f"<text x='{ox + pw / 2}' y='{oy + ph / 2}' font-size='11' fill='{FG2}' text-anchor='middle'>"
                f"{html.escape(p.get('note') or 'nothing logged')}</text>")
    ys = [v for s in series for v in s["y"] if v is not None] + [q["y"] for q in p.get("points", [])]
    y0, y1 = p["range"] if len(p.get("range") or ()) == 2 else (min(ys), max(ys))   # a share: 0 to 1
    if y1 <= y0:
        y1 = y0 + (abs(y0) * 0.1 or 1.0)
    fmt = _bytes if p.get("bytes") else _fmt
    left, right, top, bottom = ox + 62, ox + pw - 6, oy + 4, oy + ph - 22

    def sx(v):
        return left + (v - x0) / (x1 - x0) * (right - left)

    def sy(v):
        return bottom - (v - y0) / (y1 - y0) * (bottom - top)

    parts = [f"<line x1='{left}' x2='{right}' y1='{bottom}' y2='{bottom}' stroke='{GRID}'/>",
             f"<line x1='{left}' x2='{right}' y1='{top}' y2='{top}' stroke='{GRID}'/>",
             f"<text x='{left - 4}' y='{top + 9}' font-size='10' fill='{FG2}' text-anchor='end'>{fmt(y1)}</text>",
             f"<text x='{left - 4}' y='{bottom}' font-size='10' fill='{FG2}' text-anchor='end'>{fmt(y0)}</text>",
             f"<text x='{left}' y='{bottom + 14}' font-size='10' fill='{FG2}'>step {x0:.0f}</text>",
             f"<text x='{right}' y='{bottom + 14}' font-size='10' fill='{FG2}' text-anchor='end'>{x1:.0f}</text>"]
    for s in series:
        pts = [(sx(x), sy(y)) for x, y in zip(s["x"], s["y"]) if y is not None]
        if s.get("mode") != "points":
            parts.append(f"<polyline fill='none' stroke='{s['color']}' stroke-width='1.5' points='"
                         + " ".join(f"{a:.1f},{b:.1f}" for a, b in pts) + "'/>")
        if s.get("mode") in ("points", "lines+points"):
            parts += [f"<circle cx='{a:.1f}' cy='{b:.1f}' r='2.5' fill='{s['color']}'/>" for a, b in pts]
    for q in p.get("points", []):
        cx, cy = sx(q["x"]), sy(q["y"])
        parts.append(f"<path d='M{cx:.1f},{cy - 6:.1f}L{cx + 6:.1f},{cy:.1f}L{cx:.1f},{cy + 6:.1f}L{cx - 6:.1f},"
                     f"{cy:.1f}Z' fill='{q['color']}' stroke='#333'/>")
    return "".join(parts)
