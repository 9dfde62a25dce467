"""``session.snapshots`` as a reader sees it: a list (index it, loop over it, ``[-1].step``)
that prints as a table with readable times and sizes, in plain text and in a notebook."""
from __future__ import annotations

import html
import time

from megatrain_nb.formatting import fmt_bytes

COLUMNS = ("step", "branch", "kind", "taken", "own bytes", "shared bytes", "path")


def _when(t: float | None) -> str:
    if not t:
        return "–"
    local = time.localtime(t)
    same_day = time.strftime("%Y-%m-%d", local) == time.strftime("%Y-%m-%d")
    return time.strftime("%H:%M:%S" if same_day else "%Y-%m-%d %H:%M", local)


def _cells(info) -> tuple[str, ...]:
    return (str(info.step), info.branch or (info.run_id or "–")[:8], info.kind, _when(info.time),
            fmt_bytes(info.bytes_unique), fmt_bytes(info.bytes_shared), str(info.path))


class SnapshotTable(list):
    """The snapshots (``SnapshotInfo``) a run can rewind to, oldest first."""

    def __repr__(self) -> str:
        if not self:
            return "no snapshots yet (snapshot_steps=N takes one every N steps; session.snapshot() takes one now)"
        rows = [COLUMNS] + [_cells(i) for i in self]
        widths = [max(len(r[c]) for r in rows) for c in range(len(COLUMNS) - 1)]
        return "\n".join("  ".join([r[c].ljust(widths[c]) for c in range(len(widths))] + [r[-1]]) for r in rows)

    def _repr_html_(self) -> str:
        if not self:
            return f"<pre>{html.escape(repr(self))}</pre>"
        head = "".join(f"<th>{c}</th>" for c in COLUMNS)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in _cells(i)) + "</tr>" for i in self)
        return f"<table class='mtnb-snapshots'><tr>{head}</tr>{body}</table>"
