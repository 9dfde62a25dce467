"""Run the dashboard's ``chart.js`` in Node.js over a tiny DOM (elements with attributes, text
and children; a canvas whose text is 6.5 px a character), so its drawing code is tested without
a browser: ``draw(spec, width)`` -> the drawn tree as nested dicts."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

CHART = Path(__file__).resolve().parents[2] / "megatrain_nb" / "notebook" / "chart.js"

DOM = r"""
class El {
  constructor(tag) { this.tag = tag; this.attrs = {}; this.children = []; this.style = {}; this._text = "";
                     this.classList = { add: c => { this.attrs.class = ((this.attrs.class || "") + " " + c).trim(); } }; }
  setAttribute(k, v) { this.attrs[k] = String(v); }
  getAttribute(k) { return this.attrs[k]; }
  appendChild(c) { this.children.push(c); return c; }
  replaceChildren(...cs) { this.children = cs; }
  set className(v) { this.attrs.class = v; }
  get className() { return this.attrs.class || ""; }
  set textContent(v) { this._text = String(v); this.children = []; }
  get textContent() { return this._text + this.children.map(c => c.textContent).join(""); }
  addEventListener() {}
  getContext() { return { font: "", measureText: t => ({ width: 6.5 * t.length }),
                          createImageData: (w, h) => ({ data: new Array(4 * w * h).fill(0) }), putImageData() {} }; }
  toDataURL() { return "data:,"; }
  toJSON() { return { tag: this.tag, attrs: this.attrs, style: this.style, text: this._text, children: this.children }; }
}
globalThis.document = { createElement: t => new El(t), createElementNS: (_ns, t) => new El(t),
                        createTextNode: t => { const e = new El("#text"); e._text = String(t); return e; },
                        getElementById: () => null, head: new El("head") };
globalThis.ResizeObserver = class { observe() {} disconnect() {} };
"""


def draw(spec: dict, width: int = 800) -> dict:
    node = shutil.which("node")
    if node is None:
        pytest.skip("Node.js not found (the chart's drawing is tested with it)")
    src = CHART.read_text().replace("export default", "const _module =")
    script = (DOM + src + f"\nconst _el = new El('div'); _el.clientWidth = {int(width)};\n"
              f"_module.render({{ model: {{ get: () => ({json.dumps(spec)}), on() {{}}, off() {{}} }}, el: _el }});\n"
              "process.stdout.write(JSON.stringify(_el));\n")
    out = subprocess.run([node, "--input-type=module", "-e", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def find(tree: dict, cls: str) -> list[dict]:
    """Every element whose class list holds ``cls``, in document order."""
    out = []
    if cls in (tree.get("attrs", {}).get("class") or "").split():
        out.append(tree)
    for c in tree.get("children", []):
        out += find(c, cls)
    return out


def text(el: dict) -> str:
    return el.get("text", "") + "".join(text(c) for c in el.get("children", []))
