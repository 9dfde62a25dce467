"""``mt.compare(a, b, ...)``: branches (or any Sessions) side by side: a table of final and best
loss, eval loss, tokens, wall time and the settings that differ, and the run-tree figure.

Example::

    branch = session.fork(learning_rate=1e-4); branch.train(block=True)
    cmp = mt.compare(session, branch)
    cmp.table          # pandas DataFrame, one row per session
    cmp.figure         # plotly Figure: loss, eval loss, LR, grad norm on shared step axes
    cmp                # in a notebook: both
"""
from __future__ import annotations

import html
from typing import Any

from .branches import ALLOWED
from .run_tree import run_tree_figure

#: settings compared (the ones a fork may change), read from each session's trainer
_SETTINGS = tuple(k for k in ALLOWED if k not in ("train_dataset", "loss_fn"))


class Comparison:
    """What :func:`compare` returns: ``rows`` (dicts), ``table`` (a DataFrame), ``figure``."""

    def __init__(self, rows: list[dict], figure):
        self.rows = rows
        self.figure = figure

    @property
    def table(self):
        import pandas as pd

        return pd.DataFrame(self.rows).set_index("branch")

    def _repr_html_(self) -> str:
        cols = list(self.rows[0]) if self.rows else []
        head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(r.get(c)))}</td>" for c in cols) + "</tr>"
                       for r in self.rows)
        return f"<table><tr>{head}</tr>{body}</table>"

    def _ipython_display_(self) -> None:
        from IPython.display import HTML, display

        display(HTML(self._repr_html_()))
        display(self.figure)

    def __repr__(self) -> str:
        return "\n".join(", ".join(f"{k}={_fmt(v)}" for k, v in r.items()) for r in self.rows)


def compare(*sessions: Any, height: int = 520) -> Comparison:
    """Compare sessions (a run and its branches, or separate runs); see the module docstring."""
    if len(sessions) < 1:
        raise ValueError("compare() needs at least one session, e.g. mt.compare(session, branch)")
    for s in sessions:
        if not hasattr(s, "history") or not hasattr(s, "trainer"):
            raise TypeError(f"compare() takes Sessions; got {type(s).__name__}")
    rows, runs = [], []
    names = _run_names(sessions)
    for s in sessions:
        hist = s.history
        losses = [r["loss"] for r in hist if isinstance(r.get("loss"), (int, float))]
        evals = [r["eval_loss"] for r in hist if isinstance(r.get("eval_loss"), (int, float))]
        last = hist[-1] if hist else {}
        changes = s.explorer.changes if hasattr(s, "explorer") else {}
        row = {"branch": s.name, "state": s.state, "steps": s.step,
               "forked_from": _name_of(last.get("parent_run_id"), names),
               "forked_at_step": last.get("forked_at_step"),
               "final_loss": losses[-1] if losses else None, "best_loss": min(losses) if losses else None,
               "final_eval_loss": evals[-1] if evals else None, "best_eval_loss": min(evals) if evals else None,
               "tokens": last.get("tokens_seen"),
               "wall_time_s": sum(float(r.get("step_time_s") or 0.0) for r in hist)}
        row["settings"] = _settings(s)
        rows.append(row)
        runs.append({"name": s.name, "run_id": last.get("run_id"), "parent_run_id": last.get("parent_run_id"),
                     "forked_at_step": last.get("forked_at_step"),
                     "changes": ", ".join(f"{k}={v}" for k, v in changes.items()), "records": hist})
    differ = [k for k in rows[0]["settings"] if len({repr(r["settings"].get(k)) for r in rows}) > 1]
    for r in rows:
        settings = r.pop("settings")
        r.update({k: settings.get(k) for k in differ})
    # a parent's curve ends where its branch's begins: fork points sit on the parent's line
    ids = {x["run_id"] for x in runs}
    for x in runs:
        if x["parent_run_id"] not in ids:
            x["parent_run_id"] = None
    return Comparison(rows, run_tree_figure(runs, height=height, title="Compare"))


def _run_names(sessions) -> dict:
    """Run id -> the branch name a reader knows it by: every run of each session's tree (a
    rewound path's old run included), then the sessions' own current runs."""
    names = {}
    for s in sessions:
        ex = getattr(s, "explorer", None)
        group = getattr(ex, "group", None)
        for run_id, node in (getattr(group, "nodes", None) or {}).items():
            names.setdefault(run_id, node.name)
    for s in sessions:
        run_id = s.explorer.run_id if hasattr(s, "explorer") else getattr(s.trainer, "run_id", None)
        names[run_id] = s.name
    return names


def _name_of(run_id, names: dict):
    """A parent's branch name; one no session here knows, as ``run <id>`` (never a bare id
    beside names)."""
    if run_id is None:
        return None
    return names.get(run_id) or f"run {str(run_id)[:8]}"


def _settings(s) -> dict:
    args = getattr(s.trainer, "args", None)
    ranks = getattr(getattr(s, "explorer", None), "ranks", None)
    if args is None and ranks is not None:   # ranks in worker processes: what they were given
        written = ranks.spec_args
        out = {k: written.get(k) for k in _SETTINGS}
    else:
        out = {k: getattr(args, k, None) for k in _SETTINGS}
    loss_fn = getattr(s.trainer, "loss_fn", None)
    out["loss_fn"] = getattr(loss_fn, "__name__", type(loss_fn).__name__) if loss_fn is not None else None
    ds = getattr(s.trainer, "train_dataset", None)
    out["train_dataset"] = f"{type(ds).__name__}({len(ds)})@{id(ds):x}" if ds is not None and hasattr(ds, "__len__") \
        else None
    ex = getattr(s, "explorer", None)
    if ex is not None and ex.weight_decay is not None:
        out["weight_decay"] = ex.weight_decay
    return out


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)
