"""A titled chart among the dashboard's extra figures, redrawn from the run's records at each
refresh: the panel the DPO and GRPO views add (``preference_view``, ``grpo_view``)."""
from __future__ import annotations

from typing import Any, Callable


def add_chart_panel(dashboard: Any, title: str, spec_of: Callable[[list], dict]) -> Any:
    """Add a chart titled ``title`` whose spec is ``spec_of(records)`` to ``dashboard``; the chart."""
    import ipywidgets as W

    from .chart import Chart   # light: ipywidgets away from %load_ext (the magics read the views' text parts)

    chart = Chart(layout=W.Layout(width="100%", min_width="280px"))
    head = W.HTML(f"<b style='font-family:sans-serif'>{title}</b>")

    def fill(_view) -> None:
        chart.spec = spec_of(dashboard.session.run_log.records())

    dashboard.add_figure(W.VBox([head, chart]), fill)
    return chart
