"""Reports of a run: a notebook built with nbformat (``.ipynb``) or rendered by nbconvert
(``.html``). Both are static and open offline: the charts are the dashboard's own
(``chart.js``, inlined: hover values, a few tens of kilobytes, not plotly.js's 5 MB), each with
a static SVG image under it for where scripts do not run (an untrusted notebook); see
``static_chart.py``. The HTML template drops the CDN scripts (require.js, MathJax, mermaid)
nbconvert would add.

Example::

    session.export_report("run.html")      # or "run.ipynb"
"""
from __future__ import annotations

import html
import os
import re
from pathlib import Path
from typing import Any

import nbformat
import numpy as np
from nbformat import v4

from megatrain_nb.atomic import atomic_file
from megatrain_nb.formatting import fmt_bytes, fmt_num, fmt_seconds
from megatrain_nb.trainer.sft_view import trained_on_view

from . import environment
from .chart import json_nums, layers_spec, training_spec
from .figures import event_label
from .inspector import fmt_stat
from .grpo_view import grpo_section
from .preference_view import reward_section
from .run_tree import label, runs_spec
from .sample_watch import answers_html
from .static_chart import chart_html, img, panels_svg
from .summary_html import loss_svg, memory_tiers_html

_MAX_POINTS = 600   # per curve: what a reader can tell apart on a page, and a report stays small
# The lab template without anything fetched from the network.
_OFFLINE_TEMPLATE = """{%- extends 'lab/index.html.j2' -%}
{%- block html_head_js -%}{%- endblock html_head_js -%}
{%- block jupyter_widgets -%}{%- endblock jupyter_widgets -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
"""


def export_report(session: Any, path: str | os.PathLike) -> str:
    """Write ``path`` (.ipynb or .html) atomically; returns it."""
    target = Path(path).expanduser()
    suffix = target.suffix.lower()
    if suffix not in (".ipynb", ".html"):
        raise ValueError(f"report path {str(path)!r} must end in .ipynb or .html")
    nb = build_notebook(session)
    nbformat.validate(nb)
    text = render_html(nb) if suffix == ".html" else nbformat.writes(nb)
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(target) as f:
        f.write(text)
    return str(target)


def render_html(nb) -> str:
    from jinja2 import DictLoader
    from nbconvert import HTMLExporter

    exporter = HTMLExporter(template_name="lab", extra_loaders=[DictLoader({"megatrain_report.j2": _OFFLINE_TEMPLATE})],
                            template_file="megatrain_report.j2", exclude_input=True, exclude_output_prompt=True,
                            exclude_input_prompt=True)
    body, _ = exporter.from_notebook_node(nb)
    return body


def _md(text: str):
    return v4.new_markdown_cell(text)


def _chart_cell(spec: dict, fallback: str, caption: str):
    """A chart: drawn by chart.js where scripts run, ``fallback`` (a static image) elsewhere."""
    cell = v4.new_code_cell(f"# {caption} (chart written by megatrain_nb)")
    cell.outputs = [v4.new_output("display_data", data={"text/html": chart_html(spec, fallback, caption),
                                                        "text/plain": f"<chart: {caption}>"})]
    cell.metadata["jupyter"] = {"source_hidden": True}
    return cell


def _html_cell(html_text: str, caption: str):
    cell = v4.new_code_cell(f"# {caption}")
    cell.outputs = [v4.new_output("display_data", data={"text/html": html_text, "text/plain": caption})]
    cell.metadata["jupyter"] = {"source_hidden": True}
    return cell


# Markdown punctuation that could open a link, image, code span, emphasis or table cell.
_MD_SPECIAL = re.compile(r"([\\`*_\[\]!|~])")


def _text(v: Any) -> str:
    """``v`` as inert text inside a markdown cell: markdown punctuation backslash-escaped and
    HTML escaped, on one line. Every user- or error-derived string goes through here: nbconvert
    passes raw HTML in markdown straight into the page."""
    one_line = " ".join(str(v).splitlines())
    return html.escape(_MD_SPECIAL.sub(r"\\\1", one_line), quote=True)


def _pre(text: str) -> str:
    """A block of preformatted text (a traceback) as an escaped HTML block, not a ``` fence
    that text containing ``` could close."""
    return f"<pre>{html.escape(str(text), quote=True)}</pre>"


def _table(rows: list[tuple[Any, ...]], header: tuple[str, ...]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_text(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def _reward_cells(records: list) -> list:
    """The sections of a run that learns from rewards: DPO's reward margin and accuracy, GRPO's
    reward, KL, completion length and time split (none for other runs)."""
    cells = []
    for section, alt in ((reward_section(records), "reward margin and accuracy"),
                         (grpo_section(records), "reward, KL, completion length, generation vs training")):
        if section is not None:
            md, spec = section
            cells += [_md(md), _chart_cell(spec, img(panels_svg(spec), alt), alt)]
    return cells


def build_notebook(session: Any):
    """The report as an nbformat v4 notebook with every output already in place."""
    log = session.run_log
    view = log.view(max_points=_MAX_POINTS)
    records = log.records()
    nb = v4.new_notebook()
    nb.metadata["title"] = f"megatrain_nb report: {session.name}"
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    cells = [_md(_summary_md(session, view, records))]

    cells.append(_md("## Configuration\n\n" + _table(environment.configuration(session), ("setting", "value"))))
    cells.append(_md("## Environment\n\n" + _table(environment.environment(session), ("item", "value"))))

    cells.append(_md("## Loss and learning rate\n\nDotted lines mark the interventions (see the events below); "
                     "point at a curve for its values."))
    cells.append(_chart_cell(training_spec(view, total=session.total_steps, height=320),
                             img(loss_svg(view, width=760, height=220), "loss"), "loss and learning rate"))

    cells += _reward_cells(records)

    cells.append(_md("## Interventions\n\n" + (_table(
        [(e["step"], e["kind"], event_label(e), e.get("source", ""), _event_detail(e)) for e in view.events],
        ("step", "kind", "marker", "source", "detail")) if view.events else "None: the run went untouched.")))

    cells.append(_md("## Memory tiers\n\nUsed bytes per tier over the run and, at the last report, by kind "
                     "against capacity."))
    tiers = _tier_history_spec(records)
    cells.append(_chart_cell(tiers, img(panels_svg(tiers), "memory tiers over time"), "memory tiers over time"))
    cells.append(_html_cell(memory_tiers_html(view), "memory tiers by kind"))
    cells.append(_md(_links_md(view)))

    cells.append(_md("## Per-layer statistics\n\nFrom the engine's last optimizer step; the heatmaps show "
                     "every unit over the run (older steps averaged in pairs)."))
    cells.append(_md(_layers_md(view)))
    for metric in ("grad_norm", "update_ratio"):
        units, steps, z = log.heat(metric)
        if z.size:
            heat = layers_spec(view, None, metric, (units, steps, z))
            spec = {"kind": "heat", "title": heat["heat_title"], "heat": heat["heat"],
                    "height": max(160, min(520, 14 * len(units) + 40))}
            cells.append(_chart_cell(spec, "<p><i>(the heatmap is drawn where scripts run: the HTML report, or "
                                           "this notebook once trusted)</i></p>", f"layers x steps: {metric}"))

    cells.append(_md("## Throughput\n\n" + _throughput_md(view, records)))
    tput = _throughput_spec(view)
    cells.append(_chart_cell(tput, img(panels_svg(tput, width=560), "throughput"), "throughput"))

    _html_section(cells, _trained_on_html(session), "trained on",
                  "## What the model is trained on\n\nThe first training example; the highlighted "
                  "tokens count toward the loss.")

    runs = session.explorer.tree() if hasattr(session, "explorer") else []
    if len(runs) > 1:   # rewinds and forks: the run tree (issue 21)
        cells.append(_md("## Branches\n\nEvery run of the tree on shared step axes; diamonds mark fork points.\n\n"
                         + _table([(label(r), r["run_id"], r["parent_run_id"] or "", r["forked_at_step"] or "",
                                    len(r["records"])) for r in runs],
                                  ("branch", "run id", "parent run", "forked at step", "steps logged"))))
        tree = runs_spec(runs, max_points=_MAX_POINTS)
        cells.append(_chart_cell(tree, img(panels_svg(tree), "run tree"), "run tree"))

    _html_section(cells, _sample_answers_html(session), "sample answers",
                  "## Answers to the sample prompt\n\nThe conversation set with `session.set_sample_prompt`, "
                  "answered from the weights at each step shown (the last answers, newest first).")
    samples = session.samples
    if samples:
        body = "".join(f"<h4>step {s['step']}: <code>{html.escape(s['prompt'])}</code></h4>"
                       f"<pre style='white-space:pre-wrap'>{html.escape(s['text'])}</pre>" for s in samples)
        cells.append(_md("## Samples\n\nDrawn with `session.generate` from the weights at that step."))
        cells.append(_html_cell(body, "samples"))
    nb.cells = cells
    return nb


def _html_section(cells: list, body: str, name: str, heading: str) -> None:
    """A heading cell and an HTML cell, when there is something to show."""
    if body:
        cells.append(_md(heading))
        cells.append(_html_cell(body, name))


def _sample_answers_html(session) -> str:
    watch = getattr(session, "sample_watch", None)
    return answers_html(watch, last=watch.keep) if watch is not None and watch.answers() else ""


def _trained_on_html(session) -> str:
    """The trained-on view of fine-tuning runs (SFTTrainer), else nothing."""
    trainer = getattr(session, "trainer", None)
    if type(trainer).__name__ != "SFTTrainer":
        return ""
    try:
        return trained_on_view(trainer, 0)._repr_html_()
    except (ValueError, IndexError):   # an iterable dataset: nothing to show
        return ""


def _summary_md(session, view, records) -> str:
    last = view.last
    total = session.total_steps
    evals = [r["eval_loss"] for r in records if r.get("eval_loss") is not None]
    rows = [("state", session.state), ("optimizer steps", f"{view.step}" + (f" of {total}" if total else "")),
            ("final loss", fmt_num(last.get("loss"))), ("last eval loss", fmt_num(evals[-1]) if evals else "–"),
            ("learning rate at the end", fmt_num(last.get("lr"), ".3g")),
            ("wall time", fmt_seconds(session.wall_time_s)), ("interventions", len(view.events))]
    text = f"# Training report: {_text(session.name)}\n\n" + _table(rows, ("", ""))
    if session.error is not None:
        text += (f"\n\n**The run failed:** {_text(f'{type(session.error).__name__}: {session.error}')}\n\n"
                 + _pre(session.error_traceback))
    return text


def _event_detail(e: dict) -> str:
    if e.get("error"):
        return str(e["error"])
    if e.get("path"):
        return str(e["path"])
    return ""


def _tier_history_spec(records: list[dict]) -> dict:
    """Bytes used per tier over the run (a ``panels`` chart of one panel)."""
    series = []
    for tier, color in (("device", "#3b7dd8"), ("host", "#e8871e"), ("disk", "#2ea05a")):
        pts = [(r.get("step"), (r.get("memory") or {}).get(tier, {}).get("used_bytes")) for r in records
               if isinstance((r.get("memory") or {}).get(tier), dict)]
        pts = [(x, y) for x, y in pts if isinstance(y, (int, float)) and x is not None]
        if pts:
            series.append({"name": tier, "color": color, "x": json_nums([x for x, _ in pts], 7),
                           "y": json_nums([y for _, y in pts], 6), "mode": "lines+points"})
    return {"kind": "panels", "columns": 1, "height": 220,
            "panels": [{"title": "memory used per tier", "bytes": True, "series": series,
                        "note": "no memory reports were logged"}],
            "legend": [{"name": s["name"], "color": s["color"]} for s in series]}


def _throughput_spec(view) -> dict:
    x, y = view.curves.get("tokens_per_s", (np.zeros(0), np.zeros(0)))
    return {"kind": "panels", "columns": 1, "height": 200,
            "panels": [{"title": "tokens per second", "note": "no throughput was logged",
                        "series": [{"name": "tokens/s", "color": "#3b7dd8", "x": json_nums(x, 7), "y": json_nums(y)}]}]}


def _links_md(view) -> str:
    rows = [(k.replace("_", " "), f"{fmt_bytes(v)}/s") for k, v in view.links.items() if v is not None]
    rows += [(f"loads issued ahead of need ({t})", f"{fmt_num(100 * v, '.1f')}%") for t, v in view.prefetch_hit_rate.items()
             if v is not None]
    if view.stall_share is not None:
        rows.append(("step time spent waiting for transfers", f"{100 * view.stall_share:.1f}%"))
    return _table(rows, ("link / counter", "value")) if rows else "No transfer telemetry was logged."


def _layers_md(view) -> str:
    if not view.layers:
        return "No layer statistics were gathered."
    rows = [(u, s.get("step"), fmt_stat(s.get("weight_norm")), fmt_stat(s.get("grad_norm")), fmt_stat(s.get("update_norm")),
             fmt_stat(s.get("update_ratio"))) for u, s in view.layers.items()]
    return _table(rows, ("unit", "step", "weight norm", "grad norm", "update norm", "update / weight"))


def _throughput_md(view, records) -> str:
    tps = [r["tokens_per_s"] for r in records if isinstance(r.get("tokens_per_s"), (int, float))]
    st = [r["step_time_s"] for r in records if isinstance(r.get("step_time_s"), (int, float))]
    tokens = sum(r.get("tokens", 0) or 0 for r in records)
    rows = [("tokens trained", f"{tokens:,}"),
            ("median tokens/s", fmt_num(float(np.median(tps)), ",.0f") if tps else "–"),
            ("median step time", f"{np.median(st):.3f} s" if st else "–")]
    return _table(rows, ("", ""))

