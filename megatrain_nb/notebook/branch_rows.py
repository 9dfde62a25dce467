"""A Session's run tree in a few fields per run: what the JupyterLab sidebar nests under the
run's card (the beacon's heartbeat ``branches``; ``extension/src/branches.ts`` draws it)."""
from __future__ import annotations


def sidebar_rows(explorer) -> list[dict]:
    """The run tree in a few fields per run, for the JupyterLab sidebar (the heartbeat's
    ``branches``): ``run_id`` (None for a fork not started), ``name``, ``parent_run_id``,
    ``forked_at_step``, ``state`` ("abandoned" for steps a rewind left), ``step``, ``loss``,
    ``changes``, ``current`` (this session's run). [] while the run has no branches."""
    with explorer.group.lock:
        nodes = dict(explorer.group.nodes)
        members = list(explorer.group.members)
    rows, seen = [], set()
    for m in members:
        s = m.session
        if s is None:
            continue
        rid = m.run_id   # (ranks in worker processes: the run they train now)
        n = nodes.get(rid)
        parent, at = (n.parent_run_id, n.forked_at_step) if n is not None else (m.origin or (None, None))
        hist = s.history
        rows.append(_row(rid, s.name, parent, at, s.state, hist[-1] if hist else {},
                         n.changes if n is not None and n.changes else _changes_text(m), m is explorer))
        seen.add(rid)
    for n in nodes.values():
        if n.run_id not in seen:
            rows.append(_row(n.run_id, n.name, n.parent_run_id, n.forked_at_step, "abandoned",
                             n.abandoned[-1] if n.abandoned else {}, n.changes, False))
    return rows if len(rows) > 1 else []


def _row(run_id, name, parent, at, state, last: dict, changes: str, current: bool) -> dict:
    return {"run_id": run_id, "name": name, "parent_run_id": parent, "forked_at_step": at, "state": state,
            "step": last.get("step"), "loss": last.get("loss"), "changes": changes or "", "current": current}


def _changes_text(ex) -> str:
    return ", ".join([f"{k}={v}" for k, v in ex.changes.items()] + ([ex.note] if ex.note else []))
