// megatrain_nb dashboard charts: plain SVG/canvas drawn from a JSON spec (see chart.py).
// No chart library: the module is a few kilobytes, so a saved notebook's widget state stays
// small, and every label is placed here so that none overlaps another or leaves its box.
// Colours come from JupyterLab's theme variables (with fallbacks), so light and dark work.

const SVG = "http://www.w3.org/2000/svg";
const FONT = "system-ui, -apple-system, 'Segoe UI', Roboto, Helvetica, Arial, sans-serif";
const FG = "var(--jp-ui-font-color1, #1f1f1f)";
const FG2 = "var(--jp-ui-font-color2, #616161)";
const GRID = "var(--jp-border-color3, #e6e6e6)";
const AXIS = "var(--jp-border-color1, #9e9e9e)";
const TICK = 11;        // px, tick and marker labels
const ROW = 15;         // px per row of marker labels

let measurer = null;
function textWidth(text, size = TICK) {
  if (!measurer) {
    measurer = document.createElement("canvas").getContext("2d");
  }
  measurer.font = `${size}px ${FONT}`;
  return Math.ceil(measurer.measureText(text).width);
}

function node(tag, attrs = {}, parent = null, ns = SVG) {
  const n = ns ? document.createElementNS(ns, tag) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v !== null && v !== undefined) n.setAttribute(k, v);
  }
  if (parent) parent.appendChild(n);
  return n;
}

function label(parent, x, y, text, { anchor = "start", color = FG2, size = TICK, cls = "mtnb-chart-label", title = null } = {}) {
  const t = node("text", { x, y, "text-anchor": anchor, "font-size": size, class: cls }, parent);
  t.style.fill = color;
  t.textContent = text;
  if (title) node("title", {}, t).textContent = title;
  return t;
}

// "nice" ticks: 1, 2, 2.5, 5 x 10^k, from one at or below lo to one at or above hi (the
// first and last tick are the axis' ends, so nothing drawn falls outside them); ``minStep``:
// the smallest spacing (1 for optimizer steps: no "1 1 1 1 2" at the start of a run)
function ticks(lo, hi, count, minStep = 0) {
  if (!(hi > lo)) return [lo, lo + 1];
  const raw = Math.max((hi - lo) / Math.max(1, count), minStep);
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 2.5, 5, 10].map(m => m * mag).find(s => s >= raw && s >= minStep && (!minStep || Number.isInteger(s))) || 10 * mag;
  const out = [];
  const first = Math.floor(lo / step + 1e-9) * step, last = Math.ceil(hi / step - 1e-9) * step;
  for (let k = 0; first + k * step <= last + step * 1e-9; k++) out.push(+(first + k * step).toPrecision(12));
  return out.length > 1 ? out : [first, first + step];
}

function fmt(v) {
  if (v === null || v === undefined || !isFinite(v)) return "–";
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e5)) return v.toExponential(a < 1e-3 ? 1 : 2).replace("e+", "e");
  return String(+v.toPrecision(4));
}

function fmtStep(v) {
  return Math.abs(v) >= 1e4 ? `${+(v / 1000).toPrecision(3)}k` : String(Math.round(v));
}

function extent(arrays) {
  let lo = Infinity, hi = -Infinity;
  for (const a of arrays) for (const v of a || []) {
    if (v !== null && isFinite(v)) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
  }
  return lo <= hi ? [lo, hi] : null;
}

function path(xs, ys, sx, sy, step = false) {
  let d = "", pen = false, prevY = null;
  for (let i = 0; i < xs.length; i++) {
    const y = ys[i];
    if (y === null || !isFinite(y)) { pen = false; continue; }
    const px = sx(xs[i]).toFixed(1), py = sy(y).toFixed(1);
    if (!pen) d += `M${px},${py}`;
    else d += step ? `H${px}V${py}` : `L${px},${py}`;
    pen = true; prevY = py;
  }
  return d;
}

// x tick labels that fit: centred under their tick; one that would cross an edge of
// [left, right] is anchored at that edge ("end" at the right: its last digit is inside the box
// whatever width the browser's font gives it); dropped when it would touch the one before
function xTicks(g, values, sx, y, left, right) {
  let end = -Infinity, last = null;
  for (const v of values) {
    const text = fmtStep(v), w = textWidth(text);
    if (text === last) continue;   // two ticks that read the same say nothing
    last = text;
    const c = sx(v);
    const at = c + w / 2 > right ? "end" : c - w / 2 < left ? "start" : "middle";
    const x0 = at === "end" ? right - w : at === "start" ? left : c - w / 2;
    if (x0 < end + 8) continue;
    label(g, at === "end" ? right : at === "start" ? left : c, y, text,
          { anchor: at, cls: "mtnb-chart-label mtnb-chart-xtick" });
    end = x0 + w;
  }
}

// A panel's y ticks: its fixed ``range`` where it has one (a share: 0 to 1), else the data's
// extent padded, from zero when the values never go below it (``zero: false`` leaves it out)
function panelTicks(p, yr) {
  if (Array.isArray(p.range) && p.range.length === 2) return ticks(p.range[0], p.range[1], 4);
  const padY = (yr[1] - yr[0]) * 0.05 || Math.abs(yr[1]) * 0.05 || 0.5;
  return ticks(yr[0] >= 0 && p.zero !== false ? Math.max(0, yr[0] - padY) : yr[0] - padY, yr[1] + padY, 4);
}

// Marker labels in rows above the plot: each goes in the first row where it does not touch
// the previous label; one that fits nowhere is shortened to the space left (full text in a
// tooltip). Labels are horizontal and anchored inside the chart, so none is cut off.
function placeMarkers(events, sx, left, right, maxRows) {
  const rowsEnd = [];
  const placed = [];
  for (const e of events) {
    const x = sx(e.step);
    let text = e.label, w = textWidth(text);
    // right of its line, or left of it near the chart's right edge
    let x0 = x + 3 + w <= right ? x + 3 : Math.max(left, x - 3 - w);
    let row = rowsEnd.findIndex(end => x0 >= end + 6);
    if (row < 0 && rowsEnd.length < maxRows) { row = rowsEnd.length; rowsEnd.push(-Infinity); }
    if (row < 0) {  // every row is taken here: the row that ends first, the text shortened
      row = rowsEnd.indexOf(Math.min(...rowsEnd));
      x0 = Math.max(x0, rowsEnd[row] + 6);
    }
    const room = right - x0;
    if (w > room) {
      while (text.length > 1 && textWidth(text + "…") > room) text = text.slice(0, -1);
      text += "…"; w = textWidth(text);
    }
    if (room < 14) continue;   // no space at all: the line and its tooltip remain
    rowsEnd[row] = x0 + w;
    placed.push({ x: x0, row, text, full: e.label, color: e.color, step: e.step });
  }
  return { placed, rows: Math.max(1, rowsEnd.length) };
}

function yAxis(g, yt, sy, left, right, format) {
  for (const v of yt) {
    const y = sy(v);
    node("line", { x1: left, x2: right, y1: y, y2: y, "stroke-width": 1 }, g).style.stroke = GRID;
    label(g, left - 6, y + 4, format(v), { anchor: "end", cls: "mtnb-chart-label mtnb-chart-ytick" });
  }
}

function drawTraining(root, spec, width) {
  const loss = spec.loss || { x: [], y: [] }, ev = spec.eval || { x: [], y: [] }, lr = spec.lr || { x: [], y: [] };
  const events = spec.events || [];
  const heightLoss = spec.height || 300, heightLr = 96;
  const xr = extent([loss.x, lr.x, ev.x, events.map(e => e.step)]) || [0, 1];
  const x0 = xr[0], x1 = Math.max(xr[1], x0 + 1);
  const yr = extent([loss.y, ev.y]) || [0, 1];
  const pad = (yr[1] - yr[0]) * 0.05 || 0.5;
  // a loss that is never negative gets no negative axis
  const yt = ticks(yr[0] >= 0 ? Math.max(0, yr[0] - pad) : yr[0] - pad, yr[1] + pad, 5);
  const lrr = extent([lr.y]) || [0, 1];
  const lrt = ticks(0, lrr[1] * 1.1 || 1, 2);
  const left = 10 + Math.max(...yt.map(v => textWidth(fmt(v))), ...lrt.map(v => textWidth(fmt(v))), 24);
  const right = width - 14;
  const sx = v => left + (v - x0) / (x1 - x0) * (right - left);

  // legend (HTML: it wraps by itself)
  const legend = node("div", { class: "mtnb-chart-legend" }, root, null);
  const items = [["train loss", "var(--mtnb-c1)", loss.y.length],
                 ["eval loss", "var(--mtnb-c2)", ev.y.length], ["learning rate", "var(--mtnb-c3)", lr.y.length]];
  for (const [name, color, n] of items) {
    if (!n && name === "eval loss") continue;
    const item = node("span", { class: "mtnb-chart-legend-item" }, legend, null);
    node("span", { class: "mtnb-chart-swatch" }, item, null).style.background = color;
    item.appendChild(document.createTextNode(name));
  }
  const lastLoss = [...loss.y].reverse().find(v => v !== null && isFinite(v));
  if (lastLoss !== undefined) {
    node("span", { class: "mtnb-chart-legend-item mtnb-chart-range" }, legend, null).textContent =
      `loss ${fmt(yr[0])} – ${fmt(yr[1])} · steps ${fmtStep(x0)} – ${fmtStep(xr[1])}`;
  }

  const marks = placeMarkers(events, sx, left, right, 3);
  const band = events.length ? marks.rows * ROW + 6 : 6;
  const top = band, bottom = heightLoss - 8;
  const sy = v => bottom - (v - yt[0]) / ((yt[yt.length - 1] - yt[0]) || 1) * (bottom - top);
  const svg = node("svg", { width, height: heightLoss, class: "mtnb-chart mtnb-chart-loss", "font-family": FONT }, root);
  const g = node("g", {}, svg);
  yAxis(g, yt, sy, left, right, fmt);
  for (const p of marks.placed) {
    label(g, p.x, 2 + (p.row + 1) * ROW - 4, p.text, { color: p.color, cls: "mtnb-chart-label mtnb-chart-marker", title: `step ${p.step}: ${p.full}` });
  }
  for (const e of events) {
    const x = sx(e.step);
    const l = node("line", { x1: x, x2: x, y1: top - 2, y2: bottom, "stroke-dasharray": "3,3", "stroke-width": 1.5 }, g);
    l.style.stroke = e.color;
    node("title", {}, l).textContent = `step ${e.step}: ${e.label}`;
  }
  const clip = `mtnb-clip-${Math.random().toString(36).slice(2)}`;
  node("rect", { x: left, y: top, width: right - left, height: bottom - top }, node("clipPath", { id: clip }, svg));
  const plot = node("g", { "clip-path": `url(#${clip})` }, svg);
  node("path", { d: path(loss.x, loss.y, sx, sy), fill: "none", "stroke-width": 1.8, class: "mtnb-loss-line" }, plot).style.stroke = "var(--mtnb-c1)";
  if (ev.y.length) {
    node("path", { d: path(ev.x, ev.y, sx, sy), fill: "none", "stroke-width": 1.5 }, plot).style.stroke = "var(--mtnb-c2)";
    ev.x.forEach((x, i) => {
      if (ev.y[i] !== null && isFinite(ev.y[i])) node("circle", { cx: sx(x), cy: sy(ev.y[i]), r: 3 }, plot).style.fill = "var(--mtnb-c2)";
    });
  }
  node("line", { x1: left, x2: left, y1: top, y2: bottom }, svg).style.stroke = AXIS;
  const invert = px => x0 + (px - left) / (right - left) * (x1 - x0);
  hover(root, svg, [{ name: "train loss", color: "var(--mtnb-c1)", x: loss.x, y: loss.y },
                    { name: "eval loss", color: "var(--mtnb-c2)", x: ev.x, y: ev.y },
                    { name: "learning rate", color: "var(--mtnb-c3)", x: lr.x, y: lr.y }], sx, invert, top, bottom);

  // learning rate, same x
  const svg2 = node("svg", { width, height: heightLr, class: "mtnb-chart mtnb-chart-lr", "font-family": FONT }, root);
  const g2 = node("g", {}, svg2);
  const t2 = 6, b2 = heightLr - 22;
  const sy2 = v => b2 - v / (lrt[lrt.length - 1] || 1) * (b2 - t2);
  yAxis(g2, lrt, sy2, left, right, fmt);
  for (const e of events) {
    node("line", { x1: sx(e.step), x2: sx(e.step), y1: t2, y2: b2, "stroke-dasharray": "3,3", "stroke-width": 1.5 }, g2).style.stroke = e.color;
  }
  node("path", { d: path(lr.x, lr.y, sx, sy2, true), fill: "none", "stroke-width": 1.8 }, g2).style.stroke = "var(--mtnb-c3)";
  node("line", { x1: left, x2: right, y1: b2, y2: b2 }, svg2).style.stroke = AXIS;
  xTicks(g2, ticks(x0, x1, Math.max(2, Math.floor((right - left) / 90)), 1).filter(v => v >= x0 && v <= x1), sx, b2 + 15, 2, width - 2);
  node("title", {}, svg2).textContent = "learning rate by optimizer step";
}

// Hover: a guide line at the step nearest the pointer and a box with every series' value
// there (the static report has no other way to read a value off a curve).
function nearest(xs, ys, x) {
  let best = -1, bd = Infinity;
  for (let i = 0; i < xs.length; i++) {
    if (ys[i] === null || !isFinite(ys[i])) continue;
    const d = Math.abs(xs[i] - x);
    if (d < bd) { bd = d; best = i; }
  }
  return best;
}

function hover(root, svg, series, sx, invert, top, bottom, format = fmt) {
  const guide = node("line", { y1: top, y2: bottom, "stroke-width": 1, visibility: "hidden", class: "mtnb-hover-line" }, svg);
  guide.style.stroke = AXIS;
  const box = node("div", { class: "mtnb-hover" }, root, null);
  box.style.display = "none";
  svg.addEventListener("mousemove", ev => {
    const r = svg.getBoundingClientRect();
    const x = invert(ev.clientX - r.left);
    let at = null;
    for (const s of series) {
      const i = nearest(s.x, s.y, x);
      if (i >= 0 && (at === null || Math.abs(s.x[i] - x) < Math.abs(at - x))) at = s.x[i];
    }
    if (at === null) return;
    const rows = [];
    for (const s of series) {
      const i = nearest(s.x, s.y, at);
      if (i >= 0 && Math.abs(s.x[i] - at) <= Math.max(1, 0.02 * Math.abs(at))) rows.push([s.name, s.color, s.y[i]]);
    }
    guide.setAttribute("x1", sx(at)); guide.setAttribute("x2", sx(at)); guide.setAttribute("visibility", "visible");
    box.replaceChildren();
    node("div", { class: "mtnb-hover-step" }, box, null).textContent = `step ${fmtStep(at)}`;
    for (const [name, color, v] of rows) {
      const line = node("div", {}, box, null);
      node("span", { class: "mtnb-chart-swatch" }, line, null).style.background = color;
      line.appendChild(document.createTextNode(` ${name}: ${format(v)}`));
    }
    const rr = root.getBoundingClientRect();
    box.style.display = "block";
    box.style.left = `${Math.min(ev.clientX - rr.left + 12, rr.width - 220)}px`;
    box.style.top = `${ev.clientY - rr.top + 12}px`;
  });
  svg.addEventListener("mouseleave", () => { guide.setAttribute("visibility", "hidden"); box.style.display = "none"; });
}

function fmtBytes(v) {
  if (v === null || v === undefined || !isFinite(v)) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let k = 0, a = Math.abs(v);
  while (a >= 1024 && k < units.length - 1) { a /= 1024; k++; }
  return `${k ? (v / Math.pow(1024, k)).toFixed(1) : Math.round(v)} ${units[k]}`;
}

// Small multiples on one step axis: the run tree (loss, eval loss, learning rate, grad norm of
// every branch, fork points marked), the report's memory and throughput curves. A panel with
// no data says why (``note``) instead of showing empty axes.
function drawPanels(root, spec, width) {
  const panels = spec.panels || [];
  const all = panels.flatMap(p => (p.series || []).map(s => s.x));
  const xr = extent(all) || [0, 1];
  const x0 = xr[0], x1 = Math.max(xr[1], x0 + 1);
  if (spec.title) node("div", { class: "mtnb-chart-title" }, root, null).textContent = spec.title;
  if ((spec.legend || []).length) {
    const legend = node("div", { class: "mtnb-chart-legend" }, root, null);
    for (const l of spec.legend) {
      const item = node("span", { class: "mtnb-chart-legend-item", title: l.name }, legend, null);
      node("span", { class: "mtnb-chart-swatch" }, item, null).style.background = l.color;
      item.appendChild(document.createTextNode(l.name));
    }
  }
  const cols = width >= 640 ? Math.max(1, spec.columns || 2) : 1;
  const gap = 16, pw = Math.floor((width - gap * (cols - 1)) / cols), ph = spec.height || 200;
  const grid = node("div", { class: "mtnb-panels" }, root, null);
  grid.style.gridTemplateColumns = `repeat(${cols}, ${pw}px)`;
  for (const p of panels) {
    const cell = node("div", { class: "mtnb-panel" }, grid, null);
    node("div", { class: "mtnb-chart-title" }, cell, null).textContent = p.title || "";
    const series = (p.series || []).filter(s => (s.y || []).some(v => v !== null && isFinite(v)));
    const svg = node("svg", { width: pw, height: ph, class: "mtnb-chart mtnb-chart-panel", "font-family": FONT }, cell);
    if (!series.length) {
      label(svg, pw / 2, ph / 2, p.note || "nothing logged", { anchor: "middle", cls: "mtnb-chart-label mtnb-chart-note" });
      continue;
    }
    const format = p.bytes ? fmtBytes : fmt;
    const yr = extent(series.map(s => s.y).concat([(p.points || []).map(q => q.y)]));
    const yt = panelTicks(p, yr);
    const left = 10 + Math.max(...yt.map(v => textWidth(format(v))), 24), right = pw - 8, top = 6, bottom = ph - 22;
    const sx = v => left + (v - x0) / (x1 - x0) * (right - left);
    const sy = v => bottom - (v - yt[0]) / ((yt[yt.length - 1] - yt[0]) || 1) * (bottom - top);
    const g = node("g", {}, svg);
    yAxis(g, yt, sy, left, right, format);
    node("line", { x1: left, x2: right, y1: bottom, y2: bottom }, g).style.stroke = AXIS;
    xTicks(g, ticks(x0, x1, Math.max(2, Math.floor((right - left) / 90)), 1).filter(v => v >= x0 && v <= x1), sx, bottom + 15, 2, pw - 2);
    for (const s of series) {
      if (s.mode !== "points") {
        node("path", { d: path(s.x, s.y, sx, sy, !!s.step), fill: "none", "stroke-width": 1.6, class: "mtnb-series" }, g).style.stroke = s.color;
      }
      if (s.mode === "points" || s.mode === "lines+points") {
        s.x.forEach((x, i) => {
          if (s.y[i] !== null && isFinite(s.y[i])) node("circle", { cx: sx(x), cy: sy(s.y[i]), r: 2.5 }, g).style.fill = s.color;
        });
      }
    }
    for (const q of p.points || []) {   // fork points: a diamond on the parent's curve
      const cx = sx(q.x), cy = sy(q.y);
      const d = node("path", { d: `M${cx},${cy - 6}L${cx + 6},${cy}L${cx},${cy + 6}L${cx - 6},${cy}Z`, "stroke-width": 1, class: "mtnb-fork" }, g);
      d.style.fill = q.color; d.style.stroke = FG;
      if (q.title) node("title", {}, d).textContent = q.title;
    }
    hover(cell, svg, series, sx, px => x0 + (px - left) / (right - left) * (x1 - x0), top, bottom, format);
  }
}

function drawHeat(root, spec, width) {
  node("div", { class: "mtnb-chart-title" }, root, null).textContent = spec.title || "";
  drawHeatmap(root, spec.heat || {}, width, spec.height || 240);
}

const VIRIDIS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
function viridis(t) {
  t = Math.max(0, Math.min(1, t)) * (VIRIDIS.length - 1);
  const i = Math.min(VIRIDIS.length - 2, Math.floor(t)), f = t - i;
  return VIRIDIS[i].map((c, k) => Math.round(c + f * (VIRIDIS[i + 1][k] - c)));
}

function drawHistogram(root, hist, width, height) {
  const svg = node("svg", { width, height, class: "mtnb-chart mtnb-chart-hist", "font-family": FONT }, root);
  const counts = hist.counts || [], edges = hist.edges || [];
  if (!counts.length || edges.length !== counts.length + 1) {
    label(svg, 8, 20, "no statistics yet (gathered at each optimizer step)");
    return;
  }
  const cmax = Math.max(...counts, 1);
  const yt = ticks(0, cmax, 3);
  const left = 10 + Math.max(...yt.map(v => textWidth(fmt(v))));
  const right = width - 8, top = 8, bottom = height - 22;
  const lo = edges[0], hi = edges[edges.length - 1];
  const sx = v => left + (v - lo) / ((hi - lo) || 1) * (right - left);
  const sy = v => bottom - v / (yt[yt.length - 1] || 1) * (bottom - top);
  yAxis(svg, yt, sy, left, right, fmt);
  counts.forEach((c, i) => {
    const x = sx(edges[i]), w = Math.max(1, sx(edges[i + 1]) - x - 1);
    node("rect", { x, y: sy(c), width: w, height: bottom - sy(c) }, svg).style.fill = "var(--mtnb-c1)";
  });
  node("line", { x1: left, x2: right, y1: bottom, y2: bottom }, svg).style.stroke = AXIS;
  const lt = fmt(lo), ht = fmt(hi);
  label(svg, left, bottom + 15, lt);
  if (textWidth(lt) + textWidth(ht) + 12 < right - left) label(svg, right, bottom + 15, ht, { anchor: "end" });
}

function drawHeatmap(root, heat, width, height) {
  const units = heat.units || [], steps = heat.steps || [], z = heat.z || [];
  const box = node("div", { class: "mtnb-heat" }, root, null);
  if (!units.length || !steps.length) {
    box.textContent = "no layer statistics yet";
    return;
  }
  const rowH = (height - 22) / units.length;
  const every = Math.max(1, Math.ceil(ROW / rowH));
  const names = units.map(u => (u.length > 22 ? "…" + u.slice(-21) : u));
  const left = 8 + Math.max(...names.filter((_, i) => i % every === 0).map(n => textWidth(n)));
  const right = width - 6, top = 0, bottom = height - 22;
  const svg = node("svg", { width, height, class: "mtnb-chart mtnb-chart-heat", "font-family": FONT }, box);
  let lo = Infinity, hi = -Infinity;
  for (const row of z) for (const v of row) if (v !== null && isFinite(v)) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
  const cw = (right - left) / steps.length;
  // one image of the cells (a canvas), placed inside the SVG
  const canvas = document.createElement("canvas");
  canvas.width = steps.length; canvas.height = units.length;
  const ctx = canvas.getContext("2d");
  const img = ctx.createImageData(steps.length, units.length);
  for (let r = 0; r < units.length; r++) for (let c = 0; c < steps.length; c++) {
    const v = (z[r] || [])[c], k = 4 * (r * steps.length + c);
    if (v === null || v === undefined || !isFinite(v)) { img.data[k + 3] = 0; continue; }
    const [R, G, B] = viridis(hi > lo ? (v - lo) / (hi - lo) : 0.5);
    img.data[k] = R; img.data[k + 1] = G; img.data[k + 2] = B; img.data[k + 3] = 255;
  }
  ctx.putImageData(img, 0, 0);
  node("image", { x: left, y: top, width: right - left, height: bottom - top, preserveAspectRatio: "none",
                  href: canvas.toDataURL(), style: "image-rendering: pixelated" }, svg);
  units.forEach((u, i) => {
    if (i % every) return;
    label(svg, left - 4, top + (i + 0.5) * rowH + 4, names[i], { anchor: "end", title: u, cls: "mtnb-chart-label mtnb-chart-ytick" });
  });
  const sx = s => left + (steps.indexOf(s) + 0.5) * cw;
  const picks = [steps[0], steps[Math.floor(steps.length / 2)], steps[steps.length - 1]];
  xTicks(svg, [...new Set(picks)], sx, bottom + 15, left, right);
  const scale = node("div", { class: "mtnb-heat-scale" }, box, null);
  node("span", {}, scale, null).textContent = `${heat.label || ""}: ${fmt(lo)}`;
  const bar = node("span", { class: "mtnb-heat-bar" }, scale, null);
  bar.style.background = `linear-gradient(to right, ${VIRIDIS.map(c => `rgb(${c})`).join(",")})`;
  node("span", {}, scale, null).textContent = fmt(hi);
}

function drawLayers(root, spec, width) {
  const height = spec.height || 240;
  const wrap = node("div", { class: "mtnb-layers" }, root, null);
  const histBox = node("div", { class: "mtnb-layers-hist" }, wrap, null);
  const heatBox = node("div", { class: "mtnb-layers-heat" }, wrap, null);
  const narrow = width < 620;
  const hw = narrow ? width : Math.floor(width * 0.36), mw = narrow ? width : width - hw - 16;
  node("div", { class: "mtnb-chart-title" }, histBox, null).textContent = spec.hist_title || "weight values";
  drawHistogram(histBox, spec.hist || {}, hw, height - 20);
  node("div", { class: "mtnb-chart-title" }, heatBox, null).textContent = spec.heat_title || "layers × steps";
  drawHeatmap(heatBox, spec.heat || {}, mw, height - 40);
}

const STYLE = `
.mtnb-chart-root { --mtnb-c1: #3b7dd8; --mtnb-c2: #e8871e; --mtnb-c3: #2ea05a;
  color: var(--jp-ui-font-color1, #1f1f1f); font-family: ${FONT}; font-size: 12px; width: 100%; }
body[data-jp-theme-light="false"] .mtnb-chart-root { --mtnb-c1: #6aa7ff; --mtnb-c2: #ffa94d; --mtnb-c3: #58d68d; }
.mtnb-chart { display: block; overflow: hidden; }
.mtnb-chart-legend { display: flex; flex-wrap: wrap; gap: 2px 14px; margin: 0 0 2px 0; color: var(--jp-ui-font-color1, #1f1f1f); }
.mtnb-chart-legend-item { display: inline-flex; align-items: center; gap: 5px; white-space: nowrap; }
.mtnb-chart-range { color: var(--jp-ui-font-color2, #616161); }
.mtnb-chart-swatch { display: inline-block; width: 14px; height: 3px; border-radius: 2px; }
.mtnb-chart-title { font-weight: 600; margin: 2px 0; overflow: hidden; text-overflow: ellipsis; white-space: nowrap; }
.mtnb-layers { display: flex; flex-wrap: wrap; gap: 16px; }
.mtnb-heat-scale { display: flex; align-items: center; gap: 6px; color: var(--jp-ui-font-color2, #616161); font-size: 11px; margin-top: 2px; }
.mtnb-heat-bar { display: inline-block; width: 120px; height: 8px; border-radius: 2px; }
.mtnb-chart-root, .mtnb-panel { position: relative; }
.mtnb-panels { display: grid; gap: 8px 16px; }
.mtnb-panel { min-width: 0; }
.mtnb-chart-legend-item { max-width: 100%; overflow: hidden; text-overflow: ellipsis; }
.mtnb-hover { position: absolute; z-index: 5; pointer-events: none; background: var(--jp-layout-color0, #fff);
  border: 1px solid var(--jp-border-color2, #d0d0d0); border-radius: 3px; padding: 3px 6px; font-size: 11px;
  white-space: nowrap; box-shadow: 0 1px 4px rgba(0,0,0,.15); }
.mtnb-hover-step { font-weight: 600; }
`;

function draw(model, el) {
  const spec = model.get("spec") || {};
  const width = Math.max(280, Math.floor(el.clientWidth || spec.width || 800));
  const root = document.createElement("div");
  root.className = "mtnb-chart-root";
  if (!spec.kind) { el.replaceChildren(root); return; }   // nothing to draw yet (a chart not filled)
  if (spec.kind === "layers") drawLayers(root, spec, width);
  else if (spec.kind === "panels") drawPanels(root, spec, width);
  else if (spec.kind === "heat") drawHeat(root, spec, width);
  else drawTraining(root, spec, width);
  el.replaceChildren(root);
}

export default {
  render({ model, el }) {
    if (!document.getElementById("mtnb-chart-style")) {
      const s = document.createElement("style");
      s.id = "mtnb-chart-style";
      s.textContent = STYLE;
      document.head.appendChild(s);
    }
    el.classList.add("mtnb-chart-host");
    el.style.width = "100%";
    let lastWidth = -1;
    const redraw = () => { lastWidth = el.clientWidth; draw(model, el); };
    redraw();
    model.on("change:spec", redraw);
    const ro = new ResizeObserver(() => {
      if (Math.abs(el.clientWidth - lastWidth) > 1) redraw();
    });
    ro.observe(el);
    return () => { ro.disconnect(); model.off("change:spec", redraw); };
  }
};
